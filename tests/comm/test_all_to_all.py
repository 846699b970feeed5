"""all_to_all_v on every backend, and the coordinator's byte counters.

The reference is built with torch.split / torch.cat of the same shards: rank j must get
cat_i(split(x_i, splits_i, split_dim)[j]) along cat_dim. An all-to-all moves bits and computes
nothing, so every comparison is exact (torch.equal), in every dtype.
"""

import logging

import pytest
import torch

from comfy.multidevice.comm.errors import CollectiveError
from comfy.multidevice.comm.group import SequenceParallelCoordinator

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int32]
BACKENDS = ["peer", "hccl", "hccl-no-alltoallv", "nccl", "nccl-no-sendrecv"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch, fake_hccl_path, fake_hccl_no_alltoallv_path, fake_nccl_path,
            fake_nccl_no_sendrecv_path):
    """The backend name to pass to the coordinator (fake libraries on CPU tensors); the
    "-no-..." variants are libraries without the all-to-all calls (the all-gather fallback)."""
    libraries = {"hccl": ("HCCL_SO_PATH", fake_hccl_path),
                 "hccl-no-alltoallv": ("HCCL_SO_PATH", fake_hccl_no_alltoallv_path),
                 "nccl": ("NCCL_SO_PATH", fake_nccl_path),
                 "nccl-no-sendrecv": ("NCCL_SO_PATH", fake_nccl_no_sendrecv_path)}
    if request.param in libraries:
        monkeypatch.setenv(*libraries[request.param])
    return request.param.split("-")[0]


def uneven(total, world):
    return [total * (r + 1) // world - total * r // world for r in range(world)]


def reference(inputs, splits, split_dim, cat_dim):
    world = len(inputs)
    return [torch.cat([inputs[i].split(splits[i], split_dim)[j] for i in range(world)], cat_dim)
            for j in range(world)]


def random_tensor(shape, dtype, gen):
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=gen).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_dim_uneven_splits(backend, world, dim, dtype):
    # Every rank sends a different number of rows to each rank (some zero), along one dim.
    gen = torch.Generator().manual_seed(world * 10 + dim)
    splits = [[(3 * i + 2 * j + 1) % 4 for j in range(world)] for i in range(world)]
    inputs = []
    for i in range(world):
        shape = [3, 5, 4]
        shape[dim] = sum(splits[i])
        inputs.append(random_tensor(shape, dtype, gen))
    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(lambda rank, comm, x, s: comm.all_to_all_v(x, s, dim), inputs, splits)
    for got, want in zip(out, reference(inputs, splits, dim % 3, dim % 3)):
        assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_round_trip_with_uneven_sequence_shards(backend, world):
    # Sequence shards [1, H, S_r, D] -> head shards [1, H_j, S, D] and back, S not divisible by W.
    heads, seq, head_dim = 7, 13, 3
    seq_rows = uneven(seq, world)
    head_split = uneven(heads, world)
    gen = torch.Generator().manual_seed(world)
    full = [torch.randn(1, heads, seq, head_dim, generator=gen) for _ in range(3)]  # q, k, v
    shards = [[t.split(seq_rows, 2)[r] for t in full] for r in range(world)]

    def job(rank, comm, local):
        by_head = comm.all_to_all_v(local, head_split, split_dim=1, cat_dim=2)
        back = comm.all_to_all_v(by_head, seq_rows, split_dim=2, cat_dim=1)
        return by_head, back

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job, shards)
    for rank, (by_head, back) in enumerate(out):
        for t in range(3):
            assert torch.equal(by_head[t], full[t].split(head_split, 1)[rank])
            assert torch.equal(back[t], shards[rank][t])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_round_trip_with_a_receive_plan(backend, world):
    # The same round trip, each rank naming what it receives (recv_splits): the same bits on
    # every call; a plan that disagrees with what is sent is an error on every rank.
    heads, seq, head_dim = 7, 13, 3
    seq_rows, head_split = uneven(seq, world), uneven(heads, world)
    gen = torch.Generator().manual_seed(world)
    full = torch.randn(1, heads, seq, head_dim, generator=gen)
    shards = list(full.split(seq_rows, 2))

    def job(rank, comm, local):
        out = []
        for _ in range(2):
            by_head = comm.all_to_all_v(local, head_split, split_dim=1, cat_dim=2, recv_splits=seq_rows)
            back = comm.all_to_all_v(by_head, seq_rows, split_dim=2, cat_dim=1, recv_splits=head_split)
            out.append((by_head, back))
        return out

    def wrong_plan(rank, comm, local):
        return comm.all_to_all_v(local, head_split, split_dim=1, cat_dim=2, recv_splits=seq_rows[::-1])

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job, shards)
        if seq_rows != seq_rows[::-1]:
            with pytest.raises(CollectiveError, match=r"recv_splits .* give chunks .* but the ranks send it"):
                coord.run(wrong_plan, shards)
    for rank, calls in enumerate(out):
        for by_head, back in calls:
            assert torch.equal(by_head, full.split(head_split, 1)[rank])
            assert torch.equal(back, shards[rank])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("planned", [False, True])
