"""Small helpers that test files of several sub-packages share."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recording_progress_bar(steps: list):
    """A stand-in for ComfyUI's comfy.utils.ProgressBar that appends ("new", total) and
    ("step", value) to `steps`; the sampler's own update_absolute is ignored."""

    class RecordingBar:
        def __init__(self, total):
            steps.append(("new", total))

        def update(self, value):
            steps.append(("step", value))

        def update_absolute(self, value, total=None, preview=None):
            pass
    return RecordingBar


def file_hashes(root: Path, skip=lambda relative: False) -> dict:
    """Relative POSIX path -> sha256 of every file under `root` (links as their target text)
    whose path `skip` does not reject; folders appear as path/ -> None, so an added empty
    folder counts too."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = Path(folder) / name
            relative = path.relative_to(root).as_posix()
            if skip(relative):
                continue
            if path.is_symlink():
                found[relative] = "link:" + os.readlink(path)
            elif path.is_dir():
                found[relative + "/"] = None
            else:
                found[relative] = hashlib.sha256(path.read_bytes()).hexdigest()
        dirs[:] = [d for d in dirs if not skip((Path(folder) / d).relative_to(root).as_posix())]
    return found
