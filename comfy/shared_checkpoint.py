"""Shared read-only checkpoint base and per-rank hot caches.

A checkpoint is read from disk and deserialized once per process; every rank's replica
and every later reload is built from that one base in RAM.

Base
    SharedCheckpoint.open(path)      one per (real path, size, mtime_ns) per process, from a
                                     thread-safe registry: concurrent opens cause one read; a
                                     second open of an unchanged file logs "Reusing shared
                                     checkpoint source" and reads nothing; a file changed on
                                     disk is a new source. Failed opens leave the registry clean.
    SharedCheckpoint.from_state_dict(tensors)   the same over tensors already in memory.
    A SharedCheckpoint is a read-only Mapping name -> zero-copy CPU view (ReadOnlyTensor):
    in-place writes raise ReadOnlyWeightError; the memory lives as long as any view does.
    total_bytes_read() counts every byte read from disk by this module, process-wide.

Hot caches
    RankReplicas(base, devices, template=None)  one RankReplica per device: the rank's
                                     device-resident copy of the template module's weights (or
                                     of the base's tensors when there is no template), built from
                                     RAM. On a CPU rank with the stored dtype the copy *is* the
                                     base view (zero-copy).
    RankReplicas.add_patches(deltas, strength)  additive weight patches (e.g. a Turbo LoRA
                                     merged to deltas) keyed by parameter name, applied the same
                                     way on every replica, now and after every reload.
    model_stage_unload(stage)        drops device residency, keeps the base.
    offload_components(*families)    unloads whole families and empties the device allocators'
                                     caches (torch.npu / torch.cuda as present).

ComfyUI (imported lazily; nothing here needs ComfyUI installed)
    comfy_diffusion_model_replicas(model_patcher, devices, base=None)  per-device replicas of
                                     a loaded MODEL's diffusion model from the shared base, with
                                     the ModelPatcher's weight patches applied by ComfyUI's own
                                     patch math; no second read of the file.
"""

from __future__ import annotations

import copy
import logging
import os
import stat
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import torch

from comfy.multidevice import resolve_device
from comfy.read_only_tensor import (ReadOnlyMemory, ReadOnlyTensor, ReadOnlyWeightError,
                                    is_read_only, read_only_view)
from comfy.safetensors_header import (HEADER_LENGTH_BYTES, CheckpointError, SafetensorsHeader,
                                      TensorInfo, parse_header_json, parse_header_length)

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError", "ReadOnlyWeightError", "ReadOnlyTensor", "is_read_only",
    "SharedCheckpoint", "total_bytes_read", "shared_checkpoint_sources", "clear_shared_checkpoints",
    "WeightPatches", "RankReplica", "RankReplicas", "model_stage_unload", "offload_components",
    "release_cached_device_memory", "comfy_diffusion_model_replicas", "checkpoint_path_of",
]

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


# ----------------------------------------------------------------------------- the base

