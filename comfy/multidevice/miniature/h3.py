"""A small MiniMax-H3-shaped DiT, written here, for tests and the dry run.

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

Its layers live in `h3_blocks.py`, the packed sequence in `h3_sequence.py`. Parameter names
follow upstream's state-dict keys. Sizes are configurable; the defaults are tiny.
The output is a flow-matching velocity: one Euler step is `x + (sigma_next - sigma) * out`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from comfy.multidevice.miniature.h3_blocks import DiTBlock, FinalLayer, rope_rotation_table, TimeEmbedder, TokenRefiner
from comfy.multidevice.miniature.h3_sequence import build_layout, pack_audio, patchify_video, unpack_audio, unpatchify_video

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
        video_rows_t = self._masked_rows_t(denoise_mask, (vt, vh, vw), sigma_v, t_pin)
        audio_rows_t = self._masked_rows_t(audio_denoise_mask, None, 1.0 - t_a, max(t_a, COND_TIMESTEP))
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
        def video_rows(z):
            return self.video_patch_proj(patchify_video(z.to(device).float(), cfg.patch_size)).to(dtype)

        def audio_rows(z):
            return self.audio_patch_proj(pack_audio(z.to(device).float())).to(dtype)

        text = context[0].to(dtype)
        if text.shape[-1] != cfg.hidden_size:
            text = self.token_refiner(self.condition_proj(text), transformer_options=transformer_options)
        # each kind's rows in layout order (cond, ref_img and ref_audio segments come one per latent)
        pending = {"text": iter([text]), "video": iter([video_rows(video_x)]),
                   "audio": iter([audio_rows(audio_x)]), "cond": map(video_rows, cond_latents),
                   "ref_img": map(video_rows, ref_latents), "ref_audio": map(audio_rows, ref_audio)}
        h = torch.cat([next(pending[kind]) for _, _, kind in layout.segments], dim=0)

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

        def final_span(kind, rows_t):
            row = t_row[seg_t[kind]] if rows_t is None else per_token_rows(rows_t, 0, 1)
            return (*layout.span(kind), row)

        v, a = self.final_layer(h, t_emb, final_span("video", video_rows_t),
                                final_span("audio", audio_rows_t))
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

    def _masked_rows_t(self, mask, video_rows, sigma, t_pin):
        """Per-row timesteps of a partially masked stream (1 = generate), or None if unmasked;
        `video_rows` (t, h, w) in patches for the video stream, None for audio."""
        if mask is None:
            return None
        m = mask[0, 0].float()
        if video_rows is not None:
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
    if dtype == torch.float32:
        return model
    out = MiniatureH3Model(model.config, dtype=dtype)
    out.load_state_dict(model.state_dict())  # cast into each parameter's dtype: the fp32 islands stay
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


def miniature_template(path) -> MiniatureH3Model:
    """The structure of a saved miniature on the meta device: replicas take its weights from the file."""
    config, dtype = read_miniature_config(path)
    with torch.device("meta"):  # the template only lends its structure: allocate nothing
        return MiniatureH3Model(config, dtype=dtype)
