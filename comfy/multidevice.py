"""Sequence-parallel coordinator: rank threads, collectives, backend choice.

One process drives W devices ("ranks"), one persistent worker thread per rank.
Collectives (`exchange` = all-gather-V, `all_to_all_v`, `all_reduce`) go through a backend:
  peer  - shared slots + barrier + tensor.to(device) + torch.cat (always works)
  hccl  - libhccl.so through ctypes (comfy/multinpu.py)
  nccl  - libnccl.so.2 through ctypes (comfy/multicuda.py)
  auto  - hccl on NPUs, nccl on CUDA, peer on CPU; falls back to peer with one warning.

Every collective first passes an abortable barrier that publishes each rank's
tensor shapes. A rank that fails aborts the barrier, so no other rank blocks on
it; a rank that never arrives makes the barrier time out with its rank named.

Every collective also adds to per-rank byte counters (`byte_counts()`), counted here from
the shapes, whatever the backend: the logical bytes each rank sends to / receives from
*other* ranks (a rank's own chunk never counts), not what a library's algorithm moves.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)

BACKEND_ENV = "COMFYUI_MULTI_DEVICE_BACKEND"
TIMEOUT_ENV = "COMFYUI_MULTI_DEVICE_TIMEOUT_S"
VALID_BACKENDS = ("auto", "hccl", "nccl", "peer")
VALID_REDUCE_OPS = ("sum", "max")
DEFAULT_TIMEOUT_S = 600.0  # a rank may load weights for minutes before its first collective


class CollectiveError(RuntimeError):
    """A collective could not complete (another rank failed, timed out, or inputs disagree)."""


class CollectiveAborted(CollectiveError):
    """Raised in a rank whose collective was cancelled because another rank failed."""


class CollectiveTimeout(CollectiveError):
    """Raised when some ranks did not reach a collective within the timeout."""


class BackendUnavailable(RuntimeError):
    """A forced backend cannot start (library missing, symbols missing, init failed)."""


# ----------------------------------------------------------------------------- devices

def resolve_device(spec: Any) -> torch.device:
    """'npu:1' / 'cuda:0' / 'cpu' / torch.device -> torch.device (imports torch_npu for npu)."""
    if isinstance(spec, torch.device):
        return spec
    text = str(spec)
    if text.startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the 'npu' device type)
        except ImportError as exc:
            raise ValueError(
                f"device {text!r} needs torch_npu, which is not installed; "
                "run install_deps_minimax_h3.sh on the Ascend host or use cuda/cpu devices") from exc
    try:
        return torch.device(text)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {text!r}: use 'npu:i', 'cuda:i' or 'cpu'") from exc


def set_thread_device(device: torch.device) -> None:
    """Make `device` current for the calling thread (NPU/CUDA keep a per-thread current device)."""
    if device.type == "npu":
        torch.npu.set_device(device)
    elif device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "npu":
        torch.npu.current_stream(device).synchronize()
    elif device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def backend_from_env(value: str | None = None) -> str:
    name = (value if value is not None else os.environ.get(BACKEND_ENV, "auto")).strip().lower() or "auto"
    if name not in VALID_BACKENDS:
        raise ValueError(
            f"unknown multi-device backend {name!r} (from {BACKEND_ENV} or the backend option); "
            f"valid values: {', '.join(VALID_BACKENDS)}")
    return name


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be positive")
    return value


# ----------------------------------------------------------------------------- barrier

class AbortableBarrier:
    """A reusable W-party barrier that can be aborted and that names the absent ranks on timeout.

    Each waiter sleeps on a lock of its own that the last arrival releases, so a wake-up
    needs no shared lock: with W rank threads on few cores, that second round of contention
    is most of the cost of a small collective.
    """

    def __init__(self, parties: int, timeout_s: float):
        self.parties = parties
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._arrived: set[int] = set()
        self._sleepers: list = []
        self._generation = 0
        self._abort_reason: str | None = None

    def wait(self, rank: int, what: str = "collective") -> None:
        with self._lock:
            if self._abort_reason is not None:
                raise CollectiveAborted(f"rank {rank}: {what} cancelled: {self._abort_reason}")
            generation = self._generation
            self._arrived.add(rank)
            if len(self._arrived) == self.parties:
                self._arrived.clear()
                self._generation += 1
                self._wake_all_locked()
                return
            sleeper = threading.Lock()
            sleeper.acquire()
            self._sleepers.append(sleeper)
        woken = sleeper.acquire(timeout=self.timeout_s)
        if self._generation != generation:
            return
        with self._lock:
            if self._generation != generation:  # released just after the timeout expired
                return
            if not woken and self._abort_reason is None:
                missing = sorted(set(range(self.parties)) - self._arrived)
                reason = (f"{what} timed out after {self.timeout_s:g}s waiting for rank(s) "
                          f"{missing} (raise {TIMEOUT_ENV} if they are just slow)")
                self._abort_locked(reason)
                raise CollectiveTimeout(f"rank {rank}: {reason}")
            raise CollectiveAborted(f"rank {rank}: {what} cancelled: {self._abort_reason}")

    def abort(self, reason: str) -> None:
        with self._lock:
            if self._abort_reason is None:
                self._abort_locked(reason)

    def _abort_locked(self, reason: str) -> None:
        self._abort_reason = reason
        self._wake_all_locked()

    def _wake_all_locked(self) -> None:
        sleepers, self._sleepers = self._sleepers, []
        for sleeper in sleepers:
            sleeper.release()

    def reset(self) -> None:
        """Re-arm after an aborted run; only called while no rank is inside a collective."""
        with self._lock:
            self._abort_reason = None
            self._arrived.clear()
            self._wake_all_locked()
            self._generation += 1

    @property
    def aborted(self) -> str | None:
        return self._abort_reason


# ----------------------------------------------------------------------------- metadata

@dataclass(frozen=True)
class ShardMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


def gathered_shape(metas: Sequence[ShardMeta], dim: int) -> tuple[int, ...]:
    shape = list(metas[0].shape)
    shape[dim] = sum(m.shape[dim] for m in metas)
    return tuple(shape)


def check_exchange_metadata(per_rank: Sequence[Sequence[ShardMeta]], dims: Sequence[int]) -> None:
    """Raise the same clear error on every rank when the ranks' shards cannot be concatenated."""
    counts = [len(m) for m in per_rank]
    if len(set(counts)) != 1:
        raise CollectiveError(f"ranks passed different numbers of tensors to exchange: {counts}")
    for i, dim in enumerate(dims):
        first = per_rank[0][i]
        for r, metas in enumerate(per_rank):
            m = metas[i]
            if m.dtype != first.dtype:
                raise CollectiveError(
                    f"exchange tensor {i}: rank {r} has dtype {m.dtype}, rank 0 has {first.dtype}")
            if len(m.shape) != len(first.shape):
                raise CollectiveError(
                    f"exchange tensor {i}: rank {r} has shape {m.shape}, rank 0 has {first.shape}")
            other_r = [s for d, s in enumerate(m.shape) if d != dim]
            other_0 = [s for d, s in enumerate(first.shape) if d != dim]
            if other_r != other_0:
                raise CollectiveError(
                    f"exchange tensor {i}: shapes {first.shape} (rank 0) and {m.shape} (rank {r}) "
                    f"differ outside the concat dim {dim}")


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def nbytes(meta_or_tensor) -> int:
    """Bytes of a ShardMeta or tensor (shape x dtype item size)."""
    return numel(meta_or_tensor.shape) * meta_or_tensor.dtype.itemsize


