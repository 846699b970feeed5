"""Option checks shared by `run` and `doctor`: ASCII-only numbers, output folders, machine limits.

All of them run before anything is built.

argparse's `type=int` takes "１２" (full-width digits), "1_000" and " 12 "; `type=float`
takes "nan" and "inf". The types here take plain ASCII decimals only, so a value is what the
user meant or an error that says so (argparse then exits 2 naming the option).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from pathlib import Path

from comfy.multidevice.comm.settings import MAX_TIMEOUT_S, seconds_problem

_INTEGER = re.compile(r"-?[0-9]+")
_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def integer(text: str) -> int:
    """argparse type: an integer written with the ASCII digits 0-9."""
    if not _INTEGER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; write it with the digits 0-9")
    return int(text)


def finite_number(text: str) -> float:
    """argparse type: a finite decimal number (no nan, no inf), ASCII digits."""
    if not _NUMBER.fullmatch(text) or not math.isfinite(float(text)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number; write it like 0.5 or 1e-5")
    return float(text)


def seconds(text: str) -> float:
    """argparse type: a timeout in seconds, checked as COMFYUI_MULTI_DEVICE_TIMEOUT_S is."""
    value, problem = seconds_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} {problem}; use seconds above 0 and at most "
                                         f"{MAX_TIMEOUT_S:g}")
    return value


def folder(text: str) -> Path:
    """argparse type: a folder path that is not empty (an empty one would mean the current folder)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path would write into the current folder; "
                                         "name a folder")
    return Path(text)


def folder_problem(path: Path, files: tuple[str, ...] = ()) -> str | None:
    """Why `path` cannot be used as an output folder (None when it can): an existing file, a
    file in the way above it, not writable, or one of the `files` to be written a folder."""
    if path.exists() and not path.is_dir():
        return "is an existing file, not a folder; name a folder (it is created when missing)"
    existing = path
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return f"cannot be created: {existing} is a file; name another folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable ({existing} does not let this user write); name another folder"
    try:  # what access() cannot tell (root, /proc, a read-only mount): try, leave nothing behind
        os.rmdir(tempfile.mkdtemp(prefix=".write-test-", dir=existing))
    except OSError as exc:
        return f"cannot be written: making a folder in {existing} fails ({exc.strerror}); " \
               "name another folder"
    for name in files:
        if (path / name).is_dir():
            return f"holds a folder named {name} where the run writes that file; remove it or " \
                   "name another folder"
    return None


def max_cpu_ranks() -> int:
    """CPU ranks are threads sharing the cores: beyond twice the cores they only take turns."""
    return max(8, 2 * (os.cpu_count() or 1))


def cpu_ranks_problem(count: int | None) -> str | None:
    """Why `--devices count` CPU ranks are too many for this machine; None when they are not."""
    most = max_cpu_ranks()
    if count is None or count <= most:
        return None
    return (f"--devices {count}: CPU ranks are threads sharing this machine's {os.cpu_count()} CPU "
            f"core(s), and more than {most} only take turns; use --devices {most} or fewer")
