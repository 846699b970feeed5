"""The per-rank `Communicator` protocol that every `comm` argument satisfies, and the `Backend` protocol (a leaf module).
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable, Sequence

import torch


VALID_REDUCE_OPS = ("sum", "max")


@runtime_checkable
class Communicator(Protocol):
    """One rank's view of its group: what model code (SP, TP, VAE decode) calls, whatever the
    transport (the in-process coordinator's RankComm or the torch.distributed DistributedComm)."""

    rank: int
    world_size: int
    device: torch.device

    def exchange(self, tensors: Sequence[torch.Tensor], cat_dims: int | Sequence[int],
                 shard_sizes: Sequence[int] | None = None, workspace: dict | None = None) -> list[torch.Tensor]:
        """All-gather-V: per tensor, every rank's shard concatenated along its cat dim (may be
        a non-contiguous view). `shard_sizes`: every rank's length along the cat dims when a
        shard plan fixes them; then the shapes need not be exchanged again on every call.
        `workspace`: a dict of buffers the communicator may keep and reuse between calls of one
        call site (the results of the last call from it must be dead by then)."""

    def all_to_all_v(self, tensors, send_splits: Sequence[int], split_dim: int, cat_dim: int | None = None,
                     workspace: dict | None = None, recv_splits: Sequence[int] | None = None,
                     write_own: Callable[[int, torch.Tensor], None] | None = None):
        """Chunk j of each tensor along split_dim goes to rank j; the received chunks, in source order.
        `recv_splits`: per source rank, the length along cat_dim of the chunk it sends this rank
        (0 for none), when a plan every rank shares fixes them; the first call with a plan
        checks it, later ones need not exchange the shapes again.
        `write_own(t, place)`: writes tensor t's chunk for this rank itself into `place` (a
        tensor of that chunk's shape inside the result); the send tensors' own chunks are then
        never read, so a caller that packs its tensors need not pack that chunk (it lies in
        its sources already)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Elementwise sum or max over the ranks, bit-identical on every rank."""

    def barrier(self) -> None:
        """Wait until every rank arrives."""

    def byte_counts(self) -> dict:
        """{"sent", "received", "calls", "by_op"}: this rank's logical bytes to / from the others."""


@runtime_checkable
class Backend(Protocol):
    """What the in-process coordinator (comm/group.py) calls to move the bytes of a collective
    between its rank threads, once the ranks have met and their metadata agree.

    Capabilities, declared by every backend (class attributes or properties), never probed:
      reads_peer_memory      the ranks read each other's tensors in place (peer copies), so a
                             rank finishes its own tensors before it meets the others
      has_all_to_all_v       a native all-to-all-V; without it the coordinator builds one from
                             all-gather-V (exact, W times the bytes)
      prepares_all_to_all_v  it can make an all-to-all's buffers from a plan before the ranks
                             meet: it has prepare_all_to_all_v(rank, tensors, send_splits,
                             received, split_dim, workspace, write_own), whose result the coordinator
                             passes to all_to_all_v as `prepared`
      one_collective_per_device  a card library that lets a device run one collective at a time,
                             whatever communicator it is on (HCCL: "one card cannot invoke multiple
                             collective operation APIs at a time"; NCCL: not safe to drive two
                             communicators of one device from two threads): no second coordinator
                             may run collectives on the same devices while this one does
    Backends: peer (comm/peer.py), hccl and nccl (comm/hccl.py, comm/nccl.py over
    comm/ctypes_lib.py). torch.distributed runs need none: `DistributedComm` is itself a
    `Communicator`, one process per rank.
    """

    name: str
    reads_peer_memory: bool
    has_all_to_all_v: bool
    prepares_all_to_all_v: bool
    one_collective_per_device: bool

    def prepare_all_gather_v(self, rank: int, tensors, dims, metas, workspace: dict | None = None):
        """Buffers for an all-gather-V whose shapes a plan fixes, made before the ranks meet (or None)."""

    def all_gather_v(self, rank: int, tensors, dims, metas, slot, prepared=None, workspace: dict | None = None):
        """Rank `rank`'s all-gather-V result: per tensor, every rank's shard along its dim."""

    def all_to_all_v(self, rank: int, tensors, metas, splits, split_dim: int, cat_dim: int, slot,
                     workspace: dict | None = None, write_own=None, **options):
        """Rank `rank`'s all-to-all-V result (only if `has_all_to_all_v`); `write_own`: see
        `Communicator.all_to_all_v` (the own chunks of a `prepared` call were written then)."""

    def all_reduce(self, rank: int, tensor: torch.Tensor, op: str, slot) -> torch.Tensor:
        """Rank `rank`'s all-reduce result, the same bits on every rank."""

    def close(self) -> None:
        """Release the library's communicators (or nothing)."""
