"""The coordinator (comm/group.py): failures, timeouts, arguments, lifetime and backend choice.

Failure cases run on peer-copy and on HCCL (over the fake libhccl): a rank that fails or never
arrives must end every rank's collective quickly, whatever the backend.
"""

import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from comfy.multidevice.comm import group
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.errors import CollectiveAborted, CollectiveError, CollectiveTimeout


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


def test_unknown_backend_lists_valid_values(monkeypatch):
    with pytest.raises(ValueError, match="auto, hccl, nccl, peer"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="mpi")
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "gloo")
    with pytest.raises(ValueError, match="environment variable COMFYUI_MULTI_DEVICE_BACKEND='gloo' is not a backend"):
        SequenceParallelCoordinator(["cpu"] * 2)


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
@pytest.mark.parametrize("collective", ["exchange", "exchange with the shard plan", "all_reduce", "all_to_all_v"])
def test_rank_failing_to_allocate_never_strands_the_others_in_the_library(
        library, collective, monkeypatch, fake_hccl_path, fake_nccl_path):
    # Out of memory on one card after the shapes are known: the other ranks must not enter
    # the library's collective (which cannot be cancelled; the fakes would wait 20 s there).
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    with SequenceParallelCoordinator(["cpu"] * 3, backend=library, timeout_s=60) as coord:
        real_empty = coord.backend._empty

        def empty(numel, dtype, device, *workspace):
            if threading.current_thread().name == "sp-rank-1":
                raise RuntimeError("rank 1 is out of device memory")
            return real_empty(numel, dtype, device, *workspace)
        monkeypatch.setattr(coord.backend, "_empty", empty)

        def job(rank, comm):
            x = torch.ones(3, 2)
            if collective == "exchange":
                return comm.exchange([x], 0)
            if collective == "exchange with the shard plan":  # buffers made before the ranks meet
                return comm.exchange([x], 0, shard_sizes=[3, 3, 3])
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


# ----------------------------------------------------------------------------- stuck ranks, Cancel

def _stuck_until(release: threading.Event):
    """A rank that never returns by itself (the test releases it at the end)."""
    release.wait(60)


def test_a_stuck_rank_is_abandoned_and_the_caller_gets_the_timeout(caplog):
    release = threading.Event()
    coord = SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=0.3)
    stuck_worker = coord._workers[1]

    def job(rank, comm):
        if rank == 1:
            _stuck_until(release)
        return comm.exchange([torch.ones(1)], 0)

    start = time.monotonic()
    try:
        with caplog.at_level(logging.ERROR, logger=group.__name__):
            with pytest.raises(CollectiveTimeout, match=r"rank\(s\) \[1\]") as info:
                coord.run(job)
        elapsed = time.monotonic() - start
        # the barrier timeout (0.3 s) plus the grace (0.3 s) plus scheduling slack
        assert elapsed < 0.3 + 0.3 + 1.5, elapsed
        assert any("abandoned" in note for note in info.value.__notes__)
        assert coord.closed and "rank 1 on cpu" in coord.broken_reason
        assert any("rank 1 on cpu" in r.getMessage() and "abandoned" in r.getMessage()
                   for r in caplog.records)
        with pytest.raises(RuntimeError, match="closed after rank 1 on cpu"):
            coord.run(lambda rank, comm: None)
    finally:
        release.set()
    stuck_worker.join(5)
    assert not stuck_worker.is_alive()  # once it returns, the abandoned thread ends


def test_a_rank_stuck_outside_collectives_is_abandoned_after_the_others_finish():
    release = threading.Event()
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=0.3)
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"rank\(s\) \[1\] neither returned"):
            coord.run(lambda rank, comm: _stuck_until(release) if rank == 1 else rank)
        assert time.monotonic() - start < 0.3 + 0.3 + 1.5
        assert coord.closed
    finally:
        release.set()


def test_a_failing_rank_beside_a_stuck_one_raises_the_failure():
    release = threading.Event()
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=0.3)

    def job(rank, comm):
        if rank == 0:
            raise KeyError("boom")
        _stuck_until(release)

    try:
        start = time.monotonic()
        with pytest.raises(KeyError, match="boom"):
            coord.run(job)
        assert time.monotonic() - start < 0.3 + 1.5
        assert coord.closed
    finally:
        release.set()


def test_a_slow_rank_within_the_grace_keeps_the_coordinator():
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=2) as coord:
        def job(rank, comm):
            if rank == 0:
                raise KeyError("boom")
            time.sleep(0.2)  # busy, not stuck: it returns well within the grace
            return rank
        with pytest.raises(KeyError):
            coord.run(job)
        assert not coord.closed
        assert coord.run(lambda rank, comm: comm.all_reduce(torch.ones(1)).item()) == [2.0, 2.0]


