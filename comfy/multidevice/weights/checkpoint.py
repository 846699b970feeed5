"""Shared read-only checkpoint base: one read of a file per process, a registry of bases.

A checkpoint is mapped (or, in pin mode, read) once per process; every rank's replica and
every later reload is built from that one base in RAM (the replicas: weights/replicas.py).

Base
    SharedCheckpoint.open(path)      one per (real path, size, mtime_ns) per process, from a
                                     thread-safe registry: concurrent opens cause one read; a
                                     second open of an unchanged file logs "Reusing shared
                                     checkpoint source" and reads nothing; a file changed on
                                     disk is a new source. Failed opens leave the registry clean.
                                     The data is one read-only shared mapping of the file (page
                                     cache, no anonymous copy; PROT_READ, so even a raw write
                                     faults instead of changing the weights); mode "pin" (or
                                     COMFYUI_MULTI_DEVICE_WEIGHT_BASE=pin) reads it into anonymous
                                     RAM instead, for network filesystems where evicted pages
                                     would be fetched again.
    SharedCheckpoint.open(path, loaded=tensors)  the same, adopting comfy-aimdo's mapping of the
                                     file when the MODEL's tensors lie in it (see open()).
    SharedCheckpoint.from_state_dict(tensors)   the same over tensors already in memory.
    A SharedCheckpoint is a read-only Mapping name -> zero-copy CPU view (ReadOnlyTensor):
    in-place writes raise ReadOnlyWeightError; the memory lives as long as any view does.
    Sent to another process (ForkingPickler: queues, pipes, spawn), a view of a file travels as
    a reference (process_reference: path, file identity, name); the receiver's open_shared_view
    opens the file as its own base there, read-only, and refuses a file replaced since.
    total_bytes_read() counts every byte read from disk by this module, process-wide: headers
                                     as read, a mapped file's data once when it is mapped (each
                                     page comes from disk at most once while the page cache
                                     keeps it; `pin` exists for when it would not); nothing for
                                     the data of an adopted mapping (upstream's loader mapped it).
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
import threading
import warnings
import weakref
from collections.abc import Iterable, Mapping

import torch

from comfy.multidevice.comm.settings import WEIGHT_BASE_ENV, weight_base_from_env
from comfy.multidevice.weights.aimdo_mapping import (adopt, find_loader_mappings, LoaderMappingMismatch,
                                                     OWNER_NAME)
from comfy.multidevice.weights.read_only import read_only_view, ReadOnlyMemory, ReadOnlyTensor
from comfy.multidevice.weights.safetensors_header import (CheckpointError, HEADER_LENGTH_BYTES,
                                                          parse_header_json, parse_header_length,
                                                          SafetensorsHeader)

log = logging.getLogger(__name__)

READ_CHUNK_BYTES = 64 << 20
REUSE_MESSAGE = "Reusing shared checkpoint source"

# ----------------------------------------------------------------------------- byte counter

_counter_lock = threading.Lock()
_total_bytes_read = 0


def total_bytes_read() -> int:
    """Bytes this module has read from disk in this process (headers and data, all files)."""
    return _total_bytes_read


def _count(n: int) -> None:
    global _total_bytes_read
    with _counter_lock:
        _total_bytes_read += n


# ----------------------------------------------------------------------------- registry

class _PendingOpen:
    """A read in progress: threads opening the same source wait for it instead of reading."""

    def __init__(self):
        self.done = threading.Event()
        self.result: SharedCheckpoint | None = None
        self.error: BaseException | None = None


_registry_lock = threading.Lock()
_registry: dict[tuple, weakref.ref] = {}   # key -> the live SharedCheckpoint of that key
_pending: dict[tuple, _PendingOpen] = {}


def _live(key: tuple) -> "SharedCheckpoint | None":
    ref = _registry.get(key)
    source = ref() if ref is not None else None
    if ref is not None and source is None:
        del _registry[key]  # nobody uses it any more: its memory is gone
    return source


def _claim(key: tuple) -> tuple["SharedCheckpoint | None", _PendingOpen | None, bool]:
    """(live source, pending read, whether the caller must do the read) for a key."""
    with _registry_lock:
        source = _live(key)
        if source is not None:
            return source, None, False
        pending = _pending.get(key)
        if pending is not None:
            return None, pending, False
        pending = _pending[key] = _PendingOpen()
        return None, pending, True


def _publish(key: tuple, pending: _PendingOpen, source: "SharedCheckpoint") -> None:
    with _registry_lock:
        for old in [k for k in _registry if k[0] == key[0]]:
            del _registry[old]  # an older version of this file: its holders keep their views
        _registry[key] = weakref.ref(source)
        del _pending[key]
    pending.result = source
    pending.done.set()


def _abandon(key: tuple, pending: _PendingOpen, error: BaseException) -> None:
    with _registry_lock:
        del _pending[key]  # a failed read leaves nothing registered
    pending.error = error
    pending.done.set()


def shared_checkpoint_sources() -> list[tuple]:
    """Keys (real path, size, mtime_ns) of the live registered sources; reads in progress excluded."""
    with _registry_lock:
        return [key for key in list(_registry) if _live(key) is not None]


def clear_shared_checkpoints() -> None:
    """Forget every registered source. Objects and views already handed out stay valid."""
    with _registry_lock:
        _registry.clear()


# ----------------------------------------------------------------------------- file data

def _map_read_only(handle, real: str, offset: int, nbytes: int) -> torch.Tensor:
    """The file's data bytes as a uint8 tensor over one read-only shared mapping (PROT_READ)."""
    try:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{real}: cannot map the checkpoint read-only ({exc}); set "
                              f"{WEIGHT_BASE_ENV}=pin to read it into RAM instead") from None
    if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        try:  # a read-ahead hint; the pages come in as the replicas are built
            mapping.madvise(mmap.MADV_WILLNEED)
        except OSError:
            pass
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point; every view refuses writes.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)


