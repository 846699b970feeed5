"""comfy-aimdo's mapping of a weight file, found on the tensors upstream's loader made from it.

With dynamic VRAM on, ComfyUI's loader maps each safetensors file once with comfy-aimdo. The
shared base (checkpoint.py) adopts that mapping instead of mapping the file a second time:
its views then point into aimdo's memory. This module is the whole ComfyUI boundary of that:
the attribute names and what they hold, and the checks a mapping must pass before any view
is made over it. It imports nothing of ComfyUI or comfy-aimdo; it reads attributes only.

Upstream's contract (ComfyUI `comfy/utils.py` `load_safetensors`, called by `load_torch_file`
when `comfy.memory_management.aimdo_enabled`; the same at v0.33.0 0f1fa67a and at 01a56b76):
- `model_mmap = comfy_aimdo.model_mmap.ModelMMAP(path)` maps the whole file; `.get()` is the
  address of its first byte, `.get_file_handle()` the file's descriptor (an int on POSIX). The
  mapping is released when the object is collected (its `__del__` deallocates it).
- `mv` is a memoryview of the mapping from the data section on (after the 8-byte length and
  the JSON header), `data_start` bytes into the file.
- every non-empty tensor of the state dict is `torch.frombuffer(mv[begin:end])` viewed as its
  dtype and shape, and its untyped storage carries two attributes:
    `_comfy_tensor_mmap_refs`  = (model_mmap, mv)
    `_comfy_tensor_file_slice` = TensorFileSlice(file_ref, lock, offset, size), where
                                 file_ref is the descriptor and offset = data_start + begin.
Empty tensors are plain `torch.empty` and carry nothing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from comfy.multidevice.tensor_bytes import tensor_leaves

MMAP_REFS_ATTRIBUTE = "_comfy_tensor_mmap_refs"
FILE_SLICE_ATTRIBUTE = "_comfy_tensor_file_slice"
KEEP_ALIVE_ATTRIBUTE = "_multidevice_loader_mapping"  # ours: on the base's storage, see adopt()

OWNER_NAME = "comfy-aimdo"


class LoaderMappingMismatch(ValueError):
    """A loader's mapping that does not match the file as our header describes it."""


@dataclass(frozen=True)
class LoadedSlice:
    """One loaded tensor over the mapping: where its storage starts, and what upstream recorded."""
    address: int        # data_ptr of its storage
    nbytes: int         # bytes of its storage
    file_ref: object    # TensorFileSlice.file_ref
    file_offset: int    # TensorFileSlice.offset (from the file's first byte)
    file_size: int      # TensorFileSlice.size


@dataclass(frozen=True)
class LoaderMapping:
    """A mapping of one file by upstream's loader, as seen on the loaded tensors over it."""
    owner: object                   # the ModelMMAP: it must outlive every view into its memory
    data: memoryview                # the file's data section
    slices: tuple[LoadedSlice, ...]


def _storages(t: torch.Tensor):
    """The untyped storages behind a tensor; a wrapper subclass (upstream's QuantizedTensor)
    keeps its bytes in inner tensors."""
    for leaf in tensor_leaves(t):
        try:
            with torch._C.DisableTorchFunctionSubclass():
                yield torch.Tensor.untyped_storage(leaf)
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, meta ...: no plain storage
            continue


def find_loader_mappings(tensors: Iterable[torch.Tensor] | Mapping[str, torch.Tensor]) -> list[LoaderMapping]:
    """The loader mappings the given tensors (or a state dict's) point into, one per mapping,
    in the order first seen."""
    if isinstance(tensors, Mapping):
        tensors = tensors.values()
    found: dict[int, tuple[object, memoryview, dict[int, LoadedSlice]]] = {}
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for storage in _storages(t):
            refs = getattr(storage, MMAP_REFS_ATTRIBUTE, None)
            file_slice = getattr(storage, FILE_SLICE_ATTRIBUTE, None)
            if not (isinstance(refs, tuple) and len(refs) == 2 and isinstance(refs[1], memoryview)):
                continue
            owner, data = refs
            try:
                file_ref, _, file_offset, file_size = file_slice
            except (TypeError, ValueError):
                file_ref, file_offset, file_size = None, -1, -1  # checked (and refused) in adopt()
            entry = found.setdefault(id(owner), (owner, data, {}))
            address = storage.data_ptr()
            entry[2][address] = LoadedSlice(address, storage.nbytes(), file_ref, file_offset, file_size)
    return [LoaderMapping(owner, data, tuple(slices.values())) for owner, data, slices in found.values()]


def _same_file(file_ref: object, st: os.stat_result) -> str | None:
    """None when the descriptor is the file `st` describes; otherwise what differs."""
    if not isinstance(file_ref, int) or isinstance(file_ref, bool):
        return f"its file handle {file_ref!r} is not a file descriptor, so the mapped file cannot be identified"
    try:
        mapped = os.fstat(file_ref)
    except OSError as exc:
        return f"its file handle {file_ref} cannot be examined ({exc.strerror or exc})"
    if (mapped.st_dev, mapped.st_ino) != (st.st_dev, st.st_ino):
        return "it maps another file"
    if (mapped.st_size, mapped.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
        return "the file changed while it was being opened"
    return None


def adopt(mapping: LoaderMapping, begins: dict[int, int], data_start: int,
          st: os.stat_result) -> torch.Tensor:
    """The file's data section as a uint8 tensor over the loader's memory (zero-copy).

    begins: {begin: nbytes} of every tensor of our validated header (offsets into the data
    section); data_start: 8 + the header length; st: our fstat of the file. Raises
    LoaderMappingMismatch naming the difference when the mapping is not exactly that file.
    The returned tensor's storage holds the mapping's owner, so the mapping lives as long as
    any tensor over that storage does.
    """
    data_bytes = st.st_size - data_start
    if mapping.data.nbytes != data_bytes or not mapping.data.c_contiguous:
        raise LoaderMappingMismatch(
            f"its data section has {mapping.data.nbytes} bytes{'' if mapping.data.c_contiguous else ' (not contiguous)'}, "
            f"the header says {data_bytes}")
    if not mapping.slices:
        raise LoaderMappingMismatch("no loaded tensor points into it")
    problem = _same_file(mapping.slices[0].file_ref, st)
    if problem is not None:
        raise LoaderMappingMismatch(problem)
    with warnings.catch_warnings(), torch._C.DisableTorchFunctionSubclass():
        # upstream's memoryview may be read-only: every view of the base refuses writes anyway
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        region = torch.frombuffer(mapping.data, dtype=torch.uint8)
    start = region.data_ptr()
    for s in mapping.slices:
        begin = s.address - start
        if begins.get(begin) != s.nbytes:
            raise LoaderMappingMismatch(f"a loaded tensor of {s.nbytes} bytes sits at data byte {begin}, "
                                        "where the header has no tensor of that size")
        if (s.file_offset, s.file_size) != (data_start + begin, s.nbytes):
            raise LoaderMappingMismatch(
                f"the loaded tensor at data byte {begin} records file offset {s.file_offset} and size "
                f"{s.file_size}; the header puts it at {data_start + begin} with {s.nbytes} bytes")
        if s.file_ref != mapping.slices[0].file_ref:
            raise LoaderMappingMismatch("its loaded tensors record different file handles")
    setattr(region.untyped_storage(), KEEP_ALIVE_ATTRIBUTE, mapping.owner)
    return region
