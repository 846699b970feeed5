"""The collectives of the rank-thread coordinator: each rank publishes its part in shared slots,
meets the others at an abortable barrier, and the backend moves the bytes.

`SlotCollectives` is the coordinator's half that rank threads call (comm/group.py runs the
threads, watches them and chooses the backend; both halves share one state, set up by
`_init_collectives`). Every collective first passes the barrier with each rank's tensor shapes,
so ranks that call different collectives, or pass shapes that disagree, get a clear error on
every rank instead of reading each other's unrelated slots. Every collective also adds to
per-rank byte counters (`byte_counts()`), counted from the shapes whatever the backend: the
logical bytes each rank sends to / receives from *other* ranks (a rank's own chunk never
counts), not what a library's algorithm moves.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import torch

from comfy.multidevice.comm.barrier import AbortableBarrier
from comfy.multidevice.comm.checks import (all_to_all_arguments, check_all_reduce_metadata,
                                           check_all_to_all_metadata, check_all_to_all_plans,
                                           check_exchange_metadata, check_recv_splits, check_reduce_op,
                                           planned_metas)
from comfy.multidevice.comm.errors import CollectiveError
from comfy.multidevice.comm.layout import (alone_all_to_all, chunk_shape, concat_received, normalize_dims, numel,
                                           pack_chunks, planned_chunk_shapes, same_chunk_shape, ShardMeta)
from comfy.multidevice.comm.traffic import (all_reduce_traffic, all_to_all_traffic, exchange_traffic,
                                            TrafficCounter)
from comfy.multidevice.devices import synchronize

log = logging.getLogger(__name__)


class RankComm:
    """The per-rank view of a coordinator that model code talks to.

    comfy/multidevice/comm/torch_dist.py offers the same methods over torch.distributed, so code written
    against RankComm runs unchanged in one process or across processes.
    """

    def __init__(self, coordinator: "SlotCollectives", rank: int):
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

    def block_flag(self) -> "RankBlockFlag":
        """This rank's end of the run's SharedBlockFlag (ComfyUI's Cancel at block starts)."""
        return RankBlockFlag(self.coordinator, self.rank)

    def __repr__(self):
        return f"RankComm(rank={self.rank}/{self.world_size}, device={self.device})"


class SharedBlockFlag:
    """Rank 0's yes/no to every rank thread once per block, one block late (between processes:
    workers/control.py BlockFlag): rank 0 appends a value as each block starts, every rank reads
    it as the next one starts. No lock or wait: every collective passes the slot barrier, so
    the collectives of block i order rank 0's value of block i before any rank's read at block
    i + 1. The coordinator starts a fresh one for every run."""

    def __init__(self, world_size: int):
        self.values: list[bool] = []  # rank 0's, one per block
        self.read = [0] * world_size  # values each rank has read
        self.unread = [False] * world_size  # the rank posted and has not read that block's value

    def post(self, rank: int, value: bool = False) -> bool:
        if self.settle(rank):
            return True
        if rank == 0:
            self.values.append(bool(value))
        self.unread[rank] = True
        return False

    def settle(self, rank: int) -> bool:
        if not self.unread[rank]:
            return False
        self.unread[rank] = False
        self.read[rank] += 1
        if self.read[rank] > len(self.values):
            raise CollectiveError(f"rank {rank} read block {self.read[rank] - 1}'s Cancel flag before rank 0 "
                                  "posted it: a block without a collective between the ranks")
        return self.values[self.read[rank] - 1]


class RankBlockFlag:
    """One rank's `post` / `settle` on the coordinator's current SharedBlockFlag."""

    def __init__(self, coordinator: "SlotCollectives", rank: int):
        self.coordinator = coordinator
        self.rank = rank

    def post(self, value: bool = False) -> bool:
        return self.coordinator.block_flag.post(self.rank, value)

    def settle(self) -> bool:
        return self.coordinator.block_flag.settle(self.rank)


class SlotCollectives:
    """The collectives over shared slots and a barrier (mixed into SequenceParallelCoordinator)."""

    world_size: int
    devices: list
    backend: Any
    backend_name: str

    def _init_collectives(self, timeout_s: float) -> None:
        self._barrier = AbortableBarrier(self.world_size, timeout_s)
        self._meta_slots: list[list[Any]] = [[None] * self.world_size for _ in range(2)]
        self._data_slots: list[list[Any]] = [[None] * self.world_size for _ in range(2)]
        # Which collective each rank entered, by parity: ranks that call different
        # collectives get a clear error instead of reading each other's unrelated slots.
        self._op_slots: list[list[Any]] = [[None] * self.world_size for _ in range(2)]
        self._parity = [0] * self.world_size
        self._comms = [RankComm(self, r) for r in range(self.world_size)]
        self._traffic = [TrafficCounter() for _ in range(self.world_size)]  # each rank writes its own
        self._last_activity = time.monotonic()  # a rank returned or reached a collective (watchdog)
        self._a2a_fallback_logged = False
        self.block_flag = SharedBlockFlag(self.world_size)

    def comm(self, rank: int) -> RankComm:
        return self._comms[rank]

    def _start_in_step(self) -> None:
        """Before a run: a failed run can leave ranks at different collective counts."""
        self._barrier.reset()
        self._parity = [0] * self.world_size
        self.block_flag = SharedBlockFlag(self.world_size)
        for slots in (*self._meta_slots, *self._data_slots, *self._op_slots):
            slots[:] = [None] * self.world_size

    def _release_slots(self) -> None:
        """After a run: don't pin the last tensors."""
        for slots in (*self._meta_slots, *self._data_slots):
            slots[:] = [None] * self.world_size

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
        check_reduce_op(op)
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