def _adopt_loader_mapping(loaded, header: SafetensorsHeader, data_start: int, st: os.stat_result,
                          real: str) -> torch.Tensor | None:
    """The data section over comfy-aimdo's mapping of this file, when `loaded` lies in one that
    matches the header; None (logged when a mapping was refused) to map the file here instead."""
    mappings = find_loader_mappings(loaded)
    if not mappings:
        return None
    begins = {info.begin: info.nbytes for info in header.tensors.values() if info.nbytes}
    problems = []
    for mapping in mappings:  # tensors of a MODEL made from several files lie in several
        try:
            return adopt(mapping, begins, data_start, st)
        except LoaderMappingMismatch as exc:
            problems.append(str(exc))
    log.warning("%s: not adopting %s's mapping of the loaded weights (%s); mapping the file here "
                "instead", real, OWNER_NAME, "; ".join(problems))
    return None


def _read_into_ram(handle, real: str, nbytes: int) -> torch.Tensor:
    """The file's data bytes (from the current position) read into a new anonymous buffer."""
    if hasattr(os, "posix_fadvise"):
        try:  # a hint for read-ahead; some filesystems refuse it
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass
    try:
        data = torch.empty(nbytes, dtype=torch.uint8)
    except RuntimeError as exc:
        raise RuntimeError(f"{real}: cannot allocate {nbytes} bytes of CPU memory for the pinned "
                           f"shared base ({exc}); free memory, use a smaller checkpoint, or unset "
                           f"{WEIGHT_BASE_ENV} to map the file instead") from exc
    buffer = memoryview(data.numpy()).cast("B")
    position = 0
    while position < len(buffer):
        got = handle.readinto(buffer[position:position + READ_CHUNK_BYTES])
        if not got:
            raise CheckpointError(f"{real}: file is truncated: data ends after {position} of "
                                  f"{len(buffer)} bytes (it changed while being read?)")
        position += got
    return data


# ----------------------------------------------------------------------------- the base

