"""Progress of long first-run work, one step per card: a log line and ComfyUI's progress bar.

The first prompt builds the DiT replicas (minutes for a 66 GB file) and splits the text encoder
over the cards; each card's part is logged with its bytes and seconds and moves the bar that the
UI shows under the running node. `node_text` shows a line of text on a node in the page (a pool
stopped, say). Outside ComfyUI (tests, the CLI) only the log line remains.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time

log = logging.getLogger(__name__)


class CardProgress:
    """`done(...)` once per card, from any rank thread; logs to the caller's logger."""

    def __init__(self, what: str, cards: int, logger: logging.Logger = log):
        self.what = what
        self.cards = cards
        self.log = logger
        self._bar = None
        self._lock = threading.Lock()

    def done(self, device, nbytes: int, how: str, start: float) -> None:
        self.log.info("%s for %s: %.2f GiB %s in %.1f s", self.what, device, nbytes / 2 ** 30, how,
                 time.monotonic() - start)
        with self._lock:
            if self._bar is None:
                self._bar = _comfy_progress_bar(self.cards)
            bar = self._bar
        if bar is not None:
            bar.update(1)  # ComfyUI's hook raises its interrupt exception here on Cancel


def _comfy_progress_bar(total: int):
    try:
        utils = importlib.import_module("comfy.utils")  # ComfyUI's; absent when we run on our own
    except ImportError:
        return None
    bar_type = getattr(utils, "ProgressBar", None)
    return bar_type(total) if bar_type is not None else None


def node_text(node_id):
    """A function that shows a line of text on node `node_id` in ComfyUI's page (its progress
    text), or does nothing outside a ComfyUI server or without a node id."""
    def show(text: str) -> None:
        if node_id is None:
            return
        try:
            server = importlib.import_module("server")  # ComfyUI's; absent when we run on our own
        except ImportError:
            return
        instance = getattr(getattr(server, "PromptServer", None), "instance", None)
        send = getattr(instance, "send_progress_text", None)
        if send is not None:
            send(text, node_id)
    return show


def executing_node_text():
    """node_text for the node ComfyUI runs now (the sampler, when a worker pool starts at the
    first step): a line under it that is not its progress bar."""
    utils = sys.modules.get("comfy_execution.utils")  # only when ComfyUI runs us
    context = getattr(utils, "get_executing_context", lambda: None)()
    return node_text(getattr(context, "node_id", None))