def test_write_own_puts_the_kept_chunk_in_place_and_it_is_never_read(backend, world, planned):
    # Sequence shards -> head shards of two tensors, each rank's own head block left unfilled
    # (NaN) in what it sends and written by `write_own` instead: the same bits as a plain call,
    # write_own called once per tensor, the unfilled chunk never read (no NaN in any result).
    heads, seq, head_dim = 7, 13, 3
    seq_rows, head_split = uneven(seq, world), uneven(heads, world)
    gen = torch.Generator().manual_seed(world)
    full = [torch.randn(1, heads, seq, head_dim, generator=gen) for _ in range(2)]

    def job(rank, comm):
        sources = [t.split(seq_rows, 2)[rank] for t in full]
        mine = slice(sum(head_split[:rank]), sum(head_split[:rank + 1]))
        unfilled = [s.clone() for s in sources]
        for u in unfilled:
            u[:, mine] = float("nan")
        calls = []

        def write_own(t, place):
            calls.append(t)
            place.copy_(sources[t][:, mine])

        options = {"recv_splits": seq_rows} if planned else {}
        got = comm.all_to_all_v(unfilled, head_split, 1, cat_dim=2, write_own=write_own, **options)
        return got, calls

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(job)
    for rank, (got, calls) in enumerate(out):
        assert calls == [0, 1]
        for t in range(2):
            assert torch.equal(got[t], full[t].split(head_split, 1)[rank])


def test_non_contiguous_inputs_and_empty_ranks(backend):
    world = 3
    bases = [torch.randn(4, 2 + r) for r in range(world)]
    views = [b.t() for b in bases]  # [2+r, 4], not contiguous; split along dim 1
    splits = [[0, 3, 1]] * world  # chunks to one rank must agree along dim 1 (cat is on 0)
    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(lambda rank, comm, x, s: comm.all_to_all_v(x, s, 1, cat_dim=0), views, splits)
    for rank, got in enumerate(out):
        # chunks differ along dim 0 (2, 3, 4 rows); rank 0 receives only empty [*, 0] chunks
        want = torch.cat([views[i].split(splits[i], 1)[rank] for i in range(world)], 0)
        assert torch.equal(got, want)


def test_many_calls_in_a_row_stay_in_step(backend):
    world = 4
    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        def job(rank, comm):
            results = []
            for step in range(12):
                x = torch.arange(world * 2, dtype=torch.float32) + 100 * rank + step
                results.append(comm.all_to_all_v(x, [2] * world, 0))
                comm.exchange([x[:1]], 0)
            return results
        out = coord.run(job)
    for step in range(12):
        for rank in range(world):
            want = torch.cat([torch.arange(world * 2.0)[2 * rank:2 * rank + 2] + 100 * i + step
                              for i in range(world)])
            assert torch.equal(out[rank][step], want)


