#!/usr/bin/env python3
"""Ranks as processes against ranks as threads, the same model, inputs and ranks, one run.

The dry run's miniature DiT and inputs (its own builders, its default size), on W CPU ranks:
  threads   the in-process coordinator (peer backend), W rank threads with cores/W intra-op
            threads each (set inside the rank threads)
  workers   comfy/multidevice/workers/: this process is rank 0, W-1 worker processes over gloo,
            cores/W intra-op threads each, the same recipe's weights (the shared read-only
            checkpoint mapped in every process)
Forwards alternate, one of each back to back, --forwards pairs after one warm-up pair; the
figure is the median of the pairs' ratios. Each pair gets new latents (as a sampler's steps
do), the same timestep and conditioning. `--dit-weights shard`: both sides keep 1/W of the
block weights per rank (the threads with their prefetch lane, the workers gathering each block
over the process group as it starts).

Last line, JSON, per W in --worlds:
  workers_vs_threads_step_ratio_wW   workers' forward / threads' forward (target <= 1.10: what
                                     rank 0 sends per step must be small against a step)
  threads_step_s_wW, workers_step_s_wW  the medians of the two forwards, seconds
  rank0_control_share_wW             the part of a workers forward rank 0 spends sending the step
                                     and the per-block Cancel flags (the rest of the ratio: the K/V
                                     exchange over gloo between processes against copies between
                                     threads, and processes sharing the cores)
  rank0_bytes_per_step_wW            the control message of one forward (the inputs as wire data)
  rank0_bytes_vs_model_wW            that / the cost model's bytes of a step: the latents and the
                                     timestep (the conditioning went once, with the first step), ~1.0
  rank0_first_bytes_vs_model_wW      the first forward's message / all its input tensors, ~1.0
  pool_start_s_wW                    start to ready: processes, rendezvous, every rank's build
  worker_anonymous_bytes_wW          a worker's anonymous memory (/proc/PID/smaps_rollup)
  thread_rank_anonymous_bytes_wW     what one more thread rank adds to this process's anonymous
                                     memory (the threads run beside one device's model: (W ranks
                                     - 1 rank) / (W - 1), measured after a forward each)
  worker_extra_rss_ratio_wW          worker / thread rank anonymous memory (the mapped weights are
                                     shared page cache in both; what a process adds is its
                                     interpreter, torch and its own activations)
  bare_torch_process_anonymous_bytes  a fresh `python -c "import torch"` beside it: the part of a
                                     worker's memory that any process with torch has
  with --dit-weights shard also:
  rank0_block_bytes_vs_full_wW       block bytes rank 0 keeps between blocks / a full replica's
  rank0_gathered_bytes_per_step_wW   block bytes rank 0 received per forward

  .venv/bin/python bench/bench_workers.py [--worlds 2 4] [--forwards 7] [--dit-weights shard]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import minimax_h3_parallel  # noqa: E402
from comfy.multidevice.cli import dry_run  # noqa: E402
from comfy.multidevice.cli.dry_run_settings import make_settings  # noqa: E402
from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel  # noqa: E402
from comfy.multidevice.tensor_bytes import tensor_nbytes  # noqa: E402
from comfy.multidevice.workers.pool import WorkerPool  # noqa: E402
from comfy.multidevice.workers.recipe import ModelRecipe  # noqa: E402

TARGET = 1.10


def anonymous_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no Anonymous line in smaps_rollup")


def bare_torch_anonymous_bytes() -> int:
    """A process that imported torch and nothing else (it says so, then waits to be read)."""
    probe = subprocess.Popen([sys.executable, "-c", "import torch, sys; print(flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        probe.stdout.readline()  # torch is imported
        return anonymous_bytes(probe.pid)
    finally:
        probe.communicate("")


def input_bytes(value) -> int:
    if torch.is_tensor(value):
        return tensor_nbytes(value)
    if isinstance(value, dict):
        return sum(input_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(input_bytes(v) for v in value)
    return 0


def timed(forward) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        forward()
    return time.perf_counter() - start


def measure(world: int, forwards: int, out_dir: str, dit_weights: str = "replicate") -> dict:
    args = minimax_h3_parallel.build_parser().parse_args(
        ["run", "--cpu", "--devices", str(world), "--out", out_dir, "--no-progress"])
    settings = make_settings(args)
    path, _ = dry_run.ensure_checkpoint(settings)
    x, context, kwargs = dry_run.make_inputs(settings)
    t = torch.tensor([1000.0])
    cores = os.cpu_count() or 1
    rank_threads = max(1, cores // world)

    before_one = anonymous_bytes()
    with SequenceParallelCoordinator(["cpu"], backend="peer") as one_coord:
        one = enable_sequence_parallel(dry_run.build_replicas(path, ["cpu"]).modules, one_coord)
        timed(lambda: one(x, t, context, **kwargs))
        one_rank = anonymous_bytes() - before_one
    del one
    coord = SequenceParallelCoordinator(["cpu"] * world, backend="peer")
    before = anonymous_bytes()
    threads = enable_sequence_parallel(dry_run.build_replicas(path, ["cpu"] * world).modules, coord,
                                       dit_weights=dit_weights)

    latents = {"x": x}

    def step(i):  # a sampler's step i: new latents, the same conditioning
        latents["x"] = [part + 1e-3 * i for part in x]

    def thread_forward():
        coord.run(lambda rank, comm: torch.set_num_threads(rank_threads))
        threads(latents["x"], t, context, **kwargs)

    def worker_forward():
        pool.forward(latents["x"], t, context, **kwargs)

    timed(thread_forward)
    w_ranks = anonymous_bytes() - before
    thread_rank = max(0, w_ranks - one_rank) / (world - 1)

    shard = dit_weights == "shard"
    recipe = ModelRecipe("comfy.multidevice.workers.recipe",
                         "miniature_shard_from_shared_checkpoint" if shard else "miniature_from_shared_checkpoint",
                         {"path": str(path)}, sharded=shard)
    pool = WorkerPool(["cpu"] * world, recipe).start()
    try:
        timed(worker_forward)  # warm-up pair
        ratios, thread_times, worker_times = [], [], []
        for i in range(1, forwards + 1):
            step(i)
            thread_times.append(timed(thread_forward))
            worker_times.append(timed(worker_forward))
            ratios.append(worker_times[-1] / thread_times[-1])
        control_share = statistics.median(c / w for c, w in zip(pool.control_seconds_per_forward[1:], worker_times))
        worker_anon = statistics.median(anonymous_bytes(w.process.pid) for w in pool.workers)
        first_sent = pool.bytes_sent_per_forward[0]
        sent = statistics.median(pool.bytes_sent_per_forward[1:])
        start_s = pool.start_seconds
        shard_figures = {}
        if shard:
            family = pool.rank0_weights.family
            full = sum(family.plan.block_bytes(i) for i in range(family.num_blocks))
            shard_figures = {f"rank0_block_bytes_vs_full_w{world}": round(family.plan.owned_bytes(0) / full, 4),
                             f"rank0_gathered_bytes_per_step_w{world}": family.gathered_bytes[0] // (forwards + 1)}
    finally:
        pool.close()
        coord.close()
        torch.set_num_threads(cores)
    model_bytes = input_bytes((x, t))  # per step: the latents and the timestep
    first_model_bytes = input_bytes((x, t, context, kwargs))
    return {f"workers_vs_threads_step_ratio_w{world}": round(statistics.median(ratios), 4),
            f"workers_vs_threads_by_pair_w{world}": [round(r, 3) for r in ratios],
            f"threads_step_s_w{world}": round(statistics.median(thread_times), 4),
            f"workers_step_s_w{world}": round(statistics.median(worker_times), 4),
            f"rank0_control_share_w{world}": round(control_share, 4),
            f"rank0_bytes_per_step_w{world}": int(sent),
            f"rank0_bytes_vs_model_w{world}": round(sent / model_bytes, 4),
            f"rank0_first_bytes_vs_model_w{world}": round(first_sent / first_model_bytes, 4),
            f"pool_start_s_w{world}": round(start_s, 2),
            f"worker_anonymous_bytes_w{world}": int(worker_anon),
            f"thread_rank_anonymous_bytes_w{world}": int(thread_rank),
            f"worker_extra_rss_ratio_w{world}": round(worker_anon / thread_rank, 2) if thread_rank else None,
            **shard_figures}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--forwards", type=int, default=7)
    parser.add_argument("--dit-weights", choices=("replicate", "shard"), default="replicate")
    args = parser.parse_args(argv)
    if any(w < 2 for w in args.worlds) or args.forwards < 1:
        parser.error("--worlds: each at least 2; --forwards at least 1")
    summary: dict = {"cores": os.cpu_count(), "forwards": args.forwards, "dit_weights": args.dit_weights}
    with tempfile.TemporaryDirectory() as out_dir:
        for world in args.worlds:
            summary.update(measure(world, args.forwards, out_dir, args.dit_weights))
            print({k: v for k, v in summary.items() if k.endswith(f"w{world}")}, file=sys.stderr)
    summary["bare_torch_process_anonymous_bytes"] = bare_torch_anonymous_bytes()
    ratios = [summary[f"workers_vs_threads_step_ratio_w{w}"] for w in args.worlds]
    summary["target"] = f"workers_vs_threads_step_ratio <= {TARGET} at every W"
    summary["target_met"] = all(r <= TARGET for r in ratios)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