def displacements(counts: Sequence[int]) -> list[int]:
    """Where each rank's part starts in a rank-major flat buffer (exclusive prefix sums)."""
    out, total = [], 0
    for count in counts:
        out.append(total)
        total += count
    return out


def pack_chunks(tensor: torch.Tensor, sizes: Sequence[int], dim: int) -> torch.Tensor:
    """The chunks of `tensor` along `dim`, each flattened, back to back in one dense buffer."""
    if tensor.is_contiguous() and all(s == 1 for s in tensor.shape[:dim]):
        return tensor.view(-1)  # chunks along the outermost non-trivial dim already are that
    return torch.cat([c.reshape(-1) for c in tensor.split(list(sizes), dim)])


def exchange_traffic(metas: Sequence[Sequence[ShardMeta]], rank: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by `rank` in an all-gather of the shards `metas`."""
    own = sum(nbytes(m) for m in metas[rank])
    everyone = sum(nbytes(m) for shard in metas for m in shard)
    return own * (len(metas) - 1), everyone - own


def check_all_reduce_metadata(metas: Sequence[ShardMeta]) -> None:
    """Raise the same clear error on every rank when the ranks' all-reduce inputs differ."""
    first = metas[0]
    for r, m in enumerate(metas):
        if m != first:
            raise CollectiveError(f"all_reduce: rank {r} has {m.shape}/{m.dtype}, "
                                  f"rank 0 has {first.shape}/{first.dtype}")


class TrafficCounter:
    """Logical bytes one rank sent to / received from other ranks, per collective kind."""

    def __init__(self):
        self._per_op: dict[str, list[int]] = {}  # op -> [sent, received, calls]

    def add(self, op: str, sent: int, received: int) -> None:
        entry = self._per_op.setdefault(op, [0, 0, 0])
        entry[0] += sent
        entry[1] += received
        entry[2] += 1

    def summary(self) -> dict:
        """{"sent", "received", "calls", "by_op": {op: {"sent", "received", "calls"}}}."""
        by_op = {op: {"sent": v[0], "received": v[1], "calls": v[2]} for op, v in self._per_op.items()}
        return {"sent": sum(v[0] for v in self._per_op.values()),
                "received": sum(v[1] for v in self._per_op.values()),
                "calls": sum(v[2] for v in self._per_op.values()),
                "by_op": by_op}


def chunk_shape(shape: Sequence[int], split_dim: int, size: int) -> tuple[int, ...]:
    """Shape of one all-to-all chunk: `shape` with `size` rows along `split_dim`."""
    out = list(shape)
    out[split_dim] = size
    return tuple(out)


def check_send_splits(tensors: Sequence[torch.Tensor], send_splits: Sequence[int], split_dim: int,
                      world_size: int) -> tuple[int, ...]:
    """Validate one rank's all-to-all split sizes locally, before anything is sent."""
    try:
        splits = tuple(int(s) for s in send_splits)
    except (TypeError, ValueError):
        raise ValueError(f"all_to_all_v send_splits must be {world_size} integers, got {send_splits!r}") from None
    if len(splits) != world_size:
        raise ValueError(f"all_to_all_v send_splits {list(splits)} has {len(splits)} entries; "
                         f"give one size per rank ({world_size})")
    if any(s < 0 for s in splits):
        raise ValueError(f"all_to_all_v send_splits {list(splits)} has a negative size")
    for t in tensors:
        if sum(splits) != t.shape[split_dim]:
            raise ValueError(
                f"all_to_all_v send_splits {list(splits)} sum to {sum(splits)} but the tensor of "
                f"shape {tuple(t.shape)} has {t.shape[split_dim]} along split dim {split_dim}; "
                "the splits must cover that dim exactly")
    return splits


def check_all_to_all_metadata(per_rank: Sequence[Sequence[ShardMeta]], splits: Sequence[Sequence[int]],
                              split_dim: int, cat_dim: int) -> None:
    """Raise the same clear error on every rank when the chunks a rank receives cannot be concatenated."""
    counts = [len(m) for m in per_rank]
    if len(set(counts)) != 1:
        raise CollectiveError(f"ranks passed different numbers of tensors to all_to_all_v: {counts}")
    world = len(per_rank)
    for t in range(counts[0]):
        first = per_rank[0][t]
        for i, metas in enumerate(per_rank):
            if metas[t].dtype != first.dtype or len(metas[t].shape) != len(first.shape):
                raise CollectiveError(
                    f"all_to_all_v tensor {t}: rank {i} has {metas[t].shape}/{metas[t].dtype}, "
                    f"rank 0 has {first.shape}/{first.dtype}")
        for j in range(world):  # every chunk sent to rank j must fit next to the others
            sources = [i for i in range(world) if splits[i][j]] or list(range(world))
            ref = sources[0]
            want = chunk_shape(per_rank[ref][t].shape, split_dim, splits[ref][j])
            for i in sources[1:]:
                got = chunk_shape(per_rank[i][t].shape, split_dim, splits[i][j])
                if [s for d, s in enumerate(got) if d != cat_dim] != \
                        [s for d, s in enumerate(want) if d != cat_dim]:
                    raise CollectiveError(
                        f"all_to_all_v tensor {t}: the chunk rank {i} sends to rank {j} has shape "
                        f"{got}, rank {ref}'s has {want}; they must agree outside the concat dim "
                        f"{cat_dim}")


def all_to_all_arguments(tensors, send_splits, split_dim, cat_dim, world_size):
    """Check one rank's all_to_all_v call locally, before anything is sent.

    Returns (single, tensors as a list, split_dim, cat_dim, send splits as a tuple); `single`
    says a lone tensor was passed (and a lone tensor is returned).
    """
    single = isinstance(tensors, torch.Tensor)
    tensors = [tensors] if single else list(tensors)
    if not tensors:
        raise ValueError("all_to_all_v needs at least one tensor")
    split_dim = normalize_dims(tensors, split_dim)[0]
    cat_dim = split_dim if cat_dim is None else normalize_dims(tensors, cat_dim)[0]
    splits = check_send_splits(tensors, send_splits, split_dim, world_size)
    return single, tensors, split_dim, cat_dim, splits


def concat_received(parts: Sequence[torch.Tensor], sizes: Sequence[int], cat_dim: int) -> torch.Tensor:
    """A rank's all-to-all result: the chunks it received, in source order, along cat_dim.

    A source whose split size for this rank is 0 takes no part (its empty chunk need not fit
    the others), so a sub-group of ranks can exchange through one world-wide call; when every
    chunk is empty they are concatenated as they are.
    """
    kept = [p for p, n in zip(parts, sizes) if n] or list(parts)
    return torch.cat(kept, dim=cat_dim)


def normalize_dims(tensors: Sequence[torch.Tensor], cat_dims: int | Sequence[int]) -> list[int]:
    if isinstance(cat_dims, int):
        cat_dims = [cat_dims] * len(tensors)
    if len(cat_dims) != len(tensors):
        raise ValueError(f"exchange got {len(tensors)} tensors but {len(cat_dims)} cat_dims")
    dims = []
    for t, d in zip(tensors, cat_dims):
        if not -t.dim() <= d < t.dim():
            raise ValueError(f"cat dim {d} is out of range for a tensor of shape {tuple(t.shape)}")
        dims.append(d % t.dim())
    return dims


# ----------------------------------------------------------------------------- backends

def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Skipping .to() for same-device tensors saves Python overhead, which all rank
    # threads pay serially under the GIL.
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


class PeerCopyBackend:
    """Shared slots + barrier + copy to the local device + cat. Works on any device kind.

    Slots are double-buffered by collective parity: a rank can only start collective n+2
    after every rank has passed the barrier of n+1, i.e. after everyone finished reading n.
    """

    name = "peer"
    reads_peer_memory = True

    def __init__(self, coordinator: "SequenceParallelCoordinator"):
        self.coordinator = coordinator

    def all_gather_v(self, rank, tensors, dims, metas, slot):
        device = self.coordinator.devices[rank]
        out = []
        for i, dim in enumerate(dims):
            parts = [_on_device(shards[i], device) for shards in slot]
            out.append(torch.cat(parts, dim=dim))
        return out

    def all_to_all_v(self, rank, tensors, metas, splits, split_dim, cat_dim, slot):
        device = self.coordinator.devices[rank]
        out = []
        for t in range(len(tensors)):
            parts = []
            for src, src_tensors in enumerate(slot):
                offset = sum(splits[src][:rank])
                chunk = src_tensors[t].narrow(split_dim, offset, splits[src][rank])
                parts.append(_on_device(chunk, device))
            out.append(concat_received(parts, [s[rank] for s in splits], cat_dim))
        return out

    def all_reduce(self, rank, tensor, op, slot):
        device = self.coordinator.devices[rank]
        # Same order of operands on every rank, so every rank gets bit-identical results.
        acc = slot[0].to(device, copy=True)
        for r in range(1, self.coordinator.world_size):
            other = _on_device(slot[r], device)
            if op == "sum":
                acc.add_(other)
            else:
                torch.maximum(acc, other, out=acc)
        return acc

    def close(self):
        pass


def _open_backend(name: str, coordinator: "SequenceParallelCoordinator"):
    if name == "peer":
        return PeerCopyBackend(coordinator)
    if name == "hccl":
        from comfy.multinpu import HcclBackend
        return HcclBackend(coordinator)
    if name == "nccl":
        from comfy.multicuda import NcclBackend
        return NcclBackend(coordinator)
    raise ValueError(f"unknown backend {name!r}; valid values: {', '.join(VALID_BACKENDS)}")


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

    comfy/multinode.py offers the same methods over torch.distributed, so code written
    against RankComm runs unchanged in one process or across processes.
    """

    def __init__(self, coordinator: "SequenceParallelCoordinator", rank: int):
        self.coordinator = coordinator
        self.rank = rank
        self.world_size = coordinator.world_size
        self.device = coordinator.devices[rank]

    def exchange(self, tensors, cat_dims):
        return self.coordinator.exchange(self.rank, tensors, cat_dims)

    def all_to_all_v(self, tensors, send_splits, split_dim, cat_dim=None):
        return self.coordinator.all_to_all_v(self.rank, tensors, send_splits, split_dim, cat_dim)

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
            fn, args, done = job
            if init_error is not None:
                done(self.rank, None, init_error)
                continue
            try:
                result = fn(self.rank, self.coordinator.comm(self.rank), *args)
            except BaseException as exc:  # noqa: BLE001 - reported to the caller of run()
                done(self.rank, None, exc)
            else:
                done(self.rank, result, None)


class SequenceParallelCoordinator:
    """W rank threads over W devices plus the collectives between them."""

    def __init__(self, devices: Sequence[Any], backend: str | None = None,
                 timeout_s: float | None = None):
        if not devices:
            raise ValueError("SequenceParallelCoordinator needs at least one device, got none")
        self.devices = [resolve_device(d) for d in devices]
        self.world_size = len(self.devices)
        self.timeout_s = float(timeout_s) if timeout_s is not None else timeout_from_env()
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
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

        Each entry of per_rank_args is a sequence with one item per rank. The first rank
        error is re-raised here (annotated with its rank) after every rank has stopped.
        """
        self._check_open()
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
            remaining = [self.world_size]
            finished = threading.Condition()

            def done(rank, result, exc):
                with finished:
                    if exc is not None:
                        errors.append((time.monotonic(), rank, exc))
                        self._barrier.abort(f"rank {rank} failed: {type(exc).__name__}: {exc}")
                    else:
                        results[rank] = result
                    remaining[0] -= 1
                    finished.notify_all()

            for r, worker in enumerate(self._workers):
                worker.jobs.put((fn, tuple(a[r] for a in per_rank_args), done))
            with finished:
                while remaining[0]:
                    finished.wait()
            for slots in (*self._meta_slots, *self._data_slots):  # don't pin the last tensors
                slots[:] = [None] * self.world_size
            if errors:
                raise self._first_error(errors)
            return results

    @staticmethod
    def _first_error(errors):
        # The root cause beats the "cancelled because rank k failed" errors it triggered.
        errors.sort(key=lambda e: (isinstance(e[2], CollectiveAborted), e[0]))
        _, rank, exc = errors[0]
        if getattr(exc, "rank", None) is None:
            try:
                exc.rank = rank
                exc.add_note(f"(raised on multi-device rank {rank})")
            except AttributeError:
                pass
        return exc

    # -- collectives (called from rank threads)
    def barrier(self, rank: int, what: str = "barrier") -> None:
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
        meta_slot[rank], data_slot[rank], op_slot[rank] = meta, data, op
        if data is not None and self.backend.reads_peer_memory:
            # Other ranks read our tensors directly: finish them first.
            synchronize(self.devices[rank])
        self._barrier.wait(rank, what or op)
        if op_slot.count(op) != self.world_size:  # C-level scan: this runs on every collective
            calls = ", ".join(f"rank {r}: {o}" for r, o in enumerate(op_slot))
            raise CollectiveError(
                f"ranks entered different collectives ({calls}); every rank must call the same "
                "collectives in the same order")
        return meta_slot, data_slot

    def exchange(self, rank: int, tensors: Sequence[torch.Tensor],
                 cat_dims: int | Sequence[int]) -> list[torch.Tensor]:
        """All-gather-V: return, per tensor, the concat of every rank's shard along its cat dim."""
        tensors = list(tensors)
        dims = normalize_dims(tensors, cat_dims)
        if self.world_size == 1:
            return tensors
        meta_slot, data_slot = self._enter(
            rank, "exchange", [ShardMeta(tuple(t.shape), t.dtype) for t in tensors], tensors)
        metas = list(meta_slot)
        check_exchange_metadata(metas, dims)
        out = self.backend.all_gather_v(rank, tensors, dims, metas, data_slot)
        sent, received = exchange_traffic(metas, rank)
        self._count(rank, "exchange", sent=sent, received=received)
        return out

    def all_to_all_v(self, rank: int, tensors: torch.Tensor | Sequence[torch.Tensor],
                     send_splits: Sequence[int], split_dim: int,
                     cat_dim: int | None = None) -> torch.Tensor | list[torch.Tensor]:
        """All-to-all with per-rank sizes: split each tensor along `split_dim` into
        `send_splits[j]`-long chunks, send chunk j to rank j, and return the chunks this rank
        received, in source-rank order, concatenated along `cat_dim` (default `split_dim`).

        Ranks may hold different shapes along `cat_dim` and send different sizes; the chunks
        arriving at one rank must agree outside `cat_dim`, except that a zero split sends
        nothing and its chunk is left out (a sub-group exchange through one call). A single
        tensor in, a single out.
        """
        single, tensors, split_dim, cat_dim, splits = all_to_all_arguments(
            tensors, send_splits, split_dim, cat_dim, self.world_size)
        if self.world_size == 1:
            return tensors[0] if single else tensors
        meta_slot, data_slot = self._enter(
            rank, "all_to_all_v", ([ShardMeta(tuple(t.shape), t.dtype) for t in tensors], splits), tensors)
        metas = [m[0] for m in meta_slot]
        all_splits = [m[1] for m in meta_slot]
        check_all_to_all_metadata(metas, all_splits, split_dim, cat_dim)
        if getattr(self.backend, "has_all_to_all_v", hasattr(self.backend, "all_to_all_v")):
            out = self.backend.all_to_all_v(rank, tensors, metas, all_splits, split_dim, cat_dim,
                                            data_slot)
        else:
            out = self._all_to_all_v_by_gather(rank, tensors, metas, all_splits, split_dim, cat_dim,
                                               data_slot)
        sent = received = 0
        for t in range(len(tensors)):
            for other in range(self.world_size):
                if other != rank:
                    sent += nbytes(ShardMeta(chunk_shape(metas[rank][t].shape, split_dim,
                                                         all_splits[rank][other]), tensors[t].dtype))
                    received += nbytes(ShardMeta(chunk_shape(metas[other][t].shape, split_dim,
                                                             all_splits[other][rank]), tensors[t].dtype))
        self._count(rank, "all_to_all_v", sent=sent, received=received)
        return out[0] if single else out

    def _all_to_all_v_by_gather(self, rank, tensors, metas, splits, split_dim, cat_dim, slot):
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
                parts.append(gathered.narrow(0, offset, sizes[rank]).view(shape))
                base += sum(sizes)
            out.append(concat_received(parts, [s[rank] for s in splits], cat_dim))
        return out

    def all_reduce(self, rank: int, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if op not in VALID_REDUCE_OPS:
            raise ValueError(f"all_reduce op {op!r} is not supported; use one of {VALID_REDUCE_OPS}")
        if self.world_size == 1:
            return tensor.clone()
        meta_slot, data_slot = self._enter(
            rank, f"all_reduce {op}", [ShardMeta(tuple(tensor.shape), tensor.dtype)], tensor)
        check_all_reduce_metadata([m[0] for m in meta_slot])
        out = self.backend.all_reduce(rank, tensor, op, data_slot)
        # Logical bytes: every rank needs every other rank's whole input.
        moved = nbytes(tensor) * (self.world_size - 1)
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
            raise RuntimeError("this SequenceParallelCoordinator is closed; create a new one")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._barrier.abort("coordinator closed")
        for w in self._workers:
            w.jobs.put(None)
        for w in self._workers:
            w.join(timeout=self.timeout_s)
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
