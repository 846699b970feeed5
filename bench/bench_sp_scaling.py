#!/usr/bin/env python3
"""Sequence-parallel scaling of the miniature H3 DiT: W=1 against W=2 CPU ranks, same run.

The model is attention dominated (S >= 8192 packed tokens, a narrow hidden size), as H3 is at
its real sequence lengths (~80% of a step's FLOPs in attention at 109k tokens). Every rank runs
with one intra-op thread (torch.set_num_threads(1)), so W=2 uses two cores and W=1 one. The two
configurations alternate for `--rounds` rounds; each figure is the median forward time.
Prints one JSON object on the last line: speedup_w2 = t(W=1) / t(W=2), efficiency_w2 =
speedup_w2 / 2, and rel_diff (W=2 against W=1 output, a parity check of what was timed).

  .venv/bin/python bench/bench_sp_scaling.py [--video-rows 8192] [--rounds 3] [--blocks 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from comfy.multidevice.miniature.h3 import MiniatureConfig, build_miniature  # noqa: E402
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel  # noqa: E402
from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402

TEXT_TOKENS, AUDIO_FRAMES = 64, 64


def bench_config(blocks: int) -> MiniatureConfig:
    # attention width 4 x 32 = 128 over hidden 64: the attention's S^2 term dominates
    return MiniatureConfig(hidden_size=64, num_layers=blocks, token_refiner_num_layers=1,
                           num_attention_heads=4, attention_head_dim=32, ffn_hidden_size=64,
                           text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64,
                           time_embed_dim=32, rope_inv_freq_len=4)


def inputs(video_rows: int, cfg: MiniatureConfig):
    side = 16  # 16 x 16 patch rows per latent frame (a 32 x 32 latent)
    frames = -(-video_rows // (side * side))
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, cfg.latents_dim, frames, 2 * side, 2 * side, generator=g)
    audio = torch.randn(1, cfg.audio_latents_dim, 2, AUDIO_FRAMES, generator=g)
    text = torch.randn(1, TEXT_TOKENS, cfg.text_dim, generator=g)
    tokens = TEXT_TOKENS + 2 * AUDIO_FRAMES + frames * side * side
    return [video, audio], torch.tensor([500.0]), text, tokens


def timed(forward, x, t, ctx):
    start = time.perf_counter()
    with torch.inference_mode():
        out = forward(x, t, ctx)
    return time.perf_counter() - start, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--video-rows", type=int, default=8192)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.blocks < 1 or args.video_rows < 1:
        parser.error("--rounds, --blocks and --video-rows must be >= 1")

    torch.set_num_threads(1)  # one intra-op thread per rank
    cfg = bench_config(args.blocks)
    model = build_miniature(cfg, seed=0)
    x, t, ctx, tokens = inputs(args.video_rows, cfg)
    w1_times, w2_times = [], []
    with SequenceParallelCoordinator(["cpu", "cpu"], backend="peer") as coord:
        sp = enable_sequence_parallel([model, copy.deepcopy(model)], coord)
        timed(model, x, t, ctx)  # warm-up both paths (allocator, kernels, thread start)
        timed(sp, x, t, ctx)
        for r in range(args.rounds):
            s1, ref = timed(model, x, t, ctx)
            s2, out = timed(sp, x, t, ctx)
            w1_times.append(s1)
            w2_times.append(s2)
            print(f"round {r + 1}/{args.rounds}: W=1 {s1:.3f} s, W=2 {s2:.3f} s", file=sys.stderr, flush=True)
        exchanged = sp.bytes_exchanged_last_forward()
    rel = max(float((o - r).abs().max()) for o, r in zip(out, ref)) / max(float(r.abs().max()) for r in ref)
    t1, t2 = statistics.median(w1_times), statistics.median(w2_times)
    result = {
        "bench": "sp_scaling", "tokens": tokens, "blocks": args.blocks, "rounds": args.rounds,
        "threads_per_rank": 1, "seconds_w1": round(t1, 4), "seconds_w2": round(t2, 4),
        "speedup_w2": round(t1 / t2, 4), "efficiency_w2": round(t1 / t2 / 2, 4),
        "exchanged_bytes_w2": exchanged, "rel_diff": rel,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
