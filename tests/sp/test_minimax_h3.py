"""Sequence-parallel DiT: W ranks against the single-device forward of the same model and inputs.

Tolerances: fp32 max |diff| <= 1e-5 x max |reference| (the ranks compute every output row from
the same weights and the same full K/V; only kernel tiling over a different number of query rows
can change the last bits). bf16: <= 1e-2 x max |reference|: the same argument, but one changed
rounding in a bf16 op is 2^-8 = 3.9e-3 relative and a few can add up through the residual
stream of 3 blocks (the output heads run in fp32, so nothing is lost after the last block).
"""

from __future__ import annotations

import threading
import types

import pytest
import torch

from comfy.multidevice.miniature import h3_blocks as miniature_blocks
from comfy.multidevice.miniature.h3_sequence import build_layout
from comfy.multidevice.sp.minimax_h3 import (WRAPPER_KEY, enable_sequence_parallel, enable_sequence_parallel_on_patcher, install_rank_sequence_parallel, contract_problems)
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.strategies import AllGatherKV, make_kv_strategy
from comfy.multidevice.sp.plan import SequenceParallelError, ShardPlan
from comfy.multidevice.devices import copy_for_rank
from tests.sp_cases import (BF16_TOL, CASES, FP32_TOL, TINY, BlockWithoutAttentionArgument, FunControlBlockPatchStandIn,
                            make_inputs, plan_edges, rel_diff, replicas, run_sp, tiny_model)


# ----------------------------------------------------------------------------- the parity matrix

@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_fp32(model32, references, backend, world, case):
    out, sp, _ = run_sp(model32, world, backend, case)
    ref = references[case]
    assert [o.shape for o in out] == [r.shape for r in ref]
    assert rel_diff(out, ref) <= FP32_TOL
    seq_len = sum(sp.tokens_per_rank())
    assert sp.tokens_per_rank() == [b - a for a, b in plan_edges(seq_len, world)]
    if world > 1:  # K and V of every block plus the final row gather crossed between ranks
        assert sp.bytes_exchanged_last_forward() > 0


def test_matrix_covers_the_hard_layouts(model32):
    """The parity matrix above includes every shape of shard the issue names."""
    seen = set()
    for case in CASES:
        x, _, ctx, kw = make_inputs(case)
        payload = kw.get("minimax_payload", {})
        layout = build_layout(ctx.shape[1], (x[0].shape[2], x[0].shape[3] // 2, x[0].shape[4] // 2),
                              x[1].shape[-1], [z.shape[2] for z in payload.get("cond_video_latents", [])],
                              [(z.shape[3] // 2, z.shape[4] // 2) for z in payload.get("ref_image_latents", [])],
                              [z.shape[-1] for z in payload.get("ref_audio_latents", [])])
        s = layout.seq_len
        kinds = {k for _, _, k in layout.segments}
        for world in (2, 3, 4):
            if s % world:
                seen.add("S not divisible by W")
            if world < s <= world + 2:
                seen.add("S barely above W")
            for a, b in plan_edges(s, world)[1:]:
                if any(sa < a < sb for sa, sb, _ in layout.segments):
                    seen.add("shard edge inside a segment")
            va, vb = layout.span("video")
            if any(a >= va and b <= vb for a, b in plan_edges(s, world)):
                seen.add("a rank holding only video rows")
        if {"cond", "ref_img", "ref_audio"} <= kinds:
            seen.add("cond and reference segments")
    assert seen == {"S not divisible by W", "S barely above W", "shard edge inside a segment",
                    "a rank holding only video rows", "cond and reference segments"}


def test_masked_case_has_per_token_rows_cut_by_shard_edges(model32):
    """The 'masked' layout feeds tensor rows to the blocks, and W=4 cuts such a span."""
    x, t, ctx, kw = make_inputs("masked")
    seen = []

    def spy(args, extra):
        seen.append(args["mod_segments"])
        return extra["original_block"](args)

    with torch.inference_mode():
        model32(x, t, ctx, transformer_options={"patches_replace": {"dit": {("double_block", 0): spy}}}, **kw)
    tensor_spans = [(a, b) for a, b, row in seen[0] if torch.is_tensor(row) and row.dim() == 1]
    assert len(tensor_spans) == 2  # audio and video
    s = seen[0][-1][1]
    edges = [a for a, _ in plan_edges(s, 4)[1:]]
    assert any(a < e < b for a, b in tensor_spans for e in edges)


@pytest.mark.parametrize("world", [2, 4])
def test_parity_bf16(world):
    model = tiny_model(torch.bfloat16, seed=1)
    for case in ("plain", "masked"):
        x, t, ctx, kw = make_inputs(case, seed=3)
        with torch.inference_mode():
            ref = model(x, t, ctx, **kw)
        out, _, _ = run_sp(model, world, "peer", case, seed=3)
        assert out[0].dtype == ref[0].dtype
        assert rel_diff(out, ref) <= BF16_TOL


def euler_sample(forward, x, context, steps, kwargs):
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    x = [z.clone() for z in x]
    for i in range(steps):
        v = forward(x, (sigmas[i] * 1000).reshape(1), context, **kwargs)
        x = [z + (sigmas[i + 1] - sigmas[i]) * d for z, d in zip(x, v)]
    return x


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 4])
def test_euler_sampling_loop_matches(model32, backend, world):
    x, _, ctx, kw = make_inputs("cond_refs", seed=5)
    with torch.inference_mode():
        ref = euler_sample(model32, x, ctx, 4, kw)
        with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=30) as coord:
            sp = enable_sequence_parallel(replicas(model32, world), coord)
            out = euler_sample(sp, x, ctx, 4, kw)
    assert rel_diff(out, ref) <= FP32_TOL


