"""A ComfyUI MODEL described to a worker as data (comfy/multidevice/workers/comfy_dit.py): its
loader by name (ComfyUI's own loaders only) with its arguments, its weight patches (tensors,
tuples, weight adapters by class name) named by their SHA-256; what cannot be described is
refused at rank 0 naming it and the fix. Stand-ins for comfy.sd and comfy.cli_args (the real
ones: tests/upstream/test_workers.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import comfy
from comfy.multidevice.workers.comfy_dit import (AdapterPatch, build_comfy_dit, comfy_dit_recipe, LoaderCall,
                                                 loader_call, patches_digest)
from comfy.multidevice.workers.recipe import RecipeError
from comfy.multidevice.workers.wire import decode, encode


def _as_comfy_sd(function, name: str):
    function.__module__, function.__qualname__, function.__name__ = "comfy.sd", name, name
    return function


@pytest.fixture
def comfy_sd(monkeypatch):
    """A stand-in comfy.sd whose two loaders record their calls."""
    calls = []
    sd = types.ModuleType("comfy.sd")
    sd.load_diffusion_model = _as_comfy_sd(lambda *a, **kw: calls.append((a, kw)) or "patcher", "load_diffusion_model")
    sd.load_checkpoint_guess_config = _as_comfy_sd(lambda *a, **kw: calls.append((a, kw)) or ("model", "clip"),
                                                   "load_checkpoint_guess_config")
    monkeypatch.setitem(sys.modules, "comfy.sd", sd)
    sd.calls = calls
    return sd


def patcher(init, patches=None):
    return types.SimpleNamespace(cached_patcher_init=init, patches=patches or {})


class LoRAAdapter:
    """A stand-in of comfy.weight_adapter's LoRAAdapter, as far as rank 0 reads it."""

    def __init__(self, loaded_keys, weights):
        self.loaded_keys, self.weights = loaded_keys, weights


LoRAAdapter.__module__ = "comfy.weight_adapter.lora"


def test_the_loader_travels_by_name_and_runs_from_the_allow_list_only(comfy_sd):
    options = {"dtype": torch.float8_e4m3fn, "load_device": torch.device("cpu")}
    call = loader_call(patcher((comfy_sd.load_diffusion_model, ("/models/dit.safetensors", options))))
    assert call == LoaderCall("comfy.sd", "load_diffusion_model", ("/models/dit.safetensors", options), None)
    arrived = decode(encode(call), max_bytes=1 << 16, what="a loader call")
    assert arrived.run() == "patcher"
    assert comfy_sd.calls == [(("/models/dit.safetensors", options), {"disable_dynamic": True})]
    checkpoint = (comfy_sd.load_checkpoint_guess_config, ("/m/all.safetensors", False, False, False, None, True, {}, {}), 0)
    assert loader_call(patcher(checkpoint)).run() == "model"
    forged = LoaderCall("os", "system", ("echo hello",))
    with pytest.raises(RecipeError, match=r"rank 0 named the loader os.system, not one of ComfyUI's loaders a worker "
                                          r"runs \(comfy.sd.load_checkpoint_guess_config, comfy.sd.load_diffusion_model\)"):
        forged.run()
    assert len(comfy_sd.calls) == 2


def test_a_loader_that_cannot_be_described_is_refused_at_rank0_naming_it(comfy_sd):
    def load_diffusion_model(path, options):  # the right name, but not ComfyUI's function
        return None

    refused = {
        "does not record how it was loaded": None,
        r"loaded by .*<lambda>, which a worker process does not run": (lambda p: None, ("x",)),
        r"loaded by .*load_diffusion_model, which a worker": (load_diffusion_model, ("x",)),
        r"the loader call comfy.sd.load_diffusion_model.args\[1\]\['custom_operations'\]: a class .* cannot travel": (
            comfy_sd.load_diffusion_model, ("x.safetensors", {"custom_operations": torch.nn.Linear})),
    }
    for message, init in refused.items():
        with pytest.raises(RecipeError, match=message + ".*use ranks as threads for this MODEL"):
            loader_call(patcher(init))


