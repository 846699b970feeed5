"""DiT files in the forms the official templates ship, made with upstream's own code and loaded
by `comfy.sd.load_diffusion_model`: block linears quantized by comfy-kitchen's layouts (the
`quantize` / `state_dict_tensors` of upstream's quantization registry, with the `comfy_quant`
metadata upstream's mixed-precision ops read: fp8 e4m3 and int8 per-tensor), and a pruned
curve-form file (`adaln_t_table` instead of the time embedder). Each is sampled by
`comfy.sample.sample` with the node's DiT role against the same file on one card (fp32
activations: 1e-5 of max |reference|)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, TINY, tiny_state_dict
from tests.upstream.test_sampling import node_dit, sample


def quantized_state_dict(upstream, fmt):
    import comfy.quant_ops
    from comfy_kitchen.tensor.base import get_layout_class
    layout = get_layout_class(comfy.quant_ops.QUANT_ALGOS[fmt]["comfy_tensor_layout"])
    out = {}
    for name, value in tiny_state_dict(upstream).items():
        if name.startswith("blocks.") and name.endswith(".weight") and value.dim() == 2 and "adaln" not in name:
            prefix = name[:-len("weight")]
            qdata, params = layout.quantize(value)
            for suffix, tensor in layout.state_dict_tensors(qdata, params).items():
                out[f"{prefix}weight{suffix}"] = tensor
            out[f"{prefix}comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
        else:
            out[name] = value
    return out


def curve_form_state_dict(upstream, grid=32):
    import comfy.ops
    shell = upstream.h3.MiniMaxH3Model(**TINY, adaln_curve_grid=grid, dtype=torch.float32,
                                       operations=comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(6)
    state = {name: torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05) + (1.0 if "norm" in name else 0.0)
             for name, p in shell.state_dict().items()}
    state["rope.inv_freq"] = torch.tensor([1.0, 0.3])
    assert "adaln_t_table" in state and not any(k.startswith("time_embedder.") for k in state)
    return state


def load(upstream, state, tmp_path, name):
    import comfy.sd
    import safetensors.torch
    path = tmp_path / f"{name}.safetensors"
    safetensors.torch.save_file(state, str(path))
    with torch.inference_mode():  # as ComfyUI runs a prompt's nodes, loaders included
        return comfy.sd.load_diffusion_model(str(path))


@pytest.fixture
def hook(upstream):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
@pytest.mark.parametrize("world", [2, 4])
def test_quantized_dit_file_under_sp(upstream, hook, tmp_path, fmt, world):
    model = load(upstream, quantized_state_dict(upstream, fmt), tmp_path, fmt)
    weight = model.model.diffusion_model.blocks[0].attn.qkv_proj.weight
    assert type(weight).__name__ == "QuantizedTensor"  # upstream's loader kept the quantized form
    reference = sample(model)
    coord, parallel = node_dit(model, world)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL


@pytest.mark.parametrize("world", [2, 4])
def test_pruned_curve_form_file_under_sp(upstream, hook, tmp_path, world):
    model = load(upstream, curve_form_state_dict(upstream), tmp_path, "curve")
    assert getattr(model.model.diffusion_model, "use_adaln_curves", False)
    reference = sample(model)
    coord, parallel = node_dit(model, world)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL


WIDE = dict(TINY, hidden_size=256, num_attention_heads=16, attention_head_dim=16, ffn_hidden_size=256,
            num_layers=2, time_embed_hidden_size=256)  # convrot groups 256 input features


@pytest.mark.parametrize("linear_dtype", ["int4", "int8"])
def test_convrot_dit_file_under_sp(upstream, hook, tmp_path, linear_dtype):
    """comfy-kitchen's ConvRot layout (weights rotated, packed int4 or int8; groups of 256 input
    features, hence a wider tiny config), through upstream's loader, at W = 4."""
    import comfy.ops
    import comfy.quant_ops
    from comfy_kitchen.tensor.base import get_layout_class
    shell = upstream.h3.MiniMaxH3Model(**WIDE, dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(9)
    layout = get_layout_class(comfy.quant_ops.QUANT_ALGOS["convrot_w4a4"]["comfy_tensor_layout"])
    state = {}
    for name, p in shell.state_dict().items():
        value = torch.randn(p.shape, generator=g) * (0.05 if p.dim() > 1 else 0.05) + (1.0 if "norm" in name else 0.0)
        if name.startswith("blocks.") and name.endswith(".weight") and value.dim() == 2 and "adaln" not in name:
            prefix = name[:-len("weight")]
            qdata, params = layout.quantize(value, linear_dtype=linear_dtype)
            for suffix, tensor in layout.state_dict_tensors(qdata, params).items():
                state[f"{prefix}weight{suffix}"] = tensor
            conf = {"format": "convrot_w4a4", "convrot": True, "convrot_groupsize": 256,
                    "linear_dtype": linear_dtype}
            state[f"{prefix}comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        else:
            state[name] = value
    state["rope.inv_freq"] = torch.tensor([1.0, 0.3])
    model = load(upstream, state, tmp_path, f"convrot_{linear_dtype}")
    assert type(model.model.diffusion_model.blocks[0].attn.qkv_proj.weight).__name__ == "QuantizedTensor"
    reference = sample(model)
    coord, parallel = node_dit(model, 4)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL
