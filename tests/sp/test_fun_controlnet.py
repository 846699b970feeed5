"""Upstream's Fun ControlNet under sequence parallel (comfy/multidevice/sp/fun_controlnet.py), with
stand-ins of its tower and block patch whose math needs the whole sequence: W ranks give the
single-device result (fp32 tolerance of tests/sp_cases.py)."""

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from tests.sp_cases import FP32_TOL, make_inputs, rel_diff, replicas


class _ControlTowerStandIn(torch.nn.Module):
    """The API of upstream's MiniMaxH3FunControl, with math that needs the whole sequence: each
    step mixes every row with the mean over all rows (as its full self-attention would)."""

    injection_layers = (0, 2)

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(0.5), requires_grad=False)

    def init_stream(self, h, latent, layout, t_emb):
        return h * self.scale + latent.mean()

    def step(self, index, c, t_emb, mod_segments, rope_freqs, transformer_options):
        c = c + 0.1 * c.mean(0, keepdim=True) + 0.01 * index
        return c, 0.3 * c


class _FunBlockPatchStandIn:
    """Upstream's MiniMaxH3FunControlBlockPatch semantics on one card (the reference)."""

    def __init__(self, control_patch, block_index, previous=None):
        self.control_patch, self.block_index, self.previous = control_patch, block_index, previous

    def __call__(self, args, extra):
        control, tower = self.control_patch, self.control_patch.model_patch.model
        step = tower.injection_layers.index(self.block_index)
        if step == 0:
            control.pristine = args["img"].clone()
        out = extra["original_block"](args) if self.previous is None else self.previous(args, extra)
        if step == 0:
            control.stream = tower.init_stream(control.pristine, control.control_latent, args["layout"], args["t_emb"])
        control.stream, skip = tower.step(step, control.stream, args["t_emb"], args["mod_segments"],
                                          args["rope_freqs"], args["transformer_options"])
        skip[args["layout"].audio_pos] = 0
        out["img"].add_(skip, alpha=control.strength)
        return out


def _fun_options():
    from types import SimpleNamespace
    control = SimpleNamespace(active=True, strength=0.7, control_latent=torch.linspace(-1, 1, 12).view(3, 4),
                              model_patch=SimpleNamespace(model=_ControlTowerStandIn()),
                              prepared=[], prepare_control_latent=None)
    control.prepare_control_latent = lambda shape: control.prepared.append(tuple(shape))
    patches = {("double_block", i): _FunBlockPatchStandIn(control, i) for i in _ControlTowerStandIn.injection_layers}
    return {"patches_replace": {"dit": patches}}, control


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fun_controlnet_runs_exactly_under_sp(model32, references, world):
    options, control = _fun_options()
    x, t, ctx, kw = make_inputs("plain")
    with torch.inference_mode():
        reference = model32(x, t, ctx, transformer_options=options, **kw)
    assert rel_diff(reference, references["plain"]) > 1e-3  # the control acts
    options, control = _fun_options()
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, world), coord)
        with torch.inference_mode():
            out = sp(x, t, ctx, transformer_options=options, **kw)
    assert rel_diff(out, reference) <= FP32_TOL
    assert not hasattr(control, "stream")  # the shared patch object was never used for rank state
