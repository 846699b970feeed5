"""Ulysses (all-to-all) sequence parallel, its hybrid, the overlapped exchange and `auto`.

The parity matrix of tests/sp/test_minimax_h3.py (W in 1..4, the four layouts: S not
divisible by W, shard edges inside segments, a rank holding only video rows, S barely above W,
cond/reference segments, per-token modulation rows) for the new modes, on peer-copy and on the
fake HCCL and NCCL libraries, against the single-device forward of the same model and inputs.

Tolerances (the same as the all-gather tests, for the same reason): fp32 max |diff| <= 1e-5 x
max |reference|: every output row is computed from the same weights and the same full K/V of its
heads; only kernel tiling over a different number of query rows / heads changes the last bits.
bf16 <= 1e-2 x max |reference|: one changed bf16 rounding is 2^-8 = 3.9e-3 relative and a few
can add up through the residual stream of 3 blocks.

Models: 4 heads (W=2, 4: plain Ulysses; W=3: degree 1) and 6 heads (W=2, 3: plain; W=4: the
hybrid, 2 groups of 2) - so plain, hybrid and degenerate hybrid all run.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from comfy.multidevice.miniature.h3 import build_miniature
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.strategies import AllGatherKV, make_kv_strategy
from comfy.multidevice.sp.plan import SequenceParallelError, shard_sizes
from comfy.multidevice.sp.cost_model import DiTShape, forward_traffic, ulysses_degree
from comfy.multidevice.sp.strategies import AutoKV, SPMode
from comfy.multidevice.sp.ulysses import UlyssesKV
from tests.sp_cases import BF16_TOL, CASES, FP32_TOL, TINY, make_inputs, rel_diff, replicas, run_sp


def config(heads):
    return dataclasses.replace(TINY, num_attention_heads=heads)


@pytest.fixture(scope="module")
def models():
    return {h: build_miniature(config(h), seed=h) for h in (4, 6)}


@pytest.fixture(scope="module")
def references(models):
    out = {}
    with torch.inference_mode():
        for heads, model in models.items():
            for case in CASES:
                x, t, ctx, kw = make_inputs(case)
                out[heads, case] = model(x, t, ctx, **kw)
    return out


@pytest.fixture(params=["peer", "hccl", "nccl"])
def backend(request):
    if request.param != "peer":
        request.getfixturevalue(f"use_fake_{request.param}")
    return request.param


# ----------------------------------------------------------------------------- parity matrix

@pytest.mark.timeout(120)
@pytest.mark.parametrize("heads", [4, 6])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_ulysses_and_hybrid(models, references, backend, world, heads):
    for case in CASES:
        out, _, counts = run_sp(models[heads], world, backend, case, "ulysses")
        ref = references[heads, case]
        assert [o.shape for o in out] == [r.shape for r in ref]
        assert rel_diff(out, ref) <= FP32_TOL, (case, world, heads)
        if world > 1:
            assert all(c["by_op"]["all_to_all_v"]["calls"] > 0 for c in counts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("heads,chunks", [(4, 2), (6, 3), (6, 2)])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_overlapped_exchange(models, references, backend, world, heads, chunks):
    for case in CASES:  # the whole layout matrix, S = 5 over 4 ranks included
        out, _, counts = run_sp(models[heads], world, backend, case, SPMode("ulysses", overlap_chunks=chunks))
        assert rel_diff(out, references[heads, case]) <= FP32_TOL, (case, world, heads, chunks)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_parity_auto(models, references, world):
    for heads in (4, 6):
        out, _, _ = run_sp(models[heads], world, "peer", "plain", "auto")
        assert rel_diff(out, references[heads, "plain"]) <= FP32_TOL


@pytest.mark.parametrize("world", [2, 4])
def test_parity_bf16(world):
    model = build_miniature(config(4), seed=1, dtype=torch.bfloat16)
    for case in ("plain", "masked"):
        x, t, ctx, kw = make_inputs(case, seed=3)
        with torch.inference_mode():
            ref = model(x, t, ctx, **kw)
        out, _, _ = run_sp(model, world, "peer", case, SPMode("ulysses", overlap_chunks=2), seed=3)
        assert out[0].dtype == ref[0].dtype and rel_diff(out, ref) <= BF16_TOL


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [3, 4])
def test_euler_sampling_loop_matches(models, backend, world):
    model = models[6]
    x, _, ctx, kw = make_inputs("cond_refs", seed=5)

    def euler(forward):
        sigmas = torch.linspace(1.0, 0.0, 5)
        z = [a.clone() for a in x]
        for i in range(4):
            v = forward(z, (sigmas[i] * 1000).reshape(1), ctx, **kw)
            z = [a + (sigmas[i + 1] - sigmas[i]) * d for a, d in zip(z, v)]
        return z

    with torch.inference_mode():
        ref = euler(model)
        with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=30) as coord:
            out = euler(enable_sequence_parallel(replicas(model, world), coord,
                                                 sp_mode=SPMode("ulysses", overlap_chunks=2)))
    assert rel_diff(out, ref) <= FP32_TOL


# ----------------------------------------------------------------------------- bytes vs the model

@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
@pytest.mark.parametrize("heads,world", [(4, 2), (4, 3), (4, 4), (6, 4), (6, 3)])
def test_byte_counters_match_the_cost_model(models, mode, heads, world):
    """What the coordinator counted in one forward of the miniature equals, rank by rank, the
    byte formula bench/project_h3.py projects the real H3 with (comfy/multidevice/sp/cost_model.py)."""
    cfg = config(heads)
    x, t, ctx, kw = make_inputs("cond_refs")
    with torch.inference_mode():
        seq_len = None

        def spy(args, extra):
            nonlocal seq_len
            seq_len = args["img"].shape[0]
            return extra["original_block"](args)
        models[heads](x, t, ctx, transformer_options={"patches_replace": {"dit": {("double_block", 0): spy}}},
                      **kw)
    _, _, counts = run_sp(models[heads], world, "peer", "cond_refs", mode)
    shape = DiTShape(hidden=cfg.hidden_size, blocks=cfg.num_layers, heads=heads,
                     head_dim=cfg.attention_head_dim, ffn=cfg.ffn_hidden_size)
    for rank, c in enumerate(counts):
        want = forward_traffic(mode, shape, seq_len, world, rank, itemsize=4)["total"]
        assert (c["sent"], c["received"]) == (want.sent, want.received), (rank, c["by_op"])
    if mode == "ulysses" and ulysses_degree(world, heads) > 1:
        # the blocks by all-to-all, the hidden state before the final layer by one exchange
        assert set(counts[0]["by_op"]) == {"all_to_all_v", "exchange"}
        assert counts[0]["by_op"]["exchange"]["calls"] == 1


def test_ulysses_moves_fewer_bytes_than_allgather_at_four_ranks(models):
    _, _, ag = run_sp(models[4], 4, "peer", "plain", "allgather")
    _, _, ul = run_sp(models[4], 4, "peer", "plain", "ulysses")
    assert max(c["received"] for c in ul) < max(c["received"] for c in ag)


# ----------------------------------------------------------------------------- the strategy itself

def _direct(world, heads, rows, strategy, skip_reshape, heads_first_out, backend="peer"):
    """Call strategy.attend on every rank with its rows of random q/k/v; compare with SDPA."""
    gen = torch.Generator().manual_seed(world * 10 + heads)
    dim = 8
    seq = sum(rows)
    q, k, v = (torch.randn(1, heads, seq, dim, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)  # [1, H, S, D]
    starts = [sum(rows[:r]) for r in range(world)]

    def local(t, r):
        part = t[:, :, starts[r]:starts[r] + rows[r]]
        return part if skip_reshape else part.transpose(1, 2).reshape(1, rows[r], heads * dim)

    def attention_fn(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False):
        assert skip_reshape and not skip_output_reshape
        o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)

    def job(rank, comm):
        kwargs = {"skip_reshape": skip_reshape}
        if heads_first_out:
            kwargs["skip_output_reshape"] = True
        return strategy.attend(comm, attention_fn, local(q, rank), local(k, rank), local(v, rank),
                               heads, **kwargs)

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job)
    for r, o in enumerate(out):
        rank_want = want[:, :, starts[r]:starts[r] + rows[r]]
        if not heads_first_out:
            rank_want = rank_want.transpose(1, 2).reshape(1, rows[r], heads * dim)
        assert o.shape == rank_want.shape
        assert torch.allclose(o, rank_want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("skip_reshape", [True, False])
@pytest.mark.parametrize("heads_first_out", [True, False])
def test_attend_layouts(skip_reshape, heads_first_out):
    _direct(3, 6, [3, 4, 4], UlyssesKV(), skip_reshape, heads_first_out)
    _direct(4, 6, [2, 3, 2, 3], UlyssesKV(overlap_chunks=3), skip_reshape, heads_first_out)


def test_explicit_degree_and_chunks_more_than_heads():
    _direct(4, 8, [3, 3, 3, 4], UlyssesKV(degree=2), True, False)      # 2 groups of 2, by request
    _direct(2, 2, [5, 6], UlyssesKV(overlap_chunks=16), True, False)   # chunks capped at the heads


def test_shards_off_the_plan_are_an_error_not_a_wrong_result():
    # S = 8 over 2 ranks is [4, 4] under the plan; [5, 3] would come back as [4, 4].
    with pytest.raises(SequenceParallelError, match="shard plan"):
        _direct(2, 4, [5, 3], UlyssesKV(), True, False)


def test_degree_that_does_not_divide_is_a_clear_error():
    with pytest.raises(SequenceParallelError, match="degree 3 must divide both the world size 4"):
        _direct(4, 6, [2, 2, 2, 2], UlyssesKV(degree=3), True, False)


def test_masks_are_rejected():
    with pytest.raises(SequenceParallelError, match="mask"):
        UlyssesKV().attend(None, None, None, None, None, 2, mask=torch.ones(1))


class _CountingComm:
    """A rank's comm that counts finished all-to-alls and the threads they ran on."""

    def __init__(self, comm):
        self.comm, self.rank, self.world_size, self.device = comm, comm.rank, comm.world_size, comm.device
        self.done, self.threads = 0, set()
        self.changed = threading.Condition()

    def all_to_all_v(self, *args, **kwargs):
        out = self.comm.all_to_all_v(*args, **kwargs)
        with self.changed:
            self.done += 1
            self.threads.add(threading.current_thread().name)
            self.changed.notify_all()
        return out