def test_shared_coordinator_is_rebuilt_after_an_abandoned_rank():
    from comfy.multidevice.roles.apply import close_shared_coordinators, shared_coordinator
    release = threading.Event()
    devices = [torch.device("cpu")] * 2
    monkey = pytest.MonkeyPatch()
    monkey.setenv("COMFYUI_MULTI_DEVICE_TIMEOUT_S", "0.3")
    try:
        first = shared_coordinator(devices, "peer")
        with pytest.raises(CollectiveTimeout):
            first.run(lambda rank, comm: _stuck_until(release) if rank == 1 else comm.barrier())
        second = shared_coordinator(devices, "peer")
        assert second is not first and not second.closed
        assert second.run(lambda rank, comm: comm.exchange([torch.full((1,), rank)], 0)[0].tolist()) \
            == [[0, 1], [0, 1]]
    finally:
        release.set()
        monkey.undo()
        close_shared_coordinators()


class _FakeModelManagement:
    """The part of ComfyUI's comfy.model_management that a Cancel goes through."""

    class InterruptProcessingException(Exception):
        pass

    def __init__(self):
        self.flag = False

    def processing_interrupted(self):
        return self.flag

    def throw_exception_if_processing_interrupted(self):
        if self.flag:
            self.flag = False
            raise self.InterruptProcessingException()


@pytest.fixture
def comfy_cancel(monkeypatch):
    fake = _FakeModelManagement()
    monkeypatch.setitem(sys.modules, "comfy.model_management", fake)
    return fake


def _press_cancel_after(fake, seconds):
    timer = threading.Timer(seconds, lambda: setattr(fake, "flag", True))
    timer.start()
    return timer


def test_cancel_stops_every_rank_at_its_next_collective(backend, comfy_cancel):
    blocks_done = [0, 0, 0]
    with SequenceParallelCoordinator(["cpu"] * 3, backend=backend, timeout_s=20) as coord:
        def job(rank, comm):
            for _ in range(100_000):  # a "sampling" far longer than the test
                time.sleep(0.005)  # one block's compute
                comm.exchange([torch.ones(2)], 0)
                blocks_done[rank] += 1
        timer = _press_cancel_after(comfy_cancel, 0.3)
        start = time.monotonic()
        with pytest.raises(_FakeModelManagement.InterruptProcessingException):
            coord.run(job)
        elapsed = time.monotonic() - start
        timer.join()
        assert elapsed < 0.3 + 1.5, elapsed
        assert comfy_cancel.flag is False  # consumed, as upstream's sampler does
        # every rank stopped within one block of the others
        assert max(blocks_done) - min(blocks_done) <= 1 and max(blocks_done) < 100_000
        assert not coord.closed
        out = coord.run(lambda rank, comm: comm.exchange([torch.full((1,), float(rank))], 0)[0])
        assert all(torch.equal(o, torch.tensor([0.0, 1.0, 2.0])) for o in out)


def test_cancel_with_a_rank_that_never_stops_abandons_it(comfy_cancel):
    release = threading.Event()
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=0.4)

    def job(rank, comm):
        if rank == 1:
            _stuck_until(release)
        while True:
            comm.barrier()

    timer = _press_cancel_after(comfy_cancel, 0.1)
    try:
        with pytest.raises(_FakeModelManagement.InterruptProcessingException):
            coord.run(job)
        assert coord.closed
    finally:
        timer.join()
        release.set()


def test_runs_without_comfyui_look_at_no_flag(monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy.model_management", raising=False)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer") as coord:
        assert coord.run(lambda rank, comm: rank) == [0, 1]


def test_the_node_runs_again_after_a_coordinator_was_abandoned(monkeypatch):
    from comfy_extras import nodes_multinpu
    from tests.node_cases import make_fake_comfy_api
    package, latest = make_fake_comfy_api(True)
    monkeypatch.setitem(sys.modules, "comfy_api", package)
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    monkeypatch.setattr(nodes_multinpu, "_NODE_CLASS", None)
    node = nodes_multinpu.node_class()
    before = node.fingerprint_inputs(npu_count=2)
    assert node.fingerprint_inputs(npu_count=2) == before  # cached as usual
    release = threading.Event()
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=0.2)
    try:
        with pytest.raises(CollectiveTimeout):
            coord.run(lambda rank, comm: _stuck_until(release) if rank else comm.barrier())
    finally:
        release.set()
    assert node.fingerprint_inputs(npu_count=2) != before  # ComfyUI runs the node again


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 0, -1.0, True, 1e9, "5"])
def test_a_bad_timeout_argument_is_refused_before_any_thread_starts(timeout):
    from comfy.multidevice.comm.settings import SettingError
    threads = threading.active_count()
    with pytest.raises(SettingError, match=r"timeout_s=.*must be a number of seconds above 0 and at most 86400"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=timeout)
    assert threading.active_count() == threads


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "\u0665"])
def test_a_bad_timeout_variable_is_refused_by_the_coordinator_too(monkeypatch, value):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=f"environment variable COMFYUI_MULTI_DEVICE_TIMEOUT_S={value!r}"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="peer")


