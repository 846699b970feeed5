"""Multi-device video VAE decode along time.

A video latent `[B, C, T, H, W]` is split over W devices along the decoder's own temporal
chunks (`ChunkedDecode`). MiniMax-H3's video VAE decodes in overlapping chunks: 5 latent
frames <-> 17 frames, each chunk decoded on its own from a 7-latent window (5 + 2 overlap),
its first frames blended with the previous chunk's tail. The chunks are independent, so they
can run on different devices at once; merged in order on the first device with the decoder's
own blend, the result is bit-identical to the single-device decode (same ops on the same
inputs, only scheduled elsewhere). A decoder without that chunk interface is refused here
(the node then decodes it on one card).

Chunks go to the devices round-robin; decoding runs on the coordinator's rank
threads (one per device, a failing rank never hangs the others).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.weights.module_copies import ReplicaCache

log = logging.getLogger(__name__)

TIME_DIM = 2  # [B, C, T, H, W]


class ParallelDecodeError(RuntimeError):
    """The parallel decode cannot be done as asked (bad window sizes, shape mismatch...)."""


# ----------------------------------------------------------------------------- H3 schedule

@dataclass(frozen=True)
class TemporalChunkPlan:
    """How a latent of `latent_frames` frames is cut into chunks and put back together.

    Frame ranges are relative to one decoded chunk (which has `window_len * time_ratio`
    frames): `body` is written out (its first `blend_frames` blended with the previous
    chunk's tail), `tail` is kept to blend into the next chunk (or written after the last).
    """

    pad_latents: int               # copies of the last latent frame appended before chunking
    windows: tuple                 # ((start, stop), ...) latent windows of the padded latent
    body: tuple                    # (start, stop) frames of a decoded chunk
    tail: tuple | None             # (start, stop) frames, None when chunks don't overlap
    blend_frames: int
    output_frames: int


@dataclass(frozen=True)
class H3ChunkSchedule:
    """MiniMax-H3's temporal chunk schedule, derived from the decoder's three numbers.

    Upstream `MiniMaxH3VideoVAE` (comfy/ldm/minimax/vae.py) has clip_length 17 frames,
    a 4x temporal ratio and token_drop 3. From these: a chunk holds ceil(17/4) = 5 latent
    frames; the decoder emits (-17 % 4) = 3 lead-in frames per chunk that are dropped; each
    chunk is decoded from its 5 latent frames plus (-3 % 5) = 2 more (the overlap), whose
    output minus the lead-in (2*4-3 = 5 frames) is blended into the next chunk's first
    frames. The latent is padded (repeating its last frame) to a whole number of chunks.
    Valid lengths 5k+2 latent frames decode to 17k+5 frames.
    """

    clip_length: int = 17
    time_ratio: int = 4
    token_drop: int = 3

    @property
    def lead_in(self) -> int:
        return (-self.clip_length) % self.time_ratio

    @property
    def chunk_latents(self) -> int:
        return math.ceil(self.clip_length / self.time_ratio)

    @property
    def overlap_latents(self) -> int:
        return (-self.token_drop) % self.chunk_latents

    @property
    def blend_frames(self) -> int:
        return max(self.overlap_latents * self.time_ratio - self.lead_in, 0)

    def _chunking(self, latent_frames: int) -> tuple[int, int]:
        """(pad_latents, n_chunks): the latent is padded so the dropped tokens complete a chunk."""
        n = self.chunk_latents
        virtual = latent_frames + self.token_drop  # the encoder's dropped tokens count here
        pad = (-virtual) % n
        chunks = (virtual + pad) // n - (1 if self.token_drop > 0 else 0)
        if chunks < 1:  # shorter than one chunk (e.g. 2 latent frames): pad a whole chunk more
            pad += n
            chunks += 1
        return pad, chunks

    def _pad_frames(self, latent_frames: int, pad: int) -> int:
        """How many output frames the padding latents produce (cut from the end)."""
        if pad <= 0:
            return 0
        partial = self.clip_length % self.time_ratio  # frames of a chunk's last, partial latent
        if partial == 0:
            return pad * self.time_ratio
        return sum(partial if (latent_frames + k) % self.chunk_latents == 0 else self.time_ratio
                   for k in range(pad))

    def plan(self, latent_frames: int) -> TemporalChunkPlan:
        if latent_frames < 2:
            raise ParallelDecodeError(
                f"temporal chunking needs at least 2 latent frames, got {latent_frames} "
                f"(a single frame decodes as an image, without chunks)")
        pad, n_chunks = self._chunking(latent_frames)
        n, r = self.chunk_latents, self.time_ratio
        padded = latent_frames + pad
        windows = tuple((i * n, min(i * n + n + self.overlap_latents, padded)) for i in range(n_chunks))
        chunk_frames = n * r
        window_frames = (n + self.overlap_latents) * r  # what one full window decodes to
        body = (self.lead_in, min(chunk_frames, window_frames))
        tail = None
        if self.token_drop > 0:
            tail = (chunk_frames + self.lead_in, min(2 * chunk_frames, window_frames))
        frames = 0
        for start, stop in windows:  # a short last window yields a short body/tail
            decoded = (stop - start) * r
            frames += max(0, min(body[1], decoded) - body[0])
        if tail is not None:
            last_decoded = (windows[-1][1] - windows[-1][0]) * r
            frames += max(0, min(tail[1], last_decoded) - tail[0])
        frames -= self._pad_frames(latent_frames, pad)
        return TemporalChunkPlan(pad_latents=pad, windows=windows,
                                 body=body, tail=tail, blend_frames=self.blend_frames,
                                 output_frames=frames)


def linear_blend(a: torch.Tensor, b: torch.Tensor, extent: int, dim: int = TIME_DIM) -> torch.Tensor:
    """b's first `extent` frames faded in over a's last `extent`; then the rest of b.

    Weight of b at overlap position p is p/extent (0 at the seam), a gets 1 - p/extent.
    """
    extent = min(a.shape[dim], b.shape[dim], extent)
    if extent <= 0:
        return b
    shape = [1] * b.dim()
    shape[dim] = extent
    ramp = (torch.arange(extent, device=b.device, dtype=b.dtype) / extent).view(shape)
    mixed = a.narrow(dim, a.shape[dim] - extent, extent) * (1 - ramp) + b.narrow(dim, 0, extent) * ramp
    if extent == b.shape[dim]:
        return mixed
    return torch.cat([mixed, b.narrow(dim, extent, b.shape[dim] - extent)], dim=dim)


# ----------------------------------------------------------------------------- chunk interface

class H3ChunkInterface:
    """What the chunked decode needs from an H3-style video VAE module, read off its attributes.

    Upstream facts relied on (MiniMaxH3VideoVAE, comfy/ldm/minimax/vae.py):
      * `clip_length`, `vae_ratio_t`, `token_drop` fix the temporal schedule (H3ChunkSchedule);
      * `decode(z, output_buffer=None)` takes *normalized* latents and first applies
        `z * latents_std + latents_mean` (buffers of shape [C], viewed [1, C, 1, 1, 1]);
        a single latent frame is decoded without chunks;
      * `_adaptive_decode(z_window)` decodes one chunk (with its spatial tiling) into
        `window_len * vae_ratio_t` raw frames;
      * `blend(a, b, extent, dim)` merges a chunk's tail into the next chunk's head;
      * `_finalize_pixels(raw)` turns raw frames into the float32 [0, 1] output, per frame;
      * `decode_output_shape(z_shape)` is the shape `decode` returns (ComfyUI preallocates it).
    Optional members fall back to linear_blend / identity.
    """

    REQUIRED = ("clip_length", "vae_ratio_t", "token_drop", "_adaptive_decode",
                "latents_mean", "latents_std")

    def __init__(self, module):
        missing = [name for name in self.REQUIRED if not hasattr(module, name)]
        if missing:
            raise ParallelDecodeError(
                f"{type(module).__name__} has no temporal chunk interface (missing "
                f"{', '.join(missing)}); decode it on one device instead")
        self.module = module
        self.schedule = H3ChunkSchedule(int(module.clip_length), int(module.vae_ratio_t),
                                        int(module.token_drop))

    @classmethod
    def supports(cls, module) -> bool:
        return all(hasattr(module, name) for name in cls.REQUIRED)

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        std = self.module.latents_std.view(1, -1, 1, 1, 1).to(z)
        mean = self.module.latents_mean.view(1, -1, 1, 1, 1).to(z)
        return z * std + mean

    @staticmethod
    def decode_window(module, z_window: torch.Tensor) -> torch.Tensor:
        return module._adaptive_decode(z_window)

    def blend(self, a: torch.Tensor, b: torch.Tensor, extent: int) -> torch.Tensor:
        own = getattr(self.module, "blend", None)
        return own(a, b, extent, dim=-3) if own is not None else linear_blend(a, b, extent, dim=-3)

    def finalize(self, raw: torch.Tensor) -> torch.Tensor:
        own = getattr(self.module, "_finalize_pixels", None)
        return own(raw) if own is not None else raw

    def check_output_frames(self, z_shape, plan: TemporalChunkPlan) -> None:
        """Refuse to run when the module's own output shape disagrees with our schedule."""
        own = getattr(self.module, "decode_output_shape", None)
        if own is None:
            return
        frames = tuple(own(tuple(z_shape)))[TIME_DIM]
        if frames != plan.output_frames:
            raise ParallelDecodeError(
                f"{type(self.module).__name__}.decode_output_shape says {frames} frames for "
                f"{z_shape[TIME_DIM]} latent frames, the H3 chunk schedule gives "
                f"{plan.output_frames}: the decoder's schedule changed, decode on one device")


# ----------------------------------------------------------------------------- chunked decode

class ChunkedDecode:
    """Decode an H3-style video latent with its chunks spread over `devices`.

    `decode(z, output_buffer=None)` has the module's own `decode` contract (normalized
    latent in, finalized frames out, written into `output_buffer` when given), so it can
    stand in for it.
    """

    def __init__(self, module, devices: Sequence, runner: SequenceParallelCoordinator | None = None,
                 merge_device=None, replicas: ReplicaCache | None = None):
        if not devices:
            raise ParallelDecodeError("ChunkedDecode needs at least one device")
        self.interface = H3ChunkInterface(module)
        self.module = module
        self.devices = [torch.device(d) for d in devices]
        self.runner = runner
        self.merge_device = torch.device(merge_device) if merge_device is not None else self.devices[0]
        self.replicas = replicas if replicas is not None else ReplicaCache(module, "video VAE decoder")
        # called on the caller's thread before the ranks decode (roles/ loads the copies
        # through ComfyUI's model management there)
        self.before_decode: Callable[[], None] | None = None

    def decode(self, z: torch.Tensor, output_buffer: torch.Tensor | None = None) -> torch.Tensor:
        if z.dim() != 5:
            raise ParallelDecodeError(f"expected a video latent [B, C, T, H, W], got shape {tuple(z.shape)}")
        if z.shape[TIME_DIM] == 1:  # an image: no chunks, the module's own path
            return self.module.decode(z, output_buffer=output_buffer) if output_buffer is not None \
                else self.module.decode(z)
        plan = self.interface.schedule.plan(z.shape[TIME_DIM])
        self.interface.check_output_frames(z.shape, plan)
        _check_output_buffer(output_buffer, plan.output_frames)  # before any chunk is decoded
        raw_parts = self.decode_chunks(z, plan)
        return self.merge(raw_parts, plan, output_buffer)

    def decoder_on(self, device: torch.device):
        """The module that decodes on `device`. On the merge card it is the module itself, as
        the caller's model manager (ComfyUI's VAE patcher) left it there, fully or partially
        loaded: a copy there would be a second, uncounted one. Elsewhere a cached copy."""
        return self.module if device == self.merge_device else self.replicas.get(device)

    def decode_chunks(self, z: torch.Tensor, plan: TemporalChunkPlan) -> list[torch.Tensor]:
        """Every chunk's raw frames, in chunk order, each on the merge device."""
        if self.before_decode is not None:
            self.before_decode()
        z = self.interface.denormalize(z)
        if plan.pad_latents:
            z = torch.cat([z, z[:, :, -1:].expand(-1, -1, plan.pad_latents, -1, -1)], dim=TIME_DIM)
        windows = [z[:, :, a:b] for a, b in plan.windows]
        world = len(self.devices)
        assignment = [list(range(r, len(windows), world)) for r in range(world)]  # round robin
        ratio = self.interface.schedule.time_ratio

        def decode_mine(rank, comm, chunk_ids):
            device = comm.device
            decoder = self.decoder_on(device)
            out = []
            for i in chunk_ids:
                raw = H3ChunkInterface.decode_window(decoder, windows[i].to(device))
                want = windows[i].shape[TIME_DIM] * ratio
                if raw.shape[TIME_DIM] != want:
                    raise ParallelDecodeError(f"chunk {i}: the decoder returned {raw.shape[TIME_DIM]} "
                                              f"frames for {windows[i].shape[TIME_DIM]} latent frames, "
                                              f"expected {want}")
                out.append((i, raw.to(self.merge_device)))
            log.debug("video VAE rank %d on %s: decoded chunks %s", rank, device, chunk_ids)
            return out

        # on the rank threads, in the caller's grad/inference mode
        if self.runner is not None:
            if len(self.runner.devices) != world:
                raise ParallelDecodeError(f"the runner has {len(self.runner.devices)} ranks for {world} devices")
            results = self.runner.run(decode_mine, assignment)
        else:
            with SequenceParallelCoordinator(self.devices, backend="peer") as coordinator:
                results = coordinator.run(decode_mine, assignment)
        parts = dict(part for rank_parts in results for part in rank_parts)
        return [parts[i] for i in range(len(windows))]

    def merge(self, raw_parts: list, plan: TemporalChunkPlan,
              output_buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Chunks in order: body (head blended with the previous tail), finalized, written out.

        Consumes `raw_parts`: each entry is released once merged, and each finished piece goes
        straight into the output, so the merge device never holds the whole video twice (raw
        chunks plus finalized frames), as the single-device decode streams its chunks too.
        """
        _check_output_buffer(output_buffer, plan.output_frames)
        out, written = output_buffer, 0

        def write(piece):
            nonlocal out, written
            if out is None:  # the first piece fixes dtype, device and the other dims
                shape = list(piece.shape)
                shape[TIME_DIM] = plan.output_frames
                out = torch.empty(shape, dtype=piece.dtype, device=piece.device)
            n = min(piece.shape[TIME_DIM], plan.output_frames - written)  # padding frames go
            if n > 0:
                out[:, :, written:written + n].copy_(piece[:, :, :n])
                written += n

        tail = None
        for i in range(len(raw_parts)):
            raw, raw_parts[i] = raw_parts[i], None
            frames = raw.shape[TIME_DIM]
            body = raw[:, :, plan.body[0]:min(plan.body[1], frames)]
            if tail is not None:
                body = self.interface.blend(tail, body, plan.blend_frames)
            write(self.interface.finalize(body))
            tail = None
            if plan.tail is not None and plan.tail[0] < frames:
                tail = raw[:, :, plan.tail[0]:min(plan.tail[1], frames)].contiguous()
            del raw, body
        if tail is not None:
            write(self.interface.finalize(tail))
        if written != plan.output_frames:
            raise ParallelDecodeError(f"the chunks gave {written} frames, the plan {plan.output_frames}")
        return out


def _check_output_buffer(output_buffer: torch.Tensor | None, total_frames: int) -> None:
    if output_buffer is not None and output_buffer.shape[TIME_DIM] != total_frames:
        raise ParallelDecodeError(f"output_buffer has {output_buffer.shape[TIME_DIM]} frames, the decode "
                                  f"gives {total_frames}: allocate it with decode_output_shape(z.shape)")


# ----------------------------------------------------------------------------- module stand-in

def with_parallel_decode(module, devices: Sequence, runner=None, merge_device=None):
    """A shallow copy of `module` whose `decode` runs ChunkedDecode; `module` is unchanged.

    The copy shares every submodule, parameter and buffer with the original, so whoever
    loads/offloads the original (ComfyUI's VAE patcher) moves the weights the copy decodes
    with on the merge device.
    """
    decoder = ChunkedDecode(module, devices, runner=runner, merge_device=merge_device)
    clone = copy.copy(module)
    object.__setattr__(clone, "decode", decoder.decode)
    object.__setattr__(clone, "parallel_decode", decoder)
    return clone