# ----------------------------------------------------------------------------- the SP region

def test_text_refiner_attention_is_not_exchanged(model32):
    """Per rank and forward: one K/V exchange per DiT block plus the final gather, nothing else."""
    _, sp, _ = run_sp(model32, 2, "peer", "plain")
    for traffic in sp.fan_out.runner.last_traffic:
        assert traffic["calls"] == TINY.num_layers + 1  # + the hidden state before the final layer
    assert TINY.token_refiner_num_layers > 0  # the refiner ran its attention, unexchanged


def test_user_attention_override_still_runs(model32, references):
    calls = []
    lock = threading.Lock()

    def user_override(func, *args, **kwargs):
        with lock:
            calls.append(tuple(args[1].shape))  # k as the user override sees it
        return func(*args, **kwargs)

    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 2), coord)
        with torch.inference_mode():
            out = sp(x, t, ctx, transformer_options={"optimized_attention_override": user_override}, **kw)
    assert rel_diff(out, references["plain"]) <= FP32_TOL
    # per rank: refiner layers + blocks; blocks see the full K ([1, heads, 35, head_dim])
    assert len(calls) == 2 * (TINY.token_refiner_num_layers + TINY.num_layers)
    full = [c for c in calls if c[2] == 35]
    assert len(full) == 2 * TINY.num_layers


def test_callers_transformer_options_are_not_modified(model32):
    x, t, ctx, kw = make_inputs("plain")
    options = {"patches_replace": {"dit": {}}, "sample_sigmas": torch.tensor([1.0, 0.5])}
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 2), coord)
        with torch.inference_mode():
            sp(x, t, ctx, transformer_options=options, **kw)
    assert options["patches_replace"] == {"dit": {}}
    assert set(options) == {"patches_replace", "sample_sigmas"}


def test_bypassed_override_is_an_error_not_a_wrong_result(model32, monkeypatch):
    monkeypatch.setattr(miniature_blocks, "attention",
                        lambda q, k, v, heads, transformer_options=None, **kw:
                        miniature_blocks.scaled_dot_product(q, k, v, heads, **kw))
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 2), coord)
        with pytest.raises(SequenceParallelError, match="did not call the attention override"):
            with torch.inference_mode():
                sp(x, t, ctx, **kw)


@pytest.mark.timeout(60)
def test_a_failing_rank_does_not_hang_the_others(model32):
    class Broken(torch.nn.Module):
        def forward(self, x):
            raise RuntimeError("rank 2 broke in its MLP")

    models = replicas(model32, 3)
    models[2].blocks[1].mlp = Broken()
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(models, coord)
        with pytest.raises(RuntimeError, match="rank 2 broke"):
            with torch.inference_mode():
                sp(x, t, ctx, **kw)
        # the coordinator is usable again afterwards
        sp_ok = enable_sequence_parallel(replicas(model32, 3), coord)
        with torch.inference_mode():
            sp_ok(x, t, ctx, **kw)


