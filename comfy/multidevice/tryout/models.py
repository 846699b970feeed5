"""Tiny MiniMax-H3 model files under the released names, made from upstream's own classes.

Seeded random weights in the small configs of `shrink.py` (the try-out node makes upstream's
loaders build the same configs): the try-out command writes them into a ComfyUI, and the e2e
suite runs its servers on them. Forms, against the released files:
- the two DiTs: pruned (adaLN curve table instead of the time embedder), fp32, where the
  released files hold their block linears in comfy-kitchen's ConvRot int8 layout. That layer
  rounds its input to int4 per token (7 levels each side) at every call: a step function. The
  text encoder at 4 cards differs from one card by fp32 summation order (ref2va_21steps:
  2.6e-6, 8e-7 of max |value|; split in float64 the two agree to 2e-15), enough to flip some
  int4 levels, and the 4-card latents then differed by 4e-3 of max |value| (frames PSNR 33 dB,
  audio bands 0.33 dB on average, as far as the text encoder's o_proj on another rank's
  columns: 30 dB, 0.5 dB), on a CPU with AVX-512; a 10 times smaller text-encoder difference
  flipped nothing. Given the same text-encoder output, the ConvRot DiT at 4 cards is
  bit-identical to one card (measured through the server; tests/upstream/test_quantized_files.py
  at W = 4), so the workflow comparison would measure the flips, not the pipeline. In
  fp32 the latents differ by 2.4e-7 of max |value| (tests/upstream/test_e2e_tiny_models.py
  keeps the DiT that smooth);
- the text encoder: bf16, where the released file is NVFP4 AWQ (comfy-kitchen's NVFP4 needs a
  card: it has no CPU kernel to run it);
- the video VAE: fp32, where the released one is int8 ConvRot. Its decode at 4 cards is
  bit-identical to 1 card in that form too (tests/upstream/test_video_vae.py), but int8
  activations amplify a 1e-7 change of the latent to a few pixel levels (the same step as the
  DiT's above);
- the audio VAE: fp32, as released; random weights at std 0.08, its buffers (anti-aliasing
  filters) as the module computes them and its Snake activations in range, so it decodes
  audible noise in its linear range (at 0.02 near silence, at 0.1 clipped: either way an audio
  comparison would say nothing);
- the two Turbo LoRAs: `<module>.lora_up.weight` / `.lora_down.weight` on every block linear.

Needs upstream ComfyUI importable (its folder on sys.path, `comfy.cli_args.args.cpu` set);
never committed, a few MB in all.
"""

from __future__ import annotations

import json
import types

import torch

from comfy.multidevice.commands import PROJECT_DIR
from comfy.multidevice.tryout.shrink import restore_upstream, shrink_upstream, TEXT_ENCODER

PINS = PROJECT_DIR / "source_deps_info.json"  # in a checkout or a clone; a patched ComfyUI has none
# The tiny DiT: the block linears' inputs (hidden, ffn) are 256 wide (ConvRot's group size, the
# released layout's); text_dim is the tiny text encoder's hidden size.
DIT = dict(hidden_size=256, num_layers=2, token_refiner_num_layers=1, num_attention_heads=16,
           attention_head_dim=16, ffn_hidden_size=256, text_dim=TEXT_ENCODER["hidden_size"],
           timestep_input_dim=16, time_embed_hidden_size=256, time_embed_dim=16, rope_inv_freq_len=2,
           adaln_curve_grid=32)
LORA_TARGETS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
AUDIO_SCALE = 0.08  # audible (raw rms ~0.04) and linear; from 0.09 on its tanh output clips
LORA_RANK = 4


def released_names() -> dict[str, tuple[str, str]]:
    """role -> (models/ folder, file name) of the released files, from source_deps_info.json."""
    files = json.loads(PINS.read_text())["model_files"]["files"]
    return {f["role"]: (f["folder"], f["file"]) for f in files}


