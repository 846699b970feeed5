"""Shared inputs for the sequence-parallel tests: tiny miniature models and packed layouts."""

from __future__ import annotations

import copy

import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.miniature import h3_blocks as miniature_blocks
from comfy.multidevice.miniature.h3 import MiniatureConfig, build_miniature
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from comfy.multidevice.sp.plan import shard_start

# Parallel against single-device, relative to max |reference| (why: tests/sp/test_minimax_h3.py).
FP32_TOL = 1e-5
BF16_TOL = 1e-2

TINY = MiniatureConfig(hidden_size=32, num_layers=3, token_refiner_num_layers=1, num_attention_heads=3,
                       attention_head_dim=16, ffn_hidden_size=48, text_dim=24, timestep_input_dim=16,
                       time_embed_hidden_size=32, time_embed_dim=16, rope_inv_freq_len=2)

# 4 heads of 32: Ulysses is plain Ulysses at W = 2 and 4 (the compressed exchange's tests)
FOUR_HEADS = MiniatureConfig(hidden_size=128, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4,
                             attention_head_dim=32, ffn_hidden_size=96, text_dim=24, timestep_input_dim=16,
                             time_embed_hidden_size=32, time_embed_dim=16, rope_inv_freq_len=4)


def plan_edges(seq_len: int, world: int, weights=None) -> list[tuple[int, int]]:
    """Every rank's (start, stop) under the shard plan (was sp/plan.py's ShardPlan.edges, only tests read it)."""
    return [(shard_start(seq_len, world, r, weights), shard_start(seq_len, world, r + 1, weights)) for r in range(world)]


def tiny_model(dtype=torch.float32, seed=0):
    return build_miniature(TINY, seed=seed, dtype=dtype)


def replicas(model, world):
    return [copy.deepcopy(model) for _ in range(world)]


def make_inputs(case: str, seed: int = 0):
    """(x, timestep, context, kwargs) for a named layout.

    plain      text 7 | audio 10 | video 18 rows: S = 35, divisible by none of 2, 3, 4
    cond_refs  text | cond | ref_img | ref_img | ref_audio | audio | video, text tag runs
    masked     partial video and audio denoise masks: per-token modulation rows
    tiny       S = 5: barely above W = 4
    """
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    kwargs = {}
    if case == "plain":
        video, audio, text = rnd(1, 24, 3, 4, 6), rnd(1, 32, 2, 5), rnd(1, 7, 24)
    elif case == "cond_refs":
        video, audio, text = rnd(1, 24, 2, 4, 6), rnd(1, 32, 2, 4), rnd(1, 6, 24)
        kwargs["minimax_payload"] = {
            "cond_video_latents": [rnd(1, 24, 1, 4, 6)],
            "ref_image_latents": [rnd(1, 24, 1, 2, 4), rnd(1, 24, 1, 4, 2)],
            "ref_audio_latents": [rnd(1, 32, 2, 3)],
            "text_token_tags": torch.tensor([1, 1, 0, 0, 0, 2]),
        }
    elif case == "masked":
        video, audio, text = rnd(1, 24, 3, 4, 6), rnd(1, 32, 2, 6), rnd(1, 5, 24)
        mask = torch.ones(1, 1, 3, 4, 6)
        mask[:, :, 0] = 0.0          # first frame kept (cond-like rows)
        mask[:, :, 1, :2, :2] = 0.5  # a partially regenerated patch
        audio_mask = torch.ones(1, 1, 2, 6)
        audio_mask[..., :2] = 0.25
        kwargs.update(denoise_mask=mask, audio_denoise_mask=audio_mask)
    elif case == "tiny":
        video, audio, text = rnd(1, 24, 1, 2, 2), rnd(1, 32, 2, 1), rnd(1, 2, 24)
    else:
        raise ValueError(case)
    timestep = torch.tensor([640.0])
    return [video, audio], timestep, text, kwargs


CASES = ("plain", "cond_refs", "masked", "tiny")


def rel_diff(out, ref) -> float:
    """max |out - ref| over both streams, relative to the largest |ref| value."""
    diff = max(float((o.float() - r.float()).abs().max()) for o, r in zip(out, ref))
    scale = max(float(r.float().abs().max()) for r in ref)
    return diff / scale


def frobenius_rel(out, ref) -> float:
    """||out - ref|| / ||ref|| over both streams (Frobenius): the compressed exchange's error measure."""
    num = sum(float((o.float() - r.float()).norm()) ** 2 for o, r in zip(out, ref))
    den = sum(float(r.float().norm()) ** 2 for r in ref)
    return (num / den) ** 0.5


def run_sp(model, world, backend, case, sp_mode="allgather", seed=0, split=None):
    """One sequence-parallel forward of `model` on `world` CPU ranks over `backend` for the named
    layout: (outputs, the parallel model, the coordinator's per-rank byte counts)."""
    x, t, ctx, kw = make_inputs(case, seed)
    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model, world), coord, sp_mode=sp_mode, split=split)
        with torch.inference_mode():
            out = sp(x, t, ctx, **kw)
        return out, sp, coord.byte_counts()


class BlockWithoutAttentionArgument(miniature_blocks.DiTBlock):
    """A block as ComfyUI v0.33.0 ships it: forward() has no `attention` parameter."""

    def forward(self, x, t_emb, mod_segments, rope_freqs, transformer_options=None):
        return super().forward(x, t_emb, mod_segments, rope_freqs, transformer_options)


class FunControlBlockPatchStandIn:
    """A block replacement carrying a control stream over the whole sequence (`control_patch`)
    without the API of upstream's Fun ControlNet: the adapter cannot drive it, and calling it
    would index local rows with full-sequence positions."""

    def __init__(self, block_index):
        self.block_index = block_index
        self.control_patch = object()
        self.calls = 0

    def __call__(self, args, extra):
        self.calls += 1
        return extra["original_block"](args)