def test_rank_threads_inherit_inference_mode(model32):
    out, _, _ = run_sp(model32, 2, "peer", "plain")
    assert out[0].is_inference() and not out[0].requires_grad


# ----------------------------------------------------------------------------- per-rank interface

class MinimalComm:
    """Only the per-rank interface a torch.distributed communicator also offers."""

    def __init__(self, comm):
        self._comm = comm
        self.rank, self.world_size, self.device = comm.rank, comm.world_size, comm.device

    def exchange(self, tensors, cat_dims, shard_sizes=None, workspace=None):
        return self._comm.exchange(tensors, cat_dims, shard_sizes, workspace)

    def all_reduce(self, tensor, op="sum"):
        return self._comm.all_reduce(tensor, op)


def test_one_rank_per_caller_with_the_minimal_comm_interface(model32, references):
    """The multi-process pattern: every rank calls its own forward after install_rank_sequence_parallel."""
    world = 3
    models = replicas(model32, world)
    x, t, ctx, kw = make_inputs("masked")

    def rank_forward(rank, comm, model):
        options = {}
        install_rank_sequence_parallel(model, MinimalComm(comm), options, "allgather")
        with torch.inference_mode():
            return model(copy_for_rank(x, comm.device), t, ctx, transformer_options=options, **kw)

    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        outs = coord.run(rank_forward, models)
    for out in outs:
        assert rel_diff(out, references["masked"]) <= FP32_TOL


# ----------------------------------------------------------------------------- errors

def test_sp_mode_is_validated_before_anything_runs(model32):
    assert isinstance(make_kv_strategy("allgather"), AllGatherKV)
    assert isinstance(make_kv_strategy(None), AllGatherKV)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        with pytest.raises(ValueError, match="unknown sequence-parallel mode 'ring'.*allgather"):
            enable_sequence_parallel(replicas(model32, 2), coord, sp_mode="ring")


def test_allgather_rejects_masks():
    with pytest.raises(SequenceParallelError, match="mask"):
        AllGatherKV().attend(None, None, None, None, None, 2, mask=torch.ones(1))


def test_replica_errors(model32):
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        with pytest.raises(ValueError, match="1 model replicas for 2 ranks"):
            enable_sequence_parallel([model32], coord)
        meta = tiny_model().to("meta")
        with pytest.raises(ValueError, match="replica 1 is on meta"):
            enable_sequence_parallel([model32, meta], coord)
        with pytest.raises(SequenceParallelError, match="MiniMax-H3"):
            enable_sequence_parallel([model32, torch.nn.Linear(2, 2)], coord)
    assert not contract_problems(model32)
    assert contract_problems(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- ComfyUI entry point

class FakePatcher:
    """The part of ComfyUI's ModelPatcher the entry point uses."""

    def __init__(self, diffusion_model):
        self.model = types.SimpleNamespace(diffusion_model=diffusion_model)
        self.wrappers = {}

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)


def test_patcher_entry_point(model32, references, fake_patcher_extension):
    models = replicas(model32, 3)
    primary = FakePatcher(models[0])
    x, t, ctx, kw = make_inputs("cond_refs")
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=30) as coord:
        with pytest.raises(ValueError, match="2 replicas for 3 ranks"):
            enable_sequence_parallel_on_patcher(primary, coord, [None, models[1]])
        primary.load_device = torch.device("meta")
        with pytest.raises(ValueError, match="loads on meta but rank 0 runs on cpu"):
            enable_sequence_parallel_on_patcher(primary, coord, [None, models[1], models[2]])
        primary.load_device = torch.device("cpu")
        assert primary.wrappers == {}  # nothing installed by the failed calls
        replica_patchers = [primary, FakePatcher(models[1]), FakePatcher(models[2])]
        enable_sequence_parallel_on_patcher(primary, coord, replica_patchers)
        enable_sequence_parallel_on_patcher(primary, coord, replica_patchers)  # re-enable replaces
        assert len(primary.wrappers["diffusion_model"][WRAPPER_KEY]) == 1
        # what ComfyUI's sampling does: the patcher's wrappers go into transformer_options
        options = {"wrappers": primary.wrappers}
        with torch.inference_mode():
            out = primary.model.diffusion_model(x, t, ctx, transformer_options=options, **kw)
            ref = model32(x, t, ctx, **kw)
        assert rel_diff(out, ref) <= FP32_TOL
        fan_out = primary.wrappers["diffusion_model"][WRAPPER_KEY][0]
        assert [s.tokens for s in fan_out.runner.last_rank_states] == [
            b - a for a, b in plan_edges(sum(s.tokens for s in fan_out.runner.last_rank_states), 3)]


