"""The coordinator, its peer-copy backend and the HCCL ctypes backend (over the fake libhccl).

The backend-independent exactness cases live in tests/collective_cases.py and run here on
peer-copy and HCCL; this file adds the coordinator's own behaviour (failures, timeouts,
arguments, lifetime) and the HCCL marshaling.
"""

import ctypes
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from comfy.multidevice.comm import group
from comfy.multidevice.comm.ctypes_lib import CLibrary
from comfy.multidevice.comm.types import (BackendUnavailable, CollectiveAborted, CollectiveError, CollectiveTimeout)
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.hccl import HcclBackend, HcclError, HcclLibrary
# The backend-independent cases, collected here for peer-copy and HCCL (the `backend` fixture).
from tests.collective_cases import (FakeFunction, make_shards, test_all_reduce_16bit_within_rounding,  # noqa: F401
                                    test_all_reduce_fp32_exact, test_all_reduce_int32,
                                    test_exchange_matches_cat, test_exchange_with_empty_shards,
                                    test_failing_rank_ends_the_run_fast,
                                    test_many_collectives_in_a_row_stay_in_step,
                                    test_non_contiguous_shards)


@pytest.fixture(params=["peer", "hccl"])
def backend(request, monkeypatch, fake_hccl_path):
    if request.param == "hccl":
        monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    return request.param


# ----------------------------------------------------------------------------- marshaling

def fake_hccl_library(**overrides):
    def init_all(n, devices, comms):
        for i in range(n):
            comms[i] = 0x1000 + i
    functions = {
        "HcclGetErrorString": lambda code: b"fake failure",
        "HcclCommInitAll": FakeFunction(on_call=init_all),
        "HcclCommDestroy": FakeFunction(),
        "HcclAllGatherV": FakeFunction(),
        "HcclAllGather": FakeFunction(),
        "HcclAllReduce": FakeFunction(),
        "HcclBroadcast": FakeFunction(),
    }
    functions.update(overrides)
    return HcclLibrary(lib=CLibrary.from_functions(functions, path="<recorded>")), functions


def test_all_gather_v_marshaling_for_uneven_shards():
    lib, functions = fake_hccl_library()
    world = 3
    backend = HcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * world), library=lib)
    assert functions["HcclCommInitAll"].calls[0][0] == world
    counts = [5 * 4, 6 * 4, 6 * 4]  # 17 rows of 4 split 5/6/6
    displs = [0, 20, 44]
    rank = 1
    send = torch.zeros(6, 4, dtype=torch.bfloat16)
    recv = torch.empty(sum(counts), dtype=torch.bfloat16)
    keepalive = backend._all_gather_v_flat(rank, send, recv, counts, displs, None)
    (call,) = functions["HcclAllGatherV"].calls
    send_ptr, send_count, recv_ptr, counts_addr, displs_addr, dtype, comm, stream = call
    assert send_ptr == send.data_ptr() and recv_ptr == recv.data_ptr()
    assert send_count == 24
    assert list((ctypes.c_uint64 * world).from_address(counts_addr)) == counts
    assert list((ctypes.c_uint64 * world).from_address(displs_addr)) == displs
    assert dtype == 11  # HCCL_DATA_TYPE_BFP16
    assert comm == 0x1000 + rank
    assert stream is None  # CPU: no stream handle
    del keepalive  # the host arrays lived until here, i.e. past the (here: no-op) sync


def test_equal_shards_use_the_plain_all_gather():
    lib, functions = fake_hccl_library()
    backend = HcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 4), library=lib)
    send = torch.zeros(3, 5, dtype=torch.float16)
    recv = torch.empty(4 * 15, dtype=torch.float16)
    backend._all_gather_v_flat(2, send, recv, [15] * 4, [0, 15, 30, 45], None)
    assert functions["HcclAllGatherV"].calls == []
    assert functions["HcclAllGather"].calls == [(send.data_ptr(), recv.data_ptr(), 15, 3, 0x1002, None)]


