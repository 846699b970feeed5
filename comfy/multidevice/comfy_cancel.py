"""ComfyUI's Cancel as every rank engine sees it: whether it was pressed, its interrupt raised,
and its per-layer check held back to the block starts while a worker pool runs a forward.

Only looked up when ComfyUI has already imported its modules: the core runs without ComfyUI,
and importing model_management would probe devices as a side effect. Rank threads stop on a
Cancel at their next collective (comm/group.py aborts the barrier); worker processes stop
together as a block starts (workers/pool.py), never inside a block: there a raise on rank 0
would leave the workers in a collective rank 0 never joins, and the pool would have to be
thrown away (minutes to load again on cards). ComfyUI's ops check the flag before every layer
(`comfy.ops.run_every_op`); `checks_at_block_starts` makes that check step aside while the
flag is set. Outside ComfyUI, or on a ComfyUI without the per-layer hook, it changes nothing.
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
