#!/usr/bin/env python3
"""The compressed exchange (exchange_precision int8 / fp8) against exact, one run: error, bytes, time.

Every figure compares a run with the compressed exchange to the exact run at the same W, mode
and engine (not to one device: the exchange is what differs). Relative error is
||out - exact|| / ||exact|| (Frobenius, over all outputs). bf16, random weights, CPU ranks.

1. Block (H3's released block dims: hidden 5376, 56 heads x 128, SwiGLU 14336; one block,
   --block-video-rows video rows): the miniature H3 with one block, whose output is read as
   it enters the final layer (after the rows' plain gather, which is never compressed), on W
   rank threads (peer backend) for W in --worlds, allgather and ulysses (56 heads: plain
   Ulysses at 2, 4 and 7, the hybrid at 8). One module serves every rank (the ranks only read
   it), so 8 ranks fit in memory.
     {int8,fp8}_block_rel_error            the largest over W and mode
     block_rel_error                       per format, mode and W
     bytes_per_block_rank                  the attention's bytes received by the busiest rank
                                           per block (the rows' final gather subtracted), per
                                           mode, W and precision
     int8_bytes_ratio / fp8_bytes_ratio    int8 / exact of those, the largest over W and mode
                                           (expected (128 + 2) / 256 = 0.508: bf16 records)
2. Step (the miniature H3 of tests' size but head dim 128: --step-blocks blocks, 8 heads x 128,
   so plain Ulysses at W = 2, 4, 8): one DiT forward, i.e. one sampling step's model call.
     {int8,fp8}_step_rel_error, step_rel_error   as for the block
3. Time per step in processes mode (gloo, W in --time-worlds, the step model at
   --time-video-rows): one worker pool per precision and round (order flipping each round),
   one warm-up and --forwards timed forwards each; the median of the rounds' int8 / exact.
     int8_processes_step_ratio             W = the first of --time-worlds
     processes_step_s                      the medians, per W and precision
   On one machine gloo moves bytes through memory: the ratio says what the coding costs
   against what it saves here, not on a PCIe or network link.
4. Memory (the step model, allgather, W = the first of --worlds, rank threads): the busiest
   rank's peak of live activation bytes in a forward (bench/bench_sp_modes.py's tracker),
   exact and int8, against the memory plan's estimate for each (sp/cost_model.py
   activation_bytes, which counts int8's received records beside what they decode into).
     activation_measured_vs_estimate       per precision: measured / estimate

The documented bounds (comm/compression.py BLOCK_REL_ERROR_BOUND / STEP_REL_ERROR_BOUND) are
printed beside each error, and `within_bounds` says whether every error is under its bound.
Prints human lines, then one JSON object on the last line. `--quick`: the test's smallest run
(the block at hidden 512, 4 heads x 128, not H3's dims).

  .venv/bin/python bench/bench_exchange_precision.py [--quick] [--worlds 2 4 8] [--time-worlds 2]
      [--block-video-rows 128] [--step-blocks 4] [--time-video-rows 1536] [--rounds 3] [--forwards 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from comfy.multidevice.comm.compression import (BLOCK_REL_ERROR_BOUND, fp8_dtype,  # noqa: E402
                                                STEP_REL_ERROR_BOUND)
from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.miniature.h3 import build_miniature, MiniatureConfig, save_miniature  # noqa: E402
from comfy.multidevice.roles.memory_plan import dit_shape_of  # noqa: E402
from comfy.multidevice.sp.cost_model import activation_bytes  # noqa: E402
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel  # noqa: E402
from comfy.multidevice.sp.strategies import SPMode  # noqa: E402
from comfy.multidevice.workers.pool import WorkerPool  # noqa: E402
from comfy.multidevice.workers.recipe import ModelRecipe  # noqa: E402

MODES = ("allgather", "ulysses")
DTYPE = torch.bfloat16
QUICK = ["--worlds", "2", "4", "--time-worlds", "2", "--block-hidden", "512", "--block-heads", "4",
         "--block-ffn", "1024", "--block-video-rows", "32", "--step-blocks", "2", "--time-video-rows", "64",
         "--rounds", "1", "--forwards", "1"]


def config(hidden: int, heads: int, ffn: int, blocks: int) -> MiniatureConfig:
    return MiniatureConfig(hidden_size=hidden, num_layers=blocks, token_refiner_num_layers=1,
                           num_attention_heads=heads, attention_head_dim=128, ffn_hidden_size=ffn,
                           text_dim=64, timestep_input_dim=32, time_embed_hidden_size=64, time_embed_dim=32,
                           rope_inv_freq_len=16)


def inputs(video_rows: int, seed: int = 0):
    """(x, timestep, context): video latents of `video_rows` patched rows (2 frames), 32 audio
    rows, 16 text tokens."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, video_rows // 2 // 4)  # rows = frames x (h / 2) x (w / 2), frames 2, h 8
    video = torch.randn(1, 24, 2, 8, 2 * width, generator=g)
    return [video, torch.randn(1, 32, 2, 16, generator=g)], torch.tensor([500.0]), torch.randn(1, 16, 64, generator=g)