def test_equal_shards_end_to_end(use_fake_hccl):
    shards = [torch.randn(4, 3, 2) for _ in range(4)]
    with SequenceParallelCoordinator(["cpu"] * 4, backend="hccl", timeout_s=20) as coord:
        out = coord.run(lambda rank, comm, x: comm.exchange([x, x], [0, 2]), shards)
    for along0, along2 in out:
        assert torch.equal(along0, torch.cat(shards, 0)) and torch.equal(along2, torch.cat(shards, 2))


@pytest.mark.parametrize("dtype,code", [(torch.float32, 4), (torch.float16, 3), (torch.bfloat16, 11),
                                        (torch.int32, 2), (torch.int8, 0)])
def test_dtype_enum(dtype, code):
    from comfy.multidevice.comm.hccl import hccl_dtype
    assert hccl_dtype(dtype) == code


def test_unsupported_dtype_names_it():
    from comfy.multidevice.comm.hccl import hccl_dtype
    with pytest.raises(CollectiveError, match="complex64"):
        hccl_dtype(torch.complex64)


def test_all_reduce_marshaling():
    lib, functions = fake_hccl_library()
    backend = HcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    send = torch.ones(7)
    recv = torch.empty(7)
    backend._all_reduce_flat(0, send, recv, "max", None)
    (call,) = functions["HcclAllReduce"].calls
    assert call == (send.data_ptr(), recv.data_ptr(), 7, 4, 2, 0x1000, None)


def test_nonzero_result_raises_with_code_and_text():
    lib, functions = fake_hccl_library(HcclAllReduce=FakeFunction(result=7))
    backend = HcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    with pytest.raises(HcclError, match=r"HcclAllReduce failed with HcclResult 7: fake failure"):
        backend._all_reduce_flat(0, torch.ones(2), torch.empty(2), "sum", None)


# ----------------------------------------------------------------------------- fake libhccl

def test_fake_error_return_is_a_clear_exception(use_fake_hccl, monkeypatch):
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclAllGatherV:4")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="hccl", timeout_s=10) as coord:
        with pytest.raises(HcclError, match=r"HcclAllGatherV failed with HcclResult 4: internal error"):
            coord.run(lambda rank, comm: comm.exchange([torch.ones(rank + 1)], 0))  # uneven


def test_fake_error_return_of_the_plain_all_gather(use_fake_hccl, monkeypatch):
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclAllGather:5")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="hccl", timeout_s=10) as coord:
        with pytest.raises(HcclError, match=r"HcclAllGather failed with HcclResult 5: not supported"):
            coord.run(lambda rank, comm: comm.exchange([torch.ones(2)], 0))  # equal shards


def test_init_failure_of_forced_hccl_raises(use_fake_hccl, monkeypatch):
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclCommInitAll:1")
    with pytest.raises(BackendUnavailable, match="HcclCommInitAll failed with HcclResult 1"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="hccl")


