"""The exchanging attention: an attention override that runs the K/V exchange inside an SP region.

`ExchangingAttention` goes into `transformer_options["optimized_attention_override"]`. Inside
its SP region it hands each call to the K/V exchange strategy; outside (e.g. a text refiner)
it passes the call through to the override it replaced, or to the attention function itself.

The attention the exchange finally calls is the one the module would have used on one card:
the override it replaced when there is one, else the module's preferred attention (ComfyUI
drops `preferred_attention` once any override is installed, so the region is told it), else
the default function. `all_keys_attention`: one rank's attention against a whole sequence's
worth of keys without an exchange (split auto's probe times it).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Callable

from comfy.multidevice.sp.plan import SequenceParallelError

log = logging.getLogger(__name__)


class ExchangingAttention:
    """Attention override (ComfyUI's `override(func, *args, **kwargs)` convention) for one rank.

    Outside `region()` it is a pass-through to any override it replaced, else to `func`. Inside,
    the strategy exchanges K/V between ranks before the attention runs. Leaving a region in which
    no attention call came through raises: the model bypassed the override, and a rank would
    have attended to its own rows only (a silently wrong result).
    """

    def __init__(self, comm, strategy, previous_override: Callable | None = None):
        self.comm = comm
        self.strategy = strategy
        self.previous_override = previous_override
        self.shard_sizes: list[int] | None = None  # every rank's rows in this forward, if known
        self._region_calls: int | None = None  # None: outside any region
        self._preferred: Callable | None = None  # the region's module's preferred attention

    def __call__(self, func, *args, **kwargs):
        if self.previous_override is not None:  # an override beats a preferred attention
            inner = functools.partial(self.previous_override, func)
        elif self._region_calls is not None and self._preferred is not None:
            inner = self._preferred
        else:
            inner = func
        if self._region_calls is None:
            return inner(*args, **kwargs)
        self._region_calls += 1
        return self.strategy.attend(self.comm, inner, *args, shard_sizes=self.shard_sizes, **kwargs)

    def install(self, transformer_options: dict) -> "ExchangingAttention":
        """Become the override of one forward's transformer_options, chaining the one found there."""
        previous = transformer_options.get("optimized_attention_override")
        while isinstance(previous, ExchangingAttention):  # a stale copy from an earlier forward
            previous = previous.previous_override
        self.previous_override = previous
        transformer_options["optimized_attention_override"] = self
        return self

    @contextlib.contextmanager
    def region(self, what: str = "attention", preferred: Callable | None = None, fix: str = ""):
        """Exchange K/V for the attention calls inside; `preferred` is the attention function the
        module asked for (its preferred_attention), used when no other override is installed.
        With no call through the override inside, raises naming `what` and `fix`. This count is
        the one check that a region's attention went through the exchange."""
        if self._region_calls is not None:
            raise SequenceParallelError("sequence-parallel attention regions cannot nest")
        self._region_calls = 0
        self._preferred = preferred
        try:
            yield self
            if self._region_calls == 0:
                raise SequenceParallelError(
                    f"rank {self.comm.rank}: {what} did not call the attention override in "
                    "transformer_options['optimized_attention_override']; sequence parallelism needs "
                    "every attention of the SP region to go through it" + (f"; {fix}" if fix else ""))
        finally:
            self._region_calls = None
            self._preferred = None


def all_keys_attention(attn, keys: int, preferred: Callable | None):
    """`attn`, called like the block's attention argument, with its K and V repeated along the
    sequence to `keys` rows: one rank's queries against a whole sequence's worth of keys, with
    no exchange (split auto's probe)."""
    def attention(h, rope_freqs=None, transformer_options=None):
        options = dict(transformer_options or {})
        previous = options.get("optimized_attention_override")

        def override(func, q, k, v, *args, **kwargs):
            # H3 contract: [1, heads, rows, head_dim] (skip_reshape=True), the sequence on dim 2
            times = -(-keys // k.shape[2])
            k, v = (t.repeat(1, 1, times, 1)[:, :, :keys] for t in (k, v))
            if previous is not None:
                return previous(func, q, k, v, *args, **kwargs)
            return (preferred or func)(q, k, v, *args, **kwargs)

        options["optimized_attention_override"] = override
        return attn(h, rope_freqs=rope_freqs, transformer_options=options)
    return attention
