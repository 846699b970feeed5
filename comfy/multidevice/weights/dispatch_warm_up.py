"""torch's one-time import for tensor subclasses with dispatch, started early on a daemon thread."""

from __future__ import annotations

import importlib
import sys
import threading

import torch


# The first op on any tensor with __torch_dispatch__ in a process makes torch import
# torch.distributed.tensor (for its DTensor fast path; sympy with it): about 0.4 s of one core
# and 40 MB, once per process. A ComfyUI server has paid it before its first prompt; a
# standalone process (the CLI, each torchrun rank) pays it on its first op on a view unless
# `start_dispatch_warm_up` was called where the process waits anyway.
_DISPATCH_IMPORT = "torch.distributed.tensor"
_warm_up_lock = threading.Lock()
_warm_up_thread: threading.Thread | None = None


def start_dispatch_warm_up() -> threading.Thread | None:
    """Start torch's one-time import for dispatch subclasses on a daemon thread (once per
    process; None when it is done or under way already, or torch.distributed is absent). The
    first op on a view then waits at most for what is left of it."""
    global _warm_up_thread
    if _DISPATCH_IMPORT in sys.modules or not torch.distributed.is_available():
        return None
    with _warm_up_lock:
        if _warm_up_thread is not None:
            return None

        def warm_up():
            try:
                importlib.import_module(_DISPATCH_IMPORT)
            except Exception:  # torch retries at the first op and reports it there, if it must
                pass
        _warm_up_thread = threading.Thread(target=warm_up, name="read-only-dispatch-warm-up", daemon=True)
        _warm_up_thread.start()
        return _warm_up_thread
