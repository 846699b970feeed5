"""The HCCL ctypes backend (comm/hccl.py), end to end over the fake libhccl and argument by
argument with recorded calls.

The backend-independent exactness cases (tests/collective_cases.py) run here on HCCL, as
tests/comm/test_nccl.py runs them on NCCL; this file adds HCCL's marshaling, errors and fallbacks.
"""

import ctypes
import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.hccl import HcclBackend, HcclError, HcclLibrary, TRAINING_SERIES_CHIPS
from comfy.multidevice.comm.errors import BackendUnavailable, CollectiveError
# The backend-independent cases, collected here for HCCL (the `backend` fixture below).
from tests.collective_cases import *  # noqa: F401,F403
from tests.collective_cases import FakeFunction, make_shards


@pytest.fixture
def backend(monkeypatch, fake_hccl_path):
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    return "hccl"


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
    return HcclLibrary("<recorded>", functions), functions


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


def test_all_to_all_keeps_the_own_chunk_out_of_the_library(use_fake_hccl, monkeypatch):
    """The chunk a rank keeps is copied straight into its place: HcclAlltoAllV gets a zero
    count to and from the rank itself, and the result is still the split/cat reference."""
    calls = []
    real = HcclBackend._all_to_all_v_flat

    def spy(self, rank, send, recv, send_counts, send_displs, recv_counts, recv_displs, stream):
        calls.append((rank, list(send_counts), list(recv_counts), send.numel()))
        return real(self, rank, send, recv, send_counts, send_displs, recv_counts, recv_displs, stream)

    monkeypatch.setattr(HcclBackend, "_all_to_all_v_flat", spy)
    world, heads = 3, [1, 2, 3]
    full = torch.randn(1, 6, 7, 4)  # [B, H, S, D]; sequence shards -> head shards
    rows = [2, 2, 3]
    shards = list(full.split(rows, 2))
    with SequenceParallelCoordinator(["cpu"] * world, backend="hccl", timeout_s=20) as coord:
        out = coord.run(lambda rank, comm, x: comm.all_to_all_v(x, heads, 1, cat_dim=2), shards)
    for rank, got in enumerate(out):
        assert torch.equal(got, full.split(heads, 1)[rank])
    for rank, send_counts, recv_counts, sent in calls:
        assert send_counts[rank] == 0 and recv_counts[rank] == 0
        assert sent == sum(send_counts)  # only the peers' chunks were packed
    assert sorted(c[0] for c in calls) == list(range(world))


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
    assert HcclLibrary.dtype(dtype) == code


def test_unsupported_dtype_names_it():
    with pytest.raises(CollectiveError, match="complex64"):
        HcclLibrary.dtype(torch.complex64)


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
            assert not coord.backend.library.has_all_gather_v
            out = coord.run(lambda rank, comm, x: comm.exchange([x, x], [1, 1]), shards)
    warnings = [r for r in caplog.records if "HcclAllGatherV" in r.getMessage()]
    assert len(warnings) == 1 and "HcclBroadcast" in warnings[0].getMessage()
    for pair in out:
        for o in pair:
            assert torch.equal(o, torch.cat(shards, dim=1))


def test_the_broadcast_fallback_puts_the_own_shard_in_place_before_the_stream_is_read(
        monkeypatch, fake_hccl_no_allgatherv_path):
    """torch_npu drains its queue when the stream handle is read (CARDS.md): a copy queued after
    that may run after the broadcasts. So when a rank thread reads its handle, its own shard must
    already be in the receive buffer (seen here by filling fresh buffers with a sentinel)."""
    from comfy.multidevice.comm import ctypes_lib
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_no_allgatherv_path)
    made, seen = {}, []

    def sentinel_buffer(numel, dtype, device, workspace=None, key=None):
        buf = torch.full((numel,), -1.0, dtype=dtype)
        made.setdefault(threading.get_ident(), []).append(buf)
        return buf

    def stream_handle(device):
        written = int((made[threading.get_ident()][-1] != -1).sum())
        seen.append((threading.current_thread().rank, written))
        return None

    monkeypatch.setattr(HcclBackend, "_empty", staticmethod(sentinel_buffer))
    monkeypatch.setattr(ctypes_lib, "current_stream_handle", stream_handle)
    rows = [2, 3, 5]
    shards = [torch.full((n, 2), float(r + 1)) for r, n in enumerate(rows)]
    with SequenceParallelCoordinator(["cpu"] * 3, backend="hccl", timeout_s=20) as coord:
        out = coord.run(lambda rank, comm, x: comm.exchange([x], 0)[0], shards)
    assert sorted(seen) == [(r, 2 * n) for r, n in enumerate(rows)]
    assert all(torch.equal(o, torch.cat(shards)) for o in out)


