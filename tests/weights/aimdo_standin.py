"""A STAND-IN for comfy-aimdo's ModelMMAP, and a state dict made the way upstream's loader makes it.

comfy-aimdo's C library initialises only beside a CUDA or ROCm torch, so a real ModelMMAP
cannot be made on these machines. The stand-in follows the contract written down in
comfy/multidevice/weights/aimdo_mapping.py exactly (and upstream's own `load_safetensors`
accepts it in tests/upstream/test_aimdo_mapping.py): the whole file mapped read-only (Python's
mmap; aimdo maps it PROT_READ too), `get()` the address of its first byte,
`get_file_handle()` the descriptor, the mapping released when the object is collected.
`loader_state_dict` builds the state dict over it as upstream's loader does: frombuffer views
of a memoryview of the data section, each storage carrying the two attributes.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import threading
import warnings
from typing import NamedTuple

import torch

from comfy.multidevice.weights.aimdo_mapping import FILE_SLICE_ATTRIBUTE, MMAP_REFS_ATTRIBUTE
from comfy.multidevice.weights.safetensors_header import SAFETENSORS_DTYPES


class StandInModelMMAP:
    """Stands in for comfy_aimdo.model_mmap.ModelMMAP (same methods, same lifetime)."""

    made = 0  # how many were constructed, process-wide

    def __init__(self, filepath):
        self._file = open(os.fspath(filepath), "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            probe = torch.frombuffer(self._map, dtype=torch.uint8, count=1)
        self._address = probe.data_ptr()  # a read-only mmap gives ctypes no address of its own
        del probe  # (no export left, so the map can be closed when this object goes)
        StandInModelMMAP.made += 1

    def get(self) -> int:
        return self._address

    def get_file_handle(self) -> int:
        return self._file.fileno()

    def __del__(self):
        mapping = getattr(self, "_map", None)
        if mapping is not None:
            mapping.close()
            self._file.close()


class StandInFileSlice(NamedTuple):
    """Stands in for comfy.memory_management.TensorFileSlice (same fields, same order)."""
    file_ref: object
    lock: object
    offset: int
    size: int


def loader_state_dict(path, model_mmap: StandInModelMMAP) -> dict[str, torch.Tensor]:
    """The state dict upstream's dynamic-VRAM loader makes over `model_mmap`'s mapping of `path`."""
    size = os.path.getsize(path)
    whole = memoryview((ctypes.c_uint8 * size).from_address(model_mmap.get()))
    (header_bytes,) = struct.unpack("<Q", whole[:8])
    header = json.loads(bytes(whole[8:8 + header_bytes]))
    data_start = 8 + header_bytes
    data = whole[data_start:]
    lock = threading.Lock()
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, (begin, end) = SAFETENSORS_DTYPES[entry["dtype"]], entry["data_offsets"]
        if begin == end:
            out[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        tensor = torch.frombuffer(data[begin:end], dtype=dtype).view(entry["shape"])
        storage = tensor.untyped_storage()
        setattr(storage, FILE_SLICE_ATTRIBUTE,
                StandInFileSlice(model_mmap.get_file_handle(), lock, data_start + begin, end - begin))
        setattr(storage, MMAP_REFS_ATTRIBUTE, (model_mmap, data))
        out[name] = tensor
    return out


def file_mappings(path) -> int:
    """How many regions of this process map `path` (/proc/self/maps)."""
    real = os.path.realpath(path)
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(" " + real))
