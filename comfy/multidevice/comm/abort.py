"""Watching a library backend's collectives, and aborting its communicators when one is stuck.

A collective that has entered HCCL or NCCL cannot be cancelled from Python: when a peer never
joins it (a rank stuck in its own code, a dead link) the rank waits inside the library for
ever, and on a card its kernel keeps spinning, so the rank thread waits in `synchronize()`
and the card stays busy. A library that can abort a communicator gets both back:

- each rank marks the moment it first calls the library in a collective and clears the mark
  once that collective's results are synchronized (`_entering_library`, `_watched`);
- the coordinator's `run()` polls `collective_fault(timeout_s)` while it waits: an
  asynchronous error a communicator reports (e.g. `ncclCommGetAsyncError`), or ranks inside the
  library for longer than the timeout. It then aborts the communicators, so every rank inside
  the library returns (with CollectiveAborted), and closes the coordinator;
- `abort(reason)` replaces destroy for a communicator that may be stuck (ranks abandoned, a
  failed run): destroy would wait for the stuck work, abort stops it and frees the card.

A rank that reads a communicator just before another thread aborts it may still call the
library on it (the libraries leave that undefined); `_entering_library` makes that window a
few instructions wide.
"""

from __future__ import annotations

import logging
import time

from comfy.multidevice.comm.ctypes_lib import CollectiveLibraryError
from comfy.multidevice.comm.errors import CollectiveAborted, CollectiveTimeout
from comfy.multidevice.comm.settings import TIMEOUT_ENV

log = logging.getLogger(__name__)


class WatchedCommunicators:
    """Mixin for a CommunicatorBackend whose library has `can_abort`, `comm_abort(comm)` and
    `async_error(comm)`; its flat hooks call `_entering_library(rank)` before their first call."""

    def __init__(self, coordinator, *args, **kwargs):
        self.aborted: str | None = None  # why the communicators were aborted
        self._entered: list[float | None] = [None] * len(coordinator.devices)
        super().__init__(coordinator, *args, **kwargs)

    # -- the ranks' side
    def _entering_library(self, rank: int) -> None:
        if self.aborted is not None:
            raise self._aborted_error(rank)
        if self._entered[rank] is None:
            self._entered[rank] = time.monotonic()

    def _aborted_error(self, rank: int) -> CollectiveAborted:
        return CollectiveAborted(f"rank {rank}: the {self.library.what} communicators were aborted "
                                 f"({self.aborted}); this collective's results were dropped")

    def _watched(self, rank: int, collective, args, kwargs):
        try:
            out = collective(rank, *args, **kwargs)
        except Exception as exc:
            if self.aborted is not None:  # the abort made the library call fail: say why
                raise self._aborted_error(rank) from exc
            raise
        finally:
            self._entered[rank] = None
        if self.aborted is not None:  # finished while the abort ran: not to be trusted
            raise self._aborted_error(rank)
        return out

    def all_gather_v(self, rank, *args, **kwargs):
        return self._watched(rank, super().all_gather_v, args, kwargs)

    def all_to_all_v(self, rank, *args, **kwargs):
        return self._watched(rank, super().all_to_all_v, args, kwargs)

    def all_reduce(self, rank, *args, **kwargs):
        return self._watched(rank, super().all_reduce, args, kwargs)

    def _all_reduce_flat(self, rank, *args):
        self._entering_library(rank)
        return super()._all_reduce_flat(rank, *args)

    # -- the coordinator's side
    def collective_fault(self, timeout_s: float) -> tuple[int, Exception] | None:
        """(rank, error) for the first thing wrong with the communicators, else None: an error a
        communicator reports, or ranks inside the library for more than `timeout_s` seconds."""
        for rank, comm in enumerate(list(self.comms)):
            try:
                error = self.library.async_error(comm)
            except CollectiveLibraryError as exc:  # asking failed: the communicator is broken too
                error = exc
            if error is not None:
                error.add_note(f"(reported by the {self.library.what} communicator of rank {rank} "
                               "while the ranks ran)")
                return rank, error
        now = time.monotonic()
        late = [r for r, since in enumerate(self._entered) if since is not None and now - since > timeout_s]
        if late:
            return late[0], CollectiveTimeout(
                f"rank(s) {late} waited in {self.library.what} for more than {timeout_s:g}s in one "
                f"collective: a peer never joined it or its link failed (raise {TIMEOUT_ENV} if the "
                "collective is just that slow)")
        return None

    def abort(self, reason: str) -> bool:
        """Abort every communicator instead of destroying it; False when the library cannot
        (then the communicators are left as they are)."""
        if self.aborted is not None:
            return True
        if not self.library.can_abort:
            return False
        self.aborted = reason  # first: no rank enters the library from here on
        comms, self.comms = self.comms, []
        for comm in comms:
            try:
                self.library.comm_abort(comm)
            except CollectiveLibraryError as exc:
                log.warning("multi-device: %s", exc)
        log.warning("multi-device: aborted the %s communicators of %d card(s) instead of destroying "
                    "them (%s): a rank inside a collective returns and the cards are free of them",
                    self.library.what, len(comms), reason)
        return True
