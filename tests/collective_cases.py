"""Backend-independent collective tests, run once per backend.

A test module imports the cases it wants and defines a `backend` fixture that returns the
backend name (after pointing the library variable at the fake): tests/comm/test_peer.py and
test_hccl.py run them on peer-copy and HCCL, tests/comm/test_nccl.py on NCCL. Exchanges are compared with
torch.cat of the shards bit for bit (an all-gather moves bits, it computes nothing);
all-reduce sums with the rank-order sum, exact in fp32 and within a stated rounding in
16-bit types.

`__all__` names the cases, so a backend's module takes them all with
`from tests.collective_cases import *`; helpers are imported by name.
"""

import threading
import time

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.errors import CollectiveError

__all__ = ("test_exchange_matches_cat", "test_exchange_with_empty_shards", "test_non_contiguous_shards",
           "test_exchange_of_tensors_with_autograd_history",
           "test_all_reduce_fp32_exact", "test_all_reduce_16bit_within_rounding", "test_all_reduce_int32",
           "test_many_collectives_in_a_row_stay_in_step", "test_failing_rank_ends_the_run_fast",
           "test_exchange_with_the_shard_plan_matches_cat",
           "test_a_shard_plan_that_does_not_fit_fails_on_every_rank",
           "test_one_host_sync_and_one_barrier_per_exchange_with_the_plan",
           "test_one_host_sync_and_one_barrier_per_all_to_all_with_a_plan")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class FakeFunction:
    """Stands in for a C function: records the ctypes arguments of each call."""

    def __init__(self, result=0, on_call=None):
        self.calls = []
        self.result = result
        self.on_call = on_call

    def __call__(self, *args):
        self.calls.append(args)
        if self.on_call:
            self.on_call(*args)
        return self.result


def make_shards(world, lengths, dim, dtype, seed=0, base_shape=(3, 5, 7)):
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for r in range(world):
        shape = list(base_shape)
        shape[dim] = lengths[r]
        shards.append(torch.randn(*shape, generator=gen).to(dtype))
    return shards


def uneven_lengths(world, total):
    return [total * (r + 1) // world - total * r // world for r in range(world)]


def coordinator(backend, world, timeout_s=20):
    return SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=timeout_s)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_exchange_matches_cat(backend, world, dim, dtype):
    lengths = uneven_lengths(world, 11)  # 11 rows: uneven for W = 2, 3, 4
    shards_a = make_shards(world, lengths, dim % 3, dtype, seed=1)
    shards_b = make_shards(world, [2 * n + 1 for n in lengths], 0, dtype, seed=2)
    shards_c = make_shards(world, [3] * world, 2, dtype, seed=3)  # equal: the plain all-gather path
    with coordinator(backend, world) as coord:
        assert coord.backend_name == backend
        out = coord.run(lambda rank, comm, a, b, c: comm.exchange([a, b, c], [dim, 0, 2]),
                        shards_a, shards_b, shards_c)
    want = [torch.cat(shards_a, dim=dim), torch.cat(shards_b, dim=0), torch.cat(shards_c, dim=2)]
    for rank_out in out:
        for got, expected in zip(rank_out, want):
            assert got.dtype == dtype and got.shape == expected.shape
            assert torch.equal(got, expected)


def test_exchange_with_empty_shards(backend):
    # Fewer rows than ranks: ranks 0 and 2 hold none.
    shards = [torch.zeros(0, 4), torch.arange(4.0).view(1, 4), torch.zeros(0, 4), torch.ones(2, 4)]
    with coordinator(backend, 4) as coord:
        out = coord.run(lambda rank, comm, x: comm.exchange([x], 0)[0], shards)
    for o in out:
        assert torch.equal(o, torch.cat(shards))


def test_exchange_of_tensors_with_autograd_history(backend):
    # ComfyUI runs a model in grad mode unless told otherwise: shards carrying autograd history
    # (made from weights that require grad) are exchanged as plain values, along an inner dim
    shards = make_shards(3, [1, 2, 3], 1, torch.float32, seed=4)
    with coordinator(backend, 3) as coord, torch.enable_grad():
        out = coord.run(lambda rank, comm, x: comm.exchange([x.requires_grad_() * 1], 1)[0],
                        [s.clone() for s in shards])
    for o in out:
        assert torch.equal(o.detach(), torch.cat(shards, dim=1))


