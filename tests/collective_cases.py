"""Backend-independent collective tests, run once per backend.

A test module imports the cases it wants and defines a `backend` fixture that returns the
backend name (after pointing the library variable at the fake): tests/comm/test_peer.py and
test_hccl.py run them on peer-copy and HCCL, tests/comm/test_nccl.py on NCCL. Exchanges are compared with
torch.cat of the shards bit for bit (an all-gather moves bits, it computes nothing);
all-reduce sums with the rank-order sum, exact in fp32 and within a stated rounding in
16-bit types.
"""

import time

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator

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
