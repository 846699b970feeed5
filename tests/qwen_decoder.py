"""A small Llama/Qwen-style decoder for the tensor-parallel tests and benchmark.

RMSNorm, rotary position embedding (split-half rotation), grouped-query attention
with Qwen3's per-head q/k RMSNorm, and a SwiGLU MLP. Randomly initialised; it needs
no checkpoint and no ComfyUI.

Its module and attribute names follow the layout of upstream ComfyUI's Llama-family
decoder (documented in comfy/multidevice/tp/), so the same tensor-parallel
converter drives both:

  decoder.embed_tokens, decoder.layers[i], decoder.norm (None: H3's encoder has no final norm)
  layers[i].input_layernorm, .post_attention_layernorm, .self_attn, .mlp
  self_attn.q_proj / k_proj / v_proj (or one fused qkv_proj), .o_proj, .q_norm, .k_norm,
      and the head counts read at forward time: num_heads, num_kv_heads, head_dim,
      inner_size (= num_heads * head_dim), kv_size (= num_kv_heads * head_dim)
  mlp.gate_proj / up_proj (or one fused gate_up_proj, gate rows first), .down_proj

Like upstream's block, a layer writes its result into the buffer of its input
(`torch.add(..., out=x)`): whoever hands one input tensor to several ranks must give
each rank its own copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MiniatureDecoderConfig:
    vocab_size: int = 96
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    qk_norm: bool = True        # Qwen3: RMSNorm over head_dim on every query and key head
    qkv_bias: bool = False      # Qwen2.5-style biases on the q/k/v projections
    merged_qkv: bool = False    # one fused q|k|v projection instead of three
    merged_mlp: bool = False    # one fused gate|up projection instead of two
    final_norm: bool = False    # H3 reads the last layer's output unnormalised


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 activations do not lose the mean-square.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables [B, 1, S, head_dim] for split-half rotation."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.float32) / head_dim))
    angles = position_ids.float()[..., None] * inv_freq  # [B, S, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class MiniatureAttention(nn.Module):
    def __init__(self, cfg: MiniatureDecoderConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.inner_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.merged_qkv = cfg.merged_qkv
        hidden = cfg.hidden_size
        bias = cfg.qkv_bias
        if self.merged_qkv:
            self.qkv_proj = nn.Linear(hidden, self.inner_size + 2 * self.kv_size, bias=bias)
        else:
            self.q_proj = nn.Linear(hidden, self.inner_size, bias=bias)
            self.k_proj = nn.Linear(hidden, self.kv_size, bias=bias)
            self.v_proj = nn.Linear(hidden, self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.inner_size, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, mask, cos, sin):
        batch, seq, _ = x.shape
        # Head counts are read here, not cached at build time: a tensor-parallel shard
        # sets them to its own share.
        if self.merged_qkv:
            q, k, v = self.qkv_proj(x).split((self.inner_size, self.kv_size, self.kv_size), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Query head h reads KV head h // (num_heads / num_kv_heads).
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, self.inner_size))


class MiniatureMLP(nn.Module):
    def __init__(self, cfg: MiniatureDecoderConfig):
        super().__init__()
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        self.merged_mlp = cfg.merged_mlp
        if self.merged_mlp:
            self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        else:
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        if self.merged_mlp:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class MiniatureBlock(nn.Module):
    def __init__(self, cfg: MiniatureDecoderConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MiniatureAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MiniatureMLP(cfg)

    def forward(self, x, mask, cos, sin):
        h = x + self.self_attn(self.input_layernorm(x), mask, cos, sin)
        return torch.add(h, self.mlp(self.post_attention_layernorm(h)), out=x)


class MiniatureDecoder(nn.Module):
    def __init__(self, cfg: MiniatureDecoderConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(MiniatureBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.final_norm else None

    def forward(self, input_ids=None, attention_mask=None, embeds=None, position_ids=None,
                intermediate_output=None, dtype=None):
        """Hidden states after the last layer, and after layer `intermediate_output` (or None).

        input_ids [B, S] or embeds [B, S, hidden]; attention_mask [B, S] with 1 = token,
        0 = padding (padding keys are masked; attention is causal either way).
        """
        x = embeds if embeds is not None else self.embed_tokens(input_ids)
        if dtype is not None:
            x = x.to(dtype)
        batch, seq, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=x.device).expand(batch, seq)
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta, x.dtype)
        mask = causal_mask(seq, attention_mask, x.dtype, x.device, batch)
        intermediate = None
        for i, layer in enumerate(self.layers):
            x = layer(x, mask, cos, sin)
            if i == intermediate_output:
                intermediate = x.clone()
        if self.norm is not None:
            x = self.norm(x)
        return x, intermediate


def causal_mask(seq: int, attention_mask, dtype, device, batch: int) -> torch.Tensor:
    """Additive mask [B, 1, S, S]: -inf-like above the diagonal and on padding keys."""
    blocked = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
    if attention_mask is not None:
        blocked = blocked | (attention_mask.to(device) == 0)[:, None, None, :]
    blocked = blocked.expand(batch, 1, seq, seq)
    return torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill(
        blocked, torch.finfo(dtype).min / 4)


def build_miniature_decoder(cfg: MiniatureDecoderConfig | None = None, seed: int = 0,
                            dtype: torch.dtype = torch.float32) -> MiniatureDecoder:
    """A MiniatureDecoder with deterministic random weights scaled to keep activations O(1)."""
    cfg = cfg or MiniatureDecoderConfig()
    gen = torch.Generator().manual_seed(seed)
    model = MiniatureDecoder(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 2 and "embed" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            else:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.requires_grad_(False)
    return model.to(dtype).eval()
