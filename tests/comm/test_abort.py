"""A collective stuck inside NCCL is ended by aborting the communicators (comm/abort.py), end to
end over the fake libnccl: its ncclCommAbort wakes a rank waiting there for a peer, and counts
the communicators it aborted (fakeNcclAbortCount).

Every fake rendezvous here waits up to a minute (FAKE_NCCL_TIMEOUT_MS), so a rank only comes
back within the tests' joins when the abort brought it back.
"""

import ctypes
import logging
import threading
import time

import pytest
import torch

from comfy.multidevice.comm import group
from comfy.multidevice.comm.errors import CollectiveTimeout
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.nccl import NcclError, NcclLibrary


@pytest.fixture
def fake(use_fake_nccl, monkeypatch):
    """The fake's own counters (the library the backends load: one copy per process)."""
    monkeypatch.setenv("FAKE_NCCL_TIMEOUT_MS", "60000")
    return ctypes.CDLL(use_fake_nccl)


def wait_until(condition, what):
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"{what} did not happen within 10 s")


def stuck_coordinator(monkeypatch, stuck_rank_does, timeout_s=30.0):
    """Two NCCL ranks where rank 1, past the barrier, runs `stuck_rank_does` instead of its
    library call, so rank 0 waits inside the fake library for a peer that never comes."""
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="nccl", timeout_s=timeout_s, run_timeout_s=20)
    coord.abandon_grace_s = 0.3
    real = coord.backend._all_gather_v_flat

    def flat(rank, *args):
        if rank == 1:
            stuck_rank_does()
        return real(rank, *args)
    monkeypatch.setattr(coord.backend, "_all_gather_v_flat", flat)
    return coord


def exchange(rank, comm):
    return comm.exchange([torch.ones(rank + 1)], 0)


# ----------------------------------------------------------------------------- the fake

def test_the_fake_abort_wakes_a_rank_waiting_for_a_peer(fake):
    lib = NcclLibrary(fake._name)
    comms = lib.comm_init_all([0, 1])
    x = torch.ones(4)
    codes = []

    def rank0():  # its peer never calls: it waits in the rendezvous
        try:
            lib.all_reduce(x.data_ptr(), x.data_ptr(), 4, 7, 0, comms[0], None)
            codes.append(0)
        except NcclError as exc:
            codes.append(exc.code)
    thread = threading.Thread(target=rank0)
    thread.start()
    wait_until(lambda: fake.fakeNcclWaiting(ctypes.c_void_p(comms[0])) == 1, "rank 0 waiting in the fake")
    before = fake.fakeNcclAbortCount()
    for comm in comms:
        lib.comm_abort(comm)
    thread.join(10)
    assert not thread.is_alive(), "the abort did not wake the waiting rank"
    assert codes == [3]  # ncclInternalError, not ncclTimeout (8) a minute later
    assert fake.fakeNcclAbortCount() - before == 2


def test_the_fake_reports_an_async_error_when_told(fake, monkeypatch):
    lib = NcclLibrary(fake._name)
    comms = lib.comm_init_all([0, 1])
    assert lib.async_error(comms[0]) is None
    monkeypatch.setenv("FAKE_NCCL_ASYNC_ERROR", "6")
    error = lib.async_error(comms[0])
    assert isinstance(error, NcclError) and error.code == 6
    assert "ncclCommGetAsyncError" in str(error) and "ncclRemoteError" in str(error)
    monkeypatch.setenv("FAKE_NCCL_ASYNC_ERROR", "7")  # ncclInProgress: a non-blocking call runs
    assert lib.async_error(comms[0]) is None
    for comm in comms:
        lib.comm_destroy(comm)


# ----------------------------------------------------------------------------- the coordinator

def test_a_rank_stuck_inside_nccl_is_aborted_after_the_timeout(fake, monkeypatch):
    release = threading.Event()
    coord = stuck_coordinator(monkeypatch, lambda: release.wait(30), timeout_s=0.5)
    before = fake.fakeNcclAbortCount()
    try:
        with pytest.raises(CollectiveTimeout, match=r"rank\(s\) \[0\] waited in NCCL for more than 0.5s"):
            coord.run(exchange)
        assert fake.fakeNcclAbortCount() - before == 2
        # rank 0 came back out of the library; rank 1, stuck in its own code, was abandoned
        assert coord.closed and coord.broken_reason.startswith("rank 1 on cpu did not stop")
        coord._workers[0].join(10)
        assert not coord._workers[0].is_alive(), "rank 0 is still inside the library"
    finally:
        release.set()


