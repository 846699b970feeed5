"""The miniature H3's packed token sequence: patch rows of the latents, segment layout, position ids.

One sequence holds text | cond video rows | reference images | reference audio | target audio |
target video, the two targets always last, each row with (t, h, w) position ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


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


@dataclass
class MiniatureLayout:
    """The packed sequence: contiguous segments [(start, stop, kind)] and position ids [S, 3]."""

    segments: list[tuple[int, int, str]]
    position_ids: torch.Tensor  # [S, 3] float64 (t, h, w)

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
    return MiniatureLayout(segments, torch.cat([p for _, p in pieces]))