# ----------------------------------------------------------------------------- re-entry, the watchdog

REPO = Path(__file__).resolve().parents[2]


def run_script(code: str, env: dict | None = None, timeout: float = 40) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: a hang there fails the test (TimeoutExpired) instead of
    blocking the whole session on a thread that never returns."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})})


@pytest.mark.timeout(60)
def test_run_called_from_inside_a_rank_fails_at_once():
    done = run_script("""
        import time
        from comfy.multidevice.comm.group import SequenceParallelCoordinator
        co = SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=1.5)
        start = time.monotonic()
        try:
            co.run(lambda r, c: co.run(lambda r2, c2: r2))
        except Exception as exc:
            print(f"{type(exc).__name__} after {time.monotonic() - start:.2f}s: {exc}")
        print("closed" if co.closed else "open", co.run(lambda r, c: r))
        """)
    assert done.returncode == 0, done.stderr
    kind, rest = done.stdout.split(" after ", 1)
    assert kind == "CollectiveError"
    assert float(rest.split("s:", 1)[0]) < 1.0  # at once, not after a timeout
    assert "run() was called from inside a function that this coordinator runs" in rest
    assert "use the comm argument's collectives" in rest
    assert done.stdout.strip().endswith("open [0, 1]")  # nothing was abandoned


@pytest.mark.timeout(60)
def test_ranks_that_all_sleep_are_ended_by_the_run_watchdog():
    done = run_script("""
        import time
        from comfy.multidevice.comm.group import SequenceParallelCoordinator
        co = SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=1.5)
        start = time.monotonic()
        try:
            co.run(lambda r, c: time.sleep(600))
        except Exception as exc:
            print(f"{type(exc).__name__} after {time.monotonic() - start:.1f}s: {exc}")
        print("closed" if co.closed else "open")
        """, env={"COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S": "1"})
    assert done.returncode == 0, done.stderr
    kind, rest = done.stdout.split(" after ", 1)
    assert kind == "CollectiveTimeout", done.stdout
    assert float(rest.split("s:", 1)[0]) < 1 + 1.5 + 5  # the watchdog, the grace, slack
    assert "no rank returned or reached a collective for 1s" in rest
    assert "raise COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S" in rest
    assert done.stdout.strip().endswith("closed")


def test_the_watchdog_names_no_rank_and_closes_the_coordinator():
    release = threading.Event()
    coord = SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=0.3, run_timeout_s=0.4)
    try:
        start = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"no rank returned or reached a collective for 0.4s "
                                                    r"\(running .*<lambda>") as info:
            coord.run(lambda rank, comm: _stuck_until(release))
        assert time.monotonic() - start < 0.4 + 0.3 + 1.5
        assert getattr(info.value, "rank", None) is None  # no rank is to blame more than another
        assert coord.closed
    finally:
        release.set()


def test_the_watchdog_leaves_a_long_run_with_steady_collectives_alone():
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=5, run_timeout_s=0.3) as coord:
        def job(rank, comm):
            for _ in range(8):  # 0.8 s in all, far past the watchdog's 0.3 s
                time.sleep(0.1)
                comm.barrier()
            return rank
        assert coord.run(job) == [0, 1]
    with SequenceParallelCoordinator(["cpu"], backend="peer", run_timeout_s=0.3) as alone:
        def single(rank, comm):  # one rank: its collectives return at once, still activity
            for _ in range(8):
                time.sleep(0.1)
                comm.exchange([torch.ones(1)], 0)
            return "done"
        assert alone.run(single) == ["done"]


def test_a_bad_run_timeout_is_refused(monkeypatch):
    from comfy.multidevice.comm.settings import SettingError
    with pytest.raises(SettingError, match=r"run_timeout_s=0: must be a number of seconds above 0"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="peer", run_timeout_s=0)
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S", "forever")
    with pytest.raises(SettingError, match=r"COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S='forever' is not a number"):
        SequenceParallelCoordinator(["cpu"] * 2, backend="peer")


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")


def test_a_rank_error_whose_str_raises_is_reported_with_its_type_and_rank():
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=20) as coord:
        def job(rank, comm):
            if rank == 1:
                raise _Unprintable()
            comm.barrier()
        start = time.monotonic()
        with pytest.raises(_Unprintable) as info:
            coord.run(job)
        assert time.monotonic() - start < 5  # not the 20 s timeout of a lost rank
        assert info.value.rank == 1 and "(raised on multi-device rank 1)" in info.value.__notes__
        assert not coord.closed  # the rank thread survived
        assert coord.run(lambda rank, comm: rank) == [0, 1, 2]
    assert group.describe_error(_Unprintable()) == \
        "_Unprintable: (its message could not be read: str() raised RuntimeError)"
