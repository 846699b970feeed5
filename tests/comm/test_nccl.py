"""The NCCL ctypes backend (comfy/multidevice/comm/nccl.py), end to end over the fake libnccl and
argument by argument with recorded calls.

The backend-independent exactness cases (tests/collective_cases.py: every exchange equal to
torch.cat of the shards bit for bit, all-reduce sums against the rank-order sum) run here on
NCCL; this file adds NCCL's errors, fallbacks, group semantics and marshaling.
"""

import ctypes
import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from comfy.multidevice.comm import group, nccl
from comfy.multidevice.comm.nccl import (NCCL_FUNCTIONS, NcclBackend, NcclError, NcclLibrary)
from comfy.multidevice.comm.errors import BackendUnavailable, CollectiveError
from comfy.multidevice.comm.group import SequenceParallelCoordinator
# The backend-independent cases, collected here for NCCL (the `backend` fixture below).
from tests.collective_cases import *  # noqa: F401,F403
from tests.collective_cases import FakeFunction


@pytest.fixture
def backend(use_fake_nccl):
    return "nccl"


def coordinator(world, **kw):
    kw.setdefault("timeout_s", 20)
    return SequenceParallelCoordinator(["cpu"] * world, backend="nccl", **kw)


# ----------------------------------------------------------------------------- fake libnccl

def test_backend_from_environment(monkeypatch, use_fake_nccl):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "NCCL")
    with SequenceParallelCoordinator(["cpu"] * 2) as coord:
        assert coord.backend_name == "nccl"
        assert coord.backend.library.path == use_fake_nccl


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("function,code,text", [
    ("ncclBroadcast", 3, "internal error"),       # inside the group of an uneven exchange
    ("ncclGroupEnd", 6, "remote process exited"),  # when the group is launched
])
def test_library_error_is_a_clear_exception(use_fake_nccl, monkeypatch, function, code, text):
    monkeypatch.setenv("FAKE_NCCL_FAIL", f"{function}:{code}")
    with coordinator(2, timeout_s=10) as coord:
        start = time.monotonic()
        with pytest.raises(NcclError, match=rf"{function} failed with ncclResult_t {code} \(\w+\): {text}") as info:
            coord.run(lambda rank, comm: comm.exchange([torch.ones(rank + 1)], 0))
        assert info.value.code == code and info.value.function == function
        assert time.monotonic() - start < 5
        # The thread-local group was closed: the same ranks still exchange afterwards.
        monkeypatch.delenv("FAKE_NCCL_FAIL")
        out = coord.run(lambda rank, comm: comm.exchange([torch.full((rank + 1,), float(rank))], 0)[0])
    assert all(torch.equal(o, torch.tensor([0.0, 1.0, 1.0])) for o in out)


def test_all_reduce_error(use_fake_nccl, monkeypatch):
    monkeypatch.setenv("FAKE_NCCL_FAIL", "ncclAllReduce:4")
    with coordinator(3, timeout_s=10) as coord:
        with pytest.raises(NcclError, match=r"ncclAllReduce failed with ncclResult_t 4 \(ncclInvalidArgument\)"):
            coord.run(lambda rank, comm: comm.all_reduce(torch.ones(2), "max"))


def test_init_failure_of_forced_nccl_raises(use_fake_nccl, monkeypatch):
    monkeypatch.setenv("FAKE_NCCL_FAIL", "ncclCommInitAll:2")
    with pytest.raises(BackendUnavailable, match=r"ncclCommInitAll failed with ncclResult_t 2 \(ncclSystemError\)"):
        coordinator(2)


def test_forced_nccl_with_missing_library_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("NCCL_SO_PATH", str(tmp_path / "nowhere" / "libnccl.so.2"))
    with pytest.raises(BackendUnavailable, match="NCCL_SO_PATH"):
        coordinator(2)


def test_library_without_a_required_symbol_is_refused(fake_hccl_path, monkeypatch):
    monkeypatch.setenv("NCCL_SO_PATH", fake_hccl_path)  # a real shared library, but not NCCL
    with pytest.raises(BackendUnavailable, match="no symbol nccl"):
        coordinator(2)


