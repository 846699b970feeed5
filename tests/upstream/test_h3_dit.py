"""Upstream's own MiniMax-H3 DiT under sequence parallel, against upstream's own single device.

The model is upstream's `MiniMaxH3Model` (from COMFYUI_DIR) with a tiny config and seeded random
weights; the inputs are the packed layouts of tests/sp_cases.py. On a ComfyUI whose blocks take
the `attention` hook every case must match one card: fp32 within 1e-5 of max |reference| (the
same argument as tests/sp: every output row is computed from the same weights and the same full
K/V; only kernel tiling over a different number of query rows can move the last bits), bf16
within 1e-2. On an older ComfyUI (v0.33.0) the adapter must refuse, before anything runs, and
never return a wrong result: the guard cases check both.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp import minimax_h3
from comfy.multidevice.sp.plan import SequenceParallelError
from tests.sp_cases import make_inputs, rel_diff

FP32_TOL = 1e-5
BF16_TOL = 1e-2
TINY = dict(hidden_size=32, num_layers=3, token_refiner_num_layers=1, num_attention_heads=3,
            attention_head_dim=16, ffn_hidden_size=48, text_dim=24, timestep_input_dim=16,
            time_embed_hidden_size=32, time_embed_dim=16, rope_inv_freq_len=2)
CASES = ("plain", "tiny", "audio_mask")  # upstream crashes single-device on a partial video mask (its own bug)


def tiny_state_dict(upstream, seed=0, config=TINY):
    """Seeded random weights for upstream's tiny MiniMaxH3Model of `config` (norm weights around 1)."""
    import comfy.ops
    shell = upstream.h3.MiniMaxH3Model(**config, dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in shell.state_dict().items():
        scale = 0.2 if p.dim() > 1 else 0.05
        state[name] = torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0)
    state["rope.inv_freq"] = torch.tensor([1.0, 0.3])
    return state


def tiny_model(upstream, dtype=torch.float32, seed=0):
    import comfy.ops
    model = upstream.h3.MiniMaxH3Model(**TINY, dtype=dtype, operations=comfy.ops.disable_weight_init)
    model.load_state_dict(tiny_state_dict(upstream, seed))  # copied into each weight's own dtype
    return model.requires_grad_(False).eval()


@pytest.fixture(scope="module")
def model32(upstream):
    return tiny_model(upstream)


def needs_hook(upstream):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI's H3 blocks take no `attention` argument: sequence parallel is "
                    "refused there (test_version_guard_* check that)")


def inputs(case, dtype=torch.float32):
    if case == "audio_mask":  # sp_cases' masked layout with its audio mask only (per-token modulation rows)
        x, t, ctx, kw = make_inputs("masked")
        kw = {"audio_denoise_mask": kw["audio_denoise_mask"]}
    else:
        x, t, ctx, kw = make_inputs(case)
    return x, t, ctx.to(dtype), kw  # the text states come in the DiT's dtype, as from ComfyUI


def sp_forward(models, world, case, sp_mode="allgather", backend="peer", dtype=torch.float32):
    x, t, ctx, kw = inputs(case, dtype)
    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=60) as coord:
        sp = minimax_h3.enable_sequence_parallel(models, coord, sp_mode=sp_mode)
        with torch.inference_mode():
            return sp(x, t, ctx, **kw)


def single_forward(model, case, dtype=torch.float32):
    x, t, ctx, kw = inputs(case, dtype)
    with torch.inference_mode():
        return model(x, t, ctx, transformer_options={}, **kw)


# ----------------------------------------------------------------------------- the guard

def test_version_guard_matches_what_this_comfyui_offers(upstream, model32):
    problems = minimax_h3.contract_problems(model32)
    if upstream.has_attention_hook:
        assert problems == []
    else:
        assert any("takes no `attention` argument" in p and "update ComfyUI" in p for p in problems), problems
        with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
            with pytest.raises(SequenceParallelError, match="v0.33.0"):
                minimax_h3.enable_sequence_parallel([model32, copy.deepcopy(model32)], coord)


