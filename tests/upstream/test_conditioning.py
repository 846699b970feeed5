"""The H3 conditioning forms under sequence parallel, through upstream's own path: keyframes
(first and last frame, fl2va), reference images and reference audio (ref2va) and per-token text
tags ride in the conditioning as upstream's nodes put them there (`minimax_keyframes`,
`minimax_refs`, `minimax_token_tags`), upstream's `extra_conds` packs them, and the layout gets
cond / ref segments ahead of the targets. Each is sampled with the node's DiT role against one
card (fp32, 1e-5 of max |reference|)."""

from __future__ import annotations

import pytest
import torch

from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL
from tests.upstream.test_sampling import node_dit, sample

TEXT_LEN = 7


def conditioning(kind):
    g = torch.Generator().manual_seed(21)
    text = torch.randn(1, TEXT_LEN, 24, generator=g)
    extra = {}
    if kind in ("keyframes", "everything"):
        extra["minimax_keyframes"] = [
            {"resolved_frame_index": 0, "latent": torch.randn(1, 24, 1, 2, 4, generator=g)},
            {"resolved_frame_index": 21, "latent": torch.randn(1, 24, 1, 2, 4, generator=g)}]
    if kind in ("references", "everything"):
        extra["minimax_refs"] = [
            {"kind": "image", "latent": torch.randn(1, 24, 1, 2, 2, generator=g), "latent_h": 2, "latent_w": 2},
            {"kind": "audio", "audio_latent": torch.randn(1, 32, 2, 3, generator=g), "ref_audio_t": 3}]
    if kind in ("text tags", "everything"):
        extra["minimax_token_tags"] = torch.tensor([1, 1, 0, 0, 2, 2, 1])
    return [[text, extra]]


def sample_with(model, positive):
    return sample(model, steps=3, positive=positive)


@pytest.mark.parametrize("world", [3, 4])
@pytest.mark.parametrize("kind", ["keyframes", "references", "text tags", "everything"])
def test_conditioning_forms_under_sp(upstream, patcher, kind, world):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    positive = conditioning(kind)
    reference = sample_with(patcher, positive)
    assert rel_diff(reference, sample_with(patcher, conditioning("plain"))) > 1e-4  # the form acts
    coord, parallel = node_dit(patcher, world)
    with coord:
        out = sample_with(parallel, positive)
    assert rel_diff(out, reference) <= FP32_TOL