# ----------------------------------------------------------------------------- errors

def test_bad_splits_are_value_errors_naming_the_value():
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=10) as coord:
        x = torch.ones(5, 2)
        with pytest.raises(ValueError, match=r"\[1, 1, 3\] has 3 entries; give one size per rank \(2\)"):
            coord.run(lambda rank, comm: comm.all_to_all_v(x, [1, 1, 3], 0))
        with pytest.raises(ValueError, match=r"sum to 4 but the tensor of shape \(5, 2\) has 5"):
            coord.run(lambda rank, comm: comm.all_to_all_v(x, [2, 2], 0))
        with pytest.raises(ValueError, match="negative"):
            coord.run(lambda rank, comm: comm.all_to_all_v(x, [6, -1], 0))
        with pytest.raises(ValueError, match="out of range"):
            coord.run(lambda rank, comm: comm.all_to_all_v(x, [2, 3], 0, cat_dim=2))
        # the coordinator still works afterwards
        out = coord.run(lambda rank, comm: comm.all_to_all_v(torch.full((2,), float(rank)), [1, 1], 0))
        assert [o.tolist() for o in out] == [[0.0, 1.0], [0.0, 1.0]]


def test_chunks_that_cannot_be_concatenated_fail_on_every_rank(backend):
    # rank 1 sends rank 0 a chunk with 3 columns, rank 0 keeps one with 2: not concatenable.
    inputs = [torch.ones(2, 4), torch.ones(2, 6)]
    splits = [[2, 2], [3, 3]]
    with SequenceParallelCoordinator(["cpu"] * 2, backend=backend, timeout_s=10) as coord:
        with pytest.raises(CollectiveError, match="chunk rank 1 sends to rank 0 has shape"):
            coord.run(lambda rank, comm, x, s: comm.all_to_all_v(x, s, 1, cat_dim=0), inputs, splits)


def test_mismatched_dtypes_fail(backend):
    inputs = [torch.ones(2), torch.ones(2, dtype=torch.float16)]
    with SequenceParallelCoordinator(["cpu"] * 2, backend=backend, timeout_s=10) as coord:
        with pytest.raises(CollectiveError, match="dtype|float16"):
            coord.run(lambda rank, comm, x: comm.all_to_all_v(x, [1, 1], 0), inputs)


def test_fallback_without_alltoallv_warns_once(monkeypatch, fake_hccl_no_alltoallv_path, caplog):
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_no_alltoallv_path)
    with caplog.at_level(logging.WARNING):
        with SequenceParallelCoordinator(["cpu"] * 2, backend="hccl", timeout_s=10) as coord:
            for _ in range(3):
                out = coord.run(lambda rank, comm: comm.all_to_all_v(
                    torch.tensor([rank * 10.0, rank * 10.0 + 1]), [1, 1], 0))
    assert [o.tolist() for o in out] == [[0.0, 10.0], [1.0, 11.0]]
    warnings = [r.getMessage() for r in caplog.records if "all_to_all_v" in r.getMessage()]
    assert len(warnings) == 1 and "exact" in warnings[0]


# ----------------------------------------------------------------------------- byte counters

