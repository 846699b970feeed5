"""Upstream's MiniMax-H3 Fun ControlNet (MiniMaxH3FunControlNetApply) under sequence parallel.

A tiny H3 file is loaded by upstream's loader; upstream's own `MiniMaxH3FunControl` tower (tiny
config, seeded weights) is applied by upstream's own node to a control video; both are sampled
by `comfy.sample.sample`, on one card and with the DiT set up by the node's DiT role. The
parallel result must equal one card (fp32, 1e-5 of max |reference|), and the control must
really act on the result.
"""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, TINY
from tests.upstream.test_sampling import node_dit, sample

INJECTION_LAYERS = (0, 2)


class _FakeVideoVAE:
    """What the Fun patch asks of a VAE: encode frames [F, H, W, 3] to the video latent shape, and
    the spatial factor. The latent depends on the frames (their per-frame means)."""

    def spacial_compression_encode(self):
        return 16

    def encode(self, frames):
        f, h, w, _ = frames.shape
        t = (f - 5) // 17 * 5 + 2
        g = torch.Generator().manual_seed(7)
        base = torch.randn(1, 24, t, h // 16, w // 16, generator=g)
        return base + frames.float().mean()


def control_model_patch(upstream, config=TINY):
    """Upstream's tower, sized like the DiT of `config`."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops
    from comfy.ldm.minimax.controlnet import MiniMaxH3FunControl
    tower = MiniMaxH3FunControl(injection_layers=INJECTION_LAYERS, hidden_size=config["hidden_size"],
                                num_attention_heads=config["num_attention_heads"],
                                attention_head_dim=config["attention_head_dim"],
                                ffn_hidden_size=config["ffn_hidden_size"], time_embed_dim=config["time_embed_dim"],
                                dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(3)
    state = {name: torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05) + (1.0 if "norm" in name else 0.0)
             for name, p in tower.state_dict().items()}
    tower.load_state_dict(state)
    tower.requires_grad_(False)
    device = comfy.model_management.get_torch_device()
    return comfy.model_patcher.ModelPatcher(tower, load_device=device, offload_device=device)


def with_fun_control(upstream, patcher, config=TINY):
    """`patcher` with upstream's own apply node's Fun ControlNet (a tower sized by `config`);
    skips where this ComfyUI has no such node."""
    try:
        from comfy_extras.nodes_minimax_h3 import MiniMaxH3FunControlNetApply
    except ImportError:
        pytest.skip("this ComfyUI has no MiniMaxH3FunControlNetApply")
    frames = torch.rand(22, 32, 64, 3, generator=torch.Generator().manual_seed(5))
    out = MiniMaxH3FunControlNetApply.execute(patcher, control_model_patch(upstream, config), _FakeVideoVAE(),
                                              0.8, 0.0, 1.0, control_video=frames)
    return out.args[0]


@pytest.fixture(scope="module")
def controlled(upstream, patcher):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    return with_fun_control(upstream, patcher)


def test_fun_controlnet_acts_on_the_single_card_result(controlled, patcher):
    assert rel_diff(sample(controlled), sample(patcher)) > 1e-3


@pytest.mark.parametrize("world", [2, 4])
def test_fun_controlnet_under_sp_equals_one_card(controlled, world):
    reference = sample(controlled)
    coord, parallel = node_dit(controlled, world)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL


def test_fun_controlnet_under_sp_twice_in_a_row(controlled):
    """The control state is per rank and per forward: a second sampling run is the same."""
    reference = sample(controlled)
    coord, parallel = node_dit(controlled, 3)
    with coord:
        first, second = sample(parallel), sample(parallel)
    assert rel_diff(first, reference) <= FP32_TOL and rel_diff(second, reference) <= FP32_TOL
