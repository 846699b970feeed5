"""The fake libhccl / libnccl (tests/fakes/) refuse what the vendors forbid (CARDS.md).

- One collective per device at a time, across every communicator of the process: CANN, "one
  card cannot invoke multiple collective operation APIs at a time"; NCCL, "not safe to issue
  operations in parallel to independent communicators located on the same device with multiple
  threads". The fake HCCL fails the later call on every rank of its communicator; the fake NCCL
  (real NCCL returns no error there: it hangs or corrupts) completes it and records a violation,
  which tests/conftest.py turns into a failure of any test that leaves one.
- Every rank of a communicator issues the same collectives, with the same sizes, in order:
  both fakes return an error on every rank, without waiting for a timeout.

The overlaps are lined up, not raced: a first call waits inside the library for its peer
while the second starts on the same device (`in_flight` reads the fake's own count).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from comfy.multidevice.comm.hccl import HcclError, HcclLibrary
from comfy.multidevice.comm.nccl import NcclError, NcclLibrary
from tests.fakes.violations import in_flight, take_nccl_violations

HCCL_E_PARA, HCCL_E_FAKE_OVERLAP, HCCL_E_FAKE_ORDER = 1, 1001, 1002
NCCL_INVALID_USAGE = 5

FAKES = {  # kind -> (library class, its error, the fake's in-flight function)
    "hccl": (HcclLibrary, HcclError, "fakeHcclInFlight"),
    "nccl": (NcclLibrary, NcclError, "fakeNcclInFlight"),
}


@pytest.fixture(params=sorted(FAKES))
def fake(request, monkeypatch):
    """(kind, path, bound library) of one fake, with a short rendezvous timeout: a call that
    waits for a peer instead of failing at once shows up as a timeout code, not a hang."""
    kind = request.param
    monkeypatch.setenv(f"FAKE_{kind.upper()}_TIMEOUT_MS", "10000")
    path = request.getfixturevalue(f"fake_{kind}_path")
    return kind, path, FAKES[kind][0](path)


def recorded(kind: str, path: str) -> list[str]:
    """The violations the fake recorded (and cleared); the fake HCCL fails instead of recording."""
    return take_nccl_violations(path) if kind == "nccl" else []


def wait_until(condition, what: str, limit_s: float = 30.0) -> None:
    """Poll until `condition()` (the threads involved are blocked inside the library)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} never happened"
        time.sleep(0.002)


def start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def finish(*threads) -> None:
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a rank is still inside the library"


def all_reduce_call(lib, error, results):
    """A rank thread body: all-reduce rank + 1 over 4 floats; (code or "ok", output) into results."""
    def call(name, comms, rank, count=4, op="sum"):
        x, out = torch.full((count,), float(rank + 1)), torch.zeros(count)
        try:
            lib.all_reduce(x.data_ptr(), out.data_ptr(), count, lib.dtype(torch.float32), lib.reduce_ops[op],
                           comms[rank], None)
            results[name, rank] = ("ok", out)
        except error as exc:
            results[name, rank] = (exc.code, str(exc))
    return call


def test_two_communicators_of_one_device_may_not_run_collectives_at_once(fake):
    """Two communicators over the same devices (a K/V exchange and a prefetch lane, say), each
    driven by its own threads: the second collective to start on device 0 while the first is
    in flight there breaks the rule."""
    kind, path, lib = fake
    error, counter = FAKES[kind][1], FAKES[kind][2]
    first, second = lib.comm_init_all([0, 1]), lib.comm_init_all([0, 1])
    results = {}
    call = all_reduce_call(lib, error, results)
    a0 = start(call, "first", first, 0)  # waits inside the library for its rank 1
    wait_until(lambda: in_flight(path, counter, 0) == 1, "the first call on device 0")
    b0 = start(call, "second", second, 0)  # the overlap: device 0 is busy with the first
    wait_until(lambda: in_flight(path, counter, 0) == 2, "the second call on device 0")
    finish(start(call, "first", first, 1), a0)  # device 1 never runs two at once
    finish(start(call, "second", second, 1), b0)
    assert in_flight(path, counter, 0) == in_flight(path, counter, 1) == 0
    assert results["first", 0][0] == results["first", 1][0] == "ok"
    assert torch.equal(results["first", 0][1], torch.full((4,), 3.0))
    violations = recorded(kind, path)
    if kind == "hccl":  # every rank of the later call's communicator fails, naming the rule
        assert [results["second", r][0] for r in range(2)] == [HCCL_E_FAKE_OVERLAP] * 2
        assert "two collectives overlap on one device" in results["second", 0][1]
    else:  # NCCL would not say: the call completes and the fake records it
        assert all(results["second", r][0] == "ok" for r in range(2))
        assert torch.equal(results["second", 1][1], torch.full((4,), 3.0))
        assert len(violations) == 1 and violations[0].startswith("device 0: ncclAllReduce (rank 0 of 2)")
        assert "independent communicators on one device" in violations[0]
    for comm in first + second:
        lib.comm_destroy(comm)