@pytest.mark.timeout(60)
def test_overlap_moves_the_next_chunk_while_this_one_is_attended():
    """The attention of chunk c waits until chunk c+1's all-to-all has finished: with the
    exchange run after the attention (no overlap) that wait would time out. Lane order per rank:
    in0, in1, out0, in2, out1, ...; so in(c+1) is the (2c+2)-th all-to-all."""
    world, heads, dim, chunks, rows = 2, 6, 8, 3, [5, 6]  # 3 heads per rank, 1 per chunk
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, heads, sum(rows), dim, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    strategy = UlyssesKV(overlap_chunks=chunks)

    def job(rank, comm):
        counting = _CountingComm(comm)
        attended = []

        def attention_fn(q, k, v, heads, **kwargs):
            c = len(attended)
            attended.append(c)
            if c < chunks - 1:
                with counting.changed:
                    assert counting.changed.wait_for(lambda: counting.done >= 2 * c + 2, timeout=10), \
                        f"rank {rank}: chunk {c + 1}'s exchange did not run during chunk {c}'s attention"
            o = F.scaled_dot_product_attention(q, k, v)
            return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)

        a = sum(rows[:rank])
        local = [t[:, :, a:a + rows[rank]] for t in (q, k, v)]
        out = strategy.attend(counting, attention_fn, *local, heads, skip_reshape=True)
        return out, counting.threads, threading.current_thread().name, len(attended)

    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        results = coord.run(job)
    for rank, (out, threads, rank_thread, attended) in enumerate(results):
        a = sum(rows[:rank])
        rank_want = want[:, :, a:a + rows[rank]].transpose(1, 2).reshape(1, rows[rank], heads * dim)
        assert torch.allclose(out, rank_want, rtol=0, atol=1e-6)
        assert attended == chunks
        # every all-to-all ran on the rank's helper thread, none on the rank thread itself
        assert rank_thread not in threads
        assert all(name.startswith(f"sp-rank-{rank}-exchange") for name in threads), threads