def test_auto_on_cuda_falls_back_to_peer_with_one_warning(monkeypatch, caplog, tmp_path):
    # Pretend the CPU ranks are CUDA GPUs so that auto tries NCCL, with no library to find.
    monkeypatch.setattr(group, "native_backend_for", lambda devices: "nccl")
    monkeypatch.setenv("NCCL_SO_PATH", str(tmp_path / "missing" / "libnccl.so.2"))
    with caplog.at_level(logging.WARNING):
        with SequenceParallelCoordinator(["cpu"] * 2, backend="auto") as coord:
            assert coord.backend_name == "peer"
            assert "libnccl.so.2" in coord.fallback_reason
            out = coord.run(lambda rank, comm: comm.exchange([torch.full((1,), float(rank))], 0)[0])
    assert all(torch.equal(o, torch.tensor([0.0, 1.0])) for o in out)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "nccl unavailable" in message and "peer-copy" in message and "=nccl" in message


def test_auto_on_cuda_uses_nccl_when_it_loads(monkeypatch, use_fake_nccl):
    monkeypatch.setattr(group, "native_backend_for", lambda devices: "nccl")
    with SequenceParallelCoordinator(["cpu"] * 2, backend="auto") as coord:
        assert coord.backend_name == "nccl" and coord.fallback_reason is None


def test_refuses_devices_nccl_does_not_drive():
    lib, _ = recorded_library()
    with pytest.raises(BackendUnavailable, match=r"NCCL drives NVIDIA GPUs; the devices are \['meta'\]"):
        NcclBackend(SimpleNamespace(devices=[torch.device("meta")] * 2), library=lib)


# ----------------------------------------------------------------------------- the fake itself

def test_fake_groups_defer_broadcasts_until_group_end(fake_nccl_path, monkeypatch):
    """Each rank thread records W broadcasts in one group (the multicuda pattern): no deadlock,
    and nothing is written before ncclGroupEnd."""
    monkeypatch.setenv("FAKE_NCCL_TIMEOUT_MS", "5000")
    lib = NcclLibrary(fake_nccl_path)
    world = 3
    comms = lib.comm_init_all(list(range(world)))
    sends = [torch.full((r + 1,), float(r + 1)) for r in range(world)]
    recvs = [torch.zeros(6) for _ in range(world)]
    before_end, errors = {}, []

    def rank_thread(rank):
        try:
            lib.group_start()
            offset = 0
            for root in range(world):
                slot = recvs[rank].data_ptr() + offset * 4
                lib.broadcast(sends[rank].data_ptr() if root == rank else slot, slot, root + 1, 7,
                              root, comms[rank], None)
                offset += root + 1
            before_end[rank] = recvs[rank].clone()
            lib.group_end()
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=15)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    for r in range(world):
        assert torch.equal(before_end[r], torch.zeros(6))
        assert torch.equal(recvs[r], torch.cat(sends))
    for c in comms:
        lib.comm_destroy(c)


def run_rank_threads(world, body, timeout=15):
    results, threads = {}, []
    for r in range(world):
        def target(rank=r):
            try:
                body(rank)
                results[rank] = 0
            except NcclError as exc:
                results[rank] = exc.code
        threads.append(threading.Thread(target=target))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads)
    return results


def test_fake_rejects_mismatched_groups_without_hanging(fake_nccl_path):
    lib = NcclLibrary(fake_nccl_path)
    comms = lib.comm_init_all([0, 1])
    bufs = [torch.zeros(4) for _ in range(2)]

    def body(rank):
        lib.group_start()
        roots = [0, 1] if rank == 0 else [1, 0]  # NCCL needs the same order on every rank
        for root in roots:
            lib.broadcast(bufs[rank].data_ptr(), bufs[rank].data_ptr(), 2, 7, root, comms[rank], None)
        lib.group_end()

    assert run_rank_threads(2, body) == {0: 5, 1: 5}  # ncclInvalidUsage on both


def test_fake_times_out_when_a_rank_never_comes(fake_nccl_path, monkeypatch):
    monkeypatch.setenv("FAKE_NCCL_TIMEOUT_MS", "200")
    lib = NcclLibrary(fake_nccl_path)
    comms = lib.comm_init_all([0, 1])
    x = torch.ones(2)
    start = time.monotonic()
    with pytest.raises(NcclError, match=r"ncclTimeout.*timeout waiting for other ranks"):
        lib.all_reduce(x.data_ptr(), x.data_ptr(), 2, 7, 0, comms[0], None)
    assert time.monotonic() - start < 5


