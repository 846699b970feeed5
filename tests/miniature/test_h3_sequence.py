"""The miniature's packed sequence: segment order and positions, patch rows and audio packing."""

from __future__ import annotations

import torch

from comfy.multidevice.miniature.h3_sequence import (build_layout, pack_audio, patchify_video, unpack_audio,
                                                     unpatchify_video)


def test_layout_puts_audio_then_video_last():
    layout = build_layout(4, (2, 2, 3), 5, cond_frames=[1], ref_images=[(1, 2)], ref_audio=[2])
    kinds = [k for _, _, k in layout.segments]
    assert kinds == ["text", "cond", "ref_img", "ref_audio", "audio", "video"]
    starts = [a for a, _, _ in layout.segments]
    stops = [b for _, b, _ in layout.segments]
    assert starts[0] == 0 and starts[1:] == stops[:-1]
    assert layout.seq_len == 4 + 6 + 2 + 4 + 10 + 12
    assert layout.position_ids.shape == (layout.seq_len, 3) and layout.position_ids.dtype == torch.float64


def test_patchify_and_audio_packing_round_trip():
    video = torch.randn(1, 24, 3, 4, 6)
    rows = patchify_video(video, (1, 2, 2))
    assert rows.shape == (3 * 2 * 3, 96)
    assert torch.equal(unpatchify_video(rows, 3, 2, 3, 24, (1, 2, 2)), video)
    audio = torch.randn(1, 32, 2, 5)
    packed = pack_audio(audio)
    assert torch.equal(packed[:5], audio[0, :, 0].T) and torch.equal(unpack_audio(packed), audio)
