"""Duck-typed views of upstream ComfyUI objects, so the package needs no ComfyUI to import.

A MODEL socket carries a ModelPatcher; its `.model` is a BaseModel whose `.diffusion_model` is
the DiT. Tests and the dry run pass the DiT module itself, which every function here accepts.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def is_model_patcher(model) -> bool:
    return callable(getattr(model, "clone", None)) and callable(getattr(model, "add_wrapper_with_key", None))


def dit_module(model):
    """The DiT module behind a MODEL input (ModelPatcher -> BaseModel -> diffusion_model)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "diffusion_model"):
        return inner.diffusion_model
    return getattr(model, "diffusion_model", model)


def block_patches_of(model) -> dict:
    """The block replacements a MODEL carries (model_options' patches_replace["dit"]); {} for none."""
    options = getattr(model, "model_options", None) or {}
    return options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})


def move_load_device(patcher, device, what: str) -> None:
    """Point a patcher's load device at `device` when it names another card (logged as `what`'s)."""
    if getattr(patcher, "load_device", device) != device:
        log.info("%s: load device %s -> %s", what, patcher.load_device, device)
        patcher.load_device = device


def lazily_patched_layers(module) -> int:
    """The layers whose weight patches ComfyUI applies at compute time (its low-VRAM mode keeps
    per-layer weight_function / bias_function lists instead of patching the weights)."""
    return sum(1 for m in module.modules()
               if getattr(m, "weight_function", None) or getattr(m, "bias_function", None))