def lora_patches(scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(0)
    up, down = torch.randn(8, 2, generator=g), torch.randn(2, 8, generator=g) * scale
    return {"blocks.0.w": [(1.0, LoRAAdapter({"b.up", "a.down"}, (up, down, 4.0, None, None, None)), 1.0, None, None)],
            "blocks.1.w": [(0.5, ("diff", (torch.ones(8, 8),)), 1.0, (0, 0, 4), None),
                           (1.0, (torch.zeros(8, 8),), 0.9, None, None)]}


def test_weight_patches_travel_as_data_named_by_a_deterministic_digest():
    blob, digest = patches_digest(patcher(None, lora_patches()))
    assert patches_digest(patcher(None, lora_patches()))[1] == digest  # equal patches, equal name
    assert patches_digest(patcher(None, lora_patches(scale=2.0)))[1] != digest
    assert blob.dtype == torch.uint8
    arrived = decode(blob.numpy(), max_bytes=blob.numel(), what="the weight patches")
    adapter = arrived["blocks.0.w"][0][1]
    assert isinstance(adapter, AdapterPatch) and adapter.kind == "LoRAAdapter"
    assert adapter.loaded_keys == ("a.down", "b.up") and adapter.weights[2] == 4.0
    assert torch.equal(adapter.weights[0], lora_patches()["blocks.0.w"][0][1].weights[0])
    assert arrived["blocks.1.w"][0][1][0] == "diff" and arrived["blocks.1.w"][0][3] == (0, 0, 4)


def test_patches_that_cannot_be_described_are_refused_at_rank0_naming_them():
    adapter = LoRAAdapter({"k"}, (torch.ones(1),))
    adapter.multiplier = 0.5  # state a worker would not get
    refused = {
        r"the weight patch 0 of 'w' applies a function \(.*<lambda>\)": {"w": [(1.0, (torch.ones(1),), 1.0, None,
                                                                            lambda w: w)]},
        r"the MODEL's weight patches\['w'\]\[0\]\[1\]\[0\]\[1\]: a function": {"w": [(1.0, [(torch.ones(1), print)],
                                                                                    1.0, None, None)]},
        r"the weight patch 0 of 'w': a LoRAAdapter with state beyond its loaded keys and weights \(\['multiplier'\]\)": {
            "w": [(1.0, adapter, 1.0, None, None)]},
    }
    for message, patches in refused.items():
        with pytest.raises(RecipeError, match=message + ".*use ranks as threads for this MODEL"):
            patches_digest(patcher(None, patches))


@pytest.fixture
def comfy_settings(monkeypatch):
    """Stand-ins for comfy.cli_args (two settings) and comfy.model_management."""
    cli_args = types.ModuleType("comfy.cli_args")
    cli_args.args = types.SimpleNamespace(cpu=False, preview_size=512, callback=print)
    for name, module in {"cli_args": cli_args, "model_management": types.ModuleType("comfy.model_management")}.items():
        monkeypatch.setitem(sys.modules, f"comfy.{name}", module)
        monkeypatch.setattr(comfy, name, module, raising=False)
    return cli_args.args


def test_a_worker_checks_the_prelude_and_the_patches_before_loading(comfy_sd, comfy_settings):
    recipe = comfy_dit_recipe(patcher((comfy_sd.load_diffusion_model, ("x.safetensors", {})), lora_patches()))
    kwargs = decode(encode(recipe), max_bytes=1 << 20, what="a recipe").kwargs
    assert kwargs["settings"] == {"cpu": False, "preview_size": 512}  # the function stays the worker's own
    with pytest.raises(RecipeError, match="the prelude function os:system cannot be found"):
        build_comfy_dit("cpu", **{**kwargs, "prelude": (("os", "system"),)})
    tampered = kwargs["patches"].clone()
    tampered[-1] ^= 1
    with pytest.raises(RecipeError, match="the weight patches arrived with SHA-256 .*, not .* as sent"):
        build_comfy_dit("cpu", **{**kwargs, "patches": tampered, "settings": {"cpu": True, "not_a_setting": 1}})
    assert comfy_settings.cpu is True and not hasattr(comfy_settings, "not_a_setting")  # set before the check
    assert comfy_sd.calls == []  # the loader never ran
