"""The coordinator: W rank threads in one process, the collectives between them, backend choice.

Over 500 lines because its one job is one state machine: the rank threads, the barrier
slots, the watchdog and the collectives read and write the same per-coordinator state.

One process drives W devices ("ranks"), one persistent worker thread per rank.
Collectives (`exchange` = all-gather-V, `all_to_all_v`, `all_reduce`) go through a backend:
  peer  - shared slots + barrier + each shard copied once into the output (always works)
  hccl  - libhccl.so through ctypes (hccl.py)
  nccl  - libnccl.so.2 through ctypes (nccl.py)
  auto  - hccl on NPUs, nccl on CUDA, peer on CPU; falls back to peer with one warning.

Every collective first passes an abortable barrier that publishes each rank's
tensor shapes. A rank that fails aborts the barrier, so no other rank blocks on
it; a rank that never arrives makes the barrier time out with its rank named.
A run in which no rank returns and none reaches a collective for `run_timeout_s`
(COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S, default 3600) is ended by a watchdog. A rank stuck inside
a library collective is ended by aborting the communicators (comm/abort.py).

Every collective also adds to per-rank byte counters (`byte_counts()`), counted here from
the shapes, whatever the backend: the logical bytes each rank sends to / receives from
*other* ranks (a rank's own chunk never counts), not what a library's algorithm moves.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

import torch

from comfy.multidevice.comfy_cancel import cancel_requested, raise_cancel
from comfy.multidevice.comm.barrier import AbortableBarrier
from comfy.multidevice.comm.checks import (all_to_all_arguments, check_all_reduce_metadata,
                                           check_all_to_all_metadata, check_all_to_all_plans,
                                           check_exchange_metadata, check_recv_splits, planned_metas)
from comfy.multidevice.comm.errors import (BackendUnavailable, CollectiveAborted, CollectiveError,
                                           CollectiveTimeout)
from comfy.multidevice.comm.hccl import HcclBackend
from comfy.multidevice.comm.layout import (alone_all_to_all, chunk_shape, concat_received, normalize_dims, numel,
                                           pack_chunks, planned_chunk_shapes, same_chunk_shape, ShardMeta)
from comfy.multidevice.comm.nccl import NcclBackend
from comfy.multidevice.comm.peer import PeerCopyBackend
from comfy.multidevice.comm.protocol import Backend, VALID_REDUCE_OPS
from comfy.multidevice.comm.settings import (BACKEND_ENV, backend_from_env, check_timeout, RUN_TIMEOUT_ENV,
                                             run_timeout_from_env, TIMEOUT_ENV, timeout_from_env,
                                             VALID_BACKENDS)
from comfy.multidevice.comm.traffic import (all_reduce_traffic, all_to_all_traffic, exchange_traffic,
                                            TrafficCounter)
from comfy.multidevice.devices import resolve_device, set_thread_device, synchronize

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


# ----------------------------------------------------------------------------- rank comm

class RankComm:
    """The per-rank view of a coordinator that model code talks to.

    comfy/multidevice/comm/torch_dist.py offers the same methods over torch.distributed, so code written
    against RankComm runs unchanged in one process or across processes.
    """

    def __init__(self, coordinator: "SequenceParallelCoordinator", rank: int):
        self.coordinator = coordinator
        self.rank = rank
        self.world_size = coordinator.world_size
        self.device = coordinator.devices[rank]

    def exchange(self, tensors, cat_dims, shard_sizes=None, workspace=None):
        return self.coordinator.exchange(self.rank, tensors, cat_dims, shard_sizes, workspace)

    def all_to_all_v(self, tensors, send_splits, split_dim, cat_dim=None, workspace=None, recv_splits=None,
                     write_own=None):
        return self.coordinator.all_to_all_v(self.rank, tensors, send_splits, split_dim, cat_dim, workspace,
                                             recv_splits, write_own)

    def all_reduce(self, tensor, op="sum"):
        return self.coordinator.all_reduce(self.rank, tensor, op)

    def byte_counts(self) -> dict:
        return self.coordinator.byte_counts()[self.rank]

    def barrier(self):
        self.coordinator.barrier(self.rank)

    def __repr__(self):
        return f"RankComm(rank={self.rank}/{self.world_size}, device={self.device})"


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


class SequenceParallelCoordinator:
    """W rank threads over W devices plus the collectives between them."""

    def __init__(self, devices: Sequence[Any], backend: str | None = None,
                 timeout_s: float | None = None, run_timeout_s: float | None = None):
        if not devices:
            raise ValueError("SequenceParallelCoordinator needs at least one device, got none")
        self.devices = [resolve_device(d) for d in devices]
        self.world_size = len(self.devices)
        self.timeout_s = check_timeout(timeout_s) if timeout_s is not None else timeout_from_env()
        self.run_timeout_s = (check_timeout(run_timeout_s, "run_timeout_s") if run_timeout_s is not None
                              else run_timeout_from_env())
        self._last_activity = time.monotonic()  # a rank returned or reached a collective (watchdog)
        requested = backend_from_env(backend)
        self.requested_backend = requested
        self._barrier = AbortableBarrier(self.world_size, self.timeout_s)
        self._meta_slots: list[list[Any]] = [[None] * self.world_size for _ in range(2)]
        self._data_slots: list[list[Any]] = [[None] * self.world_size for _ in range(2)]
        # Which collective each rank entered, by parity: ranks that call different
        # collectives get a clear error instead of reading each other's unrelated slots.
        self._op_slots: list[list[Any]] = [[None] * self.world_size for _ in range(2)]
        self._parity = [0] * self.world_size
        self._comms = [RankComm(self, r) for r in range(self.world_size)]
        self._traffic = [TrafficCounter() for _ in range(self.world_size)]  # each rank writes its own
        self._run_lock = threading.Lock()
        self._closed = False
        self._last_run_failed = False  # then close() aborts the communicators instead of destroying them
        self.broken_reason: str | None = None  # set when ranks were abandoned
        # How long ranks get to stop once told to (a failure, a Cancel) before they are abandoned.
        self.abandon_grace_s = min(self.timeout_s, ABANDON_GRACE_MAX_S)
        self.fallback_reason: str | None = None
        self._a2a_fallback_logged = False
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
    def comm(self, rank: int) -> RankComm:
        return self._comms[rank]

    def run(self, fn: Callable[..., Any], *per_rank_args: Sequence[Any]) -> list:
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
        ComfyUI's own InterruptProcessingException. With a library backend that can abort (NCCL),
        a communicator that reports an error, or ranks inside a library collective for
        `timeout_s`, end the run the same way at once: the communicators are aborted (the ranks
        inside return) and the coordinator is closed; abandoned ranks' communicators are aborted
        too (comm/abort.py).

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
            # A failed run can leave ranks at different collective counts: start in step.
            self._barrier.reset()
            self._parity = [0] * self.world_size
            for slots in (*self._meta_slots, *self._data_slots, *self._op_slots):
                slots[:] = [None] * self.world_size
            results: list[Any] = [None] * self.world_size
            errors: list[tuple[float, int, BaseException]] = []
            running = set(range(self.world_size))
            finished = threading.Condition()

            def done(rank, result, exc):
                with finished:
                    if rank not in running:  # an abandoned rank came back after run() gave up
                        return
                    self._last_activity = time.monotonic()
                    if exc is not None:
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
                cancel = self._wait_for_ranks(finished, running, errors, fn)
                stuck = sorted(running)
                running.clear()  # from here on, a late rank's result is dropped
            for slots in (*self._meta_slots, *self._data_slots):  # don't pin the last tensors
                slots[:] = [None] * self.world_size
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

    def _wait_for_ranks(self, finished: threading.Condition, running: set, errors: list, fn):
        """Wait (holding `finished`) until every rank has returned or the ones left must be
        abandoned. Polls ComfyUI's interrupt flag; returns (time, module) of a Cancel, else None.
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
                elif cancel is None and (module := cancel_requested()) is not None:
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

    # -- collectives (called from rank threads)
    def barrier(self, rank: int, what: str = "barrier") -> None:
        self._last_activity = time.monotonic()
        if self.world_size > 1:
            self._enter(rank, "barrier", None, None, what)

    def _enter(self, rank: int, op: str, meta: Any, data: Any, what: str | None = None):
        """Publish this rank's part of collective `op` and wait for every rank.

        Returns this collective's (meta slot, data slot). Raises CollectiveError on every
        rank when the ranks entered different collectives (a bug in the caller's code).
        """
        parity = self._parity[rank]
        self._parity[rank] ^= 1
        meta_slot, data_slot = self._meta_slots[parity], self._data_slots[parity]
        op_slot = self._op_slots[parity]
        # Only a backend whose ranks read each other's tensors needs them published: a library
        # backend's slot would keep a block's K and V alive two collectives past their use.
        shared = data is not None and self.backend.reads_peer_memory
        meta_slot[rank], data_slot[rank], op_slot[rank] = meta, data if shared else None, op
        if shared:
            # Other ranks read our tensors directly: finish them first.
            synchronize(self.devices[rank])
        self._barrier.wait(rank, what or op)
        # every rank is past the previous collective now, so none still reads what this rank
        # published for it: let those tensors go (otherwise held until this slot is reused)
        self._data_slots[parity ^ 1][rank] = None
        if op_slot.count(op) != self.world_size:  # C-level scan: this runs on every collective
            calls = ", ".join(f"rank {r}: {o}" for r, o in enumerate(op_slot))
            raise CollectiveError(
                f"ranks entered different collectives ({calls}); every rank must call the same "
                "collectives in the same order")
        return meta_slot, data_slot

    def exchange(self, rank: int, tensors: Sequence[torch.Tensor],
                 cat_dims: int | Sequence[int], shard_sizes: Sequence[int] | None = None,
                 workspace: dict | None = None) -> list[torch.Tensor]:
        """All-gather-V: return, per tensor, the concat of every rank's shard along its cat dim
        (a view in the layout the backend gathered into; not contiguous when the cat dim is not
        the outermost). `shard_sizes`: every rank's length along the cat dims, from the shard
        plan; then a library backend makes its buffers before the ranks meet and they meet once.
        `workspace`: buffers the backend may keep for this call site (see `Communicator`).
        """
        self._last_activity = time.monotonic()
        tensors = list(tensors)
        dims = normalize_dims(tensors, cat_dims)
        if self.world_size == 1:
            return tensors
        mine = [ShardMeta(tuple(t.shape), t.dtype) for t in tensors]
        planned = prepared = None
        if shard_sizes is not None:
            planned = planned_metas(tensors, dims, shard_sizes, rank)  # ValueError before anything
            prepared = self.backend.prepare_all_gather_v(rank, tensors, dims, planned, workspace)
        # The plan travels with the shapes, so every rank checks every rank's against them.
        meta_slot, data_slot = self._enter(rank, "exchange", (mine, planned), tensors)
        metas = [m[0] for m in meta_slot]
        check_exchange_metadata(metas, dims)
        if any(m[1] != metas for m in meta_slot if m[1] is not None) or \
                len({m[1] is None for m in meta_slot}) != 1:
            raise CollectiveError(
                "exchange: the ranks' shard_sizes disagree with each other or with the shapes they "
                f"passed ({[tuple(m[0][0].shape) for m in meta_slot]}); every rank must pass the "
                "same shard plan, or none")
        out = self.backend.all_gather_v(rank, tensors, dims, metas, data_slot, prepared, workspace)
        sent, received = exchange_traffic(metas, rank)
        self._count(rank, "exchange", sent=sent, received=received)
        return out

    def all_to_all_v(self, rank: int, tensors: torch.Tensor | Sequence[torch.Tensor],
                     send_splits: Sequence[int], split_dim: int, cat_dim: int | None = None,
                     workspace: dict | None = None,
                     recv_splits: Sequence[int] | None = None,
                     write_own: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor | list[torch.Tensor]:
        """All-to-all with per-rank sizes: split each tensor along `split_dim` into
        `send_splits[j]`-long chunks, send chunk j to rank j, and return the chunks this rank
        received, in source-rank order, concatenated along `cat_dim` (default `split_dim`).

        Ranks may hold different shapes along `cat_dim` and send different sizes; the chunks
        arriving at one rank must agree outside `cat_dim`, except that a zero split sends
        nothing and its chunk is left out (a sub-group exchange through one call). A single
        tensor in, a single out. `recv_splits`: see `Communicator.all_to_all_v`; the shapes
        travel with every call here anyway, so they are only checked against them.
        `write_own`: see `Communicator.all_to_all_v`.
        """
        self._last_activity = time.monotonic()
        single, tensors, split_dim, cat_dim, splits = all_to_all_arguments(
            tensors, send_splits, split_dim, cat_dim, self.world_size)
        if self.world_size == 1:
            out = alone_all_to_all(tensors, write_own)
            return out[0] if single else out
        plan = check_recv_splits(recv_splits, self.world_size)
        native = self.backend.has_all_to_all_v
        options = {}
        if plan is not None and native and self.backend.prepares_all_to_all_v:
            # the shapes are known from the plan: a library backend makes its buffers before
            # the ranks meet, and they meet once (the plan is checked before any library call;
            # one that does not even fit this rank's own chunk is left to that check)
            received = planned_chunk_shapes([t.shape for t in tensors], splits, plan, split_dim, cat_dim, rank)
            own = [chunk_shape(t.shape, split_dim, splits[rank]) for t in tensors]
            if all(same_chunk_shape(r[rank], o) for r, o in zip(received, own)):
                options["prepared"] = self.backend.prepare_all_to_all_v(rank, tensors, splits, received,
                                                                         split_dim, workspace, write_own)
        meta_slot, data_slot = self._enter(
            rank, "all_to_all_v", ([ShardMeta(tuple(t.shape), t.dtype) for t in tensors], splits, plan), tensors)
        metas = [m[0] for m in meta_slot]
        all_splits = [m[1] for m in meta_slot]
        check_all_to_all_metadata(metas, all_splits, split_dim, cat_dim)
        check_all_to_all_plans(metas, all_splits, [m[2] for m in meta_slot], split_dim, cat_dim)
        if native:
            out = self.backend.all_to_all_v(rank, tensors, metas, all_splits, split_dim, cat_dim,
                                            data_slot, workspace, write_own, **options)
        else:
            out = self._all_to_all_v_by_gather(rank, tensors, metas, all_splits, split_dim, cat_dim,
                                               data_slot, write_own)
        sent, received = all_to_all_traffic(metas, all_splits, split_dim, rank)
        self._count(rank, "all_to_all_v", sent=sent, received=received)
        return out[0] if single else out

    def _all_to_all_v_by_gather(self, rank, tensors, metas, splits, split_dim, cat_dim, slot, write_own=None):
        """All-to-all for a backend that only has all-gather-V: every rank gathers every
        rank's packed send buffer and keeps its own chunks. Exact; moves W times the bytes."""
        if not self._a2a_fallback_logged:
            self._a2a_fallback_logged = True
            log.warning("rank %d: backend %s has no all-to-all: all_to_all_v all-gathers the packed "
                        "send buffers instead (exact, moves %dx the bytes)", rank, self.backend_name,
                        self.world_size)
        out = []
        for t, tensor in enumerate(tensors):
            flat = pack_chunks(tensor, splits[rank], split_dim)
            flat_metas = [[ShardMeta((numel(m[t].shape),), m[t].dtype)] for m in metas]
            gathered = self.backend.all_gather_v(rank, [flat], [0], flat_metas, slot)[0]
            parts, base = [], 0
            for src in range(self.world_size):
                sizes = [numel(chunk_shape(metas[src][t].shape, split_dim, n)) for n in splits[src]]
                offset = base + sum(sizes[:rank])
                shape = chunk_shape(metas[src][t].shape, split_dim, splits[src][rank])
                part = gathered.narrow(0, offset, sizes[rank]).view(shape)
                if src == rank and write_own is not None and sizes[rank]:
                    part = torch.empty_like(part)  # the sent own chunk was never written
                    write_own(t, part)
                parts.append(part)
                base += sum(sizes)
            out.append(concat_received(parts, [s[rank] for s in splits], cat_dim))
        return out

    def all_reduce(self, rank: int, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in VALID_REDUCE_OPS:
            raise ValueError(f"all_reduce op {op!r} is not supported; use one of {VALID_REDUCE_OPS}")
        self._last_activity = time.monotonic()
        if self.world_size == 1:
            return tensor.clone()
        meta_slot, data_slot = self._enter(
            rank, f"all_reduce {op}", [ShardMeta(tuple(tensor.shape), tensor.dtype)], tensor)
        check_all_reduce_metadata([m[0] for m in meta_slot])
        out = self.backend.all_reduce(rank, tensor, op, data_slot)
        moved = all_reduce_traffic(tensor, self.world_size)
        self._count(rank, "all_reduce", sent=moved, received=moved)
        return out

    # -- byte counters
    def _count(self, rank: int, op: str, sent: int, received: int) -> None:
        self._traffic[rank].add(op, sent, received)

    def byte_counts(self) -> list[dict]:
        """Per rank: {"sent", "received", "calls", "by_op": {op: {"sent", "received", "calls"}}}.

        Bytes are logical payload to/from other ranks (see the module docstring), counted
        since the coordinator was made or `reset_byte_counts()` was last called.
        """
        return [counter.summary() for counter in self._traffic]

    def reset_byte_counts(self) -> None:
        """Zero the counters; call it between runs, not while ranks are inside collectives."""
        self._traffic = [TrafficCounter() for _ in range(self.world_size)]

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
                                       timeout_s=coordinator.timeout_s)