def test_a_failing_rank_during_the_overlapped_exchange_does_not_hang():
    heads, dim, rows = 4, 8, [3, 3, 3]
    strategy = UlyssesKV(overlap_chunks=4)
    calls = []

    def attention_fn(q, k, v, heads, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second chunk attended on any rank fails
            raise RuntimeError("attention kernel failed")
        o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)

    def job(rank, comm):
        t = torch.randn(1, heads, rows[rank], dim)
        return strategy.attend(comm, attention_fn, t, t, t, heads, skip_reshape=True)

    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=30) as coord:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="attention kernel failed"):
            coord.run(job)
        assert time.monotonic() - start < 10
        calls.append(1)  # no more failures: the coordinator still works afterwards
        out = coord.run(lambda rank, comm: comm.all_to_all_v(torch.arange(3.0), [1, 1, 1], 0))
        assert [o.tolist() for o in out] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


# ----------------------------------------------------------------------------- modes and options

def test_sp_modes_by_name_and_by_object():
    assert isinstance(make_kv_strategy("ulysses"), UlyssesKV)
    assert isinstance(make_kv_strategy("auto"), AutoKV)
    assert isinstance(make_kv_strategy(SPMode("allgather")), AllGatherKV)
    s = make_kv_strategy(SPMode("ulysses", overlap_chunks=3, degree=2))
    assert (s.overlap_chunks, s.degree) == (3, 2)
    assert str(SPMode("ulysses", 4)) == "ulysses (overlap 4 chunks)"


