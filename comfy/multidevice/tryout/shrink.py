"""The try-out's tiny configs, and the one switch that makes upstream's H3 loaders build them.

Upstream's `CLIPLoader` (type minimax) and `VAELoader` build the released sizes whatever the
file holds (Qwen3-VL-32B; the full video and audio VAEs); only the DiT's size comes from its
file. `shrink_upstream()` points them at the small configs below. `models.py` builds the tiny
files with the switch on, and the try-out node (`node.py`) turns it on as ComfyUI loads it, so
files and loaders agree. The node carries a copy of this file: it imports nothing of the
package (a try-out node may load before the pack does).
"""

from __future__ import annotations

import dataclasses
import functools

# Qwen3-VL language model: small widths, but 50 layers as released (upstream recognises the
# file by `model.layers.49.self_attn.q_proj.weight`). Its hidden size is the DiT's text_dim.
TEXT_ENCODER = dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
# Its vision tower (ref2va encodes the reference pictures with it); num_heads set, or the
# default 16 heads on this width give a head size that upstream's rope cannot take.
VISION = dict(hidden_size=32, intermediate_size=64, depth=1, deepstack_visual_indexes=[0], num_heads=2)
VIDEO_VAE = dict(ch=32, ch_mult=(1, 1, 1, 1, 1, 1), num_res_blocks=1)  # GroupNorm(32) needs 32 channels
VIDEO_DECODER = dict(num_layers=1, heads=2, dim_head=16, num_register_tokens=1)
# The hop (2*4*4*5*5 = 800 samples, 40 latents/s at 32 kHz) stays; BigVGAN halves its width 7 times.
AUDIO_VAE = dict(encoder_dim=8, latent_dim=64, decoder_dim=128)

_undo: list = []


def shrink_upstream() -> None:
    """Make upstream's H3 text encoder and VAE classes build the configs above (idempotent)."""
    if _undo:
        return
    from comfy.ldm.minimax import audio_vae, vae
    from comfy.text_encoders import qwen3vl

    language = dataclasses.make_dataclass(
        "TinyQwen3VL32BConfig", [(k, type(v), v) for k, v in TEXT_ENCODER.items()],
        bases=(qwen3vl.QWEN3VL_CONFIGS["qwen3vl_32b"],))
    for table, value in ((qwen3vl.QWEN3VL_CONFIGS, language), (qwen3vl.QWEN3VL_VISION, VISION)):
        _undo.append((table.__setitem__, "qwen3vl_32b", table["qwen3vl_32b"]))
        table["qwen3vl_32b"] = value
    for module, name, defaults in ((vae, "ViT3DDecoder", VIDEO_DECODER), (vae, "MiniMaxH3VideoVAE", VIDEO_VAE),
                                   (audio_vae, "MiniMaxH3AudioVAE", AUDIO_VAE)):
        real = getattr(module, name)
        _undo.append((functools.partial(setattr, module), name, real))
        setattr(module, name, functools.partial(real, **defaults))


def restore_upstream() -> None:
    while _undo:
        put, key, value = _undo.pop()
        put(key, value)
