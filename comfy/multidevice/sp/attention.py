"""The exchanging attention: an attention override that runs the K/V exchange inside an SP region.

`ExchangingAttention` goes into `transformer_options["optimized_attention_override"]`. Inside
its SP region it hands each call to the K/V exchange strategy; outside (e.g. a text refiner)
it passes the call through to the override it replaced, or to the attention function itself.
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
        self._region_calls: int | None = None  # None: outside any region

    def __call__(self, func, *args, **kwargs):
        inner = func if self.previous_override is None else functools.partial(self.previous_override, func)
        if self._region_calls is None:
            return inner(*args, **kwargs)
        self._region_calls += 1
        return self.strategy.attend(self.comm, inner, *args, **kwargs)

    def install(self, transformer_options: dict) -> "ExchangingAttention":
        """Become the override of one forward's transformer_options, chaining the one found there."""
        previous = transformer_options.get("optimized_attention_override")
        while isinstance(previous, ExchangingAttention):  # a stale copy from an earlier forward
            previous = previous.previous_override
        self.previous_override = previous
        transformer_options["optimized_attention_override"] = self
        return self

    @contextlib.contextmanager
    def region(self, what: str = "attention"):
        if self._region_calls is not None:
            raise SequenceParallelError("sequence-parallel attention regions cannot nest")
        self._region_calls = 0
        try:
            yield self
            if self._region_calls == 0:
                raise SequenceParallelError(
                    f"rank {self.comm.rank}: {what} did not call the attention override in "
                    "transformer_options['optimized_attention_override']; sequence parallelism needs "
                    "every attention of the SP region to go through it")
        finally:
            self._region_calls = None


def install_exchanging_attention(transformer_options: dict, comm, strategy) -> ExchangingAttention:
    """Put a new ExchangingAttention for this rank into transformer_options (chaining any override)."""
    return ExchangingAttention(comm, strategy).install(transformer_options)
