"""What the fake libraries recorded instead of failing, read from this process.

Real NCCL returns no error when two collectives overlap on one device: it hangs or corrupts
data. The fake completes the call and records a violation (fake_nccl.c); these helpers read
that record, so a test can assert it and tests/conftest.py can fail a test that left one.
"""

from __future__ import annotations

import ctypes
import os

from tests.fakes.build import BUILT

_LEN = 4096


def loaded(path: str) -> ctypes.CDLL | None:
    """The library at `path` if this process has loaded it already (never loads it)."""
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def take_nccl_violations(path: str) -> list[str]:
    """The violations the fake libnccl at `path` recorded since the last take (cleared now)."""
    lib = loaded(path)
    if lib is None:
        return []
    buf = ctypes.create_string_buffer(_LEN)
    count = lib.fakeNcclViolations(buf, _LEN)
    lines = buf.value.decode(errors="replace").splitlines()
    if count > len(lines):
        lines.append(f"... {count - len(lines)} more")
    return lines


def take_all_nccl_violations() -> list[str]:
    """The violations of every fake libnccl built and loaded in this process."""
    return [line for path in sorted(BUILT.get("fake_nccl", ())) for line in take_nccl_violations(path)]


def in_flight(path: str, function: str, device: int) -> int:
    """How many collectives the fake at `path` has in flight on `device` now
    (`function`: fakeHcclInFlight or fakeNcclInFlight)."""
    lib = loaded(path)
    return 0 if lib is None else getattr(lib, function)(device)
