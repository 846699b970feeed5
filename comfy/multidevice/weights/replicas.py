"""Per-device copies of a module for multi-device stages that run one replica per card.

`replica_on(module, device)` copies a module with its parameters and buffers going straight
to `device` (no whole-module CPU copy on the way). `ReplicaCache` hands out one module per
device: the module itself on the device its weights live on, a cached copy on the others.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Callable

import torch

from comfy.multidevice.devices import accelerator_api, module_device, resolve_device
from comfy.multidevice.weights.block_shards import tensor_nbytes as _nbytes
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.read_only import ReadOnlyTensor

log = logging.getLogger(__name__)


def replica_on(module: torch.nn.Module, device) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers live on `device` (frozen parameters).

    deepcopy is told up front what every tensor becomes, so each tensor is copied once,
    source -> device, and everything else (structure, plain attributes) is copied as usual.
    """
    device = torch.device(device)
    memo = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to(device, copy=True), requires_grad=False)
    for b in module.buffers():
        memo[id(b)] = b.detach().to(device, copy=True)
    return copy.deepcopy(module, memo)


class ReplicaCache:
    """One module per device: the module itself where its weights are, a cached copy elsewhere."""

    def __init__(self, module, what: str = "module"):
        self.module = module
        self.what = what
        self._copies: dict = {}

    def get(self, device) -> torch.nn.Module:
        device = torch.device(device)
        home = module_device(self.module)
        if home is None or home == device:
            return self.module
        key = str(device)
        if key not in self._copies:
            log.info("%s: building a replica on %s", self.what, device)
            self._copies[key] = replica_on(self.module, device)
        return self._copies[key]

    def holds(self, device) -> bool:
        """Whether get(device) returns without building anything."""
        device = torch.device(device)
        home = module_device(self.module)
        return home is None or home == device or str(device) in self._copies

    def copy_bytes(self, device) -> int:
        """Bytes a copy on `device` takes (0 where the module itself serves)."""
        device = torch.device(device)
        home = module_device(self.module)
        if home is None or home == device:
            return 0
        return sum(t.nbytes for t in (*self.module.parameters(), *self.module.buffers()))

    def drop(self, device) -> int:
        """Forget the copy on `device` (rebuilt by the next get); return its bytes."""
        copy_ = self._copies.pop(str(torch.device(device)), None)
        if copy_ is None:
            return 0
        return sum(t.nbytes for t in (*copy_.parameters(), *copy_.buffers()))

    def clear(self) -> None:
        self._copies.clear()


# ----------------------------------------------------------------------------- patches

PatchFunction = Callable[[str, torch.Tensor], torch.Tensor]
# (name, replica module, device) -> the patched tensor for `name`, read from the module's layer
LayerPatchFunction = Callable[[str, torch.nn.Module, torch.device], torch.Tensor]


class WeightPatches:
    """Weight patches keyed by tensor name, shared by a family of replicas.

    Each name has an ordered list of entries: additive deltas (weight += strength * delta) or
    functions fn(name, weight_fp32) -> patched weight (float32, or the dtype the function
    computes in). Deltas are added in float32 on the replica's device; the result is cast back
    with `cast(name, weight, dtype)` (default: .to(dtype)); the same operations in the same
    order give the same weights on every replica.

    A tensor of a quantized layer (see _holds_wrapped_tensor) has a layer patch instead: one
    function that computes the patched tensor from the layer as its loader rebuilt it on the
    replica's device (e.g. dequantize, add the LoRA, requantize with a fixed seed).
    """

    def __init__(self):
        self._entries: dict[str, list[tuple[str, Any, float]]] = {}
        self._layer: dict[str, LayerPatchFunction] = {}
        self.version = 0
        self.cast: Callable[[str, torch.Tensor, torch.dtype], torch.Tensor] = (
            lambda name, weight, dtype: weight.to(dtype))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return [*self._entries, *self._layer]

    def layer_patch(self, name: str) -> LayerPatchFunction | None:
        return self._layer.get(name)

    def _add(self, name: str, kind: str, value: Any, strength: float) -> None:
        self._entries.setdefault(name, []).append((kind, value, strength))

    def _bump(self) -> None:
        self.version += 1

    def clear(self) -> None:
        self._entries.clear()
        self._layer.clear()
        self._bump()

    def apply(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """The patched weight as a new tensor on weight's device and dtype (weight is not changed)."""
        work = weight.to(torch.float32, copy=True)
        for kind, value, strength in self._entries.get(name, ()):
            if kind == "delta":
                if work.dtype != torch.float32:
                    work = work.to(torch.float32)
                work.add_(value.to(work.device, torch.float32), alpha=strength)
            else:
                # cast as the function returns it: ComfyUI's patch math returns its LoRA compute
                # dtype, and its rounding to the stored dtype starts from that
                work = value(name, work)
        return self.cast(name, work, weight.dtype)


# ----------------------------------------------------------------------------- hot caches

DtypeSpec = torch.dtype | Mapping[str, torch.dtype] | None


def _module_slots(module: torch.nn.Module, skip: Iterable[str] = ()) -> dict[str, tuple[torch.nn.Module, str, bool]]:
    """state-dict name -> (owning submodule, attribute name, is_parameter); names in `skip` left out."""
    slots, skip = {}, set(skip)
    for name in module.state_dict(keep_vars=True):
        if name in skip:
            continue
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        slots[name] = (owner, leaf, leaf in owner._parameters)
    return slots


def _holds_wrapped_tensor(module: torch.nn.Module) -> bool:
    """True for a layer holding a tensor subclass that is stored as several plain tensors, e.g.
    ComfyUI's quantized layers: a QuantizedTensor weight whose state dict is its int8/fp8 data
    plus scales and a `comfy_quant` record, rebuilt by the layer's own _load_from_state_dict."""
    return any(t is not None and not isinstance(t, ReadOnlyTensor)
               and type(t) not in (torch.Tensor, torch.nn.Parameter)
               for t in (*module._parameters.values(), *module._buffers.values()))


def _loader_layers(template: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, list[str]]]:
    """prefix -> (layer, its state-dict names) for every layer whose weights only its own
    loader can rebuild (see _holds_wrapped_tensor)."""
    layers = {}
    for path, sub in template.named_modules():
        if _holds_wrapped_tensor(sub):
            prefix = f"{path}." if path else ""
            layers[prefix] = (sub, [prefix + n for n in sub.state_dict(keep_vars=True)])
    return layers


