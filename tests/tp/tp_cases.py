"""What the tensor-parallel tests share: the miniature decoder's two layouts, its inputs, the
per-rank byte formula, the tolerances, and a module tree with upstream's CLIP attribute layout.

Model: the miniature Llama/Qwen-style decoder (8 query heads, 2 KV heads, so W=4 is the
KV-replication case). Every parallel result is compared with the same model run on one
device, same inputs:
  fp32: max |TP - single| <= 1e-5 * max |single|.
  bf16: max |TP - single| <= 2**-5 * max |single| (4 to 8 bf16 ulps at the output's
        scale; observed up to ~0.011). Why: bf16 keeps 8 significant bits (relative
        rounding 2**-8 to 2**-7 of a value); the parallel run
        sums each row-parallel layer's partial products in another order and rounds the W
        partials to bf16 before the all-reduce, so every such layer may differ by an
        ulp or two, and 2 layers x 2 row-parallel projections compound. The test also
        checks the parallel bf16 run is no further from the fp32 result than about the
        single-device bf16 run is, i.e. the split costs no accuracy class.
"""

import torch
import torch.nn as nn

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from tests.qwen_decoder import MiniatureDecoderConfig, build_miniature_decoder


FP32_REL_TOL = 1e-5
BF16_REL_TOL = 2.0 ** -5


def coordinator(world, backend="peer"):
    return SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=30)


def inputs(cfg, seed=0, batch=2, seq=13, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, seq, cfg.hidden_size, generator=gen).to(dtype)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, -4:] = 0  # the second prompt is padded
    return embeds, mask


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def expected_rank_bytes(cfg, world, itemsize, embedding=False):
    """Bytes one rank must hold, from the config alone (the split this project promises).

    A shard holds no input embedding (embedding=False) until a call passes token ids."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_local = cfg.num_attention_heads // world
    kv_local = max(cfg.num_key_value_heads // world, 1)  # replicated when W > KV heads
    split = (q_local * d * h            # q_proj rows
             + 2 * kv_local * d * h     # k_proj, v_proj rows
             + h * q_local * d          # o_proj columns
             + 2 * (inter // world) * h  # gate, up rows
             + h * (inter // world))    # down_proj columns
    if cfg.qkv_bias:
        split += (q_local + 2 * kv_local) * d
    total = cfg.num_hidden_layers * split + replicated_elements(cfg)
    if embedding:
        total += embedding_elements(cfg)
    return total * itemsize


def replicated_elements(cfg):
    """Elements every rank holds whole: the norms."""
    h = cfg.hidden_size
    per_layer = 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)  # block norms, q/k norms
    return cfg.num_hidden_layers * per_layer + (h if cfg.final_norm else 0)


def embedding_elements(cfg):
    return cfg.vocab_size * cfg.hidden_size


def holds_embedding(shard):
    return any(name.startswith("embed_tokens.") for name, _ in shard.named_parameters())


LAYOUTS = {
    "separate": MiniatureDecoderConfig(),
    "fused": MiniatureDecoderConfig(merged_qkv=True, merged_mlp=True, final_norm=True, qkv_bias=True),
}


class WrappedWeight(torch.Tensor):
    """Stands in for a quantized weight type (e.g. ComfyUI's NVFP4 tensors)."""


# ----------------------------------------------------------------------------- upstream mirror
# A module tree with upstream ComfyUI's attribute layout (see the notes in
# comfy/multidevice/tp/): CLIP -> cond_stage_model (SD1ClipModel: `.clip` names the
# child) -> SDClipModel -> `.transformer` (Qwen3VL: `.model` language model, `.visual`,
# get_input_embeddings() -> model.embed_tokens) ; CLIP.patcher.patches.

class MirrorQwen3VL(nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.model = decoder
        self.visual = nn.Linear(4, decoder.config.hidden_size)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask=None, embeds=None, intermediate_output=None):
        return self.model(input_ids, attention_mask=attention_mask, embeds=embeds,
                          intermediate_output=intermediate_output)


class MirrorSDClipModel(nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.transformer = MirrorQwen3VL(decoder)

    def encode(self, ids):
        embeds = self.transformer.get_input_embeddings()(ids)
        return self.transformer(None, embeds=embeds)[0]


class MirrorSD1ClipModel(nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.clip = "qwen3vl_32b"
        self.qwen3vl_32b = MirrorSDClipModel(decoder)


class MirrorPatcher:
    """Like upstream's ModelPatcher: manages `.model`; clone() shares it and copies patches."""

    def __init__(self, model, patches):
        self.model, self.patches = model, patches

    def clone(self):
        return MirrorPatcher(self.model, dict(self.patches))


class MirrorCLIP:
    """Like upstream's comfy.sd.CLIP: clone() = new CLIP, cloned patcher, same cond_stage_model."""

    clones = 0

    def __init__(self, cond, patches):
        self.cond_stage_model = cond
        self.patcher = MirrorPatcher(cond, patches)

    def clone(self):
        MirrorCLIP.clones += 1
        n = MirrorCLIP.__new__(MirrorCLIP)
        n.patcher = self.patcher.clone()
        n.cond_stage_model = self.cond_stage_model
        return n


def mirror_clip(cfg, seed=12, patches=None):
    return MirrorCLIP(MirrorSD1ClipModel(build_miniature_decoder(cfg, seed=seed)), patches or {})
