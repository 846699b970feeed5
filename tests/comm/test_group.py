"""The coordinator (comm/group.py): failures, timeouts, arguments, lifetime and backend choice.

Failure cases run on peer-copy and on HCCL (over the fake libhccl): a rank that fails or never
arrives must end every rank's collective quickly, whatever the backend.
"""

import logging
import threading
import time

import pytest
import torch

from comfy.multidevice.comm import group
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.types import CollectiveAborted, CollectiveError, CollectiveTimeout


@pytest.fixture(params=["peer", "hccl"])
def backend(request, monkeypatch, fake_hccl_path):
    if request.param == "hccl":
        monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    return request.param


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
    with pytest.raises(ValueError, match="'gloo'.*COMFYUI_MULTI_DEVICE_BACKEND"):
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
