"""A step's tensors that the previous step already sent travel as their digest: the
conditioning (text states, reference latents) goes to the workers once per prompt, the
latents and the timestep every step.

Rank 0 (`SentTensors.pack`) walks a message's lists, tuples and dicts; each tensor of at
least MIN_BYTES is named by the BLAKE2 digest of its bytes, and one whose digest the previous
message carried is replaced by a `Repeat` of it, the others kept aside to travel once. A
worker (`ReceivedTensors.unpack`) puts them back. Both sides keep exactly the previous
message's tensors (the worker their values, rank 0 their digests), so they agree on what a
digest means without more messages; one the worker does not hold is an error, never a
stale value. A `Repeat` travels as a wire record (workers/wire.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from comfy.multidevice.tensor_bytes import tensor_nbytes
from comfy.multidevice.workers.wire import wire_record

MIN_BYTES = 16 * 1024  # below this, hashing a tensor costs more than sending it


@wire_record("repeat")
@dataclass(frozen=True)
class Repeat:
    digest: str

    def __post_init__(self):
        if type(self.digest) is not str:
            raise TypeError(f"a Repeat names its tensor by a digest string, not {type(self.digest).__name__}")


def tensor_digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    meta = f"{t.dtype}|{tuple(t.shape)}".encode()
    return hashlib.blake2b(meta + data.tobytes(), digest_size=16).hexdigest()


def _walk(value: Any, on_tensor) -> Any:
    """`value` with each tensor (and Repeat) replaced by on_tensor(it); containers rebuilt."""
    if torch.is_tensor(value) or isinstance(value, Repeat):
        return on_tensor(value)
    if isinstance(value, dict):
        return {k: _walk(v, on_tensor) for k, v in value.items()}
    if isinstance(value, list):
        return [_walk(v, on_tensor) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_walk(v, on_tensor) for v in value)
    return value


class SentTensors:
    """Rank 0's side: which digests the previous message carried."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        self.min_bytes = min_bytes
        self._previous: set[str] = set()

    def pack(self, value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """(value with repeated tensors as Repeat, the new tensors by digest)."""
        carried: set[str] = set()
        new: dict[str, torch.Tensor] = {}

        def on_tensor(t):
            if not torch.is_tensor(t) or tensor_nbytes(t) < self.min_bytes:
                return t
            digest = tensor_digest(t)
            carried.add(digest)
            if digest not in self._previous:
                new[digest] = t
            return Repeat(digest)

        packed = _walk(value, on_tensor)
        self._previous = carried
        return packed, new


class ReceivedTensors:
    """A worker's side: the previous message's tensors by digest."""

    def __init__(self):
        self._previous: dict[str, torch.Tensor] = {}

    def unpack(self, value: Any, new: dict[str, torch.Tensor]) -> Any:
        held = {**self._previous, **new}
        carried: dict[str, torch.Tensor] = {}

        def on_tensor(item):
            if not isinstance(item, Repeat):
                return item
            if item.digest not in held:
                raise RuntimeError(f"rank 0 named tensor {item.digest} as sent before, but this worker does "
                                   "not hold it; the pool is out of step")
            carried[item.digest] = held[item.digest]
            return held[item.digest]

        out = _walk(value, on_tensor)
        self._previous = carried
        return out
