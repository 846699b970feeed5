"""An abortable W-party barrier: a failing rank releases the others at once, a missing one is named.
"""

from __future__ import annotations

import logging
import threading

from comfy.multidevice.comm.settings import TIMEOUT_ENV
from comfy.multidevice.comm.errors import CollectiveAborted, CollectiveTimeout

log = logging.getLogger(__name__)

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
    def waiting(self) -> int:
        """How many ranks are waiting here now (each of them times out by itself)."""
        return len(self._arrived)

    @property
    def aborted(self) -> str | None:
        return self._abort_reason
