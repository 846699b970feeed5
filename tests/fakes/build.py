"""Build the fake collective libraries (C, host memory) with the system compiler.

Used by the tests and by bench/ so both run the real ctypes backends without hardware.
Builds are cached by source hash and flags in a temporary folder.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent
BUILT: dict[str, set[str]] = {}  # name -> the libraries built (or found built) in this process


class FakeBuildError(RuntimeError):
    pass


def build_fake(name: str, defines: tuple[str, ...] = (), out_dir: str | os.PathLike | None = None) -> str:
    """Compile tests/fakes/<name>.c into a shared library; return its path."""
    source = FAKES_DIR / f"{name}.c"
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FakeBuildError("no C compiler found (cc/gcc); install gcc to build the fake libraries")
    flags = ["-O2", "-shared", "-fPIC", "-pthread", *[f"-D{d}" for d in defines]]
    # The shared header is part of every fake: a change to it must rebuild them.
    headers = b"".join(h.read_bytes() for h in sorted(FAKES_DIR.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:16]
    target_dir = Path(out_dir or Path(tempfile.gettempdir()) / "minimax_h3_fakes")
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / f"lib{name}-{digest}.so"
    if not target.exists():
        partial = target.with_suffix(f".{os.getpid()}.tmp")
        result = subprocess.run([compiler, *flags, "-o", str(partial), str(source)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise FakeBuildError(f"building {source.name} failed:\n{result.stderr}")
        os.replace(partial, target)  # atomic: concurrent builders never see half a file
    BUILT.setdefault(name, set()).add(str(target))
    return str(target)