def test_broadcast_fallback_without_allgatherv(monkeypatch, fake_hccl_no_allgatherv_path, caplog):
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_no_allgatherv_path)
    shards = make_shards(3, [4, 0, 6], 1, torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        with SequenceParallelCoordinator(["cpu"] * 3, backend="hccl", timeout_s=20) as coord:
            assert not coord.backend.hccl.has_all_gather_v
            out = coord.run(lambda rank, comm, x: comm.exchange([x, x], [1, 1]), shards)
    warnings = [r for r in caplog.records if "HcclAllGatherV" in r.getMessage()]
    assert len(warnings) == 1 and "HcclBroadcast" in warnings[0].getMessage()
    for pair in out:
        for o in pair:
            assert torch.equal(o, torch.cat(shards, dim=1))


def test_auto_falls_back_to_peer_with_one_warning(monkeypatch, caplog, tmp_path):
    # Pretend the CPU ranks are NPUs so that auto tries HCCL, with no library to find.
    monkeypatch.setattr(group, "native_backend_for", lambda devices: "hccl")
    monkeypatch.setenv("HCCL_SO_PATH", str(tmp_path / "missing" / "libhccl.so"))
    with caplog.at_level(logging.WARNING):
        with SequenceParallelCoordinator(["cpu"] * 2, backend="auto") as coord:
            assert coord.backend_name == "peer"
            assert "missing" in coord.fallback_reason
            out = coord.run(lambda rank, comm: comm.exchange([torch.full((1,), float(rank))], 0)[0])
    assert [torch.equal(o, torch.tensor([0.0, 1.0])) for o in out] == [True, True]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "libhccl.so" in warnings[0].getMessage() and "peer-copy" in warnings[0].getMessage()


def test_forced_hccl_with_missing_library_raises(monkeypatch, tmp_path):
    missing = str(tmp_path / "nowhere" / "libhccl.so")
    monkeypatch.setenv("HCCL_SO_PATH", missing)
    with pytest.raises(BackendUnavailable, match="HCCL_SO_PATH"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="hccl")


def test_unknown_backend_lists_valid_values(monkeypatch):
    with pytest.raises(ValueError, match="auto, hccl, nccl, peer"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="mpi")
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "gloo")
    with pytest.raises(ValueError, match="'gloo'.*COMFYUI_MULTI_DEVICE_BACKEND"):
        SequenceParallelCoordinator(["cpu"] * 2)


def test_backend_from_environment(monkeypatch, fake_hccl_path):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "HCCL")
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    with SequenceParallelCoordinator(["cpu"] * 2) as coord:
        assert coord.backend_name == "hccl"


def test_no_devices_is_an_error():
    with pytest.raises(ValueError, match="at least one device"):
        SequenceParallelCoordinator([])


# ----------------------------------------------------------------------------- failures

def test_other_ranks_see_an_abort_error(backend):
    seen = {}
    with SequenceParallelCoordinator(["cpu"] * 3, backend=backend, timeout_s=60) as coord:
        def job(rank, comm):
            if rank == 0:
                raise KeyError("boom")
            try:
                comm.exchange([torch.ones(1)], 0)
            except CollectiveAborted as exc:
                seen[rank] = str(exc)
                raise
        with pytest.raises(KeyError):
            coord.run(job)
    assert set(seen) == {1, 2}
    assert all("rank 0 failed" in msg for msg in seen.values())


def test_barrier_timeout_names_absent_ranks():
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=0.5) as coord:
        def job(rank, comm):
            if rank == 1:
                return None  # never joins the exchange
            return comm.exchange([torch.ones(1)], 0)
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"rank\(s\) \[1\]") as info:
            coord.run(job)
        assert time.monotonic() - start < 5
        assert "COMFYUI_MULTI_DEVICE_TIMEOUT_S" in str(info.value)


def test_mismatched_shapes_fail_on_every_rank(backend):
    with SequenceParallelCoordinator(["cpu"] * 2, backend=backend, timeout_s=10) as coord:
        shards = [torch.ones(2, 3), torch.ones(2, 4)]
        with pytest.raises(CollectiveError, match=r"differ outside the concat dim 0"):
            coord.run(lambda rank, comm, x: comm.exchange([x], 0), shards)


def test_mismatched_dtypes_fail():
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=10) as coord:
        shards = [torch.ones(2), torch.ones(2, dtype=torch.float16)]
        with pytest.raises(CollectiveError, match="dtype"):
            coord.run(lambda rank, comm, x: comm.exchange([x], 0), shards)