def frobenius_rel(out, ref) -> float:
    num = sum(float((o.float() - r.float()).norm()) ** 2 for o, r in zip(out, ref))
    den = sum(float(r.float().norm()) ** 2 for r in ref)
    return (num / den) ** 0.5


def precisions() -> list[str]:
    return ["exact", "int8"] + (["fp8"] if fp8_dtype() is not None else [])


def sp_runs(model, world: int, x, t, ctx, hidden: int, capture_block: bool) -> dict:
    """Per (mode, precision): the forward's output (or the last block's, gathered) and the
    attention's bytes received per block by the busiest rank."""
    seen = {}
    hook = None
    if capture_block:
        hook = model.final_layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0].clone()))
    found = {}
    try:
        with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=600) as coord:
            for mode in MODES:
                for precision in precisions():
                    sp = enable_sequence_parallel([model] * world, coord,
                                                  sp_mode=SPMode(mode, exchange_precision=precision))
                    coord.reset_byte_counts()
                    with torch.inference_mode():
                        out = sp(x, t, ctx)
                    counts = coord.byte_counts()
                    rows = sp.tokens_per_rank()
                    total = sum(rows)
                    # the final gather of the rows: every rank receives the others' [S_r, hidden] once
                    gather = [(total - r) * hidden * DTYPE.itemsize for r in rows]
                    attention = max(c["received"] - g for c, g in zip(counts, gather))
                    found[mode, precision] = ([seen["h"]] if capture_block else out,
                                              attention // len(model.blocks))
    finally:
        if hook is not None:
            hook.remove()
    return found


def errors_and_bytes(model, worlds, video_rows: int, hidden: int, capture_block: bool, what: str) -> dict:
    x, t, ctx = inputs(video_rows)
    errors, nbytes = {}, {}
    for world in worlds:
        started = time.perf_counter()
        found = sp_runs(model, world, x, t, ctx, hidden, capture_block)
        for mode in MODES:
            exact_out, exact_bytes = found[mode, "exact"]
            nbytes[f"{mode}_w{world}"] = {p: found[mode, p][1] for p in precisions()}
            for precision in precisions()[1:]:
                errors.setdefault(precision, {})[f"{mode}_w{world}"] = round(
                    frobenius_rel(found[mode, precision][0], exact_out), 6)
        print(f"{what} W={world}: " + "; ".join(f"{p} {e}" for p, e in
                                                  ((p, {k: v for k, v in errors[p].items() if k.endswith(f"_w{world}")})
                                                   for p in errors)) + f" ({time.perf_counter() - started:.0f} s)",
              flush=True)
    return {"errors": errors, "bytes": nbytes}


def activation_peaks(model, world: int, video_rows: int) -> dict:
    """Per precision (exact, int8; allgather): the busiest rank's measured peak of live bytes in
    one forward, the plan's estimate for it, and their ratio."""
    from bench_sp_modes import LiveStorageBytes, tracked_ranks  # the same tracker as the SP modes' bench
    x, t, ctx = inputs(video_rows)
    shape = dit_shape_of(model)
    out = {}
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=600) as coord:
        for precision in ("exact", "int8"):
            sp = enable_sequence_parallel([model] * world, coord, sp_mode=SPMode("allgather", exchange_precision=precision))
            with torch.inference_mode():
                sp(x, t, ctx)  # warm-up: the strategy's buffers exist before the measured forward
                trackers = [LiveStorageBytes() for _ in range(world)]
                with tracked_ranks(coord, trackers):
                    sp(x, t, ctx)
            measured = max(tr.peak for tr in trackers)
            estimate = activation_bytes(shape, sum(sp.tokens_per_rank()), world, DTYPE.itemsize, precision=precision)
            out[precision] = {"measured": measured, "estimate": estimate, "ratio": round(measured / estimate, 3)}
    print("memory W=%d: " % world + ", ".join(f"{p} {v['measured'] / 1e6:.1f} MB measured, {v['estimate'] / 1e6:.1f} MB "
                                              f"estimated ({v['ratio']})" for p, v in out.items()), flush=True)
    return out