def test_byte_counters_count_payload_to_and_from_other_ranks(backend):
    world = 3
    rows = [2, 3, 4]  # exchange shards of [rows, 5] fp32
    a2a_splits = [[1, 2, 0], [0, 1, 1], [3, 0, 1]]  # rows of [*, 2] bf16 sent i -> j
    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        def job(rank, comm):
            comm.exchange([torch.zeros(rows[rank], 5)], 0)
            comm.all_to_all_v(torch.zeros(sum(a2a_splits[rank]), 2, dtype=torch.bfloat16),
                              a2a_splits[rank], 0)
            comm.all_reduce(torch.zeros(6), "sum")
            return comm.byte_counts()
        per_rank = coord.run(job)
        counts = coord.byte_counts()
        assert counts == per_rank
        for r in range(world):
            ex = counts[r]["by_op"]["exchange"]
            assert ex == {"sent": rows[r] * 20 * (world - 1),
                          "received": (sum(rows) - rows[r]) * 20, "calls": 1}
            a2a = counts[r]["by_op"]["all_to_all_v"]
            assert a2a["sent"] == sum(a2a_splits[r][j] for j in range(world) if j != r) * 4
            assert a2a["received"] == sum(a2a_splits[i][r] for i in range(world) if i != r) * 4
            assert counts[r]["by_op"]["all_reduce"] == {"sent": 48, "received": 48, "calls": 1}
            assert counts[r]["sent"] == ex["sent"] + a2a["sent"] + 48
            assert counts[r]["calls"] == 3
        # what one rank sends, the others receive
        assert sum(c["sent"] for c in counts) == sum(c["received"] for c in counts)
        coord.reset_byte_counts()
        assert coord.byte_counts() == [{"sent": 0, "received": 0, "calls": 0, "by_op": {}}] * world


def test_single_rank_moves_nothing():
    with SequenceParallelCoordinator(["cpu"], backend="peer") as coord:
        x = torch.randn(4, 3)
        out = coord.run(lambda rank, comm: (comm.exchange([x], 0)[0], comm.all_to_all_v(x, [4], 0)))
        assert torch.equal(out[0][0], x) and torch.equal(out[0][1], x)
        assert coord.byte_counts()[0]["sent"] == coord.byte_counts()[0]["received"] == 0


# ----------------------------------------------------------------------------- HCCL binding

def test_hccl_backend_uses_alltoallv_when_the_library_has_it(monkeypatch, fake_hccl_path,
                                                              fake_hccl_no_alltoallv_path):
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="hccl") as coord:
        assert coord.backend.has_all_to_all_v
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_no_alltoallv_path)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="hccl") as coord:
        assert not coord.backend.has_all_to_all_v


def test_hccl_alltoallv_marshaling():
    # HcclAlltoAllV(sendBuf, sendCounts, sdispls, sendType, recvBuf, recvCounts, rdispls,
    #               recvType, comm, stream): host uint64 arrays, counts in elements.
    import ctypes
    from types import SimpleNamespace
    from comfy.multidevice.comm.hccl import HcclBackend, HcclLibrary

    calls = []

    def init_all(n, devices, comms):
        for i in range(n):
            comms[i] = 0x2000 + i
        return 0

    functions = {
        "HcclGetErrorString": lambda code: b"fake",
        "HcclCommInitAll": init_all,
        "HcclCommDestroy": lambda comm: 0,
        "HcclAlltoAllV": lambda *args: calls.append(args) or 0,
    }
    lib = HcclLibrary("<in-process>", functions)
    backend = HcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 3), library=lib)
    assert backend.has_all_to_all_v
    send = torch.zeros(12, dtype=torch.bfloat16)
    recv = torch.empty(9, dtype=torch.bfloat16)
    keep = backend._all_to_all_v_flat(2, send, recv, [4, 0, 8], [0, 4, 4], [3, 3, 3], [0, 3, 6], None)
    (args,) = calls
    sptr, scounts, sdispls, stype, rptr, rcounts, rdispls, rtype, comm, stream = args
    assert (sptr, rptr) == (send.data_ptr(), recv.data_ptr())
    read = lambda addr: list((ctypes.c_uint64 * 3).from_address(addr))  # noqa: E731
    assert read(scounts) == [4, 0, 8] and read(sdispls) == [0, 4, 4]
    assert read(rcounts) == [3, 3, 3] and read(rdispls) == [0, 3, 6]
    assert stype == rtype == 11  # bf16
    assert comm == 0x2002 and stream is None
    del keep


def test_fake_hccl_alltoallv_error_code_is_a_clear_exception(monkeypatch, fake_hccl_path):
    from comfy.multidevice.comm.hccl import HcclError
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclAlltoAllV:4")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="hccl", timeout_s=10) as coord:
        with pytest.raises(HcclError, match=r"HcclAlltoAllV failed with HcclResult 4"):
            coord.run(lambda rank, comm: comm.all_to_all_v(torch.ones(2), [1, 1], 0))


