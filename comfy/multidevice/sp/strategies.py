"""The sequence-parallel modes: one registry from a mode name to its K/V exchange strategy.

  allgather  `AllGatherKV`: every rank gathers the full K and V, keeps its own Q rows
  ulysses    `UlyssesKV` (ulysses.py): all-to-all from sequence shards to head shards
  auto       `AutoKV`: allgather or ulysses by the one rule of `auto` (mode_choice.py: the
             measurement doctor --deep kept for these cards, else the byte model), decided on
             the first call and logged once

`SPMode` carries a mode with its options; `make_kv_strategy` turns a name or an SPMode into a
strategy object with `attend(comm, attention_fn, q, k, v, heads, ...)`. An SPMode whose
`exchange_precision` is not exact wraps that strategy in `CompressedKV`, which hands it a
CompressedComm (comm/compressed_comm.py); the exact strategies never see one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from comfy.multidevice.comm.compressed_comm import CompressedComm
from comfy.multidevice.comm.compression import check_precision, EXACT
from comfy.multidevice.sp.attention_budget import attend_within_budget
from comfy.multidevice.sp.cost_model import ulysses_degree
from comfy.multidevice.sp.mode_choice import choose_sp_mode, measurement_for
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.sp.ulysses import UlyssesKV

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- K/V exchange

class AllGatherKV:
    """K/V exchange strategy "allgather": every rank gathers the full K and V, keeps its Q.

    Each rank's attention then covers its own query rows against all key rows, so the output
    rows equal the single-device rows exactly (no softmax merging). Traffic per call and rank:
    (W-1)/W of K and V. Ranks that share one memory (CPU) attend in row pieces
    (attention_budget.py), so that together they hold one card's attention working set.
    """

    name = "allgather"

    def __init__(self):
        self.workspace: dict | None = None  # the K/V buffers every block of a forward reuses

    def begin_forward(self) -> None:
        self.workspace = {}

    def end_forward(self) -> None:
        self.workspace = None  # nothing held between forwards

    def attend(self, comm, attention_fn: Callable, q, k, v, heads, *args, shard_sizes=None, **kwargs):
        """`shard_sizes`: every rank's rows under the shard plan, when the caller knows it (the
        exchange then needs no shape round per call)."""
        if kwargs.get("mask") is not None:
            raise SequenceParallelError(
                "sequence-parallel attention got an attention mask; the all-gather exchange only "
                "supports full self-attention (mask=None)")
        # [B, heads, S, head_dim] with skip_reshape (H3's layout), else [B, S, heads*head_dim]
        seq_dim = 2 if kwargs.get("skip_reshape", False) else 1
        # K and V in one exchange: gathered sequence-major, returned as [B, heads, S, head_dim]
        # views of that buffer (no transposing copy, no cat). With shard_sizes (the SP adapter's
        # path) a forward's blocks run one after another and each block's K/V are dead when the
        # next one gathers, so they share one pair of buffers
        options = {} if shard_sizes is None else {"shard_sizes": shard_sizes, "workspace": self.workspace}
        k_full, v_full = comm.exchange([k, v], [seq_dim, seq_dim], **options)
        return attend_within_budget(comm, attention_fn, q, k_full, v_full, heads, *args, **kwargs)


DEFAULT_SP_MODE = "allgather"


def make_kv_strategy(sp_mode=None):
    """The K/V exchange strategy for an `sp_mode` string (None -> the default), or for a
    configured mode object with a `make_kv_strategy()` method (an `SPMode`)."""
    if not hasattr(sp_mode, "make_kv_strategy"):
        sp_mode = SPMode((sp_mode or DEFAULT_SP_MODE).strip().lower())
    return sp_mode.make_kv_strategy()


class AutoKV:
    """K/V exchange strategy "auto": allgather or ulysses, by mode_choice.py's rule (the node's).

    The choice depends on W, the heads, the head dim and what doctor --deep measured for these
    cards (the byte ratio of the two modes does not change with the sequence length), so it is
    made on the first call and kept: one strategy object lives as long as the rank's set-up, and
    rank 0 logs the choice once. Every rank reads the same measurement file.
    """

    name = "auto"

    def __init__(self, overlap_chunks: int = 1):
        self.overlap_chunks = overlap_chunks
        self.chosen: str | None = None
        self._strategy = None
        self._in_forward = False

    def begin_forward(self) -> None:
        self._in_forward = True
        if self._strategy is not None:
            self._strategy.begin_forward()

    def end_forward(self) -> None:
        self._in_forward = False
        if self._strategy is not None:
            self._strategy.end_forward()

    def attend(self, comm, attention_fn, q, k, v, heads, *args, shard_sizes=None, **kwargs):
        if self._strategy is None:
            head_dim = q.shape[-1] if kwargs.get("skip_reshape", False) else q.shape[-1] // heads
            measured = measurement_for(str(comm.device).split(":")[0], comm.world_size)
            choice = choose_sp_mode("auto", comm.world_size, heads, head_dim, measured=measured)
            self.chosen = choice.mode
            self._strategy = (UlyssesKV(overlap_chunks=self.overlap_chunks) if self.chosen == "ulysses"
                              else AllGatherKV())
            if self._in_forward:
                self._strategy.begin_forward()
            if comm.rank == 0:
                log.info("rank 0: sp_mode auto: %s for %d ranks and %d heads (ulysses degree %d): %s",
                         self.chosen, comm.world_size, heads, ulysses_degree(comm.world_size, heads),
                         choice.reason)
        return self._strategy.attend(comm, attention_fn, q, k, v, heads, *args,
                                     shard_sizes=shard_sizes, **kwargs)


class CompressedKV:
    """Any K/V strategy with its exchanges coded at `precision` (int8 or fp8): what the strategy
    moves (K, V for allgather; q, k, v and the output for ulysses) crosses as byte records."""

    def __init__(self, strategy, precision: str):
        self.strategy = strategy
        self.precision = precision
        self.name = strategy.name
        self._comms: dict[int, CompressedComm] = {}  # id(comm) -> its wrapper, made once

    def begin_forward(self) -> None:
        self.strategy.begin_forward()

    def end_forward(self) -> None:
        self.strategy.end_forward()

    def attend(self, comm, attention_fn, q, k, v, heads, *args, **kwargs):
        wrapped = self._comms.get(id(comm))
        if wrapped is None or wrapped.inner is not comm:
            wrapped = self._comms[id(comm)] = CompressedComm(comm, self.precision)
        return self.strategy.attend(wrapped, attention_fn, q, k, v, heads, *args, **kwargs)


@dataclass(frozen=True)
class SPMode:
    """A sequence-parallel mode with its options; pass it wherever an `sp_mode` string goes.

    mode: allgather | ulysses | auto; overlap_chunks: head chunks whose exchange overlaps the
    attention (ulysses, 1 = off); degree: force the Ulysses group size (default: the hybrid rule);
    exchange_precision: exact, int8 or fp8 (comm/compression.py; the attention's inputs rounded).
    """

    mode: str = DEFAULT_SP_MODE
    overlap_chunks: int = 1
    degree: int | None = None
    exchange_precision: str = EXACT

    def __post_init__(self):
        if self.mode not in SP_MODES:
            raise ValueError(f"unknown sequence-parallel mode {self.mode!r}; valid modes: "
                             f"{', '.join(SP_MODES)}")
        if self.overlap_chunks < 1:
            raise ValueError(f"overlap chunks must be >= 1 (1 = no overlap), got {self.overlap_chunks}")
        if self.overlap_chunks > 1 and self.mode == "allgather":
            raise ValueError("overlap applies to the ulysses exchange; use sp_mode ulysses or auto")
        check_precision(self.exchange_precision)

    def make_kv_strategy(self):
        strategy = KV_STRATEGIES[self.mode](self)
        precision = check_precision(self.exchange_precision)
        return strategy if precision == EXACT else CompressedKV(strategy, precision)

    def __str__(self):
        return (self.mode + (f" (overlap {self.overlap_chunks} chunks)" if self.overlap_chunks > 1 else "")
                + ("" if check_precision(self.exchange_precision) == EXACT
                   else f" ({self.exchange_precision} exchange)"))


# The one registry of mode names, each with its strategy made from an SPMode's options: the
# CLI's choices, SPMode's check and make_kv_strategy use it.
KV_STRATEGIES: dict[str, Callable[[SPMode], object]] = {
    "allgather": lambda mode: AllGatherKV(), "ulysses": lambda mode: UlyssesKV(mode.degree, mode.overlap_chunks),
    "auto": lambda mode: AutoKV(mode.overlap_chunks)}
SP_MODES = tuple(KV_STRATEGIES)