def processes_times(path: str, worlds, video_rows: int, rounds: int, forwards: int) -> dict:
    recipe = ModelRecipe("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint", {"path": path})
    x, t, ctx = inputs(video_rows, seed=1)
    out = {}
    for world in worlds:
        times = {"exact": [], "int8": []}
        ratios = []
        for r in range(rounds):
            medians = {}
            for precision in (("exact", "int8") if r % 2 == 0 else ("int8", "exact")):
                pool = WorkerPool(["cpu"] * world, recipe, SPMode("allgather", exchange_precision=precision),
                                  timeout_s=600).start()
                try:
                    with torch.inference_mode():
                        pool.forward(x, t, ctx)  # warm-up
                        mine = []
                        for _ in range(forwards):
                            start = time.perf_counter()
                            pool.forward(x, t, ctx)
                            mine.append(time.perf_counter() - start)
                finally:
                    pool.close()
                times[precision] += mine
                medians[precision] = statistics.median(mine)
            ratios.append(medians["int8"] / medians["exact"])
            print(f"processes W={world} round {r + 1}/{rounds}: exact {medians['exact']:.3f} s, "
                  f"int8 {medians['int8']:.3f} s", flush=True)
        out[world] = {"ratio": round(statistics.median(ratios), 4), "ratios": [round(v, 4) for v in ratios],
                      "step_s": {p: round(statistics.median(v), 4) for p, v in times.items()}}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smallest run (the test's): " + " ".join(QUICK))
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--time-worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--block-hidden", type=int, default=5376)
    parser.add_argument("--block-heads", type=int, default=56)
    parser.add_argument("--block-ffn", type=int, default=14336)
    parser.add_argument("--block-video-rows", type=int, default=128)
    parser.add_argument("--step-blocks", type=int, default=4)
    parser.add_argument("--time-video-rows", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--forwards", type=int, default=3)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args((QUICK if "--quick" in argv else []) + argv)
    started = time.perf_counter()
    torch.manual_seed(0)

    block_model = build_miniature(config(args.block_hidden, args.block_heads, args.block_ffn, 1), seed=0, dtype=DTYPE)
    block = errors_and_bytes(block_model, args.worlds, args.block_video_rows, args.block_hidden, True, "block")
    del block_model
    step_cfg = config(1024, 8, 2048, args.step_blocks)
    step_model = build_miniature(step_cfg, seed=1, dtype=DTYPE)
    step = errors_and_bytes(step_model, args.worlds, 256, 1024, False, "step")
    peaks = activation_peaks(step_model, args.worlds[0], 256)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "step.safetensors")
        save_miniature(step_model, path)
        timing = processes_times(path, args.time_worlds, args.time_video_rows, args.rounds, args.forwards)

    result = {"block_dims": {"hidden": args.block_hidden, "heads": args.block_heads, "head_dim": 128,
                             "ffn": args.block_ffn, "video_rows": args.block_video_rows},
              "step_dims": {"hidden": 1024, "heads": 8, "head_dim": 128, "blocks": args.step_blocks},
              "dtype": "bfloat16", "worlds": args.worlds}
    within = True
    for precision in precisions()[1:]:
        worst_block = max(block["errors"][precision].values())
        worst_step = max(step["errors"][precision].values())
        ratio = max(b[precision] / b["exact"] for b in block["bytes"].values())
        result[f"{precision}_block_rel_error"] = worst_block
        result[f"{precision}_step_rel_error"] = worst_step
        result[f"{precision}_bytes_ratio"] = round(ratio, 4)
        result[f"{precision}_block_rel_error_bound"] = BLOCK_REL_ERROR_BOUND[precision]
        result[f"{precision}_step_rel_error_bound"] = STEP_REL_ERROR_BOUND[precision]
        within = within and worst_block <= BLOCK_REL_ERROR_BOUND[precision] and \
            worst_step <= STEP_REL_ERROR_BOUND[precision]
        print(f"{precision}: block error {worst_block} (bound {BLOCK_REL_ERROR_BOUND[precision]}), step error "
              f"{worst_step} (bound {STEP_REL_ERROR_BOUND[precision]}), bytes {ratio:.4f} of exact", flush=True)
    result["block_rel_error"] = block["errors"]
    result["step_rel_error"] = step["errors"]
    result["bytes_per_block_rank"] = block["bytes"]
    first = args.time_worlds[0]
    result["int8_processes_step_ratio"] = timing[first]["ratio"]
    result["processes_step"] = {f"w{w}": v for w, v in timing.items()}
    result["activation_w"] = args.worlds[0]
    result["activation_bytes"] = peaks
    result["activation_measured_vs_estimate"] = {p: v["ratio"] for p, v in peaks.items()}
    result["within_bounds"] = within
    result["seconds"] = round(time.perf_counter() - started, 1)
    print(f"processes W={first}: int8 / exact step {timing[first]['ratio']} ({timing[first]['step_s']})", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