# ----------------------------------------------------------------------------- marshaling

def recorded_library(**overrides):
    """An NcclLibrary whose C functions are FakeFunctions appending to one shared call log."""
    log = []

    def init_all(comms, n, devices):
        for i in range(n):
            comms[i] = 0x2000 + i

    functions = {"ncclGetErrorString": lambda code: b"fake failure"}
    for spec in NCCL_FUNCTIONS[1:]:
        on_call = init_all if spec.name == "ncclCommInitAll" else None
        fn = overrides.get(spec.name) or FakeFunction(on_call=on_call)
        functions[spec.name] = (lambda name, fn: lambda *a: (log.append((name, a)), fn(*a))[1])(spec.name, fn)
    lib = NcclLibrary("<recorded>", functions)
    return lib, log


@pytest.fixture
def p2p_direct_unset(monkeypatch):
    """NCCL_P2P_DIRECT_DISABLE unset for the test and after it (the backend sets os.environ)."""
    monkeypatch.setenv(nccl.P2P_DIRECT_ENV, "placeholder")  # recorded, so the undo removes it
    monkeypatch.delenv(nccl.P2P_DIRECT_ENV)
    monkeypatch.setattr(nccl, "_p2p_policy_logged", False)


def env_at_init():
    """A recorded library whose ncclCommInitAll notes NCCL_P2P_DIRECT_DISABLE as NCCL sees it."""
    seen = []
    lib, _ = recorded_library(ncclCommInitAll=FakeFunction(
        on_call=lambda comms, n, devices: seen.append(os.environ.get(nccl.P2P_DIRECT_ENV))))
    return lib, seen


def test_direct_peer_reads_are_disabled_before_comm_init_all(p2p_direct_unset, caplog):
    """One process over several GPUs: NCCL must not read peers' cudaMallocAsync memory directly
    (CARDS.md), so the policy is in the environment when ncclCommInitAll reads it; logged once."""
    lib, seen = env_at_init()
    with caplog.at_level(logging.INFO, logger="comfy.multidevice.comm.nccl"):
        NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
        NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    assert seen == ["1", "1"]
    lines = [r.getMessage() for r in caplog.records if nccl.P2P_DIRECT_ENV in r.getMessage()]
    assert len(lines) == 1 and "NCCL_P2P_DIRECT_DISABLE=1" in lines[0] and "cudaMallocAsync" in lines[0]


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_users_own_peer_access_setting_is_kept(p2p_direct_unset, monkeypatch, caplog, value):
    monkeypatch.setenv(nccl.P2P_DIRECT_ENV, value)
    lib, seen = env_at_init()
    with caplog.at_level(logging.INFO, logger="comfy.multidevice.comm.nccl"):
        NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    assert seen == [value]
    (line,) = [r.getMessage() for r in caplog.records if nccl.P2P_DIRECT_ENV in r.getMessage()]
    assert f"NCCL_P2P_DIRECT_DISABLE={value}" in line and "user" in line


def test_function_table_matches_nccl_h():
    names = [f.name for f in NCCL_FUNCTIONS]
    assert names == ["ncclGetErrorString", "ncclCommInitAll", "ncclCommDestroy", "ncclGroupStart",
                     "ncclGroupEnd", "ncclBroadcast", "ncclAllGather", "ncclAllReduce",
                     "ncclSend", "ncclRecv", "ncclCommAbort", "ncclCommGetAsyncError"]
    # only the point-to-point calls (NCCL >= 2.7, for all-to-all-V) and abort / async errors
    # (NCCL >= 2.4, for stuck collectives) may be missing
    assert [f.name for f in NCCL_FUNCTIONS if f.optional] == ["ncclSend", "ncclRecv", "ncclCommAbort",
                                                              "ncclCommGetAsyncError"]
    table = {f.name: f for f in NCCL_FUNCTIONS}
    # ncclSend(const void*, size_t count, ncclDataType_t, int peer, ncclComm_t, cudaStream_t)
    assert table["ncclSend"].argtypes[1] is ctypes.c_size_t and table["ncclRecv"].argtypes[3] is ctypes.c_int
    # ncclBroadcast(const void*, void*, size_t, ncclDataType_t, int root, ncclComm_t, cudaStream_t)
    assert table["ncclBroadcast"].argtypes[2] is ctypes.c_size_t
    assert table["ncclBroadcast"].argtypes[4] is ctypes.c_int
    assert len(table["ncclAllReduce"].argtypes) == 7 and table["ncclGroupStart"].argtypes == ()
    # ncclCommGetAsyncError(ncclComm_t, ncclResult_t *asyncError): the result is written through a pointer
    assert table["ncclCommGetAsyncError"].argtypes[1]._type_ is ctypes.c_int


