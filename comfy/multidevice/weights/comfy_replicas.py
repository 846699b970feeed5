"""Per-card replicas of a ComfyUI MODEL's diffusion model, from the shared base, patched by ComfyUI's math.

ComfyUI is imported lazily, inside the patch functions: nothing here needs it installed.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Sequence

import torch

from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.patches import LayerPatchFunction, PatchFunction
from comfy.multidevice.weights.replicas import base_label, RankReplicas


def checkpoint_path_of(model_patcher: Any) -> str | None:
    """The .safetensors file a ComfyUI ModelPatcher was loaded from, when its loader recorded it.

    Core loaders store their factory and arguments in `cached_patcher_init` (upstream's
    multi-GPU clone re-runs it, re-reading the file); the path is the argument naming an
    existing .safetensors file. None when there is no such argument.
    """
    init = getattr(model_patcher, "cached_patcher_init", None)
    if not isinstance(init, tuple) or len(init) < 2 or not isinstance(init[1], (tuple, list)):
        return None
    return next((os.fspath(arg) for arg in init[1] if isinstance(arg, (str, os.PathLike))
                 and os.fspath(arg).endswith(".safetensors") and os.path.isfile(arg)), None)


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
        raise ValueError(f"{base_label(base)} does not hold the loaded diffusion model's weights (no "
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
        if replicas[0].quantized_layer(name) is not None:  # a tensor of a quantized layer
            if source is None:
                source = model_patcher.clone()
            replicas.add_layer_patch([name], _comfy_layer_patch(source, key))
        elif name in replica_names:
            replicas.add_patch_function([name], _comfy_patch_function(list(patch_list), key))
    replicas.patches.cast = _comfy_cast("diffusion_model.")
    if load:
        replicas.load()
    return replicas
