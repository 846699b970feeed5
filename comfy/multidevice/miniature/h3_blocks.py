"""The miniature H3's layers: attention with partial RoPE, adaLN modulation, SwiGLU, blocks, final layer.

Parameter names follow upstream's state-dict keys; attention is called as ComfyUI's
optimized_attention is, so an override in transformer_options takes the call.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn as nn
import torch.nn.functional as F


def rope_rotation_table(angles: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[S, half] angles -> [1, S, 1, half, 2, 2] rotation matrices [[cos, -sin], [sin, cos]]."""
    cos, sin = angles.cos(), angles.sin()
    table = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return table.unsqueeze(0).unsqueeze(2).to(dtype)


def apply_split_half_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[j], x[half + j]) of the first 2*half dims of x [S, heads, D]."""
    half = table.shape[-3]
    rot = table[0].to(x.dtype)  # [S, 1, half, 2, 2]
    first, second, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    new_first = rot[..., 0, 0] * first + rot[..., 0, 1] * second
    new_second = rot[..., 1, 0] * first + rot[..., 1, 1] * second
    return torch.cat([new_first, new_second, rest], dim=-1)


def scaled_dot_product(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False,
                       **kwargs):
    """Plain attention with ComfyUI's optimized_attention calling convention.

    skip_reshape=True: q/k/v are [B, heads, S, head_dim]; otherwise [B, S, heads*head_dim].
    The output is [B, S, heads*head_dim] unless skip_output_reshape.
    """
    if not skip_reshape:
        b, s, width = q.shape
        q, k, v = (t.reshape(b, t.shape[1], heads, width // heads).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if skip_output_reshape:
        return out
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


def attention(q, k, v, heads, transformer_options=None, preferred_attention=None, **kwargs):
    """The miniature's optimized_attention: an override in transformer_options takes the call.

    Like ComfyUI, the override is called as override(func, q, k, v, heads, **kwargs) with
    plain tensors, where func is the attention it may delegate to, and the module's
    preferred_attention is dropped then; without an override, preferred_attention.function
    (when set) runs instead of the default.
    """
    override = (transformer_options or {}).get("optimized_attention_override")
    if override is not None:
        return override(scaled_dot_product, q, k, v, heads,
                        transformer_options=transformer_options, **kwargs)
    if preferred_attention is not None and preferred_attention.function is not None:
        return preferred_attention.function(q, k, v, heads, transformer_options=transformer_options, **kwargs)
    return scaled_dot_product(q, k, v, heads, **kwargs)


# ----------------------------------------------------------------------------- modules

class TimeEmbedder(nn.Module):
    def __init__(self, freq_dim, hidden, out):
        super().__init__()
        self.freq_dim = freq_dim
        self.proj_in = nn.Linear(freq_dim, hidden, dtype=torch.float32)
        self.proj_out = nn.Linear(hidden, out, dtype=torch.float32)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
        angles = 1000.0 * t.float()[:, None] * freqs[None]
        return self.proj_out(F.silu(self.proj_in(torch.cat([angles.cos(), angles.sin()], -1))))


class Attention(nn.Module):
    def __init__(self, hidden, heads, head_dim, eps, dtype):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv_proj = nn.Linear(hidden, 3 * heads * head_dim, bias=False, dtype=dtype)
        self.q_norm = nn.RMSNorm(head_dim, eps=eps, dtype=dtype)
        self.k_norm = nn.RMSNorm(head_dim, eps=eps, dtype=dtype)
        self.out_proj = nn.Linear(heads * head_dim, hidden, bias=False, dtype=dtype)
        # upstream's ComfyAttention: `function` is the attention a checkpoint asks for (None: the default)
        self.comfy_attention = types.SimpleNamespace(function=None)

    def forward(self, x, rope_freqs=None, transformer_options=None):
        s = x.shape[0]
        q, k, v = self.qkv_proj(x).view(s, 3, self.heads, self.head_dim).unbind(1)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope_freqs is not None:
            q, k = apply_split_half_rope(q, rope_freqs), apply_split_half_rope(k, rope_freqs)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, S, head_dim]
        out = attention(q, k, v, self.heads, preferred_attention=self.comfy_attention, mask=None,
                        skip_reshape=True, transformer_options=transformer_options)
        return self.out_proj(out[0])


class MLP(nn.Module):
    def __init__(self, hidden, ffn, dtype):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * ffn, bias=False, dtype=dtype)
        self.fc2 = nn.Linear(ffn, hidden, bias=False, dtype=dtype)

    def forward(self, x):
        gate, up = self.fc1(x).chunk(2, dim=-1)  # the first half gates
        return self.fc2(F.silu(gate) * up)


class AdalnProj(nn.Module):
    """t_emb [M, t_dim] -> `expand` tensors of [M * modalities, hidden]."""

    def __init__(self, t_dim, hidden, expand, modalities, dtype):
        super().__init__()
        self.expand, self.modalities = expand, modalities
        self.linear = nn.Linear(t_dim, expand * hidden * modalities, dtype=dtype)

    def forward(self, t_emb):
        out = self.linear(F.silu(t_emb))
        return out.view(out.shape[0] * self.modalities, -1).chunk(self.expand, dim=-1)


def modulate(h, shift, scale, segments):
    """h * (1 + scale[row]) + shift[row] per span; row is an int or per-token indices."""
    out = torch.empty_like(h)
    for a, b, row in segments:
        out[a:b] = h[a:b] * (1.0 + scale[row].to(h.dtype)) + shift[row].to(h.dtype)
    return out


def gated_residual(x, gate, update, segments):
    out = torch.empty_like(x)
    for a, b, row in segments:
        out[a:b] = x[a:b] + gate[row].to(x.dtype) * update[a:b]
    return out


class RefinerBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, eps, dtype):
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.attn = Attention(hidden, heads, head_dim, eps, dtype)
        self.mlp = MLP(hidden, ffn, dtype)

    def forward(self, x, transformer_options=None):
        x = x + self.attn(self.norm1(x), transformer_options=transformer_options)
        return x + self.mlp(self.norm2(x))


class TokenRefiner(nn.Module):
    def __init__(self, layers, hidden, heads, head_dim, ffn, eps, dtype):
        super().__init__()
        self.blocks = nn.ModuleList(RefinerBlock(hidden, heads, head_dim, ffn, eps, dtype)
                                    for _ in range(layers))
        self.final_norm = nn.RMSNorm(hidden, eps=eps, dtype=dtype)

    def forward(self, x, transformer_options=None):
        for block in self.blocks:
            x = block(x, transformer_options=transformer_options)
        return self.final_norm(x)


class DiTBlock(RefinerBlock):
    def __init__(self, hidden, heads, head_dim, ffn, t_dim, eps, dtype):
        super().__init__(hidden, heads, head_dim, ffn, eps, dtype)
        self.adaln_proj = AdalnProj(t_dim, hidden, 6, 3, dtype)

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None, attention=None):
        attention = self.attn if attention is None else attention
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaln_proj(t_emb)
        h = modulate(self.norm1(x), shift_a, scale_a, mod_segments)
        x = gated_residual(x, gate_a, attention(h, rope_freqs=rope_freqs,
                                                transformer_options=transformer_options), mod_segments)
        h = modulate(self.norm2(x), shift_m, scale_m, mod_segments)
        return gated_residual(x, gate_m, self.mlp(h), mod_segments)


class FinalLayer(nn.Module):
    def __init__(self, hidden, t_dim, video_dim, audio_dim, eps, dtype):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.adaln_proj = AdalnProj(t_dim, hidden, 2, 1, dtype)
        self.video_out = nn.Linear(hidden, video_dim, dtype=torch.float32)
        self.audio_out = nn.Linear(hidden, audio_dim, dtype=torch.float32)

    def forward(self, x, t_emb, video_seg, audio_seg):
        shift, scale = self.adaln_proj(t_emb)

        def project(seg, head):
            a, b, row = seg
            h = self.norm(x[a:b]) * (1.0 + scale[row].to(x.dtype)) + shift[row].to(x.dtype)
            return head(h.float())

        return project(video_seg, self.video_out), project(audio_seg, self.audio_out)