# ----------------------------------------------------------------------------- set-up once

def test_rank_set_up_is_made_once_and_reused_by_every_forward(model32, references, monkeypatch):
    """Contract check, K/V strategy, exchanging attention and the block table survive across
    forwards; the modulation spans and RoPE rows are sliced once per forward, not per block;
    every forward still matches the single device (fp32, 1e-5 relative)."""
    from comfy.multidevice.sp import minimax_h3

    checks, slices = [], []
    real_check, real_slice = minimax_h3._require_support, minimax_h3.slice_mod_segments
    monkeypatch.setattr(minimax_h3, "_require_support", lambda m, what: (checks.append(what), real_check(m, what)))
    monkeypatch.setattr(minimax_h3, "slice_mod_segments", lambda s, p: (slices.append(p.rank), real_slice(s, p))[1])
    x, t, ctx, kw = make_inputs("plain")
    world, forwards = 3, 3
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, world), coord, sp_mode="allgather")
        checks.clear()  # the checks of enable time itself
        seen = []
        for _ in range(forwards):
            with torch.inference_mode():
                out = sp(x, t, ctx, **kw)
            assert rel_diff(out, references["plain"]) <= FP32_TOL
            seen.append([(id(s), id(s.strategy), id(s.exchanging), id(s._table)) for s in sp.fan_out.runner.last_rank_states])
    assert seen[0] == seen[1] == seen[2]  # the same objects on every forward
    assert len(checks) == world  # once per rank's model, at its first forward
    # once per rank and forward for the blocks (not once per block)
    assert sorted(slices) == sorted(list(range(world)) * forwards)


def test_auto_decides_and_logs_once_over_many_forwards(model32, caplog):
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 3), coord, sp_mode="auto")
        with caplog.at_level("INFO", logger="comfy.multidevice.sp"):
            for _ in range(3):
                with torch.inference_mode():
                    sp(x, t, ctx, **kw)
    decisions = [r for r in caplog.records if "sp_mode auto" in r.getMessage()]
    assert len(decisions) == 1, [r.getMessage() for r in decisions]


# ----------------------------------------------------------------------------- version guard

class _BlockIgnoringAttention(miniature_blocks.DiTBlock):
    """A block that takes `attention` but runs its own module anyway (what v0.33's block wrapper
    does with args["attention"]): under SP every rank would attend to its own rows only."""

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None, attention=None):
        return super().forward(x, t_emb, mod_segments, rope_freqs, transformer_options)


def _with_block_class(model, cls):
    import copy
    out = copy.deepcopy(model)
    for block in out.blocks:
        block.__class__ = cls
    return out


def test_blocks_without_the_attention_hook_are_refused_before_anything_is_set_up(model32):
    old = _with_block_class(model32, BlockWithoutAttentionArgument)
    problems = contract_problems(old)
    assert any("takes no `attention` argument" in p and "update ComfyUI" in p for p in problems), problems
    assert contract_problems(old)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        with pytest.raises(SequenceParallelError, match="takes no `attention` argument.*v0.33.0"):
            enable_sequence_parallel([old, copy_of(old)], coord)


def test_a_block_that_ignores_the_attention_hook_fails_on_every_rank_not_silently(model32):
    ignoring = _with_block_class(model32, _BlockIgnoringAttention)
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(ignoring, 3), coord)
        with pytest.raises(SequenceParallelError, match=r"block 0 did not call args\['attention'\]"):
            with torch.inference_mode():
                sp(x, t, ctx, **kw)
        # the ranks are free again: a supported model runs on the same coordinator
        good = enable_sequence_parallel(replicas(model32, 3), coord)
        with torch.inference_mode():
            assert rel_diff(good(x, t, ctx, **kw), model32(x, t, ctx, **kw)) <= FP32_TOL