# ComfyUI contract: a quantized layer's format record; its loader reads it with .numpy().
_HOST_SIDE_SUFFIX = "comfy_quant"


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
        self._layer_patched: dict[str, int] = {}  # quantized-layer tensor -> bytes of its patched copy
        self._loaders: dict[str, tuple[torch.nn.Module, list[str]]] = {}  # prefix -> layer, names
        self._loader_of: dict[str, str] = {}                                # name -> prefix
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
        template_loaders = _loader_layers(template)
        records = {n for _, names in template_loaders.values() for n in names if n.endswith(_HOST_SIDE_SUFFIX)}
        self._check_names({n: t for n, t in declared.items() if n not in records})
        # Copy the module's structure but not its weights: the deepcopy memo maps every
        # weight to the base view it will start out bound to; a quantized layer's tensors
        # are left out of the copy (its loader rebuilds them from the base just below).
        memo = {}
        for source, names in self._groups.items():
            original = declared[names[0]]
            view = self._base_tensor(source)
            memo[id(original)] = (torch.nn.Parameter(view, requires_grad=False)
                                  if isinstance(original, torch.nn.Parameter) else view)
        for layer, _ in template_loaders.values():
            for t in (*layer._parameters.values(), *layer._buffers.values()):
                if t is not None:
                    memo.setdefault(id(t), None)
        self.module = copy.deepcopy(template, memo)
        self.module.requires_grad_(False)
        for prefix, (_, names) in template_loaders.items():
            self._loaders[prefix] = (self.module.get_submodule(prefix[:-1]) if prefix else self.module, names)
            self._loader_of.update((n, prefix) for n in names)
        self._slots = _module_slots(self.module, skip=self._loader_of)
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
        for prefix in self._loaders:
            self._load_layer(prefix)

    def _check_names(self, declared: Mapping[str, torch.Tensor] | None) -> None:
        missing = [self.prefix + s for s in self._groups if self.prefix + s not in self.base]
        if missing:
            raise ValueError(
                f"{_label(self.base)} has no tensor {missing[0]!r} ({len(missing)} missing) needed by "
                f"the replica for {self._where()}; check the prefix ({self.prefix!r}) and the checkpoint")
        if declared is None:
            return
        for source, names in self._groups.items():
            if names[0] not in declared:
                continue  # a quantized layer's format record: its loader reads the file's own
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

    @functools.cached_property
    def _source_of(self) -> dict[str, str]:
        """name -> the source name its group is bound by (tied names share one source)."""
        return {n: source for source, names in self._groups.items() for n in names}

    @property
    def resident(self) -> bool:
        return self._resident

    @property
    def resident_bytes(self) -> int:
        """Bytes held by this replica beyond the shared base (device copies, patched weights)."""
        return (sum(self._bound[self._groups[s][0]].nbytes for s in self._owned)
                + sum(self._layer_patched.values()))

    @functools.cached_property
    def device_bytes(self) -> int:
        """Bytes the replica's weights take on its device once loaded (what a card must hold;
        fixed by the base and the dtypes, so computed once: ComfyUI asks for it often)."""
        total = 0
        for source in self._groups:
            base = self._base_tensor(source)
            total += base.numel() * self._target_dtype(source, base).itemsize
        return total

    def loaded_with(self, name: str) -> list[str]:
        """The names rebuilt together with `name`: all of a quantized layer's state-dict names
        (its data, scales and format record) for one of them, else just `name`."""
        prefix = self._loader_of.get(name)
        return list(self._loaders[prefix][1]) if prefix is not None else [name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors the replica is bound to now: device copies when resident, base views otherwise."""
        with self._lock:
            return dict(self._bound)

    # -- binding
    def _bind_base(self) -> None:
        self._bind({s: self._base_tensor(s) for s in self._groups}, patch_layers=False)
        self._owned.clear()
        self._layer_patched.clear()

    def _bind(self, tensors: Mapping[str, torch.Tensor], patch_layers: bool = True) -> None:
        reload = set()
        for source, t in tensors.items():
            names = self._groups[source]
            prefix = self._loader_of.get(names[0])
            if prefix is not None:
                reload.add(prefix)
            elif self.module is not None:
                first_owner, first_leaf, is_param = self._slots[names[0]]
                value = torch.nn.Parameter(t, requires_grad=False) if is_param else t
                for name in names:
                    owner, leaf, param = self._slots[name]
                    (owner._parameters if param else owner._buffers)[leaf] = value
            for name in names:
                self._bound[name] = t
        for prefix in sorted(reload):
            self._load_layer(prefix, patch=patch_layers)

    def _load_layer(self, prefix: str, patch: bool = False) -> None:
        """Rebuild a quantized layer's weights from its bound tensors with the layer's own
        loader, assigning them as they are (no copy: on a CPU rank the base views themselves);
        with `patch`, then replace its patched tensors by their layer patches' results."""
        layer, names = self._loaders[prefix]
        state = {n: self._bound[n] for n in names}
        if isinstance(getattr(layer, "factory_kwargs", None), dict):
            # ComfyUI contract: the loader moves what it reads to factory_kwargs["device"];
            # this replica's tensors are already where they belong.
            layer.factory_kwargs = dict(layer.factory_kwargs, device=None)
        errors: list[str] = []
        layer._load_from_state_dict(state, prefix, {"assign_to_params_buffers": True}, True, [], [], errors)
        if errors:
            raise ValueError(f"{_label(self.base)}: the layer {prefix[:-1]!r} could not be rebuilt on "
                             f"{self._where()}: {errors[0]}")
        layer.requires_grad_(False)
        for name in names:
            fn = self.patches.layer_patch(name) if patch else None
            if fn is None:
                self._layer_patched.pop(name, None)
                continue
            value = fn(name, self.module, self.device)
            leaf = name[len(prefix):]
            if leaf in layer._parameters:
                layer._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
            else:
                layer._buffers[leaf] = value
            self._layer_patched[name] = _nbytes(value)
            # the unpatched device copy served only as the patch's input: rebind the base view
            source = self._source_of[name]
            if source in self._owned:
                self._owned.discard(source)
                for n in self._groups[source]:
                    self._bound[n] = self._base_tensor(source)

    def _materialize(self, source: str) -> torch.Tensor:
        base = self._base_tensor(source)
        if source.endswith(_HOST_SIDE_SUFFIX) and self._loader_of.get(self._groups[source][0]) is not None:
            return base  # read on the host by the layer's loader; stays the base view
        t = base.to(self.device, self._target_dtype(source, base))  # the base view itself if nothing changes
        patched = next((n for n in self._groups[source] if n in self.patches), None)
        if patched is not None:
            t = self.patches.apply(patched, t)
        if t is base:
            self._owned.discard(source)
        else:
            self._owned.add(source)
        return t

    def load(self, names: Iterable[str] | None = None, only: bool = False) -> "RankReplica":
        """Make the replica resident on its device (only `names` are rebuilt if given and resident).

        only=True: copy just `names` to the device, resident or not (the others stay bound to
        the base); sharded DiT blocks use it so a card never holds the whole model at once.
        """
        with self._lock:
            if self._resident and self._patch_version == self.patches.version and names is None:
                return self
            wanted = None if names is None else set(names)
            sources = list(self._groups) if wanted is None or not (self._resident or only) else [
                s for s, group in self._groups.items() if any(n in wanted for n in group)]
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


class QuantizedPatchError(ValueError):
    """A weight patch (e.g. a LoRA) on quantized layers, which replicas from the base cannot apply."""

    def __init__(self, names: Sequence[str], message: str):
        super().__init__(message)
        self.names = list(names)


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
        quantized = [n for n in names if n in self.replicas[0]._loader_of]
        if quantized:
            raise QuantizedPatchError(quantized, f"patch for {quantized[0]!r} of a quantized layer "
                                      f"({len(quantized)} such): a delta or a float function cannot "
                                      "patch a quantized tensor; give it a layer patch "
                                      "(RankReplicas.add_layer_patch), which rebuilds the layer's tensor")
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

    def add_layer_patch(self, names: Iterable[str], fn: LayerPatchFunction) -> list[str]:
        """Patch each named tensor of a quantized layer with fn(name, replica module, device) ->
        the patched tensor, called on each replica after the layer's loader rebuilt it there
        (only where the layer is made resident, so a shard patches only what it keeps)."""
        names = list(names)
        first = self.replicas[0]
        for name in names:
            prefix = first._loader_of.get(name)
            if prefix is None:
                raise ValueError(f"{name!r} is not a tensor of a quantized layer (known: "
                                 f"{sorted(first._loader_of)[:3]}); patch it with add_patches or "
                                 "add_patch_function")
            layer, leaf = first._loaders[prefix][0], name[len(prefix):]
            if leaf not in layer._parameters and leaf not in layer._buffers:
                raise ValueError(f"{name!r} is stored inside the layer's {prefix[:-1]!r} weight, not "
                                 "held by it; patch the layer's weight instead")
        for name in names:
            self.patches._layer[name] = fn
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
        # only a kind whose runtime is already loaded can hold cached memory
        module = accelerator_api(kind) if kind == "cuda" or hasattr(torch, kind) else None
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
        try:
            from comfy.model_management import lora_compute_dtype
        except ImportError:  # a stand-in for comfy.lora alone (tests): float32
            return comfy.lora.calculate_weight(patch_list, weight, key)
        # ComfyUI patches in its LoRA compute dtype for the card (float16 on Ascend and recent
        # NVIDIA cards, float32 on the CPU), and the result depends on it; the float32 copy
        # converts to it exactly as the stored weight would
        return comfy.lora.calculate_weight(patch_list, weight.to(lora_compute_dtype(weight.device)), key)
    return apply


def _comfy_layer_patch(source: Any, key: str) -> LayerPatchFunction:
    """A quantized layer's tensor patched by ComfyUI's own ModelPatcher.patch_weight_to_device,
    run against the replica's module on the replica's device, as ComfyUI loads the MODEL on a
    card: dequantized in its LoRA compute dtype, patched, requantized by the layer's set_weight
    with stochastic rounding seeded from the key (comfy.utils.string_to_seed): the same bits on
    every card of one kind, and no random state of the process is used. `source` is a clone of
    the node's MODEL (its patch set as it was then)."""
    def apply(name: str, module: torch.nn.Module, device: torch.device) -> torch.Tensor:
        from types import SimpleNamespace
        patcher = copy.copy(source)
        # ComfyUI contract: the key is resolved on patcher.model; return_weight=True leaves the
        # module and the patcher's backup untouched
        patcher.model = SimpleNamespace(diffusion_model=module)
        return patcher.patch_weight_to_device(key, device_to=device, return_weight=True)
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
    applied with comfy.lora.calculate_weight and ComfyUI's rounding (on a quantized layer: by
    ComfyUI's own patch_weight_to_device, which requantizes with a seeded rounding), so every
    device gets the same weights ComfyUI computes for the primary. The file is read at most once per process.
    Rebuild the replicas when the MODEL input changes (new LoRA, new strength).
    """
    diffusion_model = getattr(getattr(model_patcher, "model", None), "diffusion_model", None)
    if not isinstance(diffusion_model, torch.nn.Module):
        raise ValueError("comfy_diffusion_model_replicas expects a ComfyUI MODEL (a ModelPatcher whose "
                         f".model.diffusion_model is a torch module), got {type(model_patcher).__name__}")
    declared = diffusion_model.state_dict()
    if base is None:
        base = checkpoint_path_of(model_patcher)
    if isinstance(base, (str, os.PathLike)):  # loaded: to adopt comfy-aimdo's mapping of the file
        base = SharedCheckpoint.open(base, loaded=declared)
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
    source = None  # a clone of the MODEL for the quantized layers' patches, made once
    for key, patch_list in patches.items():
        name = key[len("diffusion_model."):] if isinstance(key, str) and key.startswith("diffusion_model.") else None
        if name in replicas[0]._loader_of:  # a tensor of a quantized layer
            if source is None:
                source = model_patcher.clone()
            replicas.add_layer_patch([name], _comfy_layer_patch(source, key))
        elif name in replica_names:
            replicas.add_patch_function([name], _comfy_patch_function(list(patch_list), key))
    replicas.patches.cast = _comfy_cast("diffusion_model.")
    if load:
        replicas.load()
    return replicas