def test_version_guard_at_run_time_even_when_detection_is_fooled(upstream, model32, monkeypatch):
    """Every block checks that it went through the exchanging attention: on a ComfyUI whose
    block wrapper ignores args['attention'], every rank raises instead of a wrong result."""
    monkeypatch.setattr(minimax_h3, "takes_attention_argument", lambda block: True)
    world = 3
    if upstream.has_attention_hook:
        out = sp_forward([copy.deepcopy(model32) for _ in range(world)], world, "plain")
        assert rel_diff(out, single_forward(model32, "plain")) <= FP32_TOL
        return
    with pytest.raises(SequenceParallelError, match=r"did not call args\['attention'\]"):
        sp_forward([copy.deepcopy(model32) for _ in range(world)], world, "plain")


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sp_mode", ["allgather", "ulysses", "auto"])
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_sp_matches_upstreams_single_device(upstream, model32, world, sp_mode, case):
    needs_hook(upstream)
    x, _, ctx, _ = inputs(case)
    reference = single_forward(model32, case)
    seq = sum(v.shape[-1] * v.shape[-2] // 4 * v.shape[-3] for v in x[:1]) + x[1].shape[-1] + ctx.shape[1]
    if world > seq:  # more ranks than rows: a clear error naming the count and the fix
        with pytest.raises(ValueError, match=rf"rows cannot be split over {world} ranks .* use at most"):
            sp_forward([copy.deepcopy(model32) for _ in range(world)], world, case, sp_mode)
        return
    out = sp_forward([copy.deepcopy(model32) for _ in range(world)], world, case, sp_mode)
    assert rel_diff(out, reference) <= FP32_TOL


def test_sp_matches_upstreams_single_device_bf16(upstream):
    needs_hook(upstream)
    model = tiny_model(upstream, dtype=torch.bfloat16)
    reference = single_forward(model, "plain", torch.bfloat16)
    out = sp_forward([copy.deepcopy(model) for _ in range(4)], 4, "plain", dtype=torch.bfloat16)
    assert rel_diff(out, reference) <= BF16_TOL


def test_sp_over_the_fake_hccl_library(upstream, model32, use_fake_hccl):
    needs_hook(upstream)
    out = sp_forward([copy.deepcopy(model32) for _ in range(4)], 4, "plain", backend="hccl")
    assert rel_diff(out, single_forward(model32, "plain")) <= FP32_TOL


# ----------------------------------------------------------------------------- preferred attention

def test_preferred_attention_is_honoured_on_every_rank(upstream, model32):
    """A checkpoint's attention (comfy_attention.function, e.g. kitchen int8) must run on every
    rank as on one card. The stand-in preferred function scales the keys, so a path that drops
    it differs visibly from the reference."""
    needs_hook(upstream)
    from comfy.ldm.modules import attention as upstream_attention
    calls = []
    lock = threading.Lock()

    def scaled_keys(q, k, v, heads, *args, **kwargs):
        with lock:
            calls.append(threading.current_thread().name)
        return upstream_attention.attention_pytorch(q, k * 1.25, v, heads, *args, **kwargs)

    # wrapped the way upstream wraps its own attention functions (tensor containers, override)
    preferred = upstream_attention.wrap_attn(scaled_keys)

    def with_preferred(model):
        out = copy.deepcopy(model)
        for module in out.modules():
            if hasattr(module, "comfy_attention"):
                module.comfy_attention.function = preferred
        return out

    reference = single_forward(with_preferred(model32), "plain")
    single_calls = len(calls)
    assert single_calls >= TINY["num_layers"]
    assert rel_diff(reference, single_forward(model32, "plain")) > 1e-3  # it is not the default
    calls.clear()
    world = 3
    out = sp_forward([with_preferred(model32) for _ in range(world)], world, "plain")
    assert rel_diff(out, reference) <= FP32_TOL
    assert sorted(set(calls)) == [f"sp-rank-{r}" for r in range(world)]
    assert all(calls.count(f"sp-rank-{r}") == single_calls for r in range(world))


# ----------------------------------------------------------------------------- PDD head bank

def with_pdd_heads(model, n=3, seed=4):
    """Upstream's final layer with an n-fold "PDD" head bank (weights n x out rows, the layer's
    out_features unchanged: that is how upstream tells the bank from a plain head)."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for head in (out.final_layer.video_out, out.final_layer.audio_out):
        rows, cols = head.weight.shape
        head.weight = torch.nn.Parameter(torch.randn(rows * n, cols, generator=g) * 0.2, requires_grad=False)
        head.bias = torch.nn.Parameter(torch.randn(rows * n, generator=g) * 0.05, requires_grad=False)
    return out


@pytest.mark.parametrize("sigma_index", [0, 2])
def test_pdd_head_bank_under_sp(upstream, model32, sigma_index):
    needs_hook(upstream)
    pdd = with_pdd_heads(model32)
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    x, t, ctx, kw = inputs("plain")
    t = sigmas[sigma_index:sigma_index + 1] * 1000.0
    options = {"sample_sigmas": sigmas}
    with torch.inference_mode():
        reference = pdd(x, t, ctx, transformer_options=dict(options), **kw)
        plain = model32(x, t, ctx, transformer_options=dict(options), **kw)
    assert rel_diff(reference, plain) > 1e-3  # the bank is in use
    world = 3
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
        sp = minimax_h3.enable_sequence_parallel([copy.deepcopy(pdd) for _ in range(world)], coord)
        with torch.inference_mode():
            out = sp(x, t, ctx, transformer_options=dict(options), **kw)
    assert rel_diff(out, reference) <= FP32_TOL
