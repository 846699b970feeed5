"""Small helpers that test files of several sub-packages share."""

from __future__ import annotations

import socket


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