def test_non_contiguous_shards(backend):
    # K/V come out of a fused projection as strided views; every backend must accept them.
    bases = [torch.randn(5, 2 + r, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    views = [b.t() for b in bases]  # [2+r, 5], not contiguous
    assert not views[1].is_contiguous()
    with coordinator(backend, 3) as coord:
        out = coord.run(lambda rank, comm, x: (comm.exchange([x], 0)[0],
                                               comm.all_reduce(x.t()[:, :2], "sum")), views)
    want_sum = bases[0][:, :2] + bases[1][:, :2] + bases[2][:, :2]
    for gathered, reduced in out:
        assert torch.equal(gathered, torch.cat(views, 0))
        assert torch.equal(reduced, want_sum)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "max"])
def test_all_reduce_fp32_exact(backend, world, op):
    gen = torch.Generator().manual_seed(world)
    xs = [torch.randn(6, 9, generator=gen) for _ in range(world)]
    want = xs[0].clone()
    for x in xs[1:]:
        want = want + x if op == "sum" else torch.maximum(want, x)
    with coordinator(backend, world) as coord:
        out = coord.run(lambda rank, comm, x: comm.all_reduce(x, op), xs)
    for o in out:
        assert torch.equal(o, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_reduce_16bit_within_rounding(backend, dtype):
    world = 4
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(64, generator=gen).to(dtype) for _ in range(world)]
    exact = sum(x.float() for x in xs)
    with coordinator(backend, world) as coord:
        sums = coord.run(lambda rank, comm, x: comm.all_reduce(x, "sum"), xs)
        maxes = coord.run(lambda rank, comm, x: comm.all_reduce(x, "max"), xs)
    # Tolerance: at most one rounding of the 16-bit format per partial sum (3 adds; the fake
    # libraries round once, peer-copy after each add), i.e. 3 ulps at 2^-8 (bf16) or 2^-11
    # (fp16) relative to the largest partial sum.
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    scale = float(sum(x.float().abs() for x in xs).max())
    want_max = torch.stack(xs).amax(0)
    for s, m in zip(sums, maxes):
        assert s.dtype == dtype
        assert float((s.float() - exact).abs().max()) <= 3 * eps * scale
        assert torch.equal(s, sums[0])  # every rank holds the same bits
        assert torch.equal(m, want_max)  # max is exact in any format


def test_all_reduce_int32(backend):
    xs = [torch.arange(5, dtype=torch.int32) * (r + 1) for r in range(3)]
    with coordinator(backend, 3) as coord:
        out = coord.run(lambda rank, comm, x: (comm.all_reduce(x, "sum"), comm.all_reduce(x, "max")), xs)
    for s, m in out:
        assert torch.equal(s, torch.arange(5, dtype=torch.int32) * 6)
        assert torch.equal(m, torch.arange(5, dtype=torch.int32) * 3)


def test_many_collectives_in_a_row_stay_in_step(backend):
    world = 3
    with coordinator(backend, world) as coord:
        def job(rank, comm):
            results = []
            for step in range(20):
                x = torch.full((rank + 1 + step % 2, 2), float(step * 10 + rank))
                results.append(comm.exchange([x], 0)[0])
                comm.all_reduce(torch.ones(1), "sum")
            return results
        out = coord.run(job)
    for step in range(20):
        want = torch.cat([torch.full((r + 1 + step % 2, 2), float(step * 10 + r)) for r in range(world)])
        for rank_results in out:
            assert torch.equal(rank_results[step], want)


def test_failing_rank_ends_the_run_fast(backend):
    world = 4
    with coordinator(backend, world, timeout_s=60) as coord:
        def job(rank, comm):
            for _ in range(3):
                comm.exchange([torch.ones(rank + 1, 2)], 0)
            if rank == 2:
                raise ValueError("rank two could not continue")
            comm.exchange([torch.ones(2, 2)], 0)  # the others wait here for rank 2
            return "unreachable"
        start = time.monotonic()
        with pytest.raises(ValueError, match="rank two could not continue") as info:
            coord.run(job)
        assert time.monotonic() - start < 5
        assert info.value.rank == 2
        # The coordinator is still usable after a failed run.
        out = coord.run(lambda rank, comm: comm.exchange([torch.full((1,), float(rank))], 0)[0])
        assert all(torch.equal(o, torch.arange(float(world))) for o in out)


