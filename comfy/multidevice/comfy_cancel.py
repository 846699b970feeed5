"""ComfyUI's Cancel as every rank engine sees it: whether it was pressed, its interrupt raised,
and, inside a DiT forward, one way to stop: every rank together as a block starts.

Only looked up when ComfyUI has already imported its modules: the core runs without ComfyUI,
and importing model_management would probe devices as a side effect. A DiT forward stops the
same way in both engines (`BlockCancel`, installed by the SP adapter: sp/minimax_h3.py): rank 0
reads ComfyUI's flag as each block starts and posts it; every rank reads it one block later and
all stop there together, never inside a block: there a raise on one rank would leave the
others in a collective it never joins, and the ranks would have to be thrown away (a worker
pool: minutes to load again on cards; rank threads: communicators aborted). The post travels
over `workers/control.py` `BlockFlag` between processes and `comm/collectives.py`
`SharedBlockFlag` between rank threads. ComfyUI's ops check the flag before every layer
(`comfy.ops.run_every_op`); `checks_at_block_starts` makes that check step aside while the
flag is set. Outside ComfyUI, or on a ComfyUI without the per-layer hook, it changes nothing.
Work of rank threads without blocks (a text encoder, a VAE) stops at its next collective
(comm/group.py).
"""

from __future__ import annotations

import contextlib
import sys
import threading


def cancel_requested():
    """ComfyUI's model_management when its Cancel flag is set, else None."""
    module = sys.modules.get("comfy.model_management")
    probe = getattr(module, "processing_interrupted", None)
    return module if probe is not None and probe() else None


def raise_cancel(module) -> None:
    """Raise ComfyUI's InterruptProcessingException the way its sampler does (clearing the flag)."""
    module.throw_exception_if_processing_interrupted()
    raise module.InterruptProcessingException()  # the flag was already cleared by someone else


class CancelledAtBlock(Exception):
    """Every rank of a forward stopped as block `block` started (ComfyUI's Cancel); the ranks
    stay usable. `module`: ComfyUI's model_management, on rank 0 (None on the others)."""

    def __init__(self, block: int, module=None):
        super().__init__(f"cancelled at block {block}")
        self.block = block
        self.module = module


class BlockCancel:
    """ComfyUI's Cancel inside one rank's DiT forward, one block late.

    `flag` carries rank 0's yes/no to every rank: `post(value)` as a block starts returns what
    was posted as the previous one started (False at block 0) and, when that was yes, posts
    nothing more; `settle()` reads what is in flight. Rank 0 posts ComfyUI's flag, the others
    post nothing; all read the same value at the same block, so all stop there.
    """

    def __init__(self, flag, rank: int):
        self.flag = flag
        self.rank = rank
        self._module = None  # rank 0: ComfyUI's model_management once its flag was seen set

    def at_block_start(self, index: int) -> None:
        module = cancel_requested() if self.rank == 0 else None
        if self.flag.post(module is not None):
            raise CancelledAtBlock(index, self._module)
        self._module = module or self._module

    def at_forward_end(self, blocks: int) -> None:
        """After the last block: a Cancel posted as it started stops the forward here."""
        if self.flag.settle():
            raise CancelledAtBlock(blocks, self._module)


_lock = threading.Lock()
_depth = 0
_original = None


def _deferring_check(original, model_management):
    def run_every_op(*args, **kwargs):
        # held across the call, so a Cancel pressed now waits and is seen at the next block
        # start (ComfyUI's mutex is re-entrant: the original check takes it again)
        with model_management.interrupt_processing_mutex:
            if model_management.processing_interrupted():
                return None
            return original(*args, **kwargs)
    run_every_op.multinpu_deferring = True
    return run_every_op


@contextlib.contextmanager
def checks_at_block_starts():
    """While inside, ComfyUI's per-layer Cancel check leaves a set flag to the block starts."""
    global _depth, _original
    ops = sys.modules.get("comfy.ops")
    model_management = sys.modules.get("comfy.model_management")
    hookable = (getattr(ops, "run_every_op", None) is not None
                and hasattr(model_management, "interrupt_processing_mutex")
                and hasattr(model_management, "processing_interrupted"))
    if not hookable:
        yield
        return
    with _lock:
        if _depth == 0:
            _original = ops.run_every_op
            ops.run_every_op = _deferring_check(_original, model_management)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                ops.run_every_op, _original = _original, None
