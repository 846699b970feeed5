"""ComfyUI's Cancel inside a worker pool's forward is taken at the next block start, not inside
a block: there every rank stops together and the pool stays up for the next prompt.

ComfyUI's ops check the Cancel flag before every layer (`comfy.ops.run_every_op` calls
`model_management.throw_exception_if_processing_interrupted`). On rank 0 of a pool, a raise
inside a block would leave the workers in a collective that rank 0 never joins, so the pool
would have to be thrown away (minutes to load again on cards). While rank 0 runs a pool's
forward, `checks_at_block_starts` makes that per-layer check step aside while the flag is set;
the pool's own check as each block starts (WorkerPool._cancel_point) then tells every rank.
Outside ComfyUI, or on a ComfyUI without the per-layer hook, it changes nothing.
"""

from __future__ import annotations

import contextlib
import sys
import threading

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