def h3_layout_shards(world, seq, heads=4, dim=8, seed=4):
    """K/V shards as H3's attention makes them: [1, heads, S_r, dim] views of the K part of each
    rank's fused qkv rows [S_r, 3 * heads * dim] (neither contiguous nor sequence-major dense)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows in uneven_lengths(world, seq):
        qkv = torch.randn(rows, 3 * heads * dim, generator=gen)
        k = qkv[:, heads * dim:2 * heads * dim].view(rows, heads, dim).transpose(0, 1).unsqueeze(0)
        out.append(k)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_with_the_shard_plan_matches_cat(backend, world):
    """H3's K/V layout with every rank's rows given by the shard plan: the result equals
    torch.cat along the sequence dim bit for bit, forward after forward."""
    ks = h3_layout_shards(world, 13)
    vs = [k * 2 for k in ks]
    sizes = [k.shape[2] for k in ks]
    with coordinator(backend, world) as coord:
        def job(rank, comm):
            return [comm.exchange([ks[rank], vs[rank]], [2, 2], shard_sizes=sizes) for _ in range(3)]
        results = coord.run(job)
    for per_call in results:
        for k_full, v_full in per_call:
            assert torch.equal(k_full, torch.cat(ks, 2)) and torch.equal(v_full, torch.cat(vs, 2))


def test_a_shard_plan_that_does_not_fit_fails_on_every_rank(backend):
    ks = h3_layout_shards(2, 9)
    with coordinator(backend, 2) as coord:
        with pytest.raises(ValueError, match=r"but shard_sizes \[5, 4\] gives it [45]; pass the shard plan"):
            coord.run(lambda rank, comm: comm.exchange([ks[rank]], 2, shard_sizes=[5, 4]))
        wrong = [[4, 5], [5, 4]]  # each rank's own rows fit, but the ranks disagree

        def job(rank, comm):
            return comm.exchange([torch.zeros(1, 2, wrong[rank][rank], 3)], 2, shard_sizes=wrong[rank])
        with pytest.raises(CollectiveError, match="shard_sizes disagree"):
            coord.run(job)


def count_host_syncs_and_barriers(coord, monkeypatch):
    """Counters of device synchronizations and coordinator barriers, per rank."""
    from comfy.multidevice.comm import collectives, ctypes_lib

    syncs = [0] * coord.world_size
    barriers = [0] * coord.world_size
    by_thread = {}  # rank thread -> rank
    coord.run(lambda rank, comm: by_thread.__setitem__(threading.get_ident(), rank))

    def counted_sync(real):
        def sync(device):
            syncs[by_thread[threading.get_ident()]] += 1
            return real(device)
        return sync

    for module in (ctypes_lib, collectives):  # where the slots synchronize (comm/collectives.py)
        monkeypatch.setattr(module, "synchronize", counted_sync(module.synchronize))
    real_wait = coord._barrier.wait

    def wait(rank, what="collective"):
        barriers[rank] += 1
        return real_wait(rank, what)
    monkeypatch.setattr(coord._barrier, "wait", wait)
    return syncs, barriers


def test_one_host_sync_and_one_barrier_per_exchange_with_the_plan(backend, monkeypatch):
    """K and V go back to back and are waited on once; with the shard plan the ranks meet once."""
    world, blocks = 3, 4
    ks = h3_layout_shards(world, 11)
    sizes = [k.shape[2] for k in ks]
    with coordinator(backend, world) as coord:
        syncs, barriers = count_host_syncs_and_barriers(coord, monkeypatch)

        def job(rank, comm):
            for _ in range(blocks):
                comm.exchange([ks[rank], ks[rank]], [2, 2], shard_sizes=sizes)
        coord.run(job)
    assert barriers == [blocks] * world  # one meeting per exchange
    assert syncs == [blocks] * world  # one wait per exchange, for K and V together


def test_one_host_sync_and_one_barrier_per_all_to_all_with_a_plan(backend, monkeypatch):
    """Ulysses' q/k/v all-to-all with every rank's receive plan: the ranks meet once per call
    (the buffers are made before they meet) and wait once, for all three tensors; the result
    is the split/cat reference, bit for bit."""
    world, calls, heads, seq = 3, 4, 6, 11
    rows = uneven_lengths(world, seq)
    blocks = uneven_lengths(world, heads)
    full = [torch.randn(1, heads, seq, 4, generator=torch.Generator().manual_seed(t)) for t in range(3)]
    shards = [[t.split(rows, 2)[r] for t in full] for r in range(world)]
    with coordinator(backend, world) as coord:
        syncs, barriers = count_host_syncs_and_barriers(coord, monkeypatch)

        def job(rank, comm):
            return [comm.all_to_all_v(shards[rank], blocks, 1, cat_dim=2, recv_splits=rows) for _ in range(calls)]
        out = coord.run(job)
    for rank, results in enumerate(out):
        for got in results:
            assert all(torch.equal(g, t.split(blocks, 1)[rank]) for g, t in zip(got, full))
    assert barriers == [calls] * world  # one meeting per all-to-all
    if backend != "peer":
        assert syncs == [calls] * world  # one wait per all-to-all, for q, k and v together