@pytest.mark.parametrize("chip", sorted(TRAINING_SERIES_CHIPS))
def test_a_training_series_chip_exchanges_by_broadcast_although_the_library_has_allgatherv(
        use_fake_hccl, monkeypatch, caplog, chip):
    """HcclAllGatherV is not supported on the Atlas training series: the chip decides, not only
    the symbol. The fake library fails any HcclAllGatherV call, so an exact result proves it
    was never made."""
    from comfy.multidevice.comm import hccl
    monkeypatch.setattr(hccl, "chip_name", lambda device: chip)
    monkeypatch.setenv("FAKE_HCCL_FAIL", "HcclAllGatherV:4")
    shards = make_shards(3, [4, 1, 6], 1, torch.float32)
    with caplog.at_level(logging.INFO, logger="comfy.multidevice.comm.hccl"):
        with SequenceParallelCoordinator(["cpu"] * 3, backend="hccl", timeout_s=20) as coord:
            assert coord.backend.library.has_all_gather_v and not coord.backend.uses_all_gather_v
            out = coord.run(lambda rank, comm, x: comm.exchange([x], [1])[0], shards)
    lines = [r.getMessage() for r in caplog.records if "HcclAllGatherV" in r.getMessage()]
    assert len(lines) == 1 and chip in lines[0] and "training series" in lines[0]
    assert all(torch.equal(o, torch.cat(shards, dim=1)) for o in out)


@pytest.mark.parametrize("chip", ["Ascend910B1", "Ascend910B3", "Ascend910B4-1", "Ascend910_9391", None])
def test_other_chips_use_allgatherv(monkeypatch, chip):
    from comfy.multidevice.comm import hccl
    monkeypatch.setattr(hccl, "chip_name", lambda device: chip)
    lib, functions = fake_hccl_library()
    backend = HcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    send, recv = torch.zeros(2), torch.empty(5)
    backend._all_gather_v_flat(0, send, recv, [2, 3], [0, 2], None)
    assert len(functions["HcclAllGatherV"].calls) == 1 and functions["HcclBroadcast"].calls == []


def test_a_chip_name_that_cannot_be_read_leaves_the_choice_to_the_library_and_says_so(monkeypatch, caplog):
    from comfy.multidevice.comm import hccl

    def unreadable(device):
        raise RuntimeError("no device properties")
    monkeypatch.setattr(hccl, "chip_name", unreadable)
    lib, functions = fake_hccl_library()
    with caplog.at_level(logging.WARNING, logger="comfy.multidevice.comm.hccl"):
        backend = HcclBackend(SimpleNamespace(devices=[torch.device("cpu")] * 2), library=lib)
    assert backend.uses_all_gather_v
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no device properties" in line and "COMFYUI_MULTI_DEVICE_BACKEND=peer" in line


def test_forced_hccl_with_missing_library_raises(monkeypatch, tmp_path):
    missing = str(tmp_path / "nowhere" / "libhccl.so")
    monkeypatch.setenv("HCCL_SO_PATH", missing)
    with pytest.raises(BackendUnavailable, match="HCCL_SO_PATH"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="hccl")


def test_backend_from_environment(monkeypatch, fake_hccl_path):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "HCCL")
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    with SequenceParallelCoordinator(["cpu"] * 2) as coord:
        assert coord.backend_name == "hccl"