def test_comm_init_all_marshaling():
    lib, log = recorded_library()
    backend = NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 3), library=lib)
    ((name, (comms, n, devlist)),) = log
    assert name == "ncclCommInitAll" and n == 3 and list(devlist[:3]) == [0, 1, 2]
    assert backend.comms == [0x2000, 0x2001, 0x2002]
    backend.close()
    assert [entry for entry in log[1:]] == [("ncclCommDestroy", (c,)) for c in (0x2000, 0x2001, 0x2002)]


def test_uneven_all_gather_v_is_one_group_of_broadcasts():
    lib, log = recorded_library()
    world = 4
    backend = NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * world), library=lib)
    log.clear()
    counts = [5 * 4, 0, 6 * 4, 6 * 4]  # rows 5/0/6/6 of 4 columns; rank 1 holds nothing
    displs = [0, 20, 20, 44]
    rank = 2
    send = torch.zeros(6, 4, dtype=torch.bfloat16)
    recv = torch.empty(sum(counts), dtype=torch.bfloat16)
    backend._all_gather_v_flat(rank, send, recv, counts, displs, None)
    names = [name for name, _ in log]
    assert names == ["ncclGroupStart", "ncclBroadcast", "ncclBroadcast", "ncclBroadcast", "ncclGroupEnd"]
    broadcasts = [args for name, args in log if name == "ncclBroadcast"]
    item = recv.element_size()
    for (sendbuff, recvbuff, count, dtype, root, comm, stream), want_root in zip(broadcasts, [0, 2, 3]):
        assert root == want_root
        assert recvbuff == recv.data_ptr() + displs[root] * item
        assert sendbuff == (send.data_ptr() if root == rank else recvbuff)
        assert count == counts[root]
        assert dtype == 9  # ncclBfloat16
        assert comm == 0x2000 + rank
        assert stream is None  # CPU: no stream handle


def test_even_all_gather_v_is_one_all_gather():
    lib, log = recorded_library()
    backend = NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    log.clear()
    send = torch.zeros(3, dtype=torch.float16)
    recv = torch.empty(6, dtype=torch.float16)
    backend._all_gather_v_flat(1, send, recv, [3, 3], [0, 3], None)
    assert log == [("ncclAllGather", (send.data_ptr(), recv.data_ptr(), 3, 6, 0x2001, None))]


def test_all_reduce_marshaling():
    lib, log = recorded_library()
    backend = NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    log.clear()
    send, recv = torch.ones(7), torch.empty(7)
    backend._all_reduce_flat(0, send, recv, "max", None)
    assert log == [("ncclAllReduce", (send.data_ptr(), recv.data_ptr(), 7, 7, 2, 0x2000, None))]


def test_error_inside_the_group_still_closes_it():
    lib, log = recorded_library(ncclBroadcast=FakeFunction(result=4))
    backend = NcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    log.clear()
    with pytest.raises(NcclError, match=r"ncclBroadcast failed with ncclResult_t 4 \(ncclInvalidArgument\): fake failure"):
        backend._all_gather_v_flat(0, torch.ones(1), torch.empty(3), [1, 2], [0, 1], None)
    assert [name for name, _ in log] == ["ncclGroupStart", "ncclBroadcast", "ncclGroupEnd"]


@pytest.mark.parametrize("dtype,code", [(torch.int8, 0), (torch.uint8, 1), (torch.int32, 2),
                                        (torch.int64, 4), (torch.float16, 6), (torch.float32, 7),
                                        (torch.float64, 8), (torch.bfloat16, 9)])
def test_dtype_enum(dtype, code):
    assert NcclLibrary.dtype(dtype) == code


def test_unsupported_dtype_names_it():
    with pytest.raises(CollectiveError, match="NCCL cannot move tensors of dtype torch.complex64"):
        NcclLibrary.dtype(torch.complex64)
