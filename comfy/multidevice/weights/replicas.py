"""Per-rank replicas: each rank's device-resident copy of a model's weights, built from the shared base.

`RankReplica` is one rank's hot cache (bound to the base in RAM until `load()`, back to it on
`unload()`); `RankReplicas` is the family over all ranks, sharing one set of weight patches
(weights/patches.py). Stage unload lives in weights/offload.py, the ComfyUI MODEL glue in
weights/comfy_replicas.py.
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from comfy.multidevice.devices import resolve_device
from comfy.multidevice.tensor_bytes import tensor_nbytes
from comfy.multidevice.weights.patches import (LayerPatchFunction, PatchFunction, QuantizedPatchError,
                                               WeightPatches)
from comfy.multidevice.weights.read_only import moved, ReadOnlyTensor

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- hot caches

DtypeSpec = torch.dtype | Mapping[str, torch.dtype] | None


def _owner(module: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """(the submodule that holds tensor `name`, the tensor's attribute name there)."""
    owner_path, _, leaf = name.rpartition(".")
    return module.get_submodule(owner_path), leaf  # "" names the module itself


def _module_slots(module: torch.nn.Module, skip: Iterable[str] = ()) -> dict[str, tuple[torch.nn.Module, str, bool]]:
    """state-dict name -> (owning submodule, attribute name, is_parameter); names in `skip` left out."""
    slots = {}
    for name in module.state_dict(keep_vars=True):
        if name not in skip:
            owner, leaf = _owner(module, name)
            slots[name] = (owner, leaf, leaf in owner._parameters)
    return slots


def holds_wrapped_tensor(module: torch.nn.Module) -> bool:
    """True for a layer holding a tensor subclass that is stored as several plain tensors, e.g.
    ComfyUI's quantized layers: a QuantizedTensor weight whose state dict is its int8/fp8 data
    plus scales and a `comfy_quant` record, rebuilt by the layer's own _load_from_state_dict."""
    return any(t is not None and not isinstance(t, ReadOnlyTensor)
               and type(t) not in (torch.Tensor, torch.nn.Parameter)
               for t in (*module._parameters.values(), *module._buffers.values()))


def _loader_layers(template: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, list[str]]]:
    """prefix -> (layer, its state-dict names) for every layer whose weights only its own
    loader can rebuild (see holds_wrapped_tensor)."""
    layers = {}
    for path, sub in template.named_modules():
        if holds_wrapped_tensor(sub):
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
        self.lock = threading.RLock()  # held while the replica binds; the family holds it to refresh
        self.resident = False  # device copies made (load) and not dropped since (unload)
        self._patch_version = -1
        self._bound: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # sources bound to a private copy rather than the base itself
        self._layer_patched: dict[str, int] = {}  # quantized-layer tensor -> bytes of its patched copy
        self._loaders: dict[str, tuple[torch.nn.Module, list[str]]] = {}  # prefix -> layer, names
        self._loader_of: dict[str, str] = {}                                # name -> prefix
        self._slots: dict[str, tuple[torch.nn.Module, str, bool]] = {}
        self._extra_buffers: dict[str, tuple[torch.nn.Module, str, torch.Tensor]] = {}
        if template is None:
            wanted = list(names) if names is not None else [n[len(prefix):] for n in base if n.startswith(prefix)]
            self._groups = {n: [n] for n in wanted}
            self._check_names(None)
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
            view = self.base_tensor(source)
            memo[id(original)] = (torch.nn.Parameter(view, requires_grad=False)
                                  if isinstance(original, torch.nn.Parameter) else view)
        for layer, _ in template_loaders.values():
            for t in (*layer._parameters.values(), *layer._buffers.values()):
                if t is not None:
                    memo.setdefault(id(t), None)
        self.module = copy.deepcopy(template, memo)
        self.module.requires_grad_(False)
        for prefix, (_, names) in template_loaders.items():
            self._loaders[prefix] = (self.module.get_submodule(prefix[:-1]), names)
            self._loader_of.update((n, prefix) for n in names)
        self._slots = _module_slots(self.module, skip=self._loader_of)
        persistent = set(self._slots)
        for name, buf in self.module.named_buffers():
            if name in persistent or buf is None:
                continue
            if buf.device.type == "meta":
                raise ValueError(f"template buffer {name!r} is on the meta device and is not in the "
                                 "state dict, so no base holds its values; build the template on CPU")
            owner, leaf = _owner(self.module, name)
            # Non-persistent buffers (not in any checkpoint) keep a CPU copy as their "base".
            self._extra_buffers[name] = (owner, leaf, buf.to("cpu"))
            owner._buffers[leaf] = self._extra_buffers[name][2]
        self._bound = {n: self.base_tensor(s) for s, names in self._groups.items() for n in names}
        for prefix in self._loaders:
            self._load_layer(prefix)

    def _check_names(self, declared: Mapping[str, torch.Tensor] | None) -> None:
        missing = [self.prefix + s for s in self._groups if self.prefix + s not in self.base]
        if missing:
            raise ValueError(
                f"{base_label(self.base)} has no tensor {missing[0]!r} ({len(missing)} missing) needed by "
                f"the replica for {self._where()}; check the prefix ({self.prefix!r}) and the checkpoint")
        if declared is None:
            return
        for source, names in self._groups.items():
            if names[0] not in declared:
                continue  # a quantized layer's format record: its loader reads the file's own
            want, have = tuple(declared[names[0]].shape), tuple(self.base[self.prefix + source].shape)
            if want != have:
                raise ValueError(f"{base_label(self.base)}: tensor {self.prefix + source!r} has shape {have} "
                                 f"but the model expects {want}; the checkpoint does not fit this model")

    def base_tensor(self, name: str) -> torch.Tensor:
        """The base's tensor for the replica name `name` (prefix + name in the base)."""
        return self.base[self.prefix + name]

    def target_dtype(self, name: str, base: torch.Tensor) -> torch.dtype:
        """The dtype tensor `name` (stored as `base`) takes on the device: the replica's dtype rule."""
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
    def sources(self) -> list[str]:
        """One name per distinct tensor: the name each group of tied names is bound by."""
        return list(self._groups)

    def device_nbytes(self, source: str) -> int:
        """Bytes the tensor `source` takes on the device once loaded (its target dtype)."""
        base = self.base_tensor(source)
        return base.numel() * self.target_dtype(source, base).itemsize

    def quantized_layer(self, name: str) -> tuple[str, torch.nn.Module] | None:
        """(prefix, layer) of the quantized layer whose loader rebuilds tensor `name`; None for
        a tensor bound as it is."""
        prefix = self._loader_of.get(name)
        return None if prefix is None else (prefix, self._loaders[prefix][0])

    @functools.cached_property
    def _source_of(self) -> dict[str, str]:
        """name -> the source name its group is bound by (tied names share one source)."""
        return {n: source for source, names in self._groups.items() for n in names}

    @property
    def resident_bytes(self) -> int:
        """Bytes held by this replica beyond the shared base (device copies, patched weights)."""
        return (sum(self._bound[self._groups[s][0]].nbytes for s in self._owned)
                + sum(self._layer_patched.values()))

    @functools.cached_property
    def device_bytes(self) -> int:
        """Bytes the replica's weights take on its device once loaded (what a card must hold;
        fixed by the base and the dtypes, so computed once: ComfyUI asks for it often)."""
        return sum(self.device_nbytes(source) for source in self._groups)

    def loaded_with(self, name: str) -> list[str]:
        """The names rebuilt together with `name`: all of a quantized layer's state-dict names
        (its data, scales and format record) for one of them, else just `name`."""
        prefix = self._loader_of.get(name)
        return list(self._loaders[prefix][1]) if prefix is not None else [name]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors the replica is bound to now: device copies when resident, base views otherwise."""
        with self.lock:
            return dict(self._bound)

    # -- binding
    def _bind_base(self) -> None:
        self._bind({s: self.base_tensor(s) for s in self._groups}, patch_layers=False)
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
                value = torch.nn.Parameter(t, requires_grad=False) if self._slots[names[0]][2] else t
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
            raise ValueError(f"{base_label(self.base)}: the layer {prefix[:-1]!r} could not be rebuilt on "
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
            self._layer_patched[name] = tensor_nbytes(value)
            # the unpatched device copy served only as the patch's input: rebind the base view
            source = self._source_of[name]
            if source in self._owned:
                self._owned.discard(source)
                for n in self._groups[source]:
                    self._bound[n] = self.base_tensor(source)

    def _materialize(self, source: str) -> torch.Tensor:
        base = self.base_tensor(source)
        if source.endswith(_HOST_SIDE_SUFFIX) and self._loader_of.get(self._groups[source][0]) is not None:
            return base  # read on the host by the layer's loader; stays the base view
        t = moved(base, self.device, self.target_dtype(source, base))  # the base view itself if nothing changes
        patched = next((n for n in self._groups[source] if n in self.patches), None)
        if patched is not None:
            t = self.patches.apply(patched, t)
        if t is base:
            self._owned.discard(source)
        else:
            self._owned.add(source)  # bound to a private copy
        return t

    def load(self, names: Iterable[str] | None = None, only: bool = False) -> "RankReplica":
        """Make the replica resident on its device (only `names` are rebuilt if given and resident).

        only=True: copy just `names` to the device, resident or not (the others stay bound to
        the base); sharded DiT blocks use it so a card never holds the whole model at once.
        """
        with self.lock:
            if self.resident and self._patch_version == self.patches.version and names is None:
                return self
            wanted = None if names is None else set(names)
            sources = list(self._groups) if wanted is None or not (self.resident or only) else [
                s for s, group in self._groups.items() if any(n in wanted for n in group)]
            self._bind({s: self._materialize(s) for s in sources})
            for owner, leaf, buf in self._extra_buffers.values():
                owner._buffers[leaf] = buf.to(self.device)
            self.resident = True
            self._patch_version = self.patches.version
            log.debug("rank %d: replica resident on %s (%d bytes beyond the base)",
                      self.rank, self.device, self.resident_bytes)
            return self

    def unload(self) -> int:
        """Point every weight back at the base (CPU, zero-copy); return the bytes dropped."""
        with self.lock:
            dropped = self.resident_bytes
            self._bind_base()
            for owner, leaf, buf in self._extra_buffers.values():
                owner._buffers[leaf] = buf
            self.resident = False
            log.debug("rank %d: replica unloaded from %s (%d bytes dropped)", self.rank, self.device, dropped)
            return dropped


def base_label(base: Mapping) -> str:
    """How errors name a base: its label, else 'the base state dict'."""
    return getattr(base, "label", "the base state dict")


class RankReplicas(Sequence):
    """A family of per-rank replicas of one model over one shared base, with shared patches.

    One RankReplica per device (rank r on devices[r]); with load=False nothing is copied yet,
    so each rank thread can call replicas[rank].load() itself.
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
        quantized = [n for n in names if self.replicas[0].quantized_layer(n) is not None]
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
            self.patches.add(name, "delta", deltas[name].detach(), float(strength))
        self._refresh(names)
        return names

    def add_patch_function(self, names: Iterable[str], fn: PatchFunction) -> list[str]:
        """Patch each named weight with fn(name, weight_fp32) -> weight_fp32 on every replica."""
        names = self._check_patch_names(names)
        for name in names:
            self.patches.add(name, "function", fn, 1.0)
        self._refresh(names)
        return names

    def add_layer_patch(self, names: Iterable[str], fn: LayerPatchFunction) -> list[str]:
        """Patch each named tensor of a quantized layer with fn(name, replica module, device) ->
        the patched tensor, called on each replica after the layer's loader rebuilt it there
        (only where the layer is made resident, so a shard patches only what it keeps)."""
        names = list(names)
        first = self.replicas[0]
        for name in names:
            found = first.quantized_layer(name)
            if found is None:
                raise ValueError(f"{name!r} is not a tensor of a quantized layer (known: "
                                 f"{sorted(first._loader_of)[:3]}); patch it with add_patches or "
                                 "add_patch_function")
            prefix, layer = found
            leaf = name[len(prefix):]
            if leaf not in layer._parameters and leaf not in layer._buffers:
                raise ValueError(f"{name!r} is stored inside the layer's {prefix[:-1]!r} weight, not "
                                 "held by it; patch the layer's weight instead")
        for name in names:
            self.patches.set_layer_patch(name, fn)
        self._refresh(names)
        return names

    def _refresh(self, names: list[str]) -> None:
        self.patches.bump()
        for replica in self.replicas:
            with replica.lock:
                if replica.resident:
                    replica.load(names)

