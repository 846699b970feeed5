"""How a torch.distributed NCCL/HCCL process group reacts to a failed or stuck collective:
in ComfyUI's own process it must abort and raise, never end the process (the server).

The libraries' process groups read these variables when a group is made:

- PyTorch's NCCL group, TORCH_NCCL_ASYNC_ERROR_HANDLING (older name NCCL_ASYNC_ERROR_HANDLING):
  3, the default, tears the whole process down when a collective fails or times out; 2 aborts
  the communicator and raises in the caller, leaving the process.
- torch_npu's HCCL group, HCCL_ASYNC_ERROR_HANDLING: 1, the default since torch 2.1, ends the
  process on an ERROR CQE (an RDMA link error); 0 handles no asynchronous error (the only other
  documented value). A collective whose peer is gone then fails through HCCL's own execution
  timeout, HCCL_EXEC_TIMEOUT (default 1836 s on the Atlas A2/A3 series; the Atlas training
  series rounds it down to a multiple of 68 s), and the error reaches the caller as an
  exception. torch_npu's docs ask for a process-group timeout above HCCL_EXEC_TIMEOUT, so HCCL
  reports a stuck collective before the group's watchdog does.

`set_collective_error_handling` runs just before a process group is made: in ComfyUI's process
(rank 0 of ranks as processes) it sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 or
HCCL_ASYNC_ERROR_HANDLING=0; in every process with an HCCL group it sets HCCL_EXEC_TIMEOUT below
the group's timeout (COMFYUI_MULTI_DEVICE_TIMEOUT_S). A variable the user set is kept; one that
would end the server, or a HCCL_EXEC_TIMEOUT not below the timeout, is named in a warning.
Worker processes keep the libraries' defaults: a worker that ends is reported by the pool.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

from comfy.multidevice.comm.settings import TIMEOUT_ENV

log = logging.getLogger(__name__)

NCCL_HANDLING_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_HANDLING_OLD_ENV = "NCCL_ASYNC_ERROR_HANDLING"  # read by PyTorch when the new name is unset
NCCL_ABORT_AND_RAISE = "2"
HCCL_HANDLING_ENV = "HCCL_ASYNC_ERROR_HANDLING"
HCCL_NO_ASYNC_HANDLING = "0"
HCCL_EXEC_TIMEOUT_ENV = "HCCL_EXEC_TIMEOUT"
HCCL_EXEC_TIMEOUT_STEP_S = 68  # the Atlas training series rounds HCCL_EXEC_TIMEOUT down to this step

_set_here: dict[str, str] = {}  # what this module set, so a later group may set it again


def hccl_exec_timeout_below(timeout_s: float) -> int:
    """HCCL_EXEC_TIMEOUT for a process-group timeout: the largest multiple of 68 s below it (the
    same on every Ascend series), or, for a timeout of 68 s or less, one second below it."""
    below = int(timeout_s) - 1 if timeout_s == int(timeout_s) else int(timeout_s)
    stepped = below // HCCL_EXEC_TIMEOUT_STEP_S * HCCL_EXEC_TIMEOUT_STEP_S
    return stepped if stepped else max(below, 1)


def _user_value(environ: MutableMapping, name: str) -> str | None:
    value = environ.get(name)
    return None if value is None or _set_here.get(name) == value else value


def _set(environ: MutableMapping, done: dict, name: str, value: str, why: str) -> None:
    environ[name] = _set_here[name] = done[name] = value
    log.info("multi-device: set %s=%s %s", name, value, why)


def set_collective_error_handling(backend: str, timeout_s: float, server_process: bool,
                                  environ: MutableMapping | None = None) -> dict[str, str]:
    """Set the variables above for a `backend` ("nccl", "hccl", "gloo") group with `timeout_s`,
    before it is made; `server_process`: this is ComfyUI's process. Returns what was set."""
    environ = os.environ if environ is None else environ
    done: dict[str, str] = {}
    if backend == "nccl" and server_process:
        user = _user_value(environ, NCCL_HANDLING_ENV) or environ.get(NCCL_HANDLING_OLD_ENV)
        if user is None:
            _set(environ, done, NCCL_HANDLING_ENV, NCCL_ABORT_AND_RAISE,
                 "(a failed or timed-out collective aborts its communicator and raises in ComfyUI's "
                 "process instead of ending it)")
        elif user.strip() != NCCL_ABORT_AND_RAISE:
            log.warning("multi-device: %s=%s is kept as you set it; unless it is 0 or 2, a collective that "
                        "fails or times out ends ComfyUI's process (2: abort and raise)", NCCL_HANDLING_ENV, user)
    if backend == "hccl" and server_process:
        user = _user_value(environ, HCCL_HANDLING_ENV)
        if user is None:
            _set(environ, done, HCCL_HANDLING_ENV, HCCL_NO_ASYNC_HANDLING,
                 "(with 1, torch_npu's default, an HCCL link error ends ComfyUI's process)")
        elif user.strip() != HCCL_NO_ASYNC_HANDLING:
            log.warning("multi-device: %s=%s is kept as you set it; with 1 an HCCL link error ends "
                        "ComfyUI's process (0 leaves it to HCCL_EXEC_TIMEOUT)", HCCL_HANDLING_ENV, user)
    if backend == "hccl":
        _order_hccl_exec_timeout(environ, done, timeout_s)
    return done


def _order_hccl_exec_timeout(environ: MutableMapping, done: dict, timeout_s: float) -> None:
    user = _user_value(environ, HCCL_EXEC_TIMEOUT_ENV)
    if user is None:
        value = hccl_exec_timeout_below(timeout_s)
        _set(environ, done, HCCL_EXEC_TIMEOUT_ENV, str(value),
             f"(s; below the process group's timeout of {timeout_s:g}s from {TIMEOUT_ENV}, so HCCL ends "
             "a stuck collective with an error first)")
        if value < HCCL_EXEC_TIMEOUT_STEP_S:
            log.warning("multi-device: the Atlas training series raises an HCCL_EXEC_TIMEOUT below 68 s "
                        "to 68 s, above the process group's timeout of %gs: raise %s above 68",
                        timeout_s, TIMEOUT_ENV)
        return
    text = user.strip()
    seconds = int(text) if text.isascii() and text.isdigit() else None
    if seconds is None or seconds == 0 or seconds >= timeout_s:
        log.warning("multi-device: %s=%s is kept as you set it, but it is not a number of seconds below "
                    "the process group's timeout of %gs (%s; 0 means never): a stuck HCCL collective is "
                    "then ended by the group's watchdog, not by HCCL. Set %s below %g, or raise %s above it",
                    HCCL_EXEC_TIMEOUT_ENV, user, timeout_s, TIMEOUT_ENV, HCCL_EXEC_TIMEOUT_ENV, timeout_s,
                    TIMEOUT_ENV)
