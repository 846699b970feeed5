"""Shared inputs of the node's tests: a ModelPatcher stand-in, the node's four inputs built small,
a device inventory, a comfy_api stand-in, and the snapshot that shows the node changed nothing."""

from __future__ import annotations

import threading
import types
import uuid

import torch

from comfy.multidevice.cards import DeviceInventory
from tests.small_vaes import TinyAudioVAE, TinyCausalVideoVAE, VAEWrapper
from tests.sp_cases import tiny_model
from tests.tp.tp_cases import LAYOUTS, mirror_clip


class FakeModelPatcher:
    """The slice of ComfyUI's ModelPatcher the node uses: clone() shares the model and copies
    the wrappers; wrappers are added/removed by key; `.model.diffusion_model` is the DiT."""

    def __init__(self, diffusion_model, load_device="cpu"):
        self.model = types.SimpleNamespace(diffusion_model=diffusion_model)
        self.load_device = torch.device(load_device)
        self.wrappers = {}
        self.patches_uuid = uuid.uuid4()

    def clone(self):
        n = FakeModelPatcher.__new__(FakeModelPatcher)
        n.model, n.load_device, n.patches_uuid = self.model, self.load_device, self.patches_uuid
        n.wrappers = {k: {kk: list(v) for kk, v in d.items()} for k, d in self.wrappers.items()}
        return n

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def forward(self, x, t, ctx, **kwargs):
        """What ComfyUI's sampling does: the patcher's wrappers go into transformer_options."""
        return self.model.diffusion_model(x, t, ctx, transformer_options={"wrappers": self.wrappers}, **kwargs)


def inputs(seed=0, clip_cfg=None, clip_patches=None):
    return (FakeModelPatcher(tiny_model(seed=seed)),
            mirror_clip(clip_cfg or LAYOUTS["separate"], patches=clip_patches),
            VAEWrapper(TinyCausalVideoVAE(seed=seed)),
            VAEWrapper(TinyAudioVAE(seed=seed)))


def inventory(npu=0, cuda=0, **env):
    names = {"ASCEND_RT_VISIBLE_DEVICES": None, "CUDA_VISIBLE_DEVICES": None}
    names.update(env)
    return DeviceInventory(counts={"npu": npu, "cuda": cuda}, env=names)

def make_fake_comfy_api(with_advanced=True):
    """A stand-in for comfy_api.latest that records how the node declares itself."""
    def input_class(io_type):
        def __init__(self, id, display_name=None, optional=False, tooltip=None, default=None,
                     options=None, advanced=None, min=None, max=None):
            self.io_type, self.id, self.optional, self.tooltip = io_type, id, optional, tooltip
            self.default, self.options, self.advanced = default, options, advanced
        if not with_advanced:
            def __init__(self, id, display_name=None, optional=False, tooltip=None, default=None,  # noqa: F811
                         options=None, min=None, max=None):
                self.io_type, self.id, self.optional, self.default, self.options = io_type, id, optional, default, options
                self.advanced = "absent"
        return type(f"{io_type}Input", (), {"__init__": __init__})

    def output_class(io_type):
        def __init__(self, id=None, display_name=None, tooltip=None):
            self.io_type, self.display_name, self.tooltip = io_type, display_name, tooltip
        return type(f"{io_type}Output", (), {"__init__": __init__})

    def comfy_type(io_type):
        return types.SimpleNamespace(Input=input_class(io_type), Output=output_class(io_type))

    io = types.SimpleNamespace(
        ComfyNode=type("ComfyNode", (), {}),
        Schema=lambda **kw: types.SimpleNamespace(**kw),
        NodeOutput=lambda *values: ("NodeOutput", values),
        Model=comfy_type("MODEL"), Clip=comfy_type("CLIP"), Vae=comfy_type("VAE"),
        Combo=comfy_type("COMBO"), String=comfy_type("STRING"), Int=comfy_type("INT"))
    latest = types.ModuleType("comfy_api.latest")
    latest.io = io
    latest.ComfyExtension = type("ComfyExtension", (), {})
    package = types.ModuleType("comfy_api")
    package.latest = latest
    return package, latest

def snapshot(model, clip, video_vae, audio_vae):
    """Identity and contents of everything the node could touch."""
    te = clip.cond_stage_model.qwen3vl_32b
    return {
        "model": (dict(vars(model)), {k: {kk: list(v) for kk, v in d.items()} for k, d in model.wrappers.items()},
                  {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}),
        "clip": (dict(vars(clip)), dict(vars(clip.patcher)), te.transformer.model,
                 dict(te.transformer._modules), dict(clip.cond_stage_model._modules)),
        "video_vae": (dict(vars(video_vae)), dict(vars(video_vae.first_stage_model))),
        "audio_vae": (dict(vars(audio_vae)), dict(vars(audio_vae.first_stage_model))),
    }


def assert_same(before, after):
    for key in before:
        b, a = before[key], after[key]
        assert len(b) == len(a)
        for x, y in zip(b, a):
            if isinstance(x, dict) and x and all(torch.is_tensor(v) for v in x.values()):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), key
            else:
                assert x == y, key


def rank_threads():
    return sum(1 for t in threading.enumerate() if t.name.startswith("sp-rank-"))

def run_dit(model, x, t, ctx, kw):
    if isinstance(model, FakeModelPatcher):
        return model.forward(x, t, ctx, **kw)
    return model(x, t, ctx, **kw)
