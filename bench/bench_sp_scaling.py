#!/usr/bin/env python3
"""Sequence-parallel scaling of the miniature H3 DiT on this machine's cores, same run.

The model is attention dominated (S >= 8192 packed tokens, a narrow hidden size), as H3 is at
its real sequence lengths (~80% of a step's FLOPs in attention at 109k tokens). Three
configurations alternate for `--rounds` rounds; each figure is the median forward time:

  w1_one_thread   W=1, one intra-op thread (one core)
  w1_all_cores    W=1, all the machine's cores as intra-op threads (what a user runs on one device)
  w2              W=2 CPU ranks, cores/2 intra-op threads set inside each rank thread

The machine's own bound is w1_one_thread / cores (every core busy, no overhead). Prints one
JSON object on the last line: speedup and efficiency of W=2 against each W=1 baseline, the
fraction of the bound reached, and rel_diff (W=2 against W=1 output, a parity check of what
was timed).

  .venv/bin/python bench/bench_sp_scaling.py [--video-rows 8192] [--rounds 3] [--blocks 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
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


def inputs(video_rows: int, cfg: MiniatureConfig, text_tokens: int = TEXT_TOKENS,
           audio_frames: int = AUDIO_FRAMES):
    """Seeded video/audio latents and text for about `video_rows` video tokens, and the tokens."""
    side = 16  # 16 x 16 patch rows per latent frame (a 32 x 32 latent)
    frames = -(-video_rows // (side * side))
    g = torch.Generator().manual_seed(0)
    video = torch.randn(1, cfg.latents_dim, frames, 2 * side, 2 * side, generator=g)
    audio = torch.randn(1, cfg.audio_latents_dim, 2, audio_frames, generator=g)
    text = torch.randn(1, text_tokens, cfg.text_dim, generator=g)
    tokens = text_tokens + 2 * audio_frames + frames * side * side
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

    cores = os.cpu_count() or 1
    rank_threads = max(1, cores // 2)
    cfg = bench_config(args.blocks)
    model = build_miniature(cfg, seed=0)
    x, t, ctx, tokens = inputs(args.video_rows, cfg)
    times = {"w1_one_thread": [], "w1_all_cores": [], "w2": []}
    with SequenceParallelCoordinator(["cpu", "cpu"], backend="peer") as coord:
        sp = enable_sequence_parallel([model, copy.deepcopy(model)], coord)

        def w1(threads):
            def forward(*a):
                torch.set_num_threads(threads)
                return model(*a)
            return forward

        def w2(*a):  # OpenMP's setting is per thread, MKL's global: set right before each run
            coord.run(lambda rank, comm: torch.set_num_threads(rank_threads))
            return sp(*a)

        runs = {"w1_one_thread": w1(1), "w1_all_cores": w1(cores), "w2": w2}
        for forward in runs.values():  # warm-up every path (allocator, kernels, thread start)
            timed(forward, x, t, ctx)
        for r in range(args.rounds):
            outs = {}
            for name, forward in runs.items():
                seconds, outs[name] = timed(forward, x, t, ctx)
                times[name].append(seconds)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {v[-1]:.3f} s" for n, v in times.items()),
                  file=sys.stderr, flush=True)
        exchanged = sp.bytes_exchanged_last_forward()
    ref, out = outs["w1_all_cores"], outs["w2"]
    rel = max(float((o - r).abs().max()) for o, r in zip(out, ref)) / max(float(r.abs().max()) for r in ref)
    med = {name: statistics.median(v) for name, v in times.items()}
    bound = med["w1_one_thread"] / cores  # all cores busy, nothing lost
    result = {
        "bench": "sp_scaling", "tokens": tokens, "blocks": args.blocks, "rounds": args.rounds,
        "cores": cores, "threads_per_rank": rank_threads,
        "seconds": {name: round(v, 4) for name, v in med.items()},
        "bound_seconds": round(bound, 4),
        "speedup_w2_vs_w1_one_thread": round(med["w1_one_thread"] / med["w2"], 4),
        "efficiency_w2_vs_w1_one_thread": round(med["w1_one_thread"] / med["w2"] / 2, 4),
        "speedup_w2_vs_w1_all_cores": round(med["w1_all_cores"] / med["w2"], 4),
        "w1_all_cores_fraction_of_bound": round(bound / med["w1_all_cores"], 4),
        "w2_fraction_of_bound": round(bound / med["w2"], 4),
        "exchanged_bytes_w2": exchanged, "rel_diff": rel,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