def test_bad_mode_options_are_value_errors():
    with pytest.raises(ValueError, match="'ring'.*allgather, ulysses, auto"):
        SPMode("ring")
    with pytest.raises(ValueError, match="overlap applies to the ulysses exchange"):
        SPMode("allgather", overlap_chunks=2)
    with pytest.raises(ValueError, match="overlap chunks must be >= 1"):
        SPMode("ulysses", overlap_chunks=0)
    with pytest.raises(ValueError, match="degree must be >= 1"):
        UlyssesKV(degree=0)


def test_auto_resolves_the_same_on_every_rank(models):
    strategies = []

    def prepare(rank, comm, model, options):
        from comfy.multidevice.sp.minimax_h3 import install_rank_sequence_parallel
        shard = install_rank_sequence_parallel(model, comm, options, "auto")
        strategies.append(shard.strategy)
        return shard

    from comfy.multidevice.sp.fan_out import RankThreads, SequenceParallelFanOut
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer") as coord:
        sp = enable_sequence_parallel(replicas(models[6], 4), coord, sp_mode="auto")
        sp.ranks = RankThreads(coord, sp.models, prepare_rank=prepare)
        sp.fan_out = SequenceParallelFanOut(sp.ranks)
        with torch.inference_mode():
            sp(x, t, ctx, **kw)
    assert [s.chosen for s in strategies] == ["ulysses"] * 4


