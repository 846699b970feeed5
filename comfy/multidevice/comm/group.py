"""The coordinator: W rank threads in one process, their failures and Cancel, backend choice.

One process drives W devices ("ranks"), one persistent worker thread per rank. Collectives
(`exchange` = all-gather-V, `all_to_all_v`, `all_reduce`; comm/collectives.py) go through a backend:
  peer  - shared slots + barrier + each shard copied once into the output (always works)
  hccl  - libhccl.so through ctypes (hccl.py)
  nccl  - libnccl.so.2 through ctypes (nccl.py)
  auto  - hccl on NPUs, nccl on CUDA, peer on CPU; falls back to peer with one warning.

A rank that fails aborts the collectives' barrier, so no other rank blocks on it; a rank that
never arrives makes the barrier time out with its rank named. A run in which no rank returns
and none reaches a collective for `run_timeout_s` (COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S, default
3600) is ended by a watchdog. A rank stuck inside a library collective is ended by aborting
the communicators (comm/abort.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from comfy.multidevice.comfy_cancel import cancel_requested, CancelledAtBlock, raise_cancel
from comfy.multidevice.comm.collectives import SlotCollectives
from comfy.multidevice.comm.errors import (BackendUnavailable, CollectiveAborted, CollectiveError,
                                           CollectiveTimeout)
from comfy.multidevice.comm.hccl import HcclBackend
from comfy.multidevice.comm.nccl import NcclBackend
from comfy.multidevice.comm.peer import PeerCopyBackend
from comfy.multidevice.comm.protocol import Backend
from comfy.multidevice.comm.settings import (BACKEND_ENV, backend_from_env, check_timeout, RUN_TIMEOUT_ENV,
                                             run_timeout_from_env, TIMEOUT_ENV, timeout_from_env,
                                             VALID_BACKENDS)
from comfy.multidevice.devices import resolve_device, set_thread_device

log = logging.getLogger(__name__)

ABANDON_GRACE_MAX_S = 10.0  # enough for a busy rank to finish its current block of the real H3
_INTERRUPT_POLL_S = 0.05  # how often run() looks at ComfyUI's Cancel flag

_abandoned_coordinators = 0  # how many coordinators closed themselves after a stuck rank / an abort
_abandoned_lock = threading.Lock()


def abandoned_coordinator_count() -> int:
    """Changes whenever a coordinator is closed after abandoning ranks or aborting its
    communicators: the node uses it as its fingerprint, so ComfyUI runs it again (and it builds
    a fresh coordinator) instead of reusing cached outputs bound to the closed one."""
    return _abandoned_coordinators


def _open_backend(name: str, coordinator: "SequenceParallelCoordinator") -> Backend:
    if name == "peer":
        return PeerCopyBackend(coordinator)
    if name == "hccl":
        return HcclBackend(coordinator)
    if name == "nccl":
        return NcclBackend(coordinator)
    raise ValueError(f"unknown backend {name!r}; valid values: {', '.join(VALID_BACKENDS)}")


def describe_error(exc: BaseException) -> str:
    """"TypeName: message", also for an exception whose __str__ itself raises."""
    try:
        text = str(exc)
    except Exception as err:  # noqa: BLE001 - a broken __str__ must not kill a rank thread
        text = f"(its message could not be read: str() raised {type(err).__name__})"
    return f"{type(exc).__name__}: {text}"


def native_backend_for(devices: Sequence[torch.device]) -> str | None:
    kinds = {d.type for d in devices}
    if kinds == {"npu"}:
        return "hccl"
    if kinds == {"cuda"}:
        return "nccl"
    return None


# ----------------------------------------------------------------------------- coordinator

class _RankWorker(threading.Thread):
    def __init__(self, coordinator: "SequenceParallelCoordinator", rank: int):
        super().__init__(name=f"sp-rank-{rank}", daemon=True)
        self.coordinator = coordinator
        self.rank = rank
        self.jobs: queue.Queue = queue.Queue()

    def run(self):
        device = self.coordinator.devices[self.rank]
        try:
            set_thread_device(device)
        except Exception as exc:  # surfaces on the first job instead of killing the thread silently
            init_error = exc
        else:
            init_error = None
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args, grad_modes, done = job
            if init_error is not None:
                done(self.rank, None, init_error)
                continue
            grad, inference = grad_modes
            try:
                # Autograd modes are thread-local: every rank runs in the caller's.
                with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                    result = fn(self.rank, self.coordinator.comm(self.rank), *args)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller of run()
                done(self.rank, None, exc)
            else:
                done(self.rank, result, None)


class SequenceParallelCoordinator(SlotCollectives):
    """W rank threads over W devices plus the collectives between them."""

    def __init__(self, devices: Sequence[Any], backend: str | None = None,
                 timeout_s: float | None = None, run_timeout_s: float | None = None, watch_cancel: bool = True):
        """`watch_cancel=False`: ComfyUI's Cancel is never looked at here (a prefetch lane, whose
        runs belong to a forward that stops at its block starts)."""
        if not devices:
            raise ValueError("SequenceParallelCoordinator needs at least one device, got none")
        self.devices = [resolve_device(d) for d in devices]
        self.world_size = len(self.devices)
        self.timeout_s = check_timeout(timeout_s) if timeout_s is not None else timeout_from_env()
        self.run_timeout_s = (check_timeout(run_timeout_s, "run_timeout_s") if run_timeout_s is not None
                              else run_timeout_from_env())
        self.watch_cancel = watch_cancel
        requested = backend_from_env(backend)
        self.requested_backend = requested
        self._init_collectives(self.timeout_s)
        self._run_lock = threading.Lock()
        self._closed = False
        self._last_run_failed = False  # then close() aborts the communicators instead of destroying them
        self.broken_reason: str | None = None  # set when ranks were abandoned
        # How long ranks get to stop once told to (a failure, a Cancel) before they are abandoned.
        self.abandon_grace_s = min(self.timeout_s, ABANDON_GRACE_MAX_S)
        self.fallback_reason: str | None = None
        self.backend = self._choose_backend(requested)
        self.backend_name = self.backend.name
        self._workers = [_RankWorker(self, r) for r in range(self.world_size)]
        for w in self._workers:
            w.start()
        log.info("multi-device coordinator: %d rank(s) on %s, backend %s",
                 self.world_size, ", ".join(map(str, self.devices)), self.backend_name)

    # -- backend choice
    def _choose_backend(self, requested: str):
        if requested != "auto":
            try:
                return _open_backend(requested, self)
            except BackendUnavailable:
                raise
            except Exception as exc:
                raise BackendUnavailable(f"backend {requested!r} could not start: {exc}") from exc
        native = native_backend_for(self.devices)
        if native is None:
            return PeerCopyBackend(self)
        try:
            return _open_backend(native, self)
        except Exception as exc:  # auto: one warning with the cause, then the fallback
            self.fallback_reason = f"{native} unavailable ({exc})"
            log.warning("multi-device backend auto: %s; using peer-copy instead. "
                        "Set %s=%s to make this an error.", self.fallback_reason, BACKEND_ENV, native)
            return PeerCopyBackend(self)

    # -- running work on the ranks
    def run(self, fn: Callable[..., Any], *per_rank_args: Sequence[Any],
            cancel_at_block_starts: bool = False) -> list:
        """Run fn(rank, comm, *args_of_rank) on every rank thread; return the results by rank.

        Each entry of per_rank_args is a sequence with one item per rank. Every rank runs in the
        caller's grad / inference mode. The first rank error is re-raised here (annotated with
        its rank) once every rank has stopped.

        This call never waits on a rank forever: once a rank has failed, or ComfyUI's Cancel was
        pressed, or a rank has finished while another has neither returned nor reached a
        collective for `timeout_s`, or no rank has returned or reached a collective for
        `run_timeout_s` (the watchdog), the others get `abandon_grace_s` to stop. A rank that still
        has not returned is abandoned (its daemon thread and its memory stay until it returns by
        itself), the coordinator is closed, and the error is raised; `closed` tells the next user
        to build a fresh coordinator. A Cancel that every rank obeyed leaves it usable and raises
        ComfyUI's own InterruptProcessingException. With `cancel_at_block_starts` (a DiT forward)
        this call does not look at the flag: the ranks stop on a Cancel by themselves, together as
        a block starts (comfy_cancel.py `BlockCancel` raising CancelledAtBlock on every rank);
        nothing is aborted, and ComfyUI's interrupt is raised the same way. With a library
        backend that can abort (NCCL), a communicator that reports an error, or ranks inside a
        library collective for `timeout_s`, end the run the same way at once: the communicators
        are aborted (the ranks inside return) and the coordinator is closed; abandoned ranks'
        communicators are aborted too (comm/abort.py).

        fn must not call run() on this same coordinator (it would wait for itself): that raises
        CollectiveError at once.
        """
        self._check_open()
        caller = threading.current_thread()
        if isinstance(caller, _RankWorker) and caller.coordinator is self:
            raise CollectiveError(
                f"run() was called from inside a function that this coordinator runs (on rank "
                f"{caller.rank}'s thread); it would wait for itself forever. Inside a rank, use the "
                "comm argument's collectives, or call the inner function directly")
        for i, arg in enumerate(per_rank_args):
            if len(arg) != self.world_size:
                raise ValueError(f"run(): per-rank argument {i} has {len(arg)} items for "
                                 f"{self.world_size} ranks")
        with self._run_lock:
            self._start_in_step()
            results: list[Any] = [None] * self.world_size
            errors: list[tuple[float, int, BaseException]] = []
            running = set(range(self.world_size))
            finished = threading.Condition()

            def done(rank, result, exc):
                with finished:
                    if rank not in running:  # an abandoned rank came back after run() gave up
                        return
                    self._last_activity = time.monotonic()
                    if isinstance(exc, CancelledAtBlock):  # every rank stops at this block start
                        errors.append((time.monotonic(), rank, exc))
                    elif exc is not None:
                        errors.append((time.monotonic(), rank, exc))
                        self._barrier.abort(f"rank {rank} failed: {describe_error(exc)}")
                    else:
                        results[rank] = result
                    running.discard(rank)
                    finished.notify_all()

            grad_modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            self._last_activity = time.monotonic()
            for r, worker in enumerate(self._workers):
                worker.jobs.put((fn, tuple(a[r] for a in per_rank_args), grad_modes, done))
            with finished:
                cancel = self._wait_for_ranks(finished, running, errors, fn,
                                              self.watch_cancel and not cancel_at_block_starts)
                stuck = sorted(running)
                running.clear()  # from here on, a late rank's result is dropped
            self._release_slots()
            stopped = [e for _, _, e in errors if isinstance(e, CancelledAtBlock)]
            failures = [e for e in errors if not isinstance(e[2], CancelledAtBlock)]
            if stopped and not failures and not stuck:  # a Cancel every rank obeyed at one block
                errors = []
                cancel = cancel or (0, next((e.module for e in stopped if e.module is not None), None))
            elif failures:
                errors = failures
            self._last_run_failed = bool(errors)
            if stuck:
                self._abandon(stuck, fn)
            elif getattr(self.backend, "aborted", None) is not None:  # the watch aborted them
                self._retire(set())
            if cancel is not None:  # seen before any error: the errors are its consequences
                raise_cancel(cancel[1])
            if errors:
                exc = self._first_error(errors)
                if stuck:
                    exc.add_note(f"rank(s) {stuck} did not stop and were abandoned; this "
                                 "coordinator is closed")
                raise exc
            return results

    def _wait_for_ranks(self, finished: threading.Condition, running: set, errors: list, fn, watch_cancel: bool):
        """Wait (holding `finished`) until every rank has returned or the ones left must be
        abandoned. With `watch_cancel`, polls ComfyUI's interrupt flag; returns (time, module) of
        a Cancel, else None.
        """
        grace = self.abandon_grace_s
        cancel = None
        give_up_at = None   # set once the ranks left have been told to stop
        stall_since = None  # first time a rank finished while others still ran
        while running:
            now = time.monotonic()
            if give_up_at is None:
                if errors:
                    give_up_at = errors[0][0] + grace
                elif (fault := self._library_fault()) is not None:
                    # A rank stuck inside the library never comes back by itself: abort it there.
                    errors.append((now, fault[0], fault[1]))
                    reason = describe_error(fault[1])
                    self._barrier.abort(reason)
                    self._abort_communicators(reason)
                    give_up_at = now + grace
                elif watch_cancel and cancel is None and (module := cancel_requested()) is not None:
                    cancel = (now, module)
                    self._barrier.abort("cancelled from ComfyUI (interrupt)")
                    give_up_at = now + grace
                elif len(running) < self.world_size:
                    stall_since = stall_since or now
                    if now - stall_since > self.timeout_s and self._barrier.waiting == 0:
                        # The finished ranks wait for the others as at a collective.
                        left = sorted(running)
                        reason = (f"rank(s) {left} neither returned nor reached a collective "
                                  f"{self.timeout_s:g}s after the other ranks had finished "
                                  f"(raise {TIMEOUT_ENV} if they are just slow)")
                        errors.append((now, left[0], CollectiveTimeout(reason)))
                        self._barrier.abort(reason)
                        give_up_at = now + grace
                if give_up_at is None and now - self._last_activity > self.run_timeout_s \
                        and self._barrier.waiting == 0:  # a rank waiting has its own timeout
                    reason = (f"no rank returned or reached a collective for {self.run_timeout_s:g}s "
                              f"(running {getattr(fn, '__qualname__', repr(fn))}; raise "
                              f"{RUN_TIMEOUT_ENV} if the work between two collectives is just "
                              "that slow)")
                    errors.append((now, None, CollectiveTimeout(reason)))
                    self._barrier.abort(reason)
                    give_up_at = now + grace
            if give_up_at is not None and now >= give_up_at:
                return cancel
            finished.wait(_INTERRUPT_POLL_S if give_up_at is None
                          else min(_INTERRUPT_POLL_S, give_up_at - now))
        return cancel

    def _abandon(self, ranks: list[int], fn) -> None:
        """Give up on ranks that did not stop: close this coordinator without waiting for them."""
        what = getattr(fn, "__qualname__", repr(fn))
        places = ", ".join(f"rank {r} on {self.devices[r]}" for r in ranks)
        self.broken_reason = (f"{places} did not stop within {self.abandon_grace_s:g}s of being "
                              f"told to (running {what}) and {'was' if len(ranks) == 1 else 'were'} "
                              "abandoned")
        log.error("multi-device: %s; its thread and the memory it holds stay until it returns by "
                  "itself. This coordinator is closed; the next use builds a new one.",
                  self.broken_reason)
        self._retire(set(ranks))

    def _retire(self, abandoned: set) -> None:
        """Close for good after ranks were abandoned or the communicators aborted, and count it
        (abandoned_coordinator_count), so the node builds a fresh coordinator."""
        if self.broken_reason is None:
            self.broken_reason = f"its {self.backend_name} communicators were aborted ({self.backend.aborted})"
        self._close(abandoned=abandoned)
        global _abandoned_coordinators
        with _abandoned_lock:
            _abandoned_coordinators += 1

    def _library_fault(self):
        """(rank, error) when the backend's library reports an error or a rank stuck inside it
        (comm/abort.py); None when all is well or the backend has no such watch."""
        watch = getattr(self.backend, "collective_fault", None)
        return None if watch is None else watch(self.timeout_s)

    def _abort_communicators(self, reason: str) -> bool:
        """Abort the backend's communicators instead of destroying them: a rank inside a call
        returns, a kernel waiting for a peer stops, the cards are free of them. False when the
        backend cannot (peer has none; a library without an abort call)."""
        abort = getattr(self.backend, "abort", None)
        return abort is not None and abort(reason)

    @staticmethod
    def _first_error(errors):
        # The root cause beats the "cancelled because rank k failed" errors it triggered.
        errors.sort(key=lambda e: (isinstance(e[2], CollectiveAborted), e[0]))
        _, rank, exc = errors[0]
        if rank is not None and getattr(exc, "rank", None) is None:
            try:
                exc.rank = rank
                exc.add_note(f"(raised on multi-device rank {rank})")
            except AttributeError:
                pass
        return exc

    # -- lifetime
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self):
        if self._closed:
            why = f" after {self.broken_reason}" if self.broken_reason else ""
            raise RuntimeError(f"this SequenceParallelCoordinator was closed{why}; create a new one")

    def close(self) -> None:
        self._close(abandoned=set())

    def _close(self, abandoned: set) -> None:
        if self._closed:
            return
        self._closed = True
        self._barrier.abort("coordinator closed")
        # After abandoned ranks or a failed run a communicator may be stuck (a rank inside a
        # call, a kernel waiting for a peer): abort it, before the joins, instead of destroying it.
        aborted = (abandoned or self._last_run_failed) and self._abort_communicators(
            self.broken_reason or "the coordinator closed after a failed run")
        for w in self._workers:
            w.jobs.put(None)
        for w in self._workers:
            if w.rank not in abandoned:
                w.join(timeout=self.timeout_s)
        if aborted:
            return
        if abandoned and self.backend.name != "peer":
            # A native communicator cannot be destroyed under a thread still inside a call.
            log.warning("multi-device: the %s communicator of the abandoned coordinator is left "
                        "open (its library cannot abort it)", self.backend.name)
            return
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


_no_lane_logged: set[str] = set()  # the backends whose "no prefetch lane" was logged


def lane_allowed(coordinator: SequenceParallelCoordinator) -> bool:
    """Whether a second coordinator may run collectives on `coordinator`'s cards while it runs
    its own: not with a card library (HCCL, NCCL), which allows one collective per card at a
    time across all communicators (CARDS.md); with peer-copy, yes. Logs once per backend when not."""
    if not coordinator.backend.one_collective_per_device:
        return True
    if coordinator.backend_name not in _no_lane_logged:
        _no_lane_logged.add(coordinator.backend_name)
        log.info("sharded DiT weights: no prefetch with the %s backend: a card runs one collective "
                 "at a time, so each block is gathered on the rank's own communicator just before "
                 "it runs, in the same order on every rank", coordinator.backend_name)
    return False


def prefetch_lane(coordinator: SequenceParallelCoordinator) -> SequenceParallelCoordinator | None:
    """A second coordinator over `coordinator`'s cards, with its backend and timeout: the lane
    on which sharded DiT weights gather block i+1 while `coordinator` runs block i
    (weights/block_shards.py); None where `lane_allowed` says no (HCCL, NCCL), so the gathers
    go through the rank's own communicator. The caller closes it (or keeps it, roles/apply.py)."""
    if not lane_allowed(coordinator):
        return None
    return SequenceParallelCoordinator(coordinator.devices, backend=coordinator.backend_name,
                                       timeout_s=coordinator.timeout_s, watch_cancel=False)
