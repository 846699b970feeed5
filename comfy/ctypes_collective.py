"""What the HCCL and NCCL ctypes backends share.

- `CFunction` / `CLibrary`: a declarative table of C functions (name, result, argument
  types, optional or not) bound once from a shared library.
- `FlatCollectiveBackend`: turns the coordinator's all-gather-V and all-reduce into
  calls on flat device buffers, issued by each rank thread on its device's current
  stream, synchronized before the results are used. Subclasses supply the library
  calls (`_all_gather_v_flat`, `_all_reduce_flat`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from comfy.multidevice import BackendUnavailable, gathered_shape, synchronize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CFunction:
    name: str
    restype: Any
    argtypes: tuple
    optional: bool = False


class CLibrary:
    """A shared library with the functions of `table` bound and typed."""

    def __init__(self, path: str, table: Sequence[CFunction], what: str, path_env: str):
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as exc:
            raise BackendUnavailable(
                f"cannot load {what} library {path!r} ({exc}); install it or point {path_env} "
                "at it") from exc
        self.path = path
        self.functions: dict[str, Any] = {}
        self.missing: list[str] = []
        for spec in table:
            try:
                fn = getattr(self.lib, spec.name)
            except AttributeError:
                if spec.optional:
                    self.missing.append(spec.name)
                    continue
                raise BackendUnavailable(
                    f"{what} library {path!r} has no symbol {spec.name}; it is too old or not "
                    f"{what}") from None
            fn.restype = spec.restype
            fn.argtypes = list(spec.argtypes)
            self.functions[spec.name] = fn

    @classmethod
    def from_functions(cls, functions: dict[str, Any], path: str = "<in-process>") -> "CLibrary":
        """A library made of Python callables (tests use it to record ctypes arguments)."""
        self = cls.__new__(cls)
        self.lib, self.path, self.functions, self.missing = None, path, dict(functions), []
        return self

    def has(self, name: str) -> bool:
        return name in self.functions

    def __getitem__(self, name: str):
        return self.functions[name]


def library_path(env_var: str, default: str) -> str:
    return os.environ.get(env_var) or default


def current_stream_handle(device: torch.device) -> int | None:
    """The raw stream handle of the calling thread's current stream (None on CPU)."""
    if device.type == "npu":
        return torch.npu.current_stream(device).npu_stream
    if device.type == "cuda":
        return torch.cuda.current_stream(device).cuda_stream
    return None


class FlatCollectiveBackend:
    """All-gather-V and all-reduce over flat buffers; subclasses issue the library calls."""

    name = "flat"
    reads_peer_memory = False  # the library moves the data; the stream orders it

    def __init__(self, coordinator):
        self.coordinator = coordinator

    # Subclass hooks: issue the call on `stream` for `rank`; raise on a non-zero result.
    # They return whatever host memory the call reads asynchronously (counts, displacements);
    # the caller keeps it alive until the stream is synchronized.
    def _all_gather_v_flat(self, rank, send, recv, counts, displs, stream):
        raise NotImplementedError

    def _all_reduce_flat(self, rank, send, recv, op, stream):
        raise NotImplementedError

    def all_gather_v(self, rank, tensors, dims, metas, slot):
        device = self.coordinator.devices[rank]
        out = []
        for i, dim in enumerate(dims):
            shard_metas = [m[i] for m in metas]
            counts = [_numel(m.shape) for m in shard_metas]
            displs = [sum(counts[:r]) for r in range(len(counts))]
            send = tensors[i].contiguous()  # the library reads one dense buffer
            recv = torch.empty(sum(counts), dtype=send.dtype, device=device)
            stream = current_stream_handle(device)  # read right before the call
            keepalive = self._all_gather_v_flat(rank, send, recv, counts, displs, stream)
            synchronize(device)
            del keepalive
            out.append(_unflatten(recv, shard_metas, counts, displs, dim))
        return out

    def all_reduce(self, rank, tensor, op, slot):
        device = self.coordinator.devices[rank]
        send = tensor.contiguous()
        recv = torch.empty_like(send)
        stream = current_stream_handle(device)
        self._all_reduce_flat(rank, send, recv, op, stream)
        synchronize(device)
        return recv

    def close(self):
        pass


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _unflatten(flat: torch.Tensor, metas, counts, displs, dim: int) -> torch.Tensor:
    if dim == 0:  # rank-major flat layout already is the concat along dim 0
        return flat.view(gathered_shape(metas, 0))
    parts = [flat.narrow(0, d, c).view(m.shape) for m, c, d in zip(metas, counts, displs)]
    return torch.cat(parts, dim=dim)
