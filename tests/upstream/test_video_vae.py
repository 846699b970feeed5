"""Upstream's MiniMax-H3 video VAE (`MiniMaxH3VideoVAE` inside `comfy.sd.VAE`, tiny config,
seeded weights): the node's chunked decode on several ranks against upstream's own decode on one.
Decoding moves no data between ranks inside a chunk, so the result must be bit-identical.

The tiny config: upstream's classes with smaller widths and one decoder layer (their defaults
are the released model's). `comfy.sd.VAE` detects the file by its keys, as for the real one.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.tryout.models import random_weights


@pytest.fixture(scope="module")
def tiny_vae(upstream):
    import comfy.sd
    from comfy.ldm.minimax import vae as h3_vae
    small = {"ch": 32, "ch_mult": (1, 1, 1, 1, 1, 1), "num_res_blocks": 1}  # GroupNorm(32) needs 32
    decoder = {"num_layers": 1, "heads": 2, "dim_head": 16, "num_register_tokens": 1}
    mp = pytest.MonkeyPatch()
    mp.setattr(h3_vae, "ViT3DDecoder", functools.partial(h3_vae.ViT3DDecoder, **decoder))
    mp.setattr(h3_vae, "MiniMaxH3VideoVAE", functools.partial(h3_vae.MiniMaxH3VideoVAE, **small))
    try:
        shell = h3_vae.MiniMaxH3VideoVAE()
        g = torch.Generator().manual_seed(2)
        state = {}
        for name, value in shell.state_dict().items():
            if name in ("latents_mean", "latents_std"):
                state[name] = value.clone()
            else:
                state[name] = torch.randn(value.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0)
        vae = comfy.sd.VAE(sd=state)
    finally:
        mp.undo()
    assert type(vae.first_stage_model).__name__ == "MiniMaxH3VideoVAE"
    return vae


def parallel_vae(vae, world):
    from comfy.multidevice.roles.apply import chunked_video_vae
    coord = SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=120)
    return coord, chunked_video_vae(vae, coord.devices, coord.devices[0], coord)


@pytest.mark.parametrize("latent_frames", [1, 2, 7, 12])
@pytest.mark.parametrize("world", [2, 4])
def test_chunked_decode_is_bit_identical(upstream, tiny_vae, world, latent_frames):
    z = torch.randn(1, 24, latent_frames, 2, 3, generator=torch.Generator().manual_seed(latent_frames))
    with torch.inference_mode():
        reference = tiny_vae.decode(z)
    coord, parallel = parallel_vae(tiny_vae, world)
    with coord, torch.inference_mode():
        out = parallel.decode(z)
    assert out.shape == reference.shape
    assert torch.equal(out, reference)


def test_chunked_decode_with_upstreams_spatial_tiles_is_bit_identical(upstream, tiny_vae):
    """18 x 20 latent rows are 288 x 320 pixels: above upstream's 256-pixel tile, so every
    chunk is decoded in spatial tiles and blended, on each rank as on one card."""
    z = torch.randn(1, 24, 7, 18, 20, generator=torch.Generator().manual_seed(99))
    with torch.inference_mode():
        reference = tiny_vae.decode(z)
    coord, parallel = parallel_vae(tiny_vae, 3)
    with coord, torch.inference_mode():
        out = parallel.decode(z)
    assert torch.equal(out, reference)


def convrot_int8(state: dict, quantized) -> dict:
    """`state` with the 2-D weights that `quantized(name)` picks in comfy-kitchen's ConvRot int8
    layout (the released DiT and video VAE files' form), made by upstream's quantization registry."""
    import comfy.quant_ops
    from comfy_kitchen.tensor.base import get_layout_class
    layout = get_layout_class(comfy.quant_ops.QUANT_ALGOS["convrot_w4a4"]["comfy_tensor_layout"])
    conf = json.dumps({"format": "convrot_w4a4", "convrot": True, "convrot_groupsize": 256, "linear_dtype": "int8"})
    out = {}
    for name, value in state.items():
        if name.endswith(".weight") and value.dim() == 2 and quantized(name):
            prefix = name[:-len("weight")]
            qdata, params = layout.quantize(value, linear_dtype="int8")
            for suffix, tensor in layout.state_dict_tensors(qdata, params).items():
                out[f"{prefix}weight{suffix}"] = tensor
            out[f"{prefix}comfy_quant"] = torch.tensor(list(conf.encode()), dtype=torch.uint8)
        else:
            out[name] = value
    return out


@pytest.fixture(scope="module")
def convrot_vae(upstream):
    """The released form: the decoder's transformer-block linears in comfy-kitchen's ConvRot int8
    (upstream loads such a file with its mixed-precision ops), 256 wide (one ConvRot group)."""
    pytest.importorskip("comfy_kitchen", reason="ConvRot int8 needs comfy-kitchen (the tree's requirements)")
    import comfy.sd
    from comfy.ldm.minimax import vae as h3_vae
    small = {"ch": 32, "ch_mult": (1, 1, 1, 1, 1, 1), "num_res_blocks": 1}
    decoder = {"num_layers": 1, "heads": 2, "dim_head": 128, "num_register_tokens": 1}
    mp = pytest.MonkeyPatch()
    mp.setattr(h3_vae, "ViT3DDecoder", functools.partial(h3_vae.ViT3DDecoder, **decoder))
    mp.setattr(h3_vae, "MiniMaxH3VideoVAE", functools.partial(h3_vae.MiniMaxH3VideoVAE, **small))
    try:
        state = convrot_int8(random_weights(h3_vae.MiniMaxH3VideoVAE(), 4, 0.1),
                             lambda name: name.startswith("decoder.transformer_blocks."))
        vae = comfy.sd.VAE(sd=state)
    finally:
        mp.undo()
    qkv = vae.first_stage_model.decoder.transformer_blocks[0].attn.to_qkv
    assert "MixedPrecisionOps" in type(qkv).__qualname__  # upstream took the file as quantized
    return vae


@pytest.mark.parametrize("latent_frames", [2, 7])
def test_chunked_decode_of_a_convrot_int8_vae_is_bit_identical(upstream, convrot_vae, latent_frames):
    """Each chunk goes through the same quantized linears on its rank as on one card, with the
    same inputs: torch.equal."""
    z = torch.randn(1, 24, latent_frames, 8, 8, generator=torch.Generator().manual_seed(latent_frames))
    with torch.no_grad():  # as ComfyUI decodes (inference mode cannot move the quantized weights)
        reference = convrot_vae.decode(z)
    coord, parallel = parallel_vae(convrot_vae, 4)
    with coord, torch.no_grad():
        out = parallel.decode(z)
    assert out.shape == reference.shape
    assert torch.equal(out, reference)
