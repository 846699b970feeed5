"""DiT files in the forms the official templates ship, made with upstream's own code and loaded
by `comfy.sd.load_diffusion_model`: block linears quantized by comfy-kitchen's layouts (the
`quantize` / `state_dict_tensors` of upstream's quantization registry, with the `comfy_quant`
metadata upstream's mixed-precision ops read: fp8 e4m3 and int8 per-tensor), and a pruned
curve-form file (`adaln_t_table` instead of the time embedder). Each is sampled by
`comfy.sample.sample` with the node's DiT role against the same file on one card (fp32
activations: 1e-5 of max |reference|), with every rank's DiT built from the shared base (no
fallback to copying the loaded weights); the base's replicas hold the quantized layers as they
are: bit-identical QuantizedTensors over the base's own memory."""

from __future__ import annotations

import json

import pytest
import torch

from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, TINY, tiny_state_dict
from tests.upstream.test_sampling import node_dit, sample


def quantized_state_dict(upstream, fmt, config=TINY):
    import comfy.quant_ops
    from comfy_kitchen.tensor.base import get_layout_class
    layout = get_layout_class(comfy.quant_ops.QUANT_ALGOS[fmt]["comfy_tensor_layout"])
    out = {}
    for name, value in tiny_state_dict(upstream, config=config).items():
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
    assert parallel.multinpu_dit_replicas.uses_base(), parallel.multinpu_dit_replicas.base_problem


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
    state = convrot_state_dict(linear_dtype)
    model = load(upstream, state, tmp_path, f"convrot_{linear_dtype}")
    assert type(model.model.diffusion_model.blocks[0].attn.qkv_proj.weight).__name__ == "QuantizedTensor"
    reference = sample(model)
    coord, parallel = node_dit(model, 4)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL
    assert parallel.multinpu_dit_replicas.uses_base(), parallel.multinpu_dit_replicas.base_problem


def convrot_state_dict(linear_dtype):
    import comfy.ops
    import comfy.quant_ops
    import comfy.ldm.minimax.model as h3
    from comfy_kitchen.tensor.base import get_layout_class
    shell = h3.MiniMaxH3Model(**WIDE, dtype=torch.float32, operations=comfy.ops.disable_weight_init)
    g = torch.Generator().manual_seed(9)
    layout = get_layout_class(comfy.quant_ops.QUANT_ALGOS["convrot_w4a4"]["comfy_tensor_layout"])
    state = {}
    for name, p in shell.state_dict().items():
        value = torch.randn(p.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0)
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
    return state


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "convrot_int8"])
def test_quantized_layers_are_served_from_the_base_as_they_are(upstream, tmp_path, fmt):
    """Replicas from the base (comfy_diffusion_model_replicas, what the node's DiT role uses)
    hold every quantized layer as a QuantizedTensor over the base's read-only memory (zero-copy
    on a CPU rank), bit-identical to what upstream's loader built for the primary, with the
    same layer outputs bit for bit; an unload / reload cycle reads nothing from disk."""
    from comfy.multidevice.weights.checkpoint import total_bytes_read
    from comfy.multidevice.weights.read_only import is_read_only
    from comfy.multidevice.weights.comfy_replicas import comfy_diffusion_model_replicas
    state = convrot_state_dict("int8") if fmt == "convrot_int8" else quantized_state_dict(upstream, fmt)
    model = load(upstream, state, tmp_path, fmt)
    primary = model.model.diffusion_model
    replicas = comfy_diffusion_model_replicas(model, ["cpu", "cpu"], load=True)
    base = replicas.base
    quantized = [n for n, m in primary.named_modules() if type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"]
    assert quantized
    x = torch.randn(3, primary.blocks[0].attn.qkv_proj.in_features, generator=torch.Generator().manual_seed(1))
    for replica in replicas:
        for name in quantized:
            mine, theirs = replica.module.get_submodule(name).weight, primary.get_submodule(name).weight
            assert type(mine).__name__ == "QuantizedTensor" and mine._layout_cls == theirs._layout_cls
            assert is_read_only(mine._qdata) and mine._qdata.data_ptr() == base[f"{name}.weight"].data_ptr()
            assert mine._qdata.dtype == theirs._qdata.dtype and torch.equal(mine._qdata, theirs._qdata)
            for field in ("scale",):
                assert torch.equal(getattr(mine._params, field), getattr(theirs._params, field))
            assert mine._params.orig_dtype == theirs._params.orig_dtype
        layer, reference = replica.module.blocks[0].attn.qkv_proj, primary.blocks[0].attn.qkv_proj
        assert torch.equal(layer(x), reference(x))
    before = total_bytes_read()
    replicas.unload()
    replicas.load()
    assert total_bytes_read() == before
    assert torch.equal(replicas[1].module.blocks[0].attn.qkv_proj(x), primary.blocks[0].attn.qkv_proj(x))


def test_a_lora_on_a_quantized_layer_is_patched_from_the_base_as_comfyui_patches_it(upstream, tmp_path):
    """Replicas from the base patch a quantized layer with ComfyUI's own patch_weight_to_device
    (dequantize, patch, requantize with the key's seeded rounding): byte for byte the tensors
    ComfyUI's load of the patched MODEL puts in the primary; the base stays unpatched, the
    patched copy counts as the replica's own bytes, and unload / reload reads nothing from disk."""
    import comfy.model_management
    from comfy.multidevice.weights.checkpoint import total_bytes_read
    from comfy.multidevice.weights.comfy_replicas import comfy_diffusion_model_replicas
    model = load(upstream, quantized_state_dict(upstream, "int8_tensorwise"), tmp_path, "int8")
    patched = model.clone()
    key = "diffusion_model.blocks.0.attn.qkv_proj.weight"
    layer = patched.model.diffusion_model.blocks[0].attn.qkv_proj
    delta = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3)) * 0.05
    patched.add_patches({key: (delta,)}, 1.0)
    replicas = comfy_diffusion_model_replicas(patched, ["cpu", "cpu"], load=True)
    base_qdata = replicas.base["blocks.0.attn.qkv_proj.weight"].clone()
    with torch.inference_mode():
        comfy.model_management.load_models_gpu([patched])  # ComfyUI patches the primary itself
        theirs = layer.weight
        for replica in replicas:
            mine = replica.module.blocks[0].attn.qkv_proj.weight
            assert type(mine).__name__ == "QuantizedTensor"
            assert torch.equal(mine._qdata, theirs._qdata) and torch.equal(mine._params.scale, theirs._params.scale)
            assert not torch.equal(mine._qdata, base_qdata)  # the patch acts
            assert replica.resident_bytes == mine._qdata.nbytes + mine._params.scale.nbytes
        comfy.model_management.unload_all_models()
    assert torch.equal(replicas.base["blocks.0.attn.qkv_proj.weight"], base_qdata)
    before = total_bytes_read()
    assert replicas.unload() > 0 and replicas[1].resident_bytes == 0
    replicas.load()
    assert total_bytes_read() == before
    assert torch.equal(replicas[1].module.blocks[0].attn.qkv_proj.weight._qdata, theirs._qdata)
