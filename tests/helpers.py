"""Small helpers that test files of several sub-packages share."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import types
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


def bench_json(script: str, *args: str, timeout: float) -> dict:
    """Run bench/`script` with `args` in a fresh interpreter; its last stdout line, as JSON (a
    bench's one machine-readable line). Fails with the bench's stderr tail when it exits non-zero."""
    repo = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, str(repo / "bench" / script), *args],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


class Interrupted(BaseException):
    """Stands for ComfyUI's InterruptProcessingException (a BaseException on newest-h3)."""


def comfy_cancel_stand_ins(monkeypatch) -> dict:
    """Stand-ins for the parts of comfy.model_management and comfy.ops a Cancel goes through,
    installed in sys.modules: the interrupt flag `state["flag"]` under ComfyUI's re-entrant
    mutex, and the ops' per-layer check, which raises `Interrupted` and clears a set flag as
    upstream's does. Returns the state."""
    state = {"flag": False}
    mm = types.ModuleType("comfy.model_management")
    mm.interrupt_processing_mutex = threading.RLock()
    mm.InterruptProcessingException = Interrupted

    def processing_interrupted():
        with mm.interrupt_processing_mutex:
            return state["flag"]

    def throw_exception_if_processing_interrupted():
        with mm.interrupt_processing_mutex:
            if state["flag"]:
                state["flag"] = False
                raise Interrupted()
    mm.processing_interrupted = processing_interrupted
    mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    ops = types.ModuleType("comfy.ops")
    ops.run_every_op = throw_exception_if_processing_interrupted
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.ops", ops)
    return state
