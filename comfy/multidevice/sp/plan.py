"""The shard plan of sequence parallelism and the helpers that slice by it.

`ShardPlan`: rank r of W owns rows [S*r//W, S*(r+1)//W) of a packed sequence of S rows (exact,
never padded; lengths differ by at most one row); `shard_sizes` is the same formula as a list.
`take_rows` (e.g. the rows of a RoPE table), `slice_mod_segments` (a modulation table of
(start, stop, row) spans, row an int or a per-token index tensor, clipped to the rank's rows and
re-based to 0) and `gather_rows` (all-gather-V of the rows back) work on one rank's part.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)


class SequenceParallelError(RuntimeError):
    """Sequence parallelism cannot run as asked (misconfiguration or a broken model contract)."""


# ----------------------------------------------------------------------------- shard plan

def shard_start(total: int, world: int, rank: int) -> int:
    """Where rank `rank` of `world` starts in `total` rows: the one shard formula of the package."""
    return total * rank // world


def shard_sizes(total: int, world: int) -> list[int]:
    """Rows per rank under the plan [S*r//W, S*(r+1)//W)."""
    return [shard_start(total, world, r + 1) - shard_start(total, world, r) for r in range(world)]


@dataclass(frozen=True)
class ShardPlan:
    """Which rows of a packed sequence of `seq_len` rows rank `rank` of `world_size` owns."""

    seq_len: int
    world_size: int
    rank: int

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.seq_len < self.world_size:
            raise ValueError(
                f"a sequence of {self.seq_len} rows cannot be split over {self.world_size} ranks "
                f"(every rank needs at least one row); use at most {self.seq_len} ranks")

    @staticmethod
    def edges(seq_len: int, world_size: int) -> list[tuple[int, int]]:
        return [(shard_start(seq_len, world_size, r), shard_start(seq_len, world_size, r + 1))
                for r in range(world_size)]

    @property
    def start(self) -> int:
        return shard_start(self.seq_len, self.world_size, self.rank)

    @property
    def stop(self) -> int:
        return shard_start(self.seq_len, self.world_size, self.rank + 1)

    @property
    def length(self) -> int:
        return self.stop - self.start


def take_rows(tensor: torch.Tensor | None, plan: ShardPlan, dim: int = 0) -> torch.Tensor | None:
    """The rank's rows of `tensor` along `dim` (a view). None passes through (no RoPE table)."""
    if tensor is None:
        return None
    if tensor.shape[dim] != plan.seq_len:
        raise SequenceParallelError(
            f"expected {plan.seq_len} sequence rows along dim {dim}, got shape {tuple(tensor.shape)}")
    return tensor.narrow(dim, plan.start, plan.length)


def slice_mod_segments(segments: Sequence[tuple[int, int, Any]], plan: ShardPlan) -> list[tuple[int, int, Any]]:
    """Clip a modulation table [(start, stop, row)] to the rank's rows and re-base it to 0.

    `row` is an int (one modulation row for the whole span) or a 1-D index tensor with one
    entry per token of the span; a span cut by a shard edge keeps only its local entries.
    """
    out = []
    for a, b, row in segments:
        if not 0 <= a <= b <= plan.seq_len:
            raise SequenceParallelError(f"modulation span ({a}, {b}) lies outside 0..{plan.seq_len}")
        per_token = torch.is_tensor(row) and row.dim() > 0
        if per_token and row.shape[0] != b - a:
            raise SequenceParallelError(
                f"modulation span ({a}, {b}) has {row.shape[0]} per-token rows for {b - a} tokens")
        lo, hi = max(a, plan.start), min(b, plan.stop)
        if lo >= hi:
            continue
        if per_token:
            row = row[lo - a:hi - a]
        out.append((lo - plan.start, hi - plan.start, row))
    return out


def gather_rows(comm, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """All-gather-V the ranks' rows back into the full sequence (rank order)."""
    return comm.exchange([tensor], [dim])[0]
