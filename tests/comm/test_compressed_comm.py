"""CompressedComm: exchange and all_to_all_v carry byte records on every backend, decoded within
the format's error; the backends see uint8 only."""

import pytest
import torch

from comfy.multidevice.comm.compressed_comm import CompressedComm
from comfy.multidevice.comm.compression import dequantize, quantize
from comfy.multidevice.comm.group import SequenceParallelCoordinator

BACKENDS = ["peer", "hccl", "nccl"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param != "peer":
        request.getfixturevalue(f"use_fake_{request.param}")
    return request.param


def rounded(x, precision):
    """What every rank must receive: the values after one round trip through the records."""
    return dequantize(quantize(x, precision), precision, x.dtype, x.shape[-1])


class DtypeSpy:
    """A Communicator that records the dtypes handed to it."""

    def __init__(self, comm):
        self.comm, self.rank, self.world_size, self.device = comm, comm.rank, comm.world_size, comm.device
        self.dtypes = set()

    def exchange(self, tensors, cat_dims, **kwargs):
        self.dtypes.update(t.dtype for t in tensors)
        return self.comm.exchange(tensors, cat_dims, **kwargs)

    def all_to_all_v(self, tensors, *args, **kwargs):
        self.dtypes.update(t.dtype for t in tensors)
        return self.comm.all_to_all_v(tensors, *args, **kwargs)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchange_gathers_the_rounded_shards_with_uneven_rows(backend, precision, world):
    rows = [5 + r for r in range(world)]  # uneven
    gen = torch.Generator().manual_seed(world)
    k = [torch.randn(1, 4, n, 32, generator=gen).to(torch.bfloat16) for n in rows]
    v = [torch.randn(1, 4, n, 32, generator=gen) for n in rows]

    def job(rank, comm):
        spy = DtypeSpy(comm)
        got = CompressedComm(spy, precision).exchange([k[rank], v[rank]], [2, 2], shard_sizes=rows, workspace={})
        return got, spy.dtypes

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job)
    want_k = torch.cat([rounded(t, precision) for t in k], 2)
    want_v = torch.cat([rounded(t, precision) for t in v], 2)
    for (got_k, got_v), dtypes in out:
        assert dtypes == {torch.uint8}
        assert got_k.dtype == torch.bfloat16 and torch.equal(got_k, want_k)
        assert got_v.dtype == torch.float32 and torch.equal(got_v, want_v)


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_round_trip_with_plans_and_write_own(backend, world, own):
    # sequence shards -> head shards -> back, as Ulysses does; the own chunk written by the caller
    heads, seq, dim = 8, 13, 16
    seq_rows = [seq * (r + 1) // world - seq * r // world for r in range(world)]
    head_split = [heads // world] * world
    gen = torch.Generator().manual_seed(world)
    full = torch.randn(1, heads, seq, dim, generator=gen)
    shards = list(full.split(seq_rows, 2))

    def job(rank, comm):
        cc = CompressedComm(comm, "int8")
        local = shards[rank]
        write = None
        send = local
        if own:
            send = local.clone()
            send.narrow(1, rank * heads // world, heads // world).fill_(float("nan"))  # never read

            def write(t, place):
                place.copy_(local.narrow(1, rank * heads // world, heads // world))
        by_head = cc.all_to_all_v([send], head_split, split_dim=1, cat_dim=2,
                                  recv_splits=seq_rows, write_own=write)[0]
        back = cc.all_to_all_v(by_head, seq_rows, split_dim=2, cat_dim=1, recv_splits=head_split)
        return by_head, back

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job)
    for rank, (by_head, back) in enumerate(out):
        want = torch.cat([rounded(s, "int8") for s in shards], 2).split(head_split, 1)[rank]
        assert torch.equal(by_head, want)
        assert torch.equal(back, rounded(torch.cat([rounded(s, "int8") for s in shards], 2),
                                         "int8").split(seq_rows, 2)[rank])


def test_one_rank_and_refusals():
    with SequenceParallelCoordinator(["cpu"], backend="peer", timeout_s=20) as coord:
        x = torch.randn(1, 2, 3, 16)
        out = coord.run(lambda rank, comm: CompressedComm(comm, "int8").exchange([x], 2))[0]
        assert out[0] is x  # one rank: nothing exchanged, nothing rounded
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=20) as coord:
        with pytest.raises(ValueError, match="last dim"):
            coord.run(lambda rank, comm: CompressedComm(comm, "int8").exchange([torch.randn(2, 16)], -1))
    with pytest.raises(ValueError, match="exact"):
        CompressedComm(object(), "exact")
