"""Progress of long first-run work, one step per card: a log line and a line on the running node.

The first prompt builds the DiT replicas (minutes for a 66 GB file) and splits the text encoder
over the cards; each card's part is logged with its bytes and seconds and shown as a line of
text under the node ComfyUI runs (the sampler, the text encoder node), not on its progress bar:
the sampler's bar is the sampler's steps. `node_text` shows a line on a given node (a pool
stopped, say). Outside ComfyUI (tests, the CLI) only the log line remains.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time

from comfy.multidevice.comfy_cancel import cancel_requested, raise_cancel

log = logging.getLogger(__name__)


class CardProgress:
    """`done(...)` once per card, from any rank thread; logs to the caller's logger, shows
    "<what>: k/N cards ready" on the running node, and stops on ComfyUI's Cancel."""

    def __init__(self, what: str, cards: int, logger: logging.Logger = log):
        self.what = what
        self.cards = cards
        self.log = logger
        self._done = 0
        self._show = None
        self._lock = threading.Lock()

    def done(self, device, nbytes: int, how: str, start: float) -> None:
        self.log.info("%s for %s: %.2f GiB %s in %.1f s", self.what, device, nbytes / 2 ** 30, how,
                      time.monotonic() - start)
        with self._lock:
            if self._show is None:
                self._show = executing_node_text()
            self._done += 1
            show, done = self._show, self._done
        show(f"{self.what}: {done}/{self.cards} cards ready")
        cancel = cancel_requested()  # the rank threads' runner stops the other ranks with it
        if cancel is not None:
            raise_cancel(cancel)


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
    first step): a line under it that is not its progress bar. The node comes from ComfyUI's
    executing context, which a rank thread does not inherit, else from the server's last
    executing node (what ComfyUI's own progress hook falls back to)."""
    utils = sys.modules.get("comfy_execution.utils")  # only when ComfyUI runs us
    context = getattr(utils, "get_executing_context", lambda: None)()
    node_id = getattr(context, "node_id", None)
    if node_id is None:
        server = sys.modules.get("server")
        node_id = getattr(getattr(getattr(server, "PromptServer", None), "instance", None), "last_node_id", None)
    return node_text(node_id)