def test_no_rank_calls_the_library_after_the_abort_and_the_coordinator_closes(fake, monkeypatch):
    before = fake.fakeNcclAbortCount()
    # rank 1 reaches its library call only once the communicators are aborted: it must not call
    coord = stuck_coordinator(monkeypatch, lambda: wait_until(lambda: fake.fakeNcclAbortCount() > before,
                                                              "the abort"), timeout_s=0.5)
    with pytest.raises(CollectiveTimeout, match=r"rank\(s\) \[0\] waited in NCCL"):
        coord.run(exchange)
    assert coord.closed and coord.broken_reason.startswith("its nccl communicators were aborted")
    for worker in coord._workers:  # nobody was abandoned: every rank came back
        worker.join(10)
        assert not worker.is_alive()
    with pytest.raises(RuntimeError, match="closed after its nccl communicators were aborted"):
        coord.run(exchange)


def test_an_abandoned_ranks_communicators_are_aborted_so_a_rank_inside_returns(fake, monkeypatch):
    def fail():
        raise KeyError("rank 1 failed between the barrier and its library call")
    coord = stuck_coordinator(monkeypatch, fail)
    before = fake.fakeNcclAbortCount()
    with pytest.raises(KeyError, match="rank 1 failed") as info:
        coord.run(exchange)
    assert any("rank(s) [0] did not stop" in note for note in info.value.__notes__)
    assert fake.fakeNcclAbortCount() - before == 2  # before: left open, rank 0 stuck for a minute
    assert coord.closed
    coord._workers[0].join(10)
    assert not coord._workers[0].is_alive(), "rank 0 is still inside the library"


def test_an_async_error_ends_the_run_and_aborts(fake, monkeypatch):
    release = threading.Event()
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="nccl", timeout_s=30, run_timeout_s=20)
    coord.abandon_grace_s = 0.3
    monkeypatch.setenv("FAKE_NCCL_ASYNC_ERROR", "6")  # the link failed
    before = fake.fakeNcclAbortCount()
    try:
        with pytest.raises(NcclError, match=r"ncclCommGetAsyncError .* 6 \(ncclRemoteError\)") as info:
            coord.run(lambda rank, comm: release.wait(30))
        assert any("communicator of rank 0" in note for note in info.value.__notes__)
        assert fake.fakeNcclAbortCount() - before == 2
        assert coord.closed
    finally:
        release.set()


def test_close_after_a_failed_run_aborts_and_after_a_good_one_destroys(fake):
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="nccl", timeout_s=30)
    before = fake.fakeNcclAbortCount()

    def job(rank, comm):
        if rank == 1:
            raise KeyError("boom")
        return rank
    with pytest.raises(KeyError):
        coord.run(job)
    assert not coord.closed  # every rank returned: the coordinator stays usable
    coord.close()
    assert fake.fakeNcclAbortCount() - before == 2

    with SequenceParallelCoordinator(["cpu"] * 2, backend="nccl", timeout_s=30) as good:
        good.run(exchange)
    assert fake.fakeNcclAbortCount() - before == 2  # destroyed, not aborted


def test_without_ncclcommabort_an_abandoned_communicator_is_left_open(fake, monkeypatch, caplog):
    release = threading.Event()
    coord = stuck_coordinator(monkeypatch, lambda: release.wait(30), timeout_s=0.5)
    del coord.backend.library.functions["ncclCommAbort"]  # an NCCL older than 2.4
    try:
        with caplog.at_level(logging.WARNING, logger=group.__name__):
            with pytest.raises(CollectiveTimeout):
                coord.run(lambda rank, comm: release.wait(30) if rank == 1 else rank)
        assert coord.closed
        assert any("left open (its library cannot abort it)" in r.getMessage() for r in caplog.records)
    finally:
        release.set()
