"""The errors a collective or a backend raises, shared by every transport (a leaf module)."""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective could not complete (another rank failed, timed out, or inputs disagree)."""


class CollectiveAborted(CollectiveError):
    """Raised in a rank whose collective was cancelled because another rank failed."""


class CollectiveTimeout(CollectiveError):
    """Raised when some ranks did not reach a collective within the timeout."""


class BackendUnavailable(RuntimeError):
    """A forced backend cannot start (library missing, symbols missing, init failed)."""