def test_dry_run_options(tmp_path):
    """--sp-mode ulysses with --sp-overlap in the CLI's dry run: parity ok, counters in the JSON."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    repo = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, str(repo / "minimax_h3_parallel.py"), "run", "--devices", "3", "--cpu",
           "--sp-mode", "ulysses", "--sp-overlap", "2", "--steps", "2", "--frames", "22", "--width", "128",
           "--height", "96", "--hidden", "64", "--blocks", "2", "--heads", "6", "--head-dim", "16",
           "--text-tokens", "9", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"),
           "--no-progress"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["parity"] == "ok" and report["sp_mode"] == "ulysses" and report["sp_overlap"] == 2
    assert sum(c["received"] for c in report["byte_counts"]) == 2 * report["model_bytes_per_step"]
    bad = subprocess.run(cmd[:cmd.index("--sp-mode")] + ["--sp-mode", "allgather", "--sp-overlap", "2"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "overlap applies to the ulysses exchange" in bad.stderr


# ----------------------------------------------------------------------------- collectives per block

def _library_calls(monkeypatch, backend_class):
    """Every `_all_to_all_v_flat` library call, by rank (one per tensor the backend sends)."""
    calls = []
    original = backend_class._all_to_all_v_flat

    def counted(self, rank, *args):
        calls.append(rank)
        return original(self, rank, *args)
    monkeypatch.setattr(backend_class, "_all_to_all_v_flat", counted)
    return calls


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("world,heads,want_calls", [(2, 4, 2), (4, 8, 2), (4, 6, 3)])
def test_one_library_call_for_qkv_and_one_for_the_output(request, monkeypatch, backend, fused, world, heads,
                                                         want_calls):
    """Plain Ulysses sends q, k and v of a block in one all-to-all and the output in one more:
    2 library calls per rank and block, whether q/k/v are views of one fused qkv buffer (as
    H3's are) or three tensors. The hybrid (6 heads over 4 ranks: groups of 2) sends q to its
    group and k/v to everyone: 3. The output is SDPA's on the whole sequence."""
    from comfy.multidevice.comm.hccl import HcclBackend
    from comfy.multidevice.comm.nccl import NcclBackend

    request.getfixturevalue(f"use_fake_{backend}")
    calls = _library_calls(monkeypatch, {"nccl": NcclBackend, "hccl": HcclBackend}[backend])
    dim, seq = 8, 5 * world + 3
    rows = shard_sizes(seq, world)  # uneven, by the SP shard plan
    gen = torch.Generator().manual_seed(world + heads)
    if fused:  # [S, 3 x H x D] rows, q/k/v as [1, H, S, D] views, the way H3 hands them over
        qkv = torch.randn(seq, 3 * heads * dim, generator=gen)
        q, k, v = (qkv[:, i * heads * dim:(i + 1) * heads * dim].view(seq, heads, dim).transpose(0, 1).unsqueeze(0)
                   for i in range(3))
    else:
        q, k, v = (torch.randn(1, heads, seq, dim, generator=gen) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    starts = [sum(rows[:r]) for r in range(world)]

    def attention_fn(q, k, v, heads, skip_reshape=False, **kwargs):
        o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)

    def job(rank, comm):
        local = [t[:, :, starts[rank]:starts[rank] + rows[rank]] for t in (q, k, v)]
        return UlyssesKV().attend(comm, attention_fn, *local, heads, skip_reshape=True, shard_sizes=rows)

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job)
    assert sorted(calls) == sorted(list(range(world)) * want_calls)
    for r, o in enumerate(out):
        rank_want = want[:, :, starts[r]:starts[r] + rows[r]].transpose(1, 2).reshape(1, rows[r], heads * dim)
        assert torch.allclose(o, rank_want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("world,heads", [(1, 4), (2, 4), (3, 6), (4, 8), (4, 6)])
def test_separate_q_k_v_give_the_bits_of_fused_views(backend, world, heads):
    """q and k as tensors of their own (as H3's norm and RoPE write them) take the path that
    packs the peers' head blocks here and writes this rank's own block straight into the
    result (`write_own`); it must give the bits of the fused-view path (plain and hybrid)."""
    dim, seq = 8, 5 * world + 3
    rows = shard_sizes(seq, world)
    gen = torch.Generator().manual_seed(world * heads)
    qkv = torch.randn(seq, 3 * heads * dim, generator=gen)
    fused = [qkv[:, i * heads * dim:(i + 1) * heads * dim].view(seq, heads, dim).transpose(0, 1).unsqueeze(0)
             for i in range(3)]
    separate = [fused[0].contiguous(), fused[1].contiguous(), fused[2]]  # v stays a view, as in H3
    starts = [sum(rows[:r]) for r in range(world)]

    def attention_fn(q, k, v, heads, skip_reshape=False, **kwargs):
        o = F.scaled_dot_product_attention(q, k, v)
        return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)

    def job(rank, comm):
        def local(ts):
            return [t[:, :, starts[rank]:starts[rank] + rows[rank]] for t in ts]
        return [UlyssesKV().attend(comm, attention_fn, *local(ts), heads, skip_reshape=True, shard_sizes=rows)
                for ts in (fused, separate)]

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job)
    want = F.scaled_dot_product_attention(*fused)
    for r, (from_fused, from_separate) in enumerate(out):
        assert torch.equal(from_separate, from_fused)
        rank_want = want[:, :, starts[r]:starts[r] + rows[r]].transpose(1, 2).reshape(1, rows[r], heads * dim)
        assert torch.allclose(from_separate, rank_want, rtol=0, atol=1e-6)
