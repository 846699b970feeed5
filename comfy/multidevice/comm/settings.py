"""The environment variables that choose the collective backend and its timeout.

COMFYUI_MULTI_DEVICE_BACKEND   auto | hccl | nccl | peer (default auto)
COMFYUI_MULTI_DEVICE_TIMEOUT_S seconds a rank waits for the others at a collective (default 600)
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

BACKEND_ENV = "COMFYUI_MULTI_DEVICE_BACKEND"
TIMEOUT_ENV = "COMFYUI_MULTI_DEVICE_TIMEOUT_S"
VALID_BACKENDS = ("auto", "hccl", "nccl", "peer")


DEFAULT_TIMEOUT_S = 600.0  # a rank may load weights for minutes before its first collective


def backend_from_env(value: str | None = None) -> str:
    name = (value if value is not None else os.environ.get(BACKEND_ENV, "auto")).strip().lower() or "auto"
    if name not in VALID_BACKENDS:
        raise ValueError(
            f"unknown multi-device backend {name!r} (from {BACKEND_ENV} or the backend option); "
            f"valid values: {', '.join(VALID_BACKENDS)}")
    return name


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} must be positive")
    return value
