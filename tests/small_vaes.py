"""Small VAEs written for the tests (not upstream code).

* `TinyCausalVideoVAE` has the temporal chunk interface of MiniMax-H3's video VAE
  (clip_length 17, 4x temporal ratio, token_drop 3, latents_mean/std, `_adaptive_decode`,
  `blend`, `_finalize_pixels`, `decode_output_shape`) over a small causal 3D conv decoder,
  and its own single-device `decode`: a plain sequential loop over the chunks that streams
  each chunk's frames out, the way a user of one card runs it. comfy/multidevice/vae/chunked.py must
  reproduce that loop's output bit for bit from chunks decoded elsewhere.
* `TinyCausalDecoder` is the same kind of decoder without any chunk interface: decoding a
  window alone differs from decoding the whole latent near the window's start (it lacks the
  causal context), which is what feathering has to smooth over.
* `TinyAudioVAE` decodes an audio latent [B, 32, 2, T] with a per-frame linear map.
* `VAEWrapper` mimics the parts of ComfyUI's `comfy.sd.VAE` the node touches: `device`,
  `first_stage_model`, `decode(samples)` that preallocates `decode_output_shape` when the
  module has chunked io and moves the latent to `device`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyCausalDecoder(nn.Module):
    """latent [B, C, T, h, w] -> frames [B, 3, T*ratio, h*s, w*s]; causal in time (kernel 3)."""

    def __init__(self, channels=4, hidden=8, ratio=4, spatial=2, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.ratio, self.spatial = ratio, spatial
        self.conv = nn.Conv3d(channels, hidden, kernel_size=3)
        self.proj = nn.Conv3d(hidden, 3 * ratio * spatial * spatial, kernel_size=1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)

    def forward(self, z):
        # causal: 2 zero frames in front, none behind; spatial zero padding 1
        h = F.pad(z, (1, 1, 1, 1, 2, 0))
        h = F.silu(self.conv(h))
        out = self.proj(h)  # [B, 3*r*s*s, T, h, w]
        b, _, t, hh, ww = out.shape
        r, s = self.ratio, self.spatial
        out = out.view(b, 3, r, s, s, t, hh, ww).permute(0, 1, 5, 2, 6, 3, 7, 4)
        return out.reshape(b, 3, t * r, hh * s, ww * s)


class TinyCausalVideoVAE(nn.Module):
    """The H3 chunk interface over TinyCausalDecoder, with a sequential single-device decode."""

    clip_length = 17
    vae_ratio_t = 4
    token_drop = 3
    comfy_has_chunked_io = True

    def __init__(self, channels=4, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + 100)
        self.decoder = TinyCausalDecoder(channels=channels, ratio=self.vae_ratio_t, seed=seed)
        self.register_buffer("latents_mean", torch.randn(channels, generator=gen) * 0.1)
        self.register_buffer("latents_std", 1.0 + torch.rand(channels, generator=gen))

    # chunk geometry, worked out here from the three numbers above
    chunk = 5        # latent frames per chunk: ceil(17 / 4)
    extra = 2        # latent frames each chunk also decodes: (-3) % 5
    lead_in = 3      # frames at the start of a decoded chunk that are dropped: (-17) % 4

    def _adaptive_decode(self, z):
        return self.decoder(z)

    def _finalize_pixels(self, raw):
        return (raw.float() * 0.5 + 0.5).clamp(0.0, 1.0)

    def blend(self, a, b, extent, dim):
        n = min(a.shape[dim], b.shape[dim], extent)
        w = torch.arange(n, dtype=b.dtype, device=b.device) / n
        shape = [1] * b.dim()
        shape[dim] = n
        w = w.view(shape)
        head = a.narrow(dim, a.shape[dim] - n, n) * (1 - w) + b.narrow(dim, 0, n) * w
        return torch.cat([head, b.narrow(dim, n, b.shape[dim] - n)], dim=dim)

    def _padding(self, t):
        """Latent frames appended so that t plus the 3 dropped tokens fill whole chunks."""
        pad = (-(t + self.token_drop)) % self.chunk
        chunks = (t + self.token_drop + pad) // self.chunk - 1
        if chunks == 0:
            pad, chunks = pad + self.chunk, 1
        return pad, chunks

    def decode_output_shape(self, shape):
        b, _, t, h, w = shape
        if t == 1:
            return (b, 3, 1, h * 2, w * 2)
        pad, chunks = self._padding(t)
        # every chunk writes 5*4 - 3 = 17 frames, the last one its 2*4 - 3 = 5 tail frames too;
        # each padding latent made 4 frames, but only 1 when it opens a chunk (3 lead-in dropped)
        written = chunks * 17 + 5
        from_padding = sum(1 if (t + k) % self.chunk == 0 else 4 for k in range(pad))
        return (b, 3, written - from_padding, h * 2, w * 2)

    def decode(self, z, output_buffer=None):
        """Reference: one device, chunk after chunk, streaming finished frames out."""
        z = z * self.latents_std.view(1, -1, 1, 1, 1) + self.latents_mean.view(1, -1, 1, 1, 1)
        shape = self.decode_output_shape(z.shape)
        out = output_buffer if output_buffer is not None else torch.empty(shape, dtype=torch.float32)
        if z.shape[2] == 1:
            out.copy_(self._finalize_pixels(self._adaptive_decode(z)[:, :, -1:]))
            return out
        pad, chunks = self._padding(z.shape[2])
        if pad:
            z = torch.cat([z, z[:, :, -1:].repeat(1, 1, pad, 1, 1)], dim=2)
        written = 0
        carry = None  # the previous chunk's tail, still to be blended

        def emit(frames):
            nonlocal written
            n = min(frames.shape[2], out.shape[2] - written)
            out[:, :, written:written + n] = self._finalize_pixels(frames[:, :, :n])
            written += n

        for i in range(chunks):
            raw = self._adaptive_decode(z[:, :, i * 5:i * 5 + 7])
            head = raw[:, :, self.lead_in:20]
            if carry is not None:
                head = self.blend(carry, head, 5, dim=-3)
            emit(head)
            carry = raw[:, :, 20 + self.lead_in:28]
        emit(carry)
        return out


class TinyAudioVAE(nn.Module):
    """audio latent [B, 32, 2, T] -> waveform [B, 2, T*8] (a per-frame linear map)."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed + 7)
        self.proj = nn.Linear(64, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)

    def decode(self, z):
        b, c, two, t = z.shape
        frames = z.permute(0, 3, 1, 2).reshape(b, t, c * two)
        return self.proj(frames).view(b, t, 2, 8).permute(0, 2, 1, 3).reshape(b, 2, t * 8)


class VAEWrapper:
    """The slice of comfy.sd.VAE the node relies on (device, first_stage_model, decode)."""

    def __init__(self, module, device="cpu"):
        self.first_stage_model = module
        self.device = torch.device(device)
        self.patcher = None

    def decode(self, samples):
        module = self.first_stage_model
        samples = samples.to(self.device)
        if getattr(module, "comfy_has_chunked_io", False):
            out = torch.empty(module.decode_output_shape(samples.shape), dtype=torch.float32)
            module.decode(samples, output_buffer=out)
            return out
        return module.decode(samples)
