"""How the DiT's rows are split over its ranks (mixed cards): the node's `split`, and weights from timings.

  even   every rank the same rows (the shard formula's even plan; the default)
  auto   measured: at the first step every rank times one block's forward on the same rows
         (sp/minimax_h3.py's probe) and takes rows in proportion to its speed, each share capped
         by what its card's free memory holds (`caps`, from the memory plan)
  3,1    explicit weights, one positive number per rank in the order of the node's cards

The all-gather is exact for any split (all-gather-V), so every split gives the one-card result.
Ulysses splits the heads, which stay even; an uneven split therefore runs the all-gather
(`strategy_for_split`; mode_choice.py refuses ulysses / hybrid with it, and `auto` picks the
all-gather). `measured_weights` times a rank's probe and shares the times; `weights_from_times`
turns them into weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from comfy.multidevice.devices import synchronize
from comfy.multidevice.sp.plan import check_weights, is_even, SequenceParallelError
from comfy.multidevice.sp.strategies import AllGatherKV, CompressedKV, make_kv_strategy

log = logging.getLogger(__name__)

SPLIT_CHOICES = ("even", "auto")  # besides explicit weights such as "3,1"


class SplitError(ValueError):
    """The node's split cannot run as asked (names the value and the fix)."""


@dataclass(frozen=True)
class RowSplit:
    """kind: even | auto | weights; `weights` for kind weights; `caps` for auto: per rank, the
    largest fraction of the rows its free memory holds (None: no cap known)."""

    kind: str = "even"
    weights: tuple[float, ...] | None = None
    caps: tuple[float, ...] | None = None

    def __post_init__(self):  # also what a worker checks of the record it receives
        if self.kind not in (*SPLIT_CHOICES, "weights") or (self.kind == "weights") != (self.weights is not None):
            raise SplitError(f"a row split of kind {self.kind!r} with weights {self.weights!r}: the kind is even, "
                             "auto, or weights with one positive number per rank")
        if self.weights is not None:
            check_weights(self.weights, len(self.weights))

    @property
    def uneven(self) -> bool:
        """Whether the ranks may get different rows (auto may: it is decided at the first step)."""
        return self.kind == "auto" or (self.kind == "weights" and not is_even(self.weights))

    def describe(self) -> str:
        if self.kind == "weights":
            return "split " + ",".join(f"{w:g}" for w in self.weights)
        return f"split {self.kind}"


EVEN = RowSplit()


def parse_split(text, world: int) -> RowSplit:
    """The node's `split` text ("even", "auto" or weights like "3,1", one per rank) for `world` ranks."""
    if isinstance(text, RowSplit):
        return text
    value = (text or "even").strip().lower()
    if value in SPLIT_CHOICES:
        return RowSplit(value)
    try:  # the plan's own check of the numbers, in the node's words
        return RowSplit("weights", check_weights(value.replace(";", ",").split(","), world))
    except ValueError:
        example = ",".join(["2"] + ["1"] * (world - 1)) if world > 1 else "1"
        raise SplitError(f"split={text!r} does not give {world} card(s) their shares: set split to even, auto, "
                         f"or one positive number per card in the order of the cards (e.g. {example}).") from None


def weights_from_times(seconds: Sequence[float], caps: Sequence[float] | None = None
                       ) -> tuple[tuple[float, ...], list[str]]:
    """Per-rank weights from the probe's `seconds` (the same rows on every rank): a share in
    proportion to the speed, capped by `caps` (fractions of the rows; the others take the rest).
    Returns the weights (fractions summing to 1, rounded to 4 digits) and one reason per rank."""
    speed = [1.0 / max(float(s), 1e-9) for s in seconds]
    world = len(speed)
    caps = [1.0] * world if caps is None else [min(max(float(c), 0.0), 1.0) for c in caps]
    if sum(caps) < 1.0:  # the cards together cannot hold the sequence: the caps' shape is the best there is
        shares, capped = [c / sum(caps) if sum(caps) else 1.0 / world for c in caps], set(range(world))
    else:
        shares, capped = [0.0] * world, set()
        while True:  # water-filling: a rank over its cap keeps the cap, the others share the rest
            free = [r for r in range(world) if r not in capped]
            rest = 1.0 - sum(caps[r] for r in capped)
            total = sum(speed[r] for r in free)
            for r in free:
                shares[r] = rest * speed[r] / total
            over = [r for r in free if shares[r] > caps[r]]
            if not over:
                break
            for r in over:
                capped.add(r)
                shares[r] = caps[r]
    weights = check_weights([max(round(s, 4), 1e-4) for s in shares], world)
    fastest = min(float(s) for s in seconds)
    reasons = [f"probe {float(s) * 1e3:.1f} ms ({fastest / max(float(s), 1e-9):.2f} of the fastest's speed)"
               + (f", capped by its free memory at {caps[r]:.3f} of the rows" if r in capped else "")
               for r, s in enumerate(seconds)]
    return weights, reasons


def measured_weights(comm, run_block: Callable[[], Any], caps: Sequence[float] | None = None) -> tuple[float, ...]:
    """split auto on one rank: time `run_block` (one block's forward on the same rows on every
    rank), share the times (an all-reduce: every rank then computes the same weights) and
    return the weights; rank 0 logs each rank's share with its reason."""
    seconds = []
    for _ in range(2):  # the first run warms up (allocations, kernels), the faster counts
        synchronize(comm.device)
        began = time.perf_counter()
        run_block()
        synchronize(comm.device)
        seconds.append(time.perf_counter() - began)
    times = torch.zeros(comm.world_size, dtype=torch.float32, device=comm.device)
    times[comm.rank] = min(seconds)
    times = comm.all_reduce(times, "sum").cpu().tolist()
    weights, reasons = weights_from_times(times, caps)
    if comm.rank == 0:
        for r, (w, why) in enumerate(zip(weights, reasons)):
            log.info("split auto: rank %d takes %.1f%% of the rows: %s", r, 100 * w / sum(weights), why)
    return weights


def check_mode_for_split(sp_mode, split: RowSplit) -> None:
    """A bad sp_mode, or Ulysses with an uneven split, refused before anything is set up (the
    entry points call it; nothing is logged)."""
    strategy_for_split(make_kv_strategy(sp_mode), split, rank=None)


def strategy_for_split(strategy, split: RowSplit, rank: int | None = 0):
    """The K/V strategy that runs with `split`: Ulysses keeps the heads even and needs even rows,
    so an uneven split is refused with it (naming the fix) and `auto` becomes the all-gather
    (said in the log by rank 0; `rank` None: said by nobody)."""
    if not split.uneven:
        return strategy
    if isinstance(strategy, CompressedKV):  # the exchange's precision stays whatever runs inside
        return CompressedKV(strategy_for_split(strategy.strategy, split, rank), strategy.precision)
    name = getattr(strategy, "name", None)
    if name == "ulysses":
        raise SequenceParallelError(
            f"{split.describe()} gives the ranks different rows, but sp_mode ulysses (or hybrid) needs the "
            "even split: set sp_mode to allgather or auto, or split to even")
    if name == "auto":
        if rank == 0:
            log.info("sp_mode auto: allgather, since %s may give the ranks different rows", split.describe())
        return AllGatherKV()
    return strategy