def copy_of(model):
    import copy
    return copy.deepcopy(model)


# ----------------------------------------------------------------------------- preferred attention

def _with_preferred_attention(model, calls):
    """A copy whose every attention module prefers a function of its own (like a checkpoint
    configured for kitchen int8 attention). It is deliberately not the default math (keys
    scaled by 1.25), so a path that drops it gives a visibly different result."""
    import copy
    out = copy.deepcopy(model)
    lock = threading.Lock()

    def preferred(q, k, v, heads, **kwargs):
        with lock:
            calls.append(threading.current_thread().name)
        kwargs.pop("transformer_options", None)
        return miniature_blocks.scaled_dot_product(q, k * 1.25, v, heads, **kwargs)
    for module in out.modules():
        if isinstance(module, miniature_blocks.Attention):
            module.comfy_attention.function = preferred
    return out


@pytest.mark.parametrize("sp_mode", ["allgather", "ulysses"])
def test_preferred_attention_is_honoured_on_every_rank(model32, sp_mode):
    single_calls, rank_calls = [], []
    reference_model = _with_preferred_attention(model32, single_calls)
    x, t, ctx, kw = make_inputs("plain")
    with torch.inference_mode():
        reference = reference_model(x, t, ctx, **kw)
        default = model32(x, t, ctx, **kw)
    attention_layers = TINY.token_refiner_num_layers + TINY.num_layers
    assert len(single_calls) == attention_layers
    assert rel_diff(reference, default) > 1e-3  # the preferred function really is different
    world = 3
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(
            [_with_preferred_attention(model32, rank_calls) for _ in range(world)], coord, sp_mode=sp_mode)
        with torch.inference_mode():
            out = sp(x, t, ctx, **kw)
    assert rel_diff(out, reference) <= FP32_TOL
    # every rank used it for the refiner and every block (ulysses: once per head chunk call)
    assert {name for name in rank_calls} == {f"sp-rank-{r}" for r in range(world)}
    assert all(rank_calls.count(f"sp-rank-{r}") >= attention_layers for r in range(world))


# ----------------------------------------------------------------------------- full-sequence patches

def test_a_control_patch_it_cannot_drive_is_refused_on_every_rank_before_any_block_runs(model32):
    patch = FunControlBlockPatchStandIn(0)
    options = {"patches_replace": {"dit": {("double_block", 0): patch}}}
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 2), coord)
        with pytest.raises(SequenceParallelError, match=r"FunControlBlockPatchStandIn \(0\).*npu_count 1 or 2"):
            with torch.inference_mode():
                sp(x, t, ctx, transformer_options=options, **kw)
    assert patch.calls == 0


def test_block_patches_that_work_per_token_still_chain(model32, references):
    calls = []

    def per_token_patch(args, extra):  # e.g. a hook that only reads or edits rows in place
        calls.append(args["img"].shape[0])
        return extra["original_block"](args)
    options = {"patches_replace": {"dit": {("double_block", 1): per_token_patch}}}
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 2), coord)
        with torch.inference_mode():
            out = sp(x, t, ctx, transformer_options=options, **kw)
    assert rel_diff(out, references["plain"]) <= FP32_TOL
    assert sorted(calls) == sorted(ShardPlan(35, 2, r).length for r in range(2))  # local rows


# ----------------------------------------------------------------------------- the final layer

def test_the_hidden_state_is_gathered_once_and_the_final_layer_runs_unpatched(model32, references):
    """The last block all-gathers the rows (one exchange per rank on top of one per block): the
    final layer runs on the full sequence on every rank, its class forward, nothing patched.
    (Replaces the rank-local final layer's tests: its rows went to rank 0 alone by all_to_all_v.)"""
    out, sp, _ = run_sp(model32, 3, "peer", "masked")  # per-token modulation rows cut by shard edges
    assert rel_diff(out, references["masked"]) <= FP32_TOL
    exchanges = sp.coordinator.byte_counts()
    assert all(set(c["by_op"]) == {"exchange"} for c in exchanges)
    assert all(c["by_op"]["exchange"]["calls"] == TINY.num_layers + 1 for c in exchanges)
    assert all(c["by_op"]["exchange"]["received"] > 0 for c in exchanges)  # every rank gets all rows
    assert all("forward" not in vars(m.final_layer) for m in sp.models)