class SharedCheckpoint(Mapping):
    """A checkpoint's tensors, mapped (or pinned) once, read-only; a Mapping name -> zero-copy view.

    Build with SharedCheckpoint.open(path) or SharedCheckpoint.from_state_dict(tensors).
    Attributes: label (real path, or a description for in-memory sources), key (registry key or
    None), file_bytes (file size; 0 in memory), bytes_read (bytes this source read from disk),
    metadata (the header's __metadata__, {} when absent), mode ("map": a read-only mapping of
    the file, "pin": anonymous RAM, "memory": in memory),
    mapped_by (None: the mapping is this module's own; "comfy-aimdo": the loader's, adopted),
    file_identity ((device, inode, size, mtime_ns) of the file read; None in memory).
    """

    def __init__(self, label: str, views: dict[str, tuple[torch.Tensor, ReadOnlyMemory]], *,
                 key: tuple | None = None, metadata: dict[str, str] | None = None,
                 file_bytes: int = 0, bytes_read: int = 0, mode: str = "memory",
                 mapped_by: str | None = None, file_identity: tuple | None = None):
        self.label = label
        self.key = key
        self.mode = mode
        self.mapped_by = mapped_by
        self.metadata = dict(metadata or {})
        self.file_bytes = file_bytes
        self.bytes_read = bytes_read
        self.file_identity = file_identity
        # Plain views + their memory; read-only views are made per access and point back to
        # this object (views keep the source alive, the source never holds them: no cycle).
        self._views = views

    # -- Mapping
    def __getitem__(self, name: str) -> ReadOnlyTensor:
        try:
            plain, memory = self._views[name]
        except KeyError:
            raise KeyError(f"{self.label} has no tensor {name!r} ({len(self._views)} tensors, e.g. "
                           f"{', '.join(map(repr, list(self._views)[:3]))})") from None
        return read_only_view(plain, memory, name, owner=self)

    def __iter__(self):
        return iter(self._views)

    def __len__(self) -> int:
        return len(self._views)

    def __contains__(self, name: object) -> bool:
        return name in self._views

    # A source is one object, compared by identity (Mapping's item-wise __eq__ would compare tensors).
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"SharedCheckpoint({self.label!r}, {len(self)} tensors, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data held in memory."""
        return sum(plain.nbytes for plain, _ in self._views.values())

    def process_reference(self, name: str) -> tuple | None:
        """How another process on this machine gets tensor `name` (read_only.py sends views this
        way): (function, arguments) returning it from that process's own base of the same file,
        mapped read-only (read into RAM if this base is pinned). None for in-memory sources."""
        if self.file_identity is None:
            return None
        return open_shared_view, (self.label, "pin" if self.mode == "pin" else "map", self.file_identity, name)

    # -- construction
    @classmethod
    def open(cls, path: str | os.PathLike, mode: str | None = None,
             loaded: Iterable[torch.Tensor] | None = None) -> "SharedCheckpoint":
        """The process's shared base for a safetensors file; reads it only if nobody has yet.

        mode "map" (default) maps the file read-only; "pin" reads it into anonymous RAM; None
        takes COMFYUI_MULTI_DEVICE_WEIGHT_BASE. A live base of the file is reused whatever its
        mode (one base per file per process).
        loaded: tensors loaded from this file (a MODEL's state dict). In mode "map", when they
        lie in comfy-aimdo's mapping of the file (ComfyUI's dynamic-VRAM loader) and that
        mapping matches our header, the base's views point into it: the file is not mapped a
        second time and only the header is read here.
        """
        mode = weight_base_from_env(mode)
        shown = os.fspath(path)
        real = os.path.realpath(shown)
        try:
            handle = open(real, "rb", buffering=0)
        except FileNotFoundError:
            raise CheckpointError(f"{shown}: no such checkpoint file; check the path") from None
        except OSError as exc:
            raise CheckpointError(f"{shown}: cannot open the checkpoint: {exc.strerror or exc}") from None
        with handle:
            st = os.fstat(handle.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{shown}: not a regular file; pass a .safetensors file")
            key = (real, st.st_size, st.st_mtime_ns)
            source, pending, reader = _claim(key)
            if source is not None:
                log.info("%s %s (already read by this process; nothing read from disk) [%s]",
                         REUSE_MESSAGE, real, threading.current_thread().name)
                return source
            if not reader:
                return cls._wait_for(pending, real)
            try:
                source = cls._read(handle, real, key, st, mode, loaded)
            except BaseException as exc:
                _abandon(key, pending, exc)
                raise
            _publish(key, pending, source)
            return source

    @staticmethod
    def _wait_for(pending: _PendingOpen, real: str) -> "SharedCheckpoint":
        pending.done.wait()
        if pending.error is not None:
            error = pending.error
            if isinstance(error, CheckpointError):
                raise CheckpointError(str(error)) from error
            raise error
        log.info("%s %s (read once by a concurrent open; nothing read from disk) [%s]",
                 REUSE_MESSAGE, real, threading.current_thread().name)
        return pending.result

    @classmethod
    def _read(cls, handle, real: str, key: tuple, st: os.stat_result, mode: str,
              loaded: Iterable[torch.Tensor] | None) -> "SharedCheckpoint":
        read = 0

        def read_exact(n: int, what: str) -> bytes:
            nonlocal read
            chunk = handle.read(n)
            read += len(chunk)
            _count(len(chunk))
            if len(chunk) != n:
                raise CheckpointError(f"{real}: file is truncated in the {what}: got {len(chunk)} of {n} "
                                      "bytes (it changed while being read?)")
            return chunk

        length = parse_header_length(read_exact(min(HEADER_LENGTH_BYTES, st.st_size), "length field"),
                                     st.st_size, real)
        header = parse_header_json(read_exact(length, "header"),
                                   st.st_size - HEADER_LENGTH_BYTES - length, real)
        data_start = HEADER_LENGTH_BYTES + length
        mapped = mode == "map" and header.data_bytes > 0
        data = (_adopt_loader_mapping(loaded, header, data_start, st, real)
                if mapped and loaded is not None else None)
        adopted = data is not None
        if not adopted:  # (an adopted file's data was mapped by upstream's loader, not read here)
            if mapped:
                data = _map_read_only(handle, real, data_start, header.data_bytes)
            else:
                data = _read_into_ram(handle, real, header.data_bytes)
            read += header.data_bytes
            _count(header.data_bytes)
        after = os.fstat(handle.fileno())
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise CheckpointError(f"{real}: the file changed while being read; open it again")

        memory = ReadOnlyMemory(data.untyped_storage(), real)
        views = {}
        for info in header.tensors.values():
            raw = data[info.begin:info.end]
            block = memory
            if info.begin % info.dtype.itemsize or (data.data_ptr() + info.begin) % info.dtype.itemsize:
                # A misaligned tensor cannot be viewed in place: give it its own aligned block.
                raw = raw.clone()
                block = ReadOnlyMemory(raw.untyped_storage(), real)
            views[info.name] = (raw.view(info.dtype).view(info.shape), block)
        if adopted:
            how = f"read from disk (the header; the data is {OWNER_NAME}'s mapping of the file, adopted)"
        else:
            how = "mapped read-only from disk" if mapped else "read into RAM from disk"
        log.info("Read shared checkpoint source %s: %d tensors, %d bytes %s [%s]",
                 real, len(views), read, how, threading.current_thread().name)
        return cls(real, views, key=key, metadata=header.metadata, file_bytes=st.st_size, bytes_read=read,
                   mode=mode, mapped_by=OWNER_NAME if adopted else None,
                   file_identity=(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    @classmethod
    def from_state_dict(cls, tensors: Mapping[str, torch.Tensor], *, label: str = "in-memory state dict",
                        copy: bool = True) -> "SharedCheckpoint":
        """A base over tensors already in CPU memory (nothing is read from disk, nothing registered).

        copy=True packs them into one new read-only buffer (the originals can be dropped or
        changed). copy=False wraps their memory in place, zero-copy: views still refuse writes,
        but whoever holds the original tensors can still change them.
        """
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{label}: {name!r} is a {type(t).__name__}, not a tensor")
            if t.device.type != "cpu":
                raise ValueError(f"{label}: tensor {name!r} is on {t.device}; a shared base lives in "
                                 "CPU memory: move or offload it to the CPU first")
        views = {}
        if not copy:
            with torch._C.DisableTorchFunctionSubclass():
                for name, t in tensors.items():
                    plain = torch.Tensor.detach(t)
                    views[name] = (plain, ReadOnlyMemory(plain.untyped_storage(), label))
            return cls(label, views)
        begins, total = {}, 0
        for name, t in tensors.items():
            begins[name] = -(-total // 64) * 64  # each tensor 64-byte aligned, so any dtype can view it
            total = begins[name] + t.nbytes
        data = torch.empty(total, dtype=torch.uint8)
        memory = ReadOnlyMemory(data.untyped_storage(), label)
        with torch._C.DisableTorchFunctionSubclass():
            for name, t in tensors.items():
                plain = data[begins[name]:begins[name] + t.nbytes].view(t.dtype).view(t.shape)
                plain.copy_(t)
                views[name] = (plain, memory)
        return cls(label, views)


def open_shared_view(path: str, mode: str, file_identity: tuple, name: str) -> ReadOnlyTensor:
    """Tensor `name` of the checkpoint at `path`, from this process's shared base of it, when the
    file is still the one `file_identity` names (a view sent by another process refers to it)."""
    base = SharedCheckpoint.open(path, mode=mode)
    if base.file_identity != file_identity:
        raise CheckpointError(f"{path}: tensor {name!r} was sent from another process, but the file "
                              "changed (or was replaced) since it was opened there; open it again there "
                              "and send the tensor again")
    return base[name]