def test_bad_arguments_are_rejected_before_running():
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer") as coord:
        with pytest.raises(ValueError, match="per-rank argument 0 has 3 items for 2 ranks"):
            coord.run(lambda rank, comm, x: x, [1, 2, 3])
        with pytest.raises(ValueError, match="cat dim 2 is out of range"):
            coord.run(lambda rank, comm: comm.exchange([torch.ones(2, 2)], 2))
        with pytest.raises(ValueError, match="all_reduce op 'mean'"):
            coord.run(lambda rank, comm: comm.all_reduce(torch.ones(1), "mean"))


def test_close_leaves_no_thread_behind():
    coord = SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=30)
    workers = list(coord._workers)
    coord.run(lambda rank, comm: comm.exchange([torch.ones(1)], 0))
    coord.close()
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(RuntimeError, match="closed"):
        coord.run(lambda rank, comm: None)
    assert not any(t.name.startswith("sp-rank-") and t in workers for t in threading.enumerate())


def test_rank_threads_are_persistent():
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer") as coord:
        first = coord.run(lambda rank, comm: threading.get_ident())
        second = coord.run(lambda rank, comm: threading.get_ident())
    assert first == second and len(set(first)) == 2


@pytest.mark.parametrize("calls", [
    ("exchange", "all_reduce sum"),
    ("all_reduce sum", "all_reduce max"),
    ("exchange", "barrier"),
])
def test_ranks_in_different_collectives_fail_clearly(backend, calls):
    # Before the check, a rank could read another rank's slot from an earlier collective
    # (e.g. exchange against barrier two collectives in): a silently wrong result.
    def call(comm, what, x):
        if what == "exchange":
            return comm.exchange([x], 0)
        if what == "barrier":
            return comm.barrier()
        return comm.all_reduce(x, what.split()[1])

    def job(rank, comm):
        x = torch.full((2, 3), float(rank + 1))
        comm.exchange([x], 0)
        comm.exchange([x], 0)
        return call(comm, calls[rank], x)

    with SequenceParallelCoordinator(["cpu"] * 2, backend=backend, timeout_s=30) as coord:
        start = time.monotonic()
        with pytest.raises(CollectiveError, match=rf"rank 0: {calls[0]}, rank 1: {calls[1]}.*same order"):
            coord.run(job)
        assert time.monotonic() - start < 5
        out = coord.run(lambda rank, comm: comm.exchange([torch.full((1,), float(rank))], 0)[0])
        assert all(torch.equal(o, torch.tensor([0.0, 1.0])) for o in out)


@pytest.mark.parametrize("library", ["hccl", "nccl"])
@pytest.mark.parametrize("collective", ["exchange", "all_reduce", "all_to_all_v"])
def test_rank_failing_to_allocate_never_strands_the_others_in_the_library(
        library, collective, monkeypatch, fake_hccl_path, fake_nccl_path):
    # Out of memory on one card after the shapes are known: the other ranks must not enter
    # the library's collective (which cannot be cancelled; the fakes would wait 20 s there).
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    with SequenceParallelCoordinator(["cpu"] * 3, backend=library, timeout_s=60) as coord:
        real_empty = coord.backend._empty

        def empty(numel, dtype, device):
            if threading.current_thread().name == "sp-rank-1":
                raise RuntimeError("rank 1 is out of device memory")
            return real_empty(numel, dtype, device)
        monkeypatch.setattr(coord.backend, "_empty", empty)

        def job(rank, comm):
            x = torch.ones(3, 2)
            if collective == "exchange":
                return comm.exchange([x], 0)
            if collective == "all_reduce":
                return comm.all_reduce(x)
            return comm.all_to_all_v(x, [1, 1, 1], 0)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 is out of device memory") as info:
            coord.run(job)
        assert time.monotonic() - start < 5
        assert info.value.rank == 1
        monkeypatch.setattr(coord.backend, "_empty", real_empty)
        out = coord.run(lambda rank, comm: comm.exchange([torch.full((1,), float(rank))], 0)[0])
        assert all(torch.equal(o, torch.arange(3.0)) for o in out)
