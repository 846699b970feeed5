"""Duck-typed views of upstream ComfyUI objects, so the package needs no ComfyUI to import.

A MODEL socket carries a ModelPatcher; its `.model` is a BaseModel whose `.diffusion_model` is
the DiT. Tests and the dry run pass the DiT module itself, which every function here accepts.
"""

from __future__ import annotations





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