def test_one_communicator_used_in_turn_from_several_threads_is_fine(fake):
    """No false alarm: collectives that follow each other on a device, whichever thread or
    communicator issues them, are what every backend does."""
    kind, path, lib = fake
    error = FAKES[kind][1]
    comms = [lib.comm_init_all([0, 1]) for _ in range(2)]
    results = {}
    call = all_reduce_call(lib, error, results)
    for turn in range(4):
        finish(*[start(call, turn, comms[turn % 2], r) for r in range(2)])
    assert all(code == "ok" and torch.equal(out, torch.full((4,), 3.0)) for code, out in results.values())
    assert len(results) == 8 and recorded(kind, path) == []
    for comm in comms[0] + comms[1]:
        lib.comm_destroy(comm)


def mismatches(kind, lib):
    """Per case, what rank 0 and rank 1 call: they differ in the function, the size, the op or
    the root."""
    f32 = lib.dtype(torch.float32)
    x = [torch.ones(4) for _ in range(2)]
    out = [torch.zeros(8) for _ in range(2)]

    def all_reduce(count, op="sum"):
        return lambda r, c: lib.all_reduce(x[r].data_ptr(), out[r].data_ptr(), count, f32, lib.reduce_ops[op], c, None)

    def all_gather(r, c):
        lib.all_gather(x[r].data_ptr(), out[r].data_ptr(), 4, f32, c, None)

    def broadcast(root):
        if kind == "hccl":
            return lambda r, c: lib.broadcast(x[r].data_ptr(), 4, f32, root, c, None)
        return lambda r, c: lib.broadcast(x[r].data_ptr(), x[r].data_ptr(), 4, f32, root, c, None)

    return {"all-reduce vs all-gather": (all_reduce(4), all_gather),
            "4 vs 2 elements": (all_reduce(4), all_reduce(2)),
            "sum vs max": (all_reduce(4), all_reduce(4, "max")),
            "root 0 vs root 1": (broadcast(0), broadcast(1))}


def test_ranks_that_call_different_collectives_all_fail_without_waiting(fake):
    kind, path, lib = fake
    error = FAKES[kind][1]
    expected = HCCL_E_FAKE_ORDER if kind == "hccl" else NCCL_INVALID_USAGE
    for case, calls in mismatches(kind, lib).items():
        comms = lib.comm_init_all([0, 1])
        codes = {}

        def rank(r):
            try:
                calls[r](r, comms[r])
                codes[r] = 0
            except error as exc:
                codes[r] = exc.code
        finish(*[start(rank, r) for r in range(2)])
        assert codes == {0: expected, 1: expected}, case  # a timeout would be 9 (hccl) / 8 (nccl)
        for comm in comms:
            lib.comm_destroy(comm)
    assert recorded(kind, path) == []


def test_hccl_all_gather_v_sizes_must_agree_on_every_rank(monkeypatch, fake_hccl_path):
    """HcclAllGatherV's counts are host arrays every rank passes alike; a rank whose own count
    is not its send count fails every rank, none waits."""
    import ctypes
    monkeypatch.setenv("FAKE_HCCL_TIMEOUT_MS", "10000")
    lib = HcclLibrary(fake_hccl_path)
    f32 = lib.dtype(torch.float32)
    cases = {"counts differ": ([1, 3], [2, 2], 1, 2, HCCL_E_FAKE_ORDER),
             "send count is not the rank's count": ([1, 3], [1, 3], 2, 3, HCCL_E_PARA)}
    for case, (counts0, counts1, send0, send1, expected) in cases.items():
        comms = lib.comm_init_all([0, 1])
        codes = {}

        def rank(r, counts, send):
            host = (ctypes.c_uint64 * 2)(*counts)
            displs = (ctypes.c_uint64 * 2)(0, counts[0])
            x, out = torch.ones(send), torch.zeros(sum(counts))
            try:
                lib.all_gather_v(x.data_ptr(), send, out.data_ptr(), ctypes.addressof(host),
                                 ctypes.addressof(displs), f32, comms[r], None)
                codes[r] = 0
            except HcclError as exc:
                codes[r] = exc.code
        finish(start(rank, 0, counts0, send0), start(rank, 1, counts1, send1))
        assert codes == {0: expected, 1: expected}, case
        for comm in comms:
            lib.comm_destroy(comm)


def test_a_device_twice_in_one_init_is_refused(fake):
    kind, _, lib = fake
    with pytest.raises(FAKES[kind][1], match="HcclCommInitAll|ncclCommInitAll"):
        lib.comm_init_all([1, 1])