def random_like(state: dict, seed: int, scale: float) -> dict:
    """Seeded random floats in the shape of `state` (norm weights around 1); other dtypes kept."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(value.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0)
            if value.is_floating_point() else value.clone() for name, value in state.items()}


def random_weights(module: torch.nn.Module, seed: int, scale: float) -> dict:
    """Seeded random parameters for `module`; its buffers as the module computed them (the audio
    VAE's anti-aliasing filters, the video VAE's latent statistics). Snake activations get their trained
    range: upstream's Snake1d divides by alpha (linear scale, kept near 1), SnakeBeta stores
    alpha and beta in log scale (kept near 0); at random values near 0 the division explodes
    and the decoder returns clipped noise or NaN."""
    params = random_like(dict(module.named_parameters()), seed, scale)
    g = torch.Generator().manual_seed(seed + 1)
    for path, sub in module.named_modules():
        for leaf in ("alpha", "beta"):
            if isinstance(getattr(sub, leaf, None), torch.nn.Parameter):
                log_scale = type(sub).__name__ == "SnakeBeta"
                shape = getattr(sub, leaf).shape
                params[f"{path}.{leaf}"] = torch.randn(shape, generator=g) * 0.05 + (0.0 if log_scale else 1.0)
    return {**{k: v.detach().clone() for k, v in module.state_dict().items() if k not in params}, **params}


def _dit_shell() -> torch.nn.Module:
    """Upstream's H3 DiT in the tiny config, fp32, its weights not initialised."""
    import comfy.ldm.minimax.model as h3
    import comfy.ops
    return h3.MiniMaxH3Model(**DIT, dtype=torch.float32, operations=comfy.ops.disable_weight_init)


def dit_state_dict(seed: int) -> dict:
    state = random_like(_dit_shell().state_dict(), seed, 0.05)  # fp32: see the module docstring
    state["rope.inv_freq"] = torch.tensor([1.0, 0.3])
    return state


def text_encoder_state_dict(seed: int) -> dict:
    import comfy.sd
    from comfy.text_encoders import minimax
    target = types.SimpleNamespace(clip=minimax.MiniMaxH3TEModel, tokenizer=minimax.MiniMaxH3Tokenizer, params={})
    clip = comfy.sd.CLIP(target=target, model_options={"dtype": torch.float32})
    state = clip.cond_stage_model.qwen3vl_32b.transformer.state_dict()
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in random_like(state, seed, 0.05).items()}


def video_vae_state_dict(seed: int) -> dict:
    from comfy.ldm.minimax import vae
    return random_weights(vae.MiniMaxH3VideoVAE(), seed, 0.1)


def audio_vae_state_dict(seed: int) -> dict:
    from comfy.ldm.minimax import audio_vae
    state = random_weights(audio_vae.MiniMaxH3AudioVAE(), seed, AUDIO_SCALE)
    # upstream allocates these with torch.empty for the checkpoint to fill: kept as they were,
    # they are whatever the memory held (at times NaN, and the AAC encoder then refuses the audio)
    state["latents_mean"] = torch.zeros_like(state["latents_mean"])
    state["latents_std"] = torch.ones_like(state["latents_std"])
    return state


def lora_state_dict(seed: int) -> dict:
    """A rank-4 LoRA on every block linear of the tiny DiT (shapes from upstream's own module)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, block in enumerate(_dit_shell().blocks):
        for target in LORA_TARGETS:
            rows, cols = block.get_submodule(target).weight.shape
            key = f"diffusion_model.blocks.{i}.{target}"
            out[f"{key}.lora_up.weight"] = (torch.randn(rows, LORA_RANK, generator=g) * 0.1).to(torch.bfloat16)
            out[f"{key}.lora_down.weight"] = (torch.randn(LORA_RANK, cols, generator=g) * 0.1).to(torch.bfloat16)
    return out


def tiny_files() -> dict[str, bytes]:
    """role -> the bytes of its tiny safetensors file, for the seven files the templates load
    (the optional BF16 fl2va DiT is not made). Upstream's classes are shrunk while they build."""
    import safetensors.torch
    shrink_upstream()
    try:
        states = {"diffusion_model_ref2va": dit_state_dict(1), "diffusion_model_fl2va": dit_state_dict(2),
                  "text_encoder": text_encoder_state_dict(3), "video_vae": video_vae_state_dict(4),
                  "audio_vae": audio_vae_state_dict(5), "turbo_lora_ref2va": lora_state_dict(6),
                  "turbo_lora_fl2va": lora_state_dict(7)}
    finally:
        restore_upstream()
    return {role: safetensors.torch.save({k: v.contiguous() for k, v in state.items()}) for role, state in states.items()}