class SharedCheckpoint(Mapping):
    """A checkpoint's tensors, read once into read-only memory; a Mapping name -> zero-copy view.

    Build with SharedCheckpoint.open(path) or SharedCheckpoint.from_state_dict(tensors).
    Attributes: label (real path, or a description for in-memory sources), key (registry key or
    None), file_bytes (file size; 0 in memory), bytes_read (bytes this source read from disk),
    metadata (the header's __metadata__, {} when absent), header (SafetensorsHeader or None).
    """

    def __init__(self, label: str, views: dict[str, tuple[torch.Tensor, ReadOnlyMemory]], *,
                 key: tuple | None = None, header: SafetensorsHeader | None = None,
                 file_bytes: int = 0, bytes_read: int = 0):
        self.label = label
        self.key = key
        self.header = header
        self.metadata: dict[str, str] = dict(header.metadata) if header is not None else {}
        self.file_bytes = file_bytes
        self.bytes_read = bytes_read
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

    def info(self, name: str) -> TensorInfo | None:
        """The header entry of a file-backed tensor (None for in-memory sources)."""
        return self.header.tensors.get(name) if self.header is not None else None

    def tensors(self, prefix: str = "") -> dict[str, ReadOnlyTensor]:
        """Views of the tensors whose names start with `prefix`, keyed without the prefix."""
        return {name[len(prefix):]: self[name] for name in self._views if name.startswith(prefix)}

    # -- construction
    @classmethod
    def open(cls, path: str | os.PathLike) -> "SharedCheckpoint":
        """The process's shared base for a safetensors file; reads it only if nobody has yet."""
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
                source = cls._read(handle, real, key, st)
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
    def _read(cls, handle, real: str, key: tuple, st: os.stat_result) -> "SharedCheckpoint":
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

        if hasattr(os, "posix_fadvise"):
            try:  # a hint for read-ahead; some filesystems refuse it
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass
        length = parse_header_length(read_exact(min(HEADER_LENGTH_BYTES, st.st_size), "length field"),
                                     st.st_size, real)
        header = parse_header_json(read_exact(length, "header"),
                                   st.st_size - HEADER_LENGTH_BYTES - length, real)
        try:
            data = torch.empty(header.data_bytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise RuntimeError(f"{real}: cannot allocate {header.data_bytes} bytes of CPU memory for "
                               f"the shared base ({exc}); free memory or use a smaller checkpoint") from exc
        buffer = memoryview(data.numpy()).cast("B")
        position = 0
        while position < len(buffer):
            got = handle.readinto(buffer[position:position + READ_CHUNK_BYTES])
            if not got:
                raise CheckpointError(f"{real}: file is truncated: data ends after {position} of "
                                      f"{len(buffer)} bytes (it changed while being read?)")
            position += got
            read += got
            _count(got)
        after = os.fstat(handle.fileno())
        if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
            raise CheckpointError(f"{real}: the file changed while being read; open it again")

        memory = ReadOnlyMemory(data.untyped_storage(), real)
        views = {}
        for info in header.tensors.values():
            raw = data[info.begin:info.end]
            block = memory
            if info.begin % info.dtype.itemsize:
                # A misaligned tensor cannot be viewed in place: give it its own aligned block.
                raw = raw.clone()
                block = ReadOnlyMemory(raw.untyped_storage(), real)
            views[info.name] = (raw.view(info.dtype).view(info.shape), block)
        log.info("Read shared checkpoint source %s: %d tensors, %d bytes from disk [%s]",
                 real, len(views), read, threading.current_thread().name)
        return cls(real, views, key=key, header=header, file_bytes=st.st_size, bytes_read=read)

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
        align = 64
        spans, total = {}, 0
        for name, t in tensors.items():
            total = -(-total // align) * align
            spans[name] = (total, total + t.nbytes)
            total += t.nbytes
        data = torch.empty(total, dtype=torch.uint8)
        memory = ReadOnlyMemory(data.untyped_storage(), label)
        with torch._C.DisableTorchFunctionSubclass():
            for name, t in tensors.items():
                begin, end = spans[name]
                plain = data[begin:end].view(t.dtype).view(t.shape)
                plain.copy_(t)
                views[name] = (plain, memory)
        return cls(label, views)


# ----------------------------------------------------------------------------- patches

PatchFunction = Callable[[str, torch.Tensor], torch.Tensor]


class WeightPatches:
    """Weight patches keyed by tensor name, shared by a family of replicas.

    Each name has an ordered list of entries: additive deltas (weight += strength * delta) or
    functions fn(name, weight_fp32) -> weight_fp32. They are applied in float32 on the
    replica's device, then cast back with `cast(name, weight_fp32, dtype)` (default: .to(dtype));
    the same operations in the same order give the same weights on every replica.
    """

    def __init__(self):
        self._entries: dict[str, list[tuple[str, Any, float]]] = {}
        self.version = 0
        self.cast: Callable[[str, torch.Tensor, torch.dtype], torch.Tensor] = (
            lambda name, weight, dtype: weight.to(dtype))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def _add(self, name: str, kind: str, value: Any, strength: float) -> None:
        self._entries.setdefault(name, []).append((kind, value, strength))

    def _bump(self) -> None:
        self.version += 1

    def clear(self) -> None:
        self._entries.clear()
        self._bump()

    def apply(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The patched weight as a new tensor on weight's device and dtype (weight is not changed)."""
        work = weight.to(torch.float32, copy=True)
        for kind, value, strength in self._entries.get(name, ()):
            if kind == "delta":
                work.add_(value.to(work.device, torch.float32), alpha=strength)
            else:
                work = value(name, work).to(torch.float32)
        return self.cast(name, work, weight.dtype)


# ----------------------------------------------------------------------------- hot caches

DtypeSpec = torch.dtype | Mapping[str, torch.dtype] | None


def _module_slots(module: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, bool]]:
    """state-dict name -> (owning submodule, attribute name, is_parameter)."""
    slots = {}
    for name in module.state_dict(keep_vars=True):
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        slots[name] = (owner, leaf, leaf in owner._parameters)
    return slots


class RankReplica:
    """One rank's hot cache: device-resident copies of its weights, built from the base in RAM.

    base      a SharedCheckpoint (or any Mapping name -> CPU tensor)
    device    the rank's device ('npu:1', 'cuda:0', 'cpu', torch.device)
    template  optional nn.Module whose structure the replica copies (without copying its
              weights; build it on the meta device to allocate nothing). Without a template the
              replica is a bare state dict of the base's tensors (those under `prefix`).
    prefix    base name = prefix + replica name
    dtype     None keeps the stored dtype; a torch.dtype casts floating tensors; a mapping
              name -> dtype sets it per tensor
    patches   WeightPatches shared with the other ranks (RankReplicas passes its own)

    load() builds or refreshes the device copies (from RAM, never from disk); unload() points
    every weight back at the base and drops the device copies. On a CPU rank with the stored
    dtype and no patch, the "copy" is the base view itself: zero bytes.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], device: Any, *, rank: int = 0,
                 template: torch.nn.Module | None = None, names: Iterable[str] | None = None,
                 prefix: str = "", dtype: DtypeSpec = None, patches: WeightPatches | None = None):
        if template is not None and names is not None:
            raise ValueError("RankReplica takes a template module or a list of names, not both")
        self.base = base
        self.device = resolve_device(device)
        self.rank = rank
        self.prefix = prefix
        self.dtype = dtype
        self.patches = patches if patches is not None else WeightPatches()
        self.module: torch.nn.Module | None = None
        self._lock = threading.RLock()
        self._resident = False
        self._patch_version = -1
        self._bound: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # sources bound to a private copy rather than the base itself
        if template is None:
            wanted = list(names) if names is not None else [n[len(prefix):] for n in base if n.startswith(prefix)]
            self._groups = {n: [n] for n in wanted}
            self._check_names(None)
            self._slots: dict[str, tuple[torch.nn.Module, str, bool]] = {}
            self._extra_buffers: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
            self._bind_base()
        else:
            self._init_from_template(template)

    # -- construction helpers
    def _where(self) -> str:
        return f"rank {self.rank} ({self.device})"

    def _init_from_template(self, template: torch.nn.Module) -> None:
        by_identity: dict[int, list[str]] = {}
        declared = template.state_dict(keep_vars=True)
        for name, t in declared.items():
            by_identity.setdefault(id(t), []).append(name)  # tied weights share one entry
        self._groups = {}
        for names in by_identity.values():
            source = next((n for n in names if self.prefix + n in self.base), names[0])
            self._groups[source] = names
        self._check_names(declared)
        # Copy the module's structure but not its weights: the deepcopy memo maps every
        # weight to the base view it will start out bound to.
        memo = {}
        for source, names in self._groups.items():
            original = declared[names[0]]
            view = self._base_tensor(source)
            memo[id(original)] = (torch.nn.Parameter(view, requires_grad=False)
                                  if isinstance(original, torch.nn.Parameter) else view)
        self.module = copy.deepcopy(template, memo)
        self.module.requires_grad_(False)
        self._slots = _module_slots(self.module)
        self._extra_buffers = {}
        persistent = set(self._slots)
        for name, buf in self.module.named_buffers():
            if name in persistent or buf is None:
                continue
            if buf.device.type == "meta":
                raise ValueError(f"template buffer {name!r} is on the meta device and is not in the "
                                 "state dict, so no base holds its values; build the template on CPU")
            owner_path, _, leaf = name.rpartition(".")
            owner = self.module.get_submodule(owner_path) if owner_path else self.module
            # Non-persistent buffers (not in any checkpoint) keep a CPU copy as their "base".
            self._extra_buffers[name] = (owner, leaf, buf.to("cpu"))
            owner._buffers[leaf] = self._extra_buffers[name][2]
        self._bound = {n: self._base_tensor(s) for s, names in self._groups.items() for n in names}

    def _check_names(self, declared: Mapping[str, torch.Tensor] | None) -> None:
        missing = [self.prefix + s for s in self._groups if self.prefix + s not in self.base]
        if missing:
            raise ValueError(
                f"{_label(self.base)} has no tensor {missing[0]!r} ({len(missing)} missing) needed by "
                f"the replica for {self._where()}; check the prefix ({self.prefix!r}) and the checkpoint")
        if declared is None:
            return
        for source, names in self._groups.items():
            want, have = tuple(declared[names[0]].shape), tuple(self.base[self.prefix + source].shape)
            if want != have:
                raise ValueError(f"{_label(self.base)}: tensor {self.prefix + source!r} has shape {have} "
                                 f"but the model expects {want}; the checkpoint does not fit this model")

    def _base_tensor(self, name: str) -> torch.Tensor:
        return self.base[self.prefix + name]

    def _target_dtype(self, name: str, base: torch.Tensor) -> torch.dtype:
        if isinstance(self.dtype, Mapping):
            return self.dtype.get(name, base.dtype)
        if self.dtype is not None and base.is_floating_point():
            return self.dtype
        return base.dtype

    # -- state
    @property
    def names(self) -> list[str]:
        """Tensor names of this replica (module state-dict names; tied names included)."""
        return [n for names in self._groups.values() for n in names]

    @property
    def resident(self) -> bool:
        return self._resident

    @property
    def resident_bytes(self) -> int:
        """Bytes held by this replica beyond the shared base (device copies, patched weights)."""
        return sum(self._bound[self._groups[s][0]].nbytes for s in self._owned)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors the replica is bound to now: device copies when resident, base views otherwise."""
        with self._lock:
            return dict(self._bound)

    # -- binding
    def _bind_base(self) -> None:
        self._bind({s: self._base_tensor(s) for s in self._groups})
        self._owned.clear()

    def _bind(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for source, t in tensors.items():
            names = self._groups[source]
            if self.module is not None:
                first_owner, first_leaf, is_param = self._slots[names[0]]
                value = torch.nn.Parameter(t, requires_grad=False) if is_param else t
                for name in names:
                    owner, leaf, param = self._slots[name]
                    (owner._parameters if param else owner._buffers)[leaf] = value
            for name in names:
                self._bound[name] = t

    def _materialize(self, source: str) -> torch.Tensor:
        base = self._base_tensor(source)
        t = base.to(self.device, self._target_dtype(source, base))  # the base view itself if nothing changes
        patched = next((n for n in self._groups[source] if n in self.patches), None)
        if patched is not None:
            t = self.patches.apply(patched, t)
        if t is base:
            self._owned.discard(source)
        else:
            self._owned.add(source)
        return t

    def load(self, names: Iterable[str] | None = None) -> "RankReplica":
        """Make the replica resident on its device (only `names` are rebuilt if given and resident)."""
        with self._lock:
            if self._resident and self._patch_version == self.patches.version and names is None:
                return self
            sources = list(self._groups) if names is None or not self._resident else [
                s for s, group in self._groups.items() if any(n in group for n in names)]
            self._bind({s: self._materialize(s) for s in sources})
            for owner, leaf, buf in self._extra_buffers.values():
                owner._buffers[leaf] = buf.to(self.device)
            self._resident = True
            self._patch_version = self.patches.version
            log.debug("rank %d: replica resident on %s (%d bytes beyond the base)",
                      self.rank, self.device, self.resident_bytes)
            return self

    def unload(self) -> int:
        """Point every weight back at the base (CPU, zero-copy); return the bytes dropped."""
        with self._lock:
            dropped = self.resident_bytes
            self._bind_base()
            for owner, leaf, buf in self._extra_buffers.values():
                owner._buffers[leaf] = buf
            self._resident = False
            log.debug("rank %d: replica unloaded from %s (%d bytes dropped)", self.rank, self.device, dropped)
            return dropped


def _label(base: Mapping) -> str:
    return getattr(base, "label", "the base state dict")


class RankReplicas(Sequence):
    """A family of per-rank replicas of one model over one shared base, with shared patches.

    RankReplicas(base, devices, template=None, *, prefix="", dtype=None, names=None, load=True)
    builds one RankReplica per device (rank r on devices[r]); with load=False nothing is copied
    yet, so each rank thread can call replicas[rank].load() itself.
    """

    def __init__(self, base: Mapping[str, torch.Tensor], devices: Sequence[Any],
                 template: torch.nn.Module | None = None, *, prefix: str = "", dtype: DtypeSpec = None,
                 names: Iterable[str] | None = None, load: bool = True):
        if not devices:
            raise ValueError("RankReplicas needs at least one device, got none")
        self.base = base
        self.patches = WeightPatches()
        names = list(names) if names is not None else None
        self.replicas = [RankReplica(base, d, rank=r, template=template, names=names, prefix=prefix,
                                     dtype=dtype, patches=self.patches) for r, d in enumerate(devices)]
        if load:
            self.load()

    def __getitem__(self, index):
        return self.replicas[index]

    def __len__(self) -> int:
        return len(self.replicas)

    @property
    def devices(self) -> list[torch.device]:
        return [r.device for r in self.replicas]

    def load(self) -> "RankReplicas":
        for replica in self.replicas:
            replica.load()
        return self

    def unload(self) -> int:
        return sum(replica.unload() for replica in self.replicas)

    def _check_patch_names(self, names: Iterable[str]) -> list[str]:
        known = set(self.replicas[0].names)
        names = list(names)
        unknown = [n for n in names if n not in known]
        if unknown:
            raise ValueError(f"patch for unknown weight(s) {unknown[:5]}: the replicas have no such tensor "
                             f"(names are the model's state-dict names, e.g. {sorted(known)[:3]})")
        return names

    def add_patches(self, deltas: Mapping[str, torch.Tensor], strength: float = 1.0) -> list[str]:
        """Add `strength * delta` to each named weight on every replica; return the patched names.

        Everything is checked before anything changes. Resident replicas are refreshed now
        (from RAM); unloaded ones get the patches when they next load.
        """
        names = self._check_patch_names(deltas)
        first = self.replicas[0]
        for name in names:
            delta, current = deltas[name], first.state_dict()[name]
            if not isinstance(delta, torch.Tensor):
                raise ValueError(f"patch for {name!r} is a {type(delta).__name__}, not a tensor")
            if tuple(delta.shape) != tuple(current.shape):
                raise ValueError(f"patch for {name!r} has shape {tuple(delta.shape)}, the weight has "
                                 f"{tuple(current.shape)}")
            if not current.is_floating_point():
                raise ValueError(f"weight {name!r} is {current.dtype}; only floating weights can be patched")
        for name in names:
            self.patches._add(name, "delta", deltas[name].detach(), float(strength))
        self._refresh(names)
        return names

    def add_patch_function(self, names: Iterable[str], fn: PatchFunction) -> list[str]:
        """Patch each named weight with fn(name, weight_fp32) -> weight_fp32 on every replica."""
        names = self._check_patch_names(names)
        for name in names:
            self.patches._add(name, "function", fn, 1.0)
        self._refresh(names)
        return names

    def clear_patches(self) -> None:
        names = self.patches.names()
        self.patches.clear()
        self._refresh(names)

    def _refresh(self, names: list[str]) -> None:
        self.patches._bump()
        for replica in self.replicas:
            with replica._lock:
                if replica.resident:
                    replica.load(names)


# ----------------------------------------------------------------------------- unload / offload

def _replicas_of(stage: Any) -> list[RankReplica]:
    if isinstance(stage, RankReplica):
        return [stage]
    if isinstance(stage, RankReplicas):
        return list(stage.replicas)
    if isinstance(stage, Iterable) and not isinstance(stage, (str, bytes, Mapping, torch.nn.Module)):
        return [r for item in stage for r in _replicas_of(item)]
    raise ValueError(f"model_stage_unload/offload_components take RankReplica or RankReplicas objects "
                     f"(or lists of them), got {type(stage).__name__}")


def model_stage_unload(stage: Any) -> int:
    """Drop the device residency of a stage (a RankReplica, a RankReplicas family, or a list
    of them) and keep its base; return the bytes dropped. A later load() copies from RAM."""
    return sum(replica.unload() for replica in _replicas_of(stage))


def release_cached_device_memory(device_types: Iterable[str]) -> list[str]:
    """Empty the caching allocator of each device type present (npu, cuda); return those emptied."""
    emptied = []
    for kind in sorted(set(device_types)):
        module = getattr(torch, kind, None) if kind in ("npu", "cuda") else None
        if module is None or not hasattr(module, "empty_cache"):
            continue
        if kind == "cuda" and not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            continue
        module.empty_cache()
        emptied.append(kind)
    return emptied


def offload_components(*components: Any) -> int:
    """Unload every replica of the given families (per-rank clones of each component) and
    release the allocators' cached device memory; return the bytes dropped."""
    replicas = [r for c in components for r in _replicas_of(c)]
    dropped = sum(r.unload() for r in replicas)
    emptied = release_cached_device_memory(r.device.type for r in replicas)
    log.info("offloaded %d replica(s): %d bytes dropped, allocator cache emptied for %s",
             len(replicas), dropped, ", ".join(emptied) or "no device type")
    return dropped


# ----------------------------------------------------------------------------- ComfyUI

def checkpoint_path_of(model_patcher: Any) -> str | None:
    """The .safetensors file a ComfyUI ModelPatcher was loaded from, when its loader recorded it.

    Core loaders store their factory and arguments in `cached_patcher_init` (upstream's
    multi-GPU clone re-runs it, re-reading the file); the path is the argument naming an
    existing .safetensors file. None when there is no such argument.
    """
    init = getattr(model_patcher, "cached_patcher_init", None)
    if not isinstance(init, tuple) or len(init) < 2 or not isinstance(init[1], (tuple, list)):
        return None
    for arg in init[1]:
        if isinstance(arg, (str, os.PathLike)) and os.fspath(arg).endswith(".safetensors") \
                and os.path.isfile(arg):
            return os.fspath(arg)
    return None


def _comfy_patch_function(patch_list: list, key: str) -> PatchFunction:
    def apply(name: str, weight: torch.Tensor) -> torch.Tensor:
        import comfy.lora  # ComfyUI's own patch math, so replicas match the primary
        return comfy.lora.calculate_weight(patch_list, weight, key)
    return apply


def _comfy_cast(prefix: str) -> Callable[[str, torch.Tensor, torch.dtype], torch.Tensor]:
    def cast(name: str, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        try:
            import comfy.float
            import comfy.utils
            rounding, seed_of = comfy.float.stochastic_rounding, comfy.utils.string_to_seed
        except (ImportError, AttributeError):
            return weight.to(dtype)
        # ComfyUI rounds patched weights with a seed derived from the key: same bits everywhere.
        return rounding(weight, dtype, seed=seed_of(prefix + name))
    return cast


def comfy_diffusion_model_replicas(model_patcher: Any, devices: Sequence[Any], base: Any = None, *,
                                   load: bool = False) -> RankReplicas:
    """Per-device replicas of a ComfyUI MODEL's diffusion model, built from the shared base.

    model_patcher  a loaded ComfyUI ModelPatcher (the MODEL socket): model.diffusion_model is
                   the template; its weights are not copied.
    devices        one replica per device (rank r on devices[r]).
    base           SharedCheckpoint or path of the diffusion model's .safetensors; None: the
                   file recorded by the loader (checkpoint_path_of), else the diffusion model's
                   own CPU weights wrapped in place (zero-copy; the model must not be loaded
                   or patched on a device right now). Names may carry the full-checkpoint prefix
                   'model.diffusion_model.'.
    load           make every replica resident now (else call replicas[r].load() per rank).

    Each replica has the dtype of the loaded model's tensor of the same name, and the
    patcher's weight patches (LoRAs: model_patcher.patches, keys 'diffusion_model.<name>')
    applied with comfy.lora.calculate_weight and ComfyUI's rounding, so every device gets the
    same weights ComfyUI computes for the primary. The file is read at most once per process.
    Rebuild the replicas when the MODEL input changes (new LoRA, new strength).
    """
    diffusion_model = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    if not isinstance(diffusion_model, torch.nn.Module):
        raise ValueError("comfy_diffusion_model_replicas expects a ComfyUI MODEL (a ModelPatcher whose "
                         f".model.diffusion_model is a torch module), got {type(model_patcher).__name__}")
    declared = diffusion_model.state_dict()
    if base is None:
        base = checkpoint_path_of(model_patcher)
    if isinstance(base, (str, os.PathLike)):
        base = SharedCheckpoint.open(base)
    elif base is None:
        if getattr(model_patcher, "backup", None):
            raise ValueError("the MODEL's weights are patched in place right now, so they are not a "
                             "clean base; pass base=<path of its .safetensors file>")
        base = SharedCheckpoint.from_state_dict(declared, copy=False,
                                                label=f"{type(diffusion_model).__name__} weights in memory")
    prefix = next((p for p in ("", "model.diffusion_model.") if all(p + n in base for n in declared)), None)
    if prefix is None:
        missing = next(n for n in declared if n not in base)
        raise ValueError(f"{_label(base)} does not hold the loaded diffusion model's weights (no "
                         f"{missing!r}, with or without 'model.diffusion_model.'); it was converted on "
                         "load or is another model: pass base=None to use the loaded weights")
    replicas = RankReplicas(base, devices, diffusion_model, prefix=prefix,
                            dtype={n: t.dtype for n, t in declared.items()}, load=False)
    for module in (r.module for r in replicas):
        for sub in module.modules():  # runtime patch hooks of a low-VRAM load belong to the primary
            for attr in ("weight_function", "bias_function"):
                if isinstance(getattr(sub, attr, None), list):
                    setattr(sub, attr, [])
    patches = getattr(model_patcher, "patches", None) or {}
    replica_names = set(replicas[0].names)
    for key, patch_list in patches.items():
        name = key[len("diffusion_model."):] if isinstance(key, str) and key.startswith("diffusion_model.") else None
        if name in replica_names:
            replicas.add_patch_function([name], _comfy_patch_function(list(patch_list), key))
    replicas.patches.cast = _comfy_cast("diffusion_model.")
    if load:
        replicas.load()
    return replicas
