"""The tensor-parallel text encoder on a ComfyUI CLIP: find its language model, split it, restore it.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping

import torch
import torch.nn as nn

from comfy.multidevice.tp.layers import TensorParallelError
from comfy.multidevice.tp.decoder import build_tensor_parallel_decoder, TensorParallelDecoder
from comfy.multidevice.tp.shard import check_decoder_split, prefixed_weights, shallow_module_copy

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- upstream CLIP
#
# Upstream facts this relies on (ComfyUI, comfy/text_encoders/{minimax,qwen3vl,llama}.py
# and comfy/sd1_clip.py, comfy/sd.py):
# - A loaded text encoder is a comfy.sd.CLIP whose `cond_stage_model` is an SD1ClipModel;
#   that object's `clip` attribute is a *string* naming the attribute that holds the
#   SDClipModel (for H3, MiniMaxH3TEModel uses the name "qwen3vl_32b").
# - SDClipModel.transformer is the Qwen3VL module (MiniMaxQwen3VL for H3). It holds the
#   language model at `.model` (a Llama2_) and the vision tower at `.visual`; its forward
#   calls self.model(input_ids, attention_mask=..., embeds=..., ..., position_ids=...,
#   visual_pos_masks=..., deepstack_embeds=...) and returns what that returns.
# - SDClipModel embeds the tokens itself through transformer.get_input_embeddings(),
#   which returns self.model.embed_tokens, on its execution device, then passes `embeds`.
# - Llama2_: embed_tokens, layers (TransformerBlock: self_attn, mlp, input_layernorm,
#   post_attention_layernorm), norm (None for the H3 encoder: final_norm False), config
#   (Qwen3VL_32BConfig: hidden 5120, 64 query heads, 8 KV heads inherited from the 8B
#   config, head_dim 128, intermediate 25600, 50 layers, merged_qkv/merged_mlp False).
#   Its forward computes RoPE (interleaved MRoPE) and the mask from its own inputs, on
#   x's device, then runs the layers with optimized_attention_for_device(x.device).
#   It runs each layer through comfy.model_prefetch.prefetch_queue_pop; the prefetch
#   queue is None unless prefetch_dynamic_vbars is requested, which Llama2_ only does
#   with a KV cache (generation), so for encoding each layer is simply called. CUDA
#   graph capture is likewise only enabled for KV-cache decoding.
# - Attention: q_proj/k_proj/v_proj (or qkv_proj when config.merged_qkv), o_proj without
#   bias, per-head q_norm/k_norm RMSNorms over head_dim; forward views q/k/v with
#   self.num_heads / self.num_kv_heads / self.head_dim, splits a fused qkv output with
#   self.inner_size / self.kv_size, and passes enable_gqa=True when the two head counts
#   differ. MLP: gate_proj/up_proj/down_proj (or gate_up_proj chunked gate-first).
# - TransformerBlock writes its output into the buffer of its input x
#   (torch.add(..., out=x)), hence the per-rank input copies in TensorParallelDecoder.
# - Weights in a text-encoder file are named relative to `transformer`, so the language
#   model's tensors carry the prefix "model." (loaded by SDClipModel.load_sd).
# - comfy.sd.CLIP.clone() returns a new CLIP with patcher = self.patcher.clone() and the
#   *same* cond_stage_model object; ModelPatcher.clone() builds a patcher around the same
#   `.model` (ModelPatcher keeps the module it manages in its `model` attribute).
# - ModelPatcher.model_size() caches the module's state-dict bytes in `patcher.size` and
#   counts again while that is 0; clone() hands the clone the cached figure.
# - Upstream's CLIP patcher applies weight patches (e.g. a CLIP LoRA) when it loads the
#   model; `clip.patcher.patches` maps state-dict keys of cond_stage_model to patches.

def _locate_language_model(clip) -> tuple[Any, nn.Module, str]:
    """(transformer, language model, state-dict prefix of the language model) or a clear error."""
    cond = getattr(clip, "cond_stage_model", None)
    if cond is None:
        raise TensorParallelError(
            f"expected a ComfyUI CLIP with a `cond_stage_model`, got {type(clip).__name__}")
    name = getattr(cond, "clip", None)
    inner = getattr(cond, name, None) if isinstance(name, str) else None
    transformer = getattr(inner, "transformer", None)
    model = getattr(transformer, "model", None)
    if model is None:
        raise TensorParallelError(
            f"{type(cond).__name__} does not hold a language model at "
            f"cond_stage_model.<clip name>.transformer.model (clip name {name!r}); "
            "tensor parallel supports the Llama/Qwen-family text encoders (e.g. CLIPLoader type minimax)")
    return transformer, model, f"{name}.transformer.model."


def check_tensor_parallel_clip(clip, world_size: int) -> nn.Module:
    """Every check tensor_parallel_clip makes for W=world_size, touching nothing (for planners
    that validate before a coordinator exists); raises TensorParallelError. Returns the
    single-device language model to split."""
    _, model, _ = _locate_language_model(clip)
    if isinstance(model, TensorParallelDecoder):
        model = model.source_decoder  # re-split from the kept original
    patched = language_model_patches(clip)
    if patched:
        raise TensorParallelError(
            f"the CLIP carries {len(patched)} weight patch(es) on its language model (e.g. "
            f"{patched[0]!r}, from a CLIP LoRA); tensor parallel slices unpatched weights. "
            "Remove the CLIP LoRA or keep the text encoder on one card")
    check_decoder_split(model, world_size)
    return model


def language_model_patches(clip) -> list[str]:
    """The patched state-dict keys of the CLIP's language model (a CLIP LoRA's), in order."""
    _, _, key_prefix = _locate_language_model(clip)
    patcher = getattr(clip, "patcher", None)
    return [k for k in (getattr(patcher, "patches", None) or {}) if k.startswith(key_prefix)]


def language_model_of(clip) -> nn.Module:
    """The language model inside a ComfyUI CLIP; TensorParallelError for another layout."""
    return _locate_language_model(clip)[1]


def apply_tensor_parallel_text_encoder(clip, coordinator, weights: Mapping[str, torch.Tensor] | None = None,
                                       weights_prefix: str = "model.") -> Any:
    """Put a ComfyUI CLIP's language model in tensor parallel over `coordinator`'s ranks.

    clip         a comfy.sd.CLIP (CLIPLoader output) of a Llama/Qwen-family encoder, e.g.
                 MiniMax-H3's Qwen3-VL (type minimax). Modified in place and returned.
    coordinator  a SequenceParallelCoordinator; its world size W must split the encoder's
                 heads (64 query / 8 KV heads for H3: W in 1, 2, 4, 8, 16, 32, 64) and MLP width.
    weights      optional full tensors of the text-encoder file (e.g. a SharedCheckpoint's
                 read-only views), named as in the file; `weights_prefix` is the language
                 model's prefix there ("model."). Without it the loaded module is sliced.

    What changes: clip.cond_stage_model.<name>.transformer.model becomes a
    TensorParallelDecoder; rank r holds 1/W of every layer's linear weights plus
    replicated norms on coordinator.devices[r]. Encoding then runs on all ranks at once
    and returns rank 0's hidden states, equal to the single-device result up to float
    summation order. The input embedding and the vision tower stay where the CLIP's own
    patcher loads them (one card; the CLIP embeds the tokens there, so no rank copies the
    embedding), and that patcher counts its module again. The single-device language model is kept (not moved) for
    remove_tensor_parallel_text_encoder(). Calling again with the same coordinator is a
    no-op; with another coordinator the encoder is re-split from the kept original.
    Errors (TensorParallelError) are raised before anything is changed.
    """
    transformer, model, _ = _locate_language_model(clip)
    if isinstance(model, TensorParallelDecoder) and model.coordinator is coordinator:
        return clip
    model = check_tensor_parallel_clip(clip, coordinator.world_size)
    source = prefixed_weights(weights, weights_prefix) if weights is not None else None
    wrapper = build_tensor_parallel_decoder(model, coordinator, weights=source)
    transformer.model = wrapper
    _recount_patcher(clip)
    if getattr(transformer, "visual", None) is not None:
        log.info("tensor parallel text encoder: the vision tower is not split; it runs on one "
                 "card, the CLIP's load device")
    log.info("tensor parallel text encoder: %d layers over %d ranks (%s); the single-device "
             "language model is kept on %s for remove_tensor_parallel_text_encoder()",
             len(model.layers), coordinator.world_size, ", ".join(map(str, coordinator.devices)),
             _device_of(model))
    return clip


def tensor_parallel_clip(clip, coordinator) -> Any:
    """A new CLIP whose language model runs tensor parallel over `coordinator`; `clip` is untouched.

    The entry point for MultiNPUParallelConfig. The checks and result of
    apply_tensor_parallel_text_encoder (from the loaded module), but on a copy: clip.clone() (upstream: a new CLIP
    whose patcher is a clone, both still sharing the one cond_stage_model), then fresh
    shallow copies of the objects on the path cond_stage_model -> <clip name> ->
    transformer, so that replacing transformer.model in the copy leaves the input CLIP's
    encoder as it was. Everything else (tokenizer, vision tower, embeddings, the
    single-device language model) is shared, not copied. The copy's patcher is pointed
    at the copied cond_stage_model. Errors are raised before anything is copied.
    """
    check_tensor_parallel_clip(clip, coordinator.world_size)  # fail before copying anything
    new = clip.clone() if hasattr(clip, "clone") else copy.copy(clip)
    cond = clip.cond_stage_model
    new_cond = shallow_module_copy(cond) if isinstance(cond, nn.Module) else copy.copy(cond)
    inner = getattr(cond, cond.clip)
    new_inner = shallow_module_copy(inner)
    new_inner.transformer = shallow_module_copy(inner.transformer)
    setattr(new_cond, cond.clip, new_inner)
    new.cond_stage_model = new_cond
    patcher = getattr(new, "patcher", None)
    if getattr(patcher, "model", None) is cond:  # upstream's patcher manages cond_stage_model
        patcher.model = new_cond
    return apply_tensor_parallel_text_encoder(new, coordinator)


def remove_tensor_parallel_text_encoder(clip) -> Any:
    """Undo apply_tensor_parallel_text_encoder: put the single-device language model back."""
    transformer, model, _ = _locate_language_model(clip)
    if isinstance(model, TensorParallelDecoder):
        transformer.model = model.source_decoder
        _recount_patcher(clip)
    return clip


def _recount_patcher(clip) -> None:
    """Make the CLIP's patcher count its module again: it now holds the fan-out module (the
    embedding, no split layers) or the whole language model back. Otherwise ComfyUI would
    reserve the whole encoder (~51.5 GB for H3) on the load card for the embedding and the
    vision tower, the size cached before the split (or handed over by clone())."""
    patcher = getattr(clip, "patcher", None)
    if isinstance(getattr(patcher, "size", None), int):
        patcher.size = 0


def _device_of(module: nn.Module) -> str:
    for t in module.parameters():
        return str(t.device)
    return "no parameters"
