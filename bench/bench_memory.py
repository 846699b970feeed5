#!/usr/bin/env python3
"""DiT weights per card, `dit_weights=shard` against `replicate`, side by side in one run.

Measured on the miniature H3 DiT (CPU ranks, peer backend) at W = 2 and 4:
- resident DiT weight bytes per rank: what a rank's module holds between blocks (`replicate`:
  the whole DiT; `shard`: the non-block weights plus the block tensors the rank owns), counted
  from the tensors bound to each rank's module; and the peak with the gathered blocks in flight;
- gathered bytes per step (what each rank received in block gathers, counted by the shards);
- seconds per step (one DiT forward): the two modes alternate for `--rounds` rounds, each
  figure is the median; ratio = shard / replicate;
- parity: the outputs of the two modes compared with torch.equal (bit-identical or not); every
  rank's weights are copies (allocator blocks) and gathered tensors sit in 64-byte-aligned
  slots, so both modes run on equally aligned operands and identity is expected on any CPU.

Then the same arithmetic for MiniMax-H3 BF16 at 1/2/4/8 cards (labelled a projection, nothing
is run): per-card GB of the DiT stage (weights + an activation estimate at 768p 15 s, 109,952
tokens) for both modes, against a 64 GB Ascend 910B card.

The miniature keeps H3's proportions: blocks hold ~97% of the weights (H3: 64.6 of 66.3 GB).
Every rank runs with one intra-op thread, set inside its rank thread (the JSON says what each
rank thread then had: intra_op_threads_per_rank).

  .venv/bin/python bench/bench_memory.py [--video-rows 4096] [--rounds 3] [--blocks 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.miniature.h3 import MiniatureConfig, build_miniature  # noqa: E402
from comfy.multidevice.sp.cost_model import DiTShape, activation_bytes  # noqa: E402
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel  # noqa: E402
from comfy.multidevice.weights.module_copies import replica_on  # noqa: E402

from bench.h3_costs import block_parameters, sharded_weight_bytes  # noqa: E402
from bench_sp_scaling import inputs  # noqa: E402  (this folder: the same seeded inputs)

TEXT_TOKENS, AUDIO_FRAMES = 32, 32
CARD_GB = 64.0  # Ascend 910B
H3_FILE_GB = 66.3  # the BF16 DiT file (docs/ARCHITECTURE.md)
H3_TOKENS_15S = 109_952  # 768p, 15 s (docs/ARCHITECTURE.md)


def bench_config(blocks: int) -> MiniatureConfig:
    return MiniatureConfig(hidden_size=128, num_layers=blocks, token_refiner_num_layers=1,
                           num_attention_heads=4, attention_head_dim=32, ffn_hidden_size=256,
                           text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64,
                           time_embed_dim=32, rope_inv_freq_len=4)


def bound_bytes(module: torch.nn.Module) -> int:
    return sum(t.nbytes for t in module.state_dict().values())


def one_world(model, world: int, x, t, ctx, rounds: int) -> dict:
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=300) as coord:
        # the setting is per thread (OpenMP): made on the main thread it never reaches the ranks
        threads = coord.run(lambda rank, comm: torch.set_num_threads(1) or torch.get_num_threads())
        replicated = [replica_on(model, "cpu") for _ in range(world)]
        sharded_models = [replica_on(model, "cpu") for _ in range(world)]
        runs = {"replicate": enable_sequence_parallel(replicated, coord, dit_weights="replicate"),
                "shard": enable_sequence_parallel(sharded_models, coord, dit_weights="shard")}
        times = {mode: [] for mode in runs}
        outs = {}
        with torch.inference_mode():
            for mode, sp in runs.items():  # warm-up, and the outputs compared below
                outs[mode] = sp(x, t, ctx)
            family = runs["shard"].block_weights
            before = list(family.gathered_bytes)
            for _ in range(rounds):
                for mode, sp in runs.items():
                    start = time.perf_counter()
                    sp(x, t, ctx)
                    times[mode].append(time.perf_counter() - start)
        gathered = [(a - b) // rounds for a, b in zip(family.gathered_bytes, before)]
        runs["shard"].close()
    replica = bound_bytes(model)
    resident = [bound_bytes(m) for m in sharded_models]
    largest_block = max(family.plan.block_bytes(i) for i in range(family.num_blocks))
    step = {mode: statistics.median(v) for mode, v in times.items()}
    return {
        "intra_op_threads_per_rank": threads,
        "replica_bytes": replica,
        "replicate_resident_bytes_per_rank": [bound_bytes(m) for m in replicated],
        "shard_resident_bytes_per_rank": resident,
        "shard_resident_ratio": max(resident) / replica,
        # the running block's and the prefetched block's gathered tensors on top
        "shard_peak_ratio": (max(resident) + 2 * largest_block) / replica,
        "gathered_bytes_per_step_per_rank": gathered,
        "seconds_per_step": step,
        "shard_step_time_ratio": step["shard"] / step["replicate"],
        "bit_identical": all(torch.equal(a, b) for a, b in zip(outs["shard"], outs["replicate"])),
    }


def h3_projection() -> dict:
    """Arithmetic for H3 BF16 (sp/cost_model.py), per card, DiT stage; nothing runs."""
    shape = DiTShape()
    block_bytes = block_parameters(shape) * 2
    other = int(H3_FILE_GB * 1e9) - block_bytes * shape.blocks  # embeddings, refiner, final layer
    table = {}
    for world in (1, 2, 4, 8):
        weights = sharded_weight_bytes(block_bytes, shape.blocks, other, world)
        act = activation_bytes(shape, H3_TOKENS_15S, world)
        row = {"activations_gb": round(act / 1e9, 1)}
        for mode in ("replicate", "shard"):
            total = (weights[mode] + act) / 1e9
            row[f"{mode}_weights_gb"] = round(weights[mode] / 1e9, 1)
            row[f"{mode}_total_gb"] = round(total, 1)
            row[f"{mode}_fits_64gb"] = total <= CARD_GB
        table[f"w{world}"] = row
    return {"label": "projection (arithmetic, not measured): H3 BF16 DiT stage per card, 768p 15 s",
            "tokens": H3_TOKENS_15S, "card_gb": CARD_GB, "block_gb": round(block_bytes / 1e9, 3),
            "non_block_gb": round(other / 1e9, 2), "per_card": table}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--video-rows", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=24)
    args = parser.parse_args(argv)
    cfg = bench_config(args.blocks)
    model = build_miniature(cfg, seed=0)
    x, t, ctx, tokens = inputs(args.video_rows, cfg, TEXT_TOKENS, AUDIO_FRAMES)
    per_world = {}
    for world in (2, 4):
        per_world[world] = one_world(model, world, x, t, ctx, args.rounds)
        print(f"W={world}: {json.dumps(per_world[world])}", file=sys.stderr)
    result = {
        "model": f"miniature H3, {args.blocks} blocks, hidden {cfg.hidden_size}, fp32, CPU ranks, peer",
        "tokens": tokens,
        "rounds": args.rounds,
        "intra_op_threads_per_rank": {f"w{w}": r["intra_op_threads_per_rank"] for w, r in per_world.items()},
        "shard_resident_ratio_w2": round(per_world[2]["shard_resident_ratio"], 4),
        "shard_resident_ratio_w4": round(per_world[4]["shard_resident_ratio"], 4),
        "shard_peak_ratio_w4": round(per_world[4]["shard_peak_ratio"], 4),
        "gathered_bytes_per_step_w4": per_world[4]["gathered_bytes_per_step_per_rank"],
        "shard_step_time_ratio_w2": round(per_world[2]["shard_step_time_ratio"], 4),
        "shard_step_time_ratio_w4": round(per_world[4]["shard_step_time_ratio"], 4),
        "seconds_per_step_w4": {k: round(v, 4) for k, v in per_world[4]["seconds_per_step"].items()},
        "shard_bit_identical": all(r["bit_identical"] for r in per_world.values()),
        "h3_bf16": h3_projection(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