# ----------------------------------------------------------------------------- NCCL binding

def test_nccl_backend_uses_send_recv_when_the_library_has_them(monkeypatch, fake_nccl_path,
                                                               fake_nccl_no_sendrecv_path):
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="nccl") as coord:
        assert coord.backend.has_all_to_all_v
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_no_sendrecv_path)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="nccl") as coord:
        assert not coord.backend.has_all_to_all_v


def test_nccl_alltoallv_is_one_group_of_sends_and_receives():
    # ncclSend(sendbuff, count, datatype, peer, comm, stream), ncclRecv(recvbuff, ...), in
    # elements; zero counts and the rank's own chunk are not sent.
    from types import SimpleNamespace
    from comfy.multidevice.comm.nccl import NcclBackend, NcclLibrary

    calls = []

    def init_all(comms, n, devices):
        for i in range(n):
            comms[i] = 0x3000 + i
        return 0

    record = lambda name: (lambda *args: calls.append((name, *args)) or 0)  # noqa: E731
    functions = {"ncclGetErrorString": lambda code: b"fake", "ncclCommInitAll": init_all,
                 "ncclCommDestroy": lambda comm: 0}
    functions.update({name: record(name) for name in ("ncclGroupStart", "ncclGroupEnd", "ncclSend",
                                                      "ncclRecv")})
    lib = NcclLibrary("<in-process>", functions)
    backend = NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 3), library=lib)
    send = torch.arange(10, dtype=torch.float32)
    recv = torch.full((7,), -1.0)
    backend._all_to_all_v_flat(1, send, recv, [4, 2, 4], [0, 4, 6], [0, 2, 5], [0, 0, 2], None)
    p, q = send.data_ptr(), recv.data_ptr()
    assert calls == [("ncclGroupStart",),
                     ("ncclSend", p, 4, 7, 0, 0x3001, None),  # no receive from rank 0: 0 rows
                     ("ncclSend", p + 6 * 4, 4, 7, 2, 0x3001, None),
                     ("ncclRecv", q + 2 * 4, 5, 7, 2, 0x3001, None),
                     ("ncclGroupEnd",)]
    assert recv[:2].tolist() == [4.0, 5.0]  # the own chunk, copied locally


def test_fake_nccl_send_error_is_a_clear_exception(monkeypatch, fake_nccl_path):
    from comfy.multidevice.comm.nccl import NcclError
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    monkeypatch.setenv("FAKE_NCCL_FAIL", "ncclSend:3")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="nccl", timeout_s=10) as coord:
        with pytest.raises(NcclError, match=r"ncclSend failed with ncclResult_t 3"):
            coord.run(lambda rank, comm: comm.all_to_all_v(torch.ones(2), [1, 1], 0))


def test_zero_splits_make_a_sub_group_exchange(backend):
    # Ranks {0, 1} and {2, 3} each swap heads for sequence rows inside their pair, through one
    # world-wide call: a zero split sends nothing and its (ill-fitting) empty chunk is left out.
    world, heads = 4, 3
    rows = [2, 3, 1, 4]
    gen = torch.Generator().manual_seed(3)
    inputs = [torch.randn(1, heads, rows[r], 2, generator=gen) for r in range(world)]
    head_split = [1, 2]  # member 0 gets head 0, member 1 heads 1..2

    def splits_of(rank):
        group = rank // 2
        return [head_split[j % 2] if j // 2 == group else 0 for j in range(world)]

    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=20) as coord:
        out = coord.run(lambda rank, comm, x: comm.all_to_all_v(x, splits_of(rank), 1, cat_dim=2),
                        inputs)
    for rank, got in enumerate(out):
        group, member = divmod(rank, 2)
        members = (2 * group, 2 * group + 1)
        want = torch.cat([inputs[m].split(head_split, 1)[member] for m in members], 2)
        assert torch.equal(got, want)
