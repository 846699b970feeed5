"""A small MiniMax-H3-shaped DiT, written here, for tests and the dry run.

Over 500 lines because it mirrors one upstream model file: every part of the contract below
(embeddings, blocks, final layer, wrappers) lives in the model, as upstream's does.

It follows the contract of upstream ComfyUI's `MiniMaxH3Model` (written down in
docs/ARCHITECTURE.md) closely enough that the sequence-parallel adapter cannot tell the
two apart:

- one packed token sequence: text | cond video rows | reference images | reference audio |
  target audio | target video (the two targets always last), with 3-axis (t, h, w) position ids;
- attention: fused qkv projection whose width (heads * head_dim) differs from the hidden size,
  a per-head RMS norm of q and k, then a split-half rotary embedding on the first
  `6 * rope_inv_freq_len` head dims only, then an attention function that honours
  `transformer_options["optimized_attention_override"]` with `[1, heads, S, head_dim]` tensors;
- adaLN with 6 chunks and 3 modality rows per timestep row; modulation spans `(start, stop, row)`
  whose row is an int or a per-token LongTensor (masked inpainting); SwiGLU MLP;
- blocks called through `transformer_options["patches_replace"]["dit"][("double_block", i)]`
  with an `original_block` that honours `args["attention"]`;
- a final layer that reads the audio and video spans of the full sequence;
- `forward(x=[video, audio], timestep, context, transformer_options, ...)` runs `_forward`
  through the `diffusion_model` wrappers of `transformer_options["wrappers"]` and returns
  `[video_out, audio_out]`.

Parameter names follow upstream's state-dict keys. Sizes are configurable; the defaults are tiny.
The output is a flow-matching velocity: one Euler step is `x + (sigma_next - sigma) * out`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

DIFFUSION_MODEL_WRAPPERS = "diffusion_model"  # the WrappersMP.DIFFUSION_MODEL value of ComfyUI
COND_TIMESTEP = 0.999  # cond / reference rows are (almost) clean
SAFETENSORS_CONFIG_KEY = "minimax_h3_miniature_config"
MODALITY_TAG = {"video": 0, "cond": 0, "ref_img": 0, "text": 1, "audio": 2, "ref_audio": 2}


@dataclass
class MiniatureConfig:
    """Sizes of the miniature; names match upstream's constructor arguments."""

    hidden_size: int = 64
    num_layers: int = 2
    token_refiner_num_layers: int = 1
    num_attention_heads: int = 4
    attention_head_dim: int = 24
    ffn_hidden_size: int = 96
    latents_dim: int = 24
    audio_latents_dim: int = 32
    patch_size: tuple[int, int, int] = (1, 2, 2)
    text_dim: int = 48
    timestep_input_dim: int = 32
    time_embed_hidden_size: int = 64
    time_embed_dim: int = 32
    rope_inv_freq_len: int = 3
    norm_eps: float = 1e-5
    sigma_shift_video: float = 12.0
    sigma_shift_audio: float = 3.0

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        rot = 6 * self.rope_inv_freq_len
        if rot >= self.attention_head_dim:
            raise ValueError(
                f"rope_inv_freq_len={self.rope_inv_freq_len} rotates {rot} of attention_head_dim="
                f"{self.attention_head_dim} dims; H3 rotates only part of the head, so use "
                f"rope_inv_freq_len < {math.ceil(self.attention_head_dim / 6)}")
        for name in ("hidden_size", "num_layers", "num_attention_heads", "attention_head_dim",
                     "ffn_hidden_size", "text_dim", "time_embed_dim", "rope_inv_freq_len"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MiniatureConfig.{name}={getattr(self, name)} must be >= 1")

    @property
    def video_patch_dim(self) -> int:
        pt, ph, pw = self.patch_size
        return self.latents_dim * pt * ph * pw

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "MiniatureConfig":
        return cls(**json.loads(text))


# ----------------------------------------------------------------------------- helpers

def time_shift_sigma(sigma: float, from_shift: float, to_shift: float) -> float:
    """Map a sigma of the schedule shifted by `from_shift` to the schedule shifted by `to_shift`.

    A shift k maps an unshifted b to s = k*b / (1 + (k-1)*b); invert, then re-apply.
    """
    unshifted = sigma / (from_shift - (from_shift - 1.0) * sigma)
    return to_shift * unshifted / (1.0 + (to_shift - 1.0) * unshifted)


def patchify_video(latent: torch.Tensor, patch: Sequence[int]) -> torch.Tensor:
    """[1, C, T, H, W] -> [T/pt * H/ph * W/pw, C*pt*ph*pw], rows in (t, h, w) order."""
    _, c, t, h, w = latent.shape
    pt, ph, pw = patch
    x = latent[0].reshape(c, t // pt, pt, h // ph, ph, w // pw, pw)
    x = x.permute(1, 3, 5, 0, 2, 4, 6)  # t', h', w', c, pt, ph, pw
    return x.reshape((t // pt) * (h // ph) * (w // pw), c * pt * ph * pw)


def unpatchify_video(rows: torch.Tensor, t: int, h: int, w: int, c: int,
                     patch: Sequence[int]) -> torch.Tensor:
    """Inverse of patchify_video: rows -> [1, C, T, H, W] (t, h, w counted in patches)."""
    pt, ph, pw = patch
    x = rows.reshape(t, h, w, c, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(1, c, t * pt, h * ph, w * pw)


def pack_audio(latent: torch.Tensor) -> torch.Tensor:
    """[1, C, 2, T] -> [2*T, C]: stereo channel 0's frames, then channel 1's."""
    return latent[0].permute(1, 2, 0).reshape(-1, latent.shape[1])


def unpack_audio(rows: torch.Tensor, channels: int = 2) -> torch.Tensor:
    return rows.reshape(channels, -1, rows.shape[-1]).permute(2, 0, 1).unsqueeze(0)


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


class PreferredAttention:
    """Stands for upstream's ComfyAttention: `function` is the attention a checkpoint asks for
    (None: the default)."""

    def __init__(self):
        self.function = None


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


class WrapperChain:
    """The calling protocol of ComfyUI's WrapperExecutor, enough for DIFFUSION_MODEL wrappers.

    A wrapper is fn(executor, *args, **kwargs); calling executor(...) continues down the chain;
    executor.class_obj is the model. The attribute names match ComfyUI's so code that rebinds an
    executor to another model replica works with either.
    """

    def __init__(self, original, class_obj, wrappers, idx=0):
        self.original = original
        self.class_obj = class_obj
        self.wrappers = list(wrappers)
        self.idx = idx

    @classmethod
    def new_class_executor(cls, original, class_obj, wrappers, idx=0):
        return cls(original, class_obj, wrappers, idx)

    def execute(self, *args, **kwargs):
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        return type(self)(self.original, self.class_obj, self.wrappers, self.idx + 1).execute(*args, **kwargs)


def diffusion_model_wrappers(transformer_options: dict) -> list:
    keyed = transformer_options.get("wrappers", {}).get(DIFFUSION_MODEL_WRAPPERS, {})
    return [w for ws in keyed.values() for w in ws]


# ----------------------------------------------------------------------------- layout

@dataclass
class MiniatureLayout:
    """The packed sequence: contiguous segments [(start, stop, kind)] and position ids [S, 3]."""

    segments: list[tuple[int, int, str]]
    position_ids: torch.Tensor  # [S, 3] float64 (t, h, w)
    signature: tuple = field(default=())

    @property
    def seq_len(self) -> int:
        return self.segments[-1][1]

    def span(self, kind: str) -> tuple[int, int]:
        a, b, _ = next(s for s in self.segments if s[2] == kind)
        return a, b

    @property
    def audio_pos(self) -> torch.Tensor:
        """Rows of the target audio in the packed sequence (upstream's PackedLayout.audio_pos)."""
        return torch.arange(*self.span("audio"))


def _frame_positions(t0: float, frames: int, rows_h: int, rows_w: int) -> torch.Tensor:
    """(t, h, w) for `frames` latent frames of rows_h x rows_w patch rows, centred in h and w."""
    t = t0 + torch.arange(frames, dtype=torch.float64)
    h = torch.arange(rows_h, dtype=torch.float64) - (rows_h - 1) / 2
    w = torch.arange(rows_w, dtype=torch.float64) - (rows_w - 1) / 2
    grid = torch.stack(torch.meshgrid(t, h, w, indexing="ij"), dim=-1)
    return grid.reshape(-1, 3)


def _audio_positions(t0: float, frames: int, w_edges: tuple[float, float]) -> torch.Tensor:
    """Stereo rows, channel-major: t advances per frame, w pinned to one edge per channel."""
    pos = torch.zeros(2 * frames, 3, dtype=torch.float64)
    pos[:, 0] = (t0 + torch.arange(frames, dtype=torch.float64)).repeat(2)
    pos[:frames, 2], pos[frames:, 2] = w_edges
    return pos


def build_layout(text_len: int, video_rows: tuple[int, int, int], audio_t: int,
                 cond_frames: Sequence[int] = (), ref_images: Sequence[tuple[int, int]] = (),
                 ref_audio: Sequence[int] = ()) -> MiniatureLayout:
    """Lay out text | cond | ref_img... | ref_audio... | audio | video; sizes in packed rows."""
    vt, vh, vw = video_rows
    pieces: list[tuple[str, torch.Tensor]] = []
    text = torch.zeros(text_len, 3, dtype=torch.float64)
    text[:, 0] = torch.arange(text_len, dtype=torch.float64)
    pieces.append(("text", text))
    cursor = float(text_len)
    refs = []
    for rh, rw in ref_images:
        refs.append(("ref_img", _frame_positions(cursor, 1, rh, rw)))
        cursor += 1.0
    for rt in ref_audio:
        refs.append(("ref_audio", _audio_positions(cursor, rt, (-(vw - 1) / 2, (vw - 1) / 2))))
        cursor += float(rt)
    # cond rows share the target's timeline origin (keyframes of the video being generated)
    for ct in cond_frames:
        pieces.append(("cond", _frame_positions(cursor, ct, vh, vw)))
    pieces.extend(refs)
    pieces.append(("audio", _audio_positions(cursor, audio_t, (-(vw - 1) / 2, (vw - 1) / 2))))
    pieces.append(("video", _frame_positions(cursor, vt, vh, vw)))
    segments, start = [], 0
    for kind, pos in pieces:
        segments.append((start, start + pos.shape[0], kind))
        start += pos.shape[0]
    signature = (text_len, tuple(video_rows), audio_t, tuple(cond_frames), tuple(ref_images),
                 tuple(ref_audio))
    return MiniatureLayout(segments, torch.cat([p for _, p in pieces]), signature)


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
        self.comfy_attention = PreferredAttention()

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


class DiTBlock(nn.Module):
    def __init__(self, hidden, heads, head_dim, ffn, t_dim, eps, dtype):
        super().__init__()
        self.norm1 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, eps=eps, dtype=dtype)
        self.attn = Attention(hidden, heads, head_dim, eps, dtype)
        self.mlp = MLP(hidden, ffn, dtype)
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


# ----------------------------------------------------------------------------- the model

class MiniatureH3Model(nn.Module):
    """The miniature DiT. `dtype` is the compute dtype of the blocks (patch projections, the
    time embedder and the output heads stay fp32, as in the released checkpoint)."""

    def __init__(self, config: MiniatureConfig | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg = self.config = config or MiniatureConfig()
        self.dtype = dtype
        hidden, heads, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_head_dim
        self.video_patch_proj = nn.Linear(cfg.video_patch_dim, hidden, dtype=torch.float32)
        self.audio_patch_proj = nn.Linear(cfg.audio_latents_dim, hidden, dtype=torch.float32)
        self.condition_proj = nn.Linear(cfg.text_dim, hidden, dtype=dtype)
        self.time_embedder = TimeEmbedder(cfg.timestep_input_dim, cfg.time_embed_hidden_size,
                                          cfg.time_embed_dim)
        self.rope = nn.Module()
        n = cfg.rope_inv_freq_len
        self.rope.register_buffer("inv_freq", 1.0 / (100.0 ** (torch.arange(n, dtype=torch.float32) / n)))
        self.token_refiner = TokenRefiner(cfg.token_refiner_num_layers, hidden, heads, hd,
                                          cfg.ffn_hidden_size, cfg.norm_eps, dtype)
        self.blocks = nn.ModuleList(
            DiTBlock(hidden, heads, hd, cfg.ffn_hidden_size, cfg.time_embed_dim, cfg.norm_eps, dtype)
            for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(hidden, cfg.time_embed_dim, cfg.video_patch_dim,
                                      cfg.audio_latents_dim, cfg.norm_eps, dtype)

    # -- public forward: the wrapper chain, then the mask scaling
    def forward(self, x, timestep, context, transformer_options=None, minimax_payload=None,
                denoise_mask=None, audio_denoise_mask=None, **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        chain = WrapperChain(self._forward, self, diffusion_model_wrappers(transformer_options))
        out = chain.execute(x, timestep, context, transformer_options, minimax_payload=minimax_payload,
                            denoise_mask=denoise_mask, audio_denoise_mask=audio_denoise_mask, **kwargs)
        out = list(out)
        if denoise_mask is not None:
            out[0] = out[0] * denoise_mask
        if audio_denoise_mask is not None:
            out[1] = out[1] * audio_denoise_mask
        return out

    def rope_freqs(self, position_ids: torch.Tensor, device) -> torch.Tensor:
        """[S, 3] positions -> [1, S, 1, 3*n, 2, 2] rotation table (n inverse freqs per axis)."""
        inv = self.rope.inv_freq.to(device)
        angles = position_ids.to(device=device, dtype=torch.float32)[:, :, None] * inv  # [S, 3, n]
        return rope_rotation_table(angles.reshape(angles.shape[0], -1), self.dtype)

    def _forward(self, x, timestep, context, transformer_options=None, minimax_payload=None,
                 denoise_mask=None, audio_denoise_mask=None, **kwargs):
        cfg = self.config
        transformer_options = {} if transformer_options is None else transformer_options
        payload = minimax_payload or {}
        video_x, audio_x = x
        self._check_inputs(video_x, audio_x, context)
        device, dtype = video_x.device, self.dtype
        pt, ph, pw = cfg.patch_size
        vt, vh, vw = video_x.shape[2] // pt, video_x.shape[3] // ph, video_x.shape[4] // pw
        audio_t = audio_x.shape[-1]
        cond_latents = list(payload.get("cond_video_latents", []))
        ref_latents = list(payload.get("ref_image_latents", []))
        ref_audio = list(payload.get("ref_audio_latents", []))
        layout = build_layout(context.shape[1], (vt, vh, vw), audio_t,
                              [z.shape[2] // pt for z in cond_latents],
                              [(z.shape[3] // ph, z.shape[4] // pw) for z in ref_latents],
                              [z.shape[-1] for z in ref_audio])
        transformer_options["minimax_h3_layout"] = layout

        # timesteps: text and video follow the video sigma, audio its own shifted schedule,
        # cond/reference rows are pinned (almost) clean
        sigma_v = float(timestep.flatten()[0].float().clamp(min=1e-6 * 1000)) / 1000.0
        t_v = 1.0 - sigma_v
        t_a = 1.0 - time_shift_sigma(sigma_v, cfg.sigma_shift_video, cfg.sigma_shift_audio)
        t_pin = max(t_v, COND_TIMESTEP)
        seg_t = {"text": t_v, "video": t_v, "audio": t_a, "cond": t_pin, "ref_img": t_pin,
                 "ref_audio": max(t_a, COND_TIMESTEP)}
        video_rows_t = self._masked_rows_t(denoise_mask, (vt, vh, vw), sigma_v, t_pin, video=True)
        audio_rows_t = self._masked_rows_t(audio_denoise_mask, None, 1.0 - t_a, max(t_a, COND_TIMESTEP),
                                           video=False)
        levels = {seg_t[k] for _, _, k in layout.segments}
        for rows_t in (video_rows_t, audio_rows_t):
            if rows_t is not None:
                levels |= set(rows_t.unique().tolist())
        unique_t = sorted(levels)
        t_row = {t: i for i, t in enumerate(unique_t)}

        def per_token_rows(rows_t, tag, modalities=3):
            lut = torch.tensor([t_row[t] * modalities + tag for t in rows_t.unique().tolist()],
                               dtype=torch.long, device=rows_t.device)
            return lut[torch.searchsorted(rows_t.unique(), rows_t)]

        mod_segments = []
        text_tags = payload.get("text_token_tags")
        for a, b, kind in layout.segments:
            base = t_row[seg_t[kind]] * 3
            if kind == "text" and text_tags is not None:
                tags = [int(v) for v in torch.as_tensor(text_tags).reshape(-1).tolist()]
                run = 0  # split the text span into runs of equal modality tag
                for i in range(1, b - a + 1):
                    if i == b - a or tags[i] != tags[run]:
                        mod_segments.append((a + run, a + i, base + tags[run]))
                        run = i
            elif kind == "video" and video_rows_t is not None:
                mod_segments.append((a, b, per_token_rows(video_rows_t, 0)))
            elif kind == "audio" and audio_rows_t is not None:
                mod_segments.append((a, b, per_token_rows(audio_rows_t, 2)))
            else:
                mod_segments.append((a, b, base + MODALITY_TAG[kind]))

        # embed every row into h [S, hidden]
        video_embed = self.video_patch_proj(patchify_video(video_x.float(), cfg.patch_size)).to(dtype)
        audio_embed = self.audio_patch_proj(pack_audio(audio_x.float())).to(dtype)
        text = context[0].to(dtype)
        if text.shape[-1] != cfg.hidden_size:
            text = self.token_refiner(self.condition_proj(text), transformer_options=transformer_options)
        conds = iter(self.video_patch_proj(patchify_video(z.to(device).float(), cfg.patch_size)).to(dtype)
                     for z in cond_latents)
        refs = iter(self.video_patch_proj(patchify_video(z.to(device).float(), cfg.patch_size)).to(dtype)
                    for z in ref_latents)
        ref_auds = iter(self.audio_patch_proj(pack_audio(z.to(device).float())).to(dtype) for z in ref_audio)
        source = {"text": lambda: text, "video": lambda: video_embed, "audio": lambda: audio_embed,
                  "cond": lambda: next(conds), "ref_img": lambda: next(refs),
                  "ref_audio": lambda: next(ref_auds)}
        h = torch.cat([source[kind]() for _, _, kind in layout.segments], dim=0)

        t_emb = self.time_embedder(torch.tensor(unique_t, dtype=torch.float32, device=device)).to(dtype)
        rope_freqs = self.rope_freqs(layout.position_ids, device)

        blocks_replace = transformer_options.get("patches_replace", {}).get("dit", {})
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            replace = blocks_replace.get(("double_block", i))
            if replace is None:
                h = block(h, t_emb, mod_segments, rope_freqs, transformer_options=transformer_options)
                continue

            def original_block(args, block=block):
                return {"img": block(args["img"], args["t_emb"], args["mod_segments"], args["rope_freqs"],
                                     transformer_options=args["transformer_options"],
                                     attention=args.get("attention"))}

            h = replace({"img": h, "t_emb": t_emb, "mod_segments": mod_segments, "rope_freqs": rope_freqs,
                         "layout": layout, "transformer_options": transformer_options},
                        {"original_block": original_block})["img"]

        va, vb = layout.span("video")
        aa, ab = layout.span("audio")
        video_row = (per_token_rows(video_rows_t, 0, 1) if video_rows_t is not None
                     else t_row[seg_t["video"]])
        audio_row = (per_token_rows(audio_rows_t, 0, 1) if audio_rows_t is not None
                     else t_row[seg_t["audio"]])
        v, a = self.final_layer(h, t_emb, (va, vb, video_row), (aa, ab, audio_row))
        video_out = unpatchify_video(v, vt, vh, vw, cfg.latents_dim, cfg.patch_size)
        return [video_out.to(video_x.dtype), unpack_audio(a).to(audio_x.dtype)]

    def _check_inputs(self, video_x, audio_x, context):
        cfg = self.config
        if video_x.dim() != 5 or video_x.shape[0] != 1 or video_x.shape[1] != cfg.latents_dim:
            raise ValueError(f"video latent must be [1, {cfg.latents_dim}, T, H, W], got {tuple(video_x.shape)}")
        pt, ph, pw = cfg.patch_size
        if video_x.shape[2] % pt or video_x.shape[3] % ph or video_x.shape[4] % pw:
            raise ValueError(f"video latent T, H, W {tuple(video_x.shape[2:])} must be multiples of the "
                             f"patch size {cfg.patch_size}")
        if audio_x.dim() != 4 or audio_x.shape[:3] != (1, cfg.audio_latents_dim, 2):
            raise ValueError(f"audio latent must be [1, {cfg.audio_latents_dim}, 2, T], got {tuple(audio_x.shape)}")
        if context.dim() != 3 or context.shape[0] != 1 or context.shape[-1] not in (cfg.text_dim, cfg.hidden_size):
            raise ValueError(f"context must be [1, L, {cfg.text_dim}] (or already refined [1, L, "
                             f"{cfg.hidden_size}]), got {tuple(context.shape)}")

    def _masked_rows_t(self, mask, video_rows, sigma, t_pin, video):
        """Per-row timesteps of a partially masked stream (1 = generate), or None if unmasked."""
        if mask is None:
            return None
        m = mask[0, 0].float()
        if video:
            pt, ph, pw = self.config.patch_size
            vt, vh, vw = video_rows
            m = m.reshape(vt, pt, vh, ph, vw, pw).amax(dim=(1, 3, 5))
        m = m.reshape(-1)
        if bool((m >= 1.0 - 1e-3).all()):
            return None
        return (1.0 - m * sigma).clamp(max=t_pin)


# ----------------------------------------------------------------------------- weights

def build_miniature(config: MiniatureConfig | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.float32) -> MiniatureH3Model:
    """A miniature with seeded random weights (adaLN weights scaled so the gates stay moderate)."""
    gen_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = MiniatureH3Model(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("adaln_proj.linear.weight"):
                    p.mul_(0.5)
                elif "norm" in name:  # non-trivial norm weights, so a mix-up of rows shows
                    p.add_(0.1 * torch.randn_like(p))
    finally:
        torch.random.set_rng_state(gen_state)
    return model.to(dtype=dtype) if dtype == torch.float32 else _cast_blocks(model, dtype)


def _cast_blocks(model: MiniatureH3Model, dtype: torch.dtype) -> MiniatureH3Model:
    """Cast everything but the fp32 islands (patch projections, time embedder, output heads)."""
    keep_fp32 = ("video_patch_proj.", "audio_patch_proj.", "time_embedder.", "final_layer.video_out.",
                 "final_layer.audio_out.", "rope.")
    state = {k: (v if k.startswith(keep_fp32) else v.to(dtype)) for k, v in model.state_dict().items()}
    out = MiniatureH3Model(model.config, dtype=dtype)
    out.load_state_dict(state)
    return out


def save_miniature(model: MiniatureH3Model, path) -> None:
    from safetensors.torch import save_file
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(path), metadata={SAFETENSORS_CONFIG_KEY: model.config.to_json(),
                                          "dtype": str(model.dtype).replace("torch.", "")})


def read_miniature_config(path) -> tuple[MiniatureConfig, torch.dtype]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if SAFETENSORS_CONFIG_KEY not in meta:
        raise ValueError(f"{path} is not a miniature checkpoint (no {SAFETENSORS_CONFIG_KEY!r} metadata); "
                         "delete it so it is rebuilt")
    return MiniatureConfig.from_json(meta[SAFETENSORS_CONFIG_KEY]), getattr(torch, meta.get("dtype", "float32"))


def miniature_from_state_dict(state: dict[str, torch.Tensor], config: MiniatureConfig,
                              dtype: torch.dtype, device: Any = "cpu") -> MiniatureH3Model:
    """A replica on `device` from a state dict (tensors are copied; the source stays untouched)."""
    with torch.device("meta"):
        model = MiniatureH3Model(config, dtype=dtype)
    model.load_state_dict({k: v.to(device, copy=True) for k, v in state.items()}, assign=True)
    return model


def load_miniature(path, device: Any = "cpu") -> MiniatureH3Model:
    from safetensors.torch import load_file
    config, dtype = read_miniature_config(path)
    return miniature_from_state_dict(load_file(str(path)), config, dtype, device)
