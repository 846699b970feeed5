"""The shard plan of sequence parallelism and the helpers that slice by it.

`ShardPlan`: rank r of W owns rows [S*r//W, S*(r+1)//W) of a packed sequence of S rows (exact,
never padded; lengths differ by at most one row); `shard_sizes` is the same formula as a list.
With per-rank `weights` (mixed cards: a faster card takes more rows) rank r starts at
r + floor((S-W) * w[:r] / sum(w)): every rank keeps one row, the rest follow the cumulative
weights, and equal weights give the even formula's edges exactly.
`take_rows` (e.g. the rows of a RoPE table), `slice_mod_segments` (a modulation table of
(start, stop, row) spans, row an int or a per-token index tensor, clipped to the rank's rows and
re-based to 0) and `gather_rows` (all-gather-V of the rows back) work on one rank's part.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)


class SequenceParallelError(RuntimeError):
    """Sequence parallelism cannot run as asked (misconfiguration or a broken model contract)."""


# ----------------------------------------------------------------------------- shard plan

def check_weights(weights, world: int) -> tuple[float, ...] | None:
    """`weights` as a tuple of `world` positive finite numbers (None stays None: the even split);
    a ValueError that names the value and the fix otherwise."""
    if weights is None:
        return None
    try:
        values = tuple(float(w) for w in weights)
    except (TypeError, ValueError):
        values = None
    if values is None or len(values) != world or not all(math.isfinite(w) and w > 0 for w in values):
        raise ValueError(
            f"split weights {weights!r} do not fit {world} rank(s): give one positive number per rank "
            f"(e.g. {','.join(['1'] * world)} for an even split, or 3,1 to give the first of two "
            "ranks three times the rows of the second), or use split even")
    return values


def shard_start(total: int, world: int, rank: int, weights: Sequence[float] | None = None) -> int:
    """Where rank `rank` of `world` starts in `total` rows: the one shard formula of the package."""
    if weights is None:
        return total * rank // world
    # exact rationals: every rank computes the same edges from the same floats
    shares = [Fraction(w) for w in check_weights(weights, world)]
    spare = max(total - world, 0)
    return rank + math.floor(spare * sum(shares[:rank]) / sum(shares))


def shard_sizes(total: int, world: int, weights: Sequence[float] | None = None) -> list[int]:
    """Rows per rank under the plan (the even [S*r//W, S*(r+1)//W) when `weights` is None)."""
    return [shard_start(total, world, r + 1, weights) - shard_start(total, world, r, weights)
            for r in range(world)]


def is_even(weights: Sequence[float] | None) -> bool:
    """Whether `weights` split the rows as the even formula does (None or all equal)."""
    return weights is None or len(set(float(w) for w in weights)) <= 1


@dataclass(frozen=True)
class ShardPlan:
    """Which rows of a packed sequence of `seq_len` rows rank `rank` of `world_size` owns;
    `weights`: per-rank shares (None: the even split)."""

    seq_len: int
    world_size: int
    rank: int
    weights: tuple[float, ...] | None = None
    # every rank's start, then the end: computed once (the properties below are read per block)
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.seq_len < self.world_size:
            raise ValueError(
                f"a sequence of {self.seq_len} rows cannot be split over {self.world_size} ranks "
                f"(every rank needs at least one row); use at most {self.seq_len} ranks")
        object.__setattr__(self, "weights", check_weights(self.weights, self.world_size))
        object.__setattr__(self, "_starts", tuple(shard_start(self.seq_len, self.world_size, r, self.weights)
                                                  for r in range(self.world_size + 1)))

    @property
    def start(self) -> int:
        return self._starts[self.rank]

    @property
    def stop(self) -> int:
        return self._starts[self.rank + 1]

    @property
    def length(self) -> int:
        return self.stop - self.start

    @property
    def sizes(self) -> list[int]:
        """Every rank's rows under this plan."""
        return [b - a for a, b in zip(self._starts, self._starts[1:])]


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
