#!/usr/bin/env python3
"""Mixed cards on CPU: the node's split `auto` against `even` in one run, one rank made slower.

No two different cards were at hand, so one of W = 2 CPU rank threads is made --slowdown times
slower by this harness alone: every block forward of rank 1's replica sleeps, after it computes,
(slowdown - 1) x the calibrated compute time of its rows (seconds per row of one block, timed on
the one-device forward with the same intra-op threads a rank gets). The sleep holds no core, as a
slower card would not hold the fast card's; the probe of split auto sees it as it would a slow card.

Both DiTs are what the node's roles make (roles/dit.py `sequence_parallel_dit`, rank threads on
one coordinator, peer backend, sp_mode auto: the all-gather with an uneven split), the miniature
H3 DiT in fp32 over the same replicas' weights; `auto`'s first forward probes (one block per rank)
and is its warm-up. Then --rounds rounds, each one forward of each split (the order flips every
round); a step is one DiT forward.

  mixed_auto_vs_even_step_ratio   the median of the rounds' auto / even step times (expected about
                                  (1 + 1/s) / 2 ... 2/(1+s) of even: 0.67 at s = 2 when the blocks dominate)
  weights_chosen, rows_auto, rows_even   auto's weights per rank and both splits' rows
  step_s_auto / step_s_even       median step times; *_rounds the per-round lists
  max_rel_diff_auto / _even       max |out - one device| / max |one device| (the SP tolerance: 1e-5)

Prints human lines, then one JSON object on the last line. `--quick`: the test's smallest run.

  .venv/bin/python bench/bench_mixed_split.py [--quick] [--video-rows 2048] [--blocks 4] [--rounds 5]
      [--slowdown 2]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.miniature.h3 import build_miniature, MiniatureConfig  # noqa: E402
from comfy.multidevice.roles.dit import sequence_parallel_dit  # noqa: E402

from bench_sp_scaling import inputs  # noqa: E402  (this folder: the same seeded inputs)

WORLD = 2
HEADS, HEAD_DIM, HIDDEN = 8, 64, 64
TOLERANCE = 1e-5  # tests/sp_cases.py FP32_TOL
QUICK = {"video_rows": 256, "blocks": 2, "rounds": 1}


def bench_config(blocks: int) -> MiniatureConfig:
    return MiniatureConfig(hidden_size=HIDDEN, num_layers=blocks, token_refiner_num_layers=1,
                           num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, ffn_hidden_size=HIDDEN,
                           text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64,
                           time_embed_dim=32, rope_inv_freq_len=HEAD_DIM // 8)


def seconds_per_block_row(model, x, t, ctx, threads: int) -> float:
    """One block's compute per row: the blocks' time in a one-device forward over blocks x rows."""
    spent, rows = [0.0], [0]
    originals = [block.forward for block in model.blocks]

    def timing(inner):
        @functools.wraps(inner)
        def forward(h, *args, **kwargs):
            began = time.perf_counter()
            out = inner(h, *args, **kwargs)
            spent[0] += time.perf_counter() - began
            rows[0] += h.shape[0]
            return out
        return forward

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            model(x, t, ctx)  # warm-up
            for block, inner in zip(model.blocks, originals):
                block.forward = timing(inner)
            model(x, t, ctx)
    finally:
        for block, inner in zip(model.blocks, originals):
            block.forward = inner
        torch.set_num_threads(before)
    return spent[0] / rows[0]


def slow_down(model, delay_per_row: float) -> None:
    """The harness's slow card: each block sleeps delay_per_row x its rows after computing."""
    for block in model.blocks:
        inner = block.forward

        @functools.wraps(inner)  # keeps the signature the SP adapter checks (`attention`)
        def forward(h, *args, _inner=inner, **kwargs):
            out = _inner(h, *args, **kwargs)
            time.sleep(delay_per_row * h.shape[0])
            return out
        block.forward = forward


def rel_diff(out, ref) -> float:
    diff = max(float((o - r).abs().max()) for o, r in zip(out, ref))
    return diff / max(float(r.abs().max()) for r in ref)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the test's smallest run")
    parser.add_argument("--video-rows", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--slowdown", type=float, default=2.0, help="rank 1's step time over its compute")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    if args.rounds < 1 or args.blocks < 1 or args.video_rows < 1 or args.slowdown < 1:
        parser.error("--rounds, --blocks and --video-rows must be >= 1, --slowdown >= 1")

    began = time.perf_counter()
    threads = max(1, (os.cpu_count() or 1) // WORLD)
    model = build_miniature(bench_config(args.blocks), seed=5)
    x, t, ctx, tokens = inputs(args.video_rows, model.config)
    with torch.inference_mode():
        reference = model(x, t, ctx)
    per_row = seconds_per_block_row(model, x, t, ctx, threads)
    delay = (args.slowdown - 1) * per_row
    print(f"{tokens} tokens, {args.blocks} blocks, {WORLD} rank threads x {threads} intra-op thread(s); "
          f"a block row computes in {per_row * 1e6:.2f} us, rank 1 sleeps {delay * 1e6:.2f} us more per row")

    with SequenceParallelCoordinator(["cpu"] * WORLD, backend="peer", timeout_s=600) as coord:
        dits = {split: sequence_parallel_dit(model, ["cpu"] * WORLD, coord, sp_mode="allgather", split=split)
                for split in ("even", "auto")}
        for dit in dits.values():
            slow_down(dit.models[1], delay)

        def step(split):
            coord.run(lambda rank, comm: torch.set_num_threads(threads))
            start = time.perf_counter()
            with torch.inference_mode():
                out = dits[split](x, t, ctx)
            return time.perf_counter() - start, out

        outs = {split: step(split)[1] for split in dits}  # warm-ups; auto's probes here
        times = {split: [] for split in dits}
        for r in range(args.rounds):
            for split in (("even", "auto") if r % 2 == 0 else ("auto", "even")):
                seconds, outs[split] = step(split)
                times[split].append(seconds)
        setups = {split: dits[split].ranks.last_rank_states for split in dits}
        weights = setups["auto"][0].weights
        rows = {split: dits[split].tokens_per_rank() for split in dits}

    ratios = [a / e for a, e in zip(times["auto"], times["even"])]
    diffs = {split: rel_diff(outs[split], reference) for split in outs}
    result = {
        "mixed_auto_vs_even_step_ratio": round(statistics.median(ratios), 4),
        "weights_chosen": [round(w, 4) for w in weights],
        "rows_auto": rows["auto"], "rows_even": rows["even"],
        "step_s_auto": round(statistics.median(times["auto"]), 4),
        "step_s_even": round(statistics.median(times["even"]), 4),
        "step_s_auto_rounds": [round(s, 4) for s in times["auto"]],
        "step_s_even_rounds": [round(s, 4) for s in times["even"]],
        "max_rel_diff_auto": diffs["auto"], "max_rel_diff_even": diffs["even"],
        "equal_within_tolerance": all(d <= TOLERANCE for d in diffs.values()),
        "slowdown": args.slowdown, "world": WORLD, "tokens": tokens, "blocks": args.blocks,
        "intra_op_threads_per_rank": threads, "seconds": round(time.perf_counter() - began, 1),
    }
    print(f"even {rows['even']} rows: {result['step_s_even']:.3f} s a step; auto {rows['auto']} rows "
          f"(weights {result['weights_chosen']}): {result['step_s_auto']:.3f} s; auto / even "
          f"{result['mixed_auto_vs_even_step_ratio']}; max rel diff {max(diffs.values()):.2e}")
    print(json.dumps(result))
    return 0 if result["equal_within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
