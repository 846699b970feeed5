#!/usr/bin/env python3
"""Is the dry run's `speedup` true? The CLI's figure beside an independent timing, same run.

Per round, alternately:
  cli           `minimax_h3_parallel.py run --cpu --devices W` in its own process, as a user
                runs it; its report's `speedup` (one device on all cores / W ranks, per step)
  independent   the same model, weights and inputs (built by the dry run's own builders), timed
                here without the CLI's sampler: --forwards forwards of one device on all the
                cores and of W rank threads with cores/W intra-op threads each (set inside the
                rank threads), interleaved, medians; speedup = one device / W ranks
The CLI and the independent timing never run at the same time. Prints one JSON object on the
last line: both speedups (medians over the rounds, and each round's), and
`cli_vs_independent` = cli / independent, with the issue's target (within 10%).

  .venv/bin/python bench/bench_dry_run.py [--devices 2] [--rounds 3] [--forwards 9]
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
from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel  # noqa: E402

TARGET = 0.10  # |cli / independent - 1|


def cli_speedup(devices: int, out_dir: str) -> float:
    """The `speedup` of one dry run, in a process of its own."""
    done = subprocess.run([sys.executable, str(REPO / "minimax_h3_parallel.py"), "run", "--cpu",
                           "--devices", str(devices), "--out", out_dir, "--no-progress"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["speedup"]


class IndependentTiming:
    """One device and W CPU rank threads on the dry run's model and inputs."""

    def __init__(self, devices: int, out_dir: str):
        args = minimax_h3_parallel.build_parser().parse_args(
            ["run", "--cpu", "--devices", str(devices), "--out", out_dir, "--no-progress"])
        settings = dry_run.make_settings(args)
        path, _ = dry_run.ensure_checkpoint(settings)
        self.x, self.context, self.kwargs = dry_run.make_inputs(settings)
        self.t = torch.tensor([1000.0])  # the first step's sigma (1.0), as the sampler passes it
        self.single = dry_run.build_replicas(path, settings.devices[:1]).modules[0]
        self.coord = SequenceParallelCoordinator(settings.devices, backend="peer")
        self.sp = enable_sequence_parallel(dry_run.build_replicas(path, settings.devices).modules, self.coord)
        self.cores = os.cpu_count() or 1
        self.rank_threads = max(1, self.cores // devices)

    def _time(self, forward) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            forward(self.x, self.t, self.context, **self.kwargs)
        return time.perf_counter() - start

    def one_device(self) -> float:
        torch.set_num_threads(self.cores)
        return self._time(self.single)

    def ranks(self) -> float:
        # intra-op threads are per thread (OpenMP): set where the ranks compute
        self.coord.run(lambda rank, comm: torch.set_num_threads(self.rank_threads))
        return self._time(self.sp)

    def speedup(self, forwards: int) -> float:
        self.one_device()  # warm-up: allocator and thread pools
        self.ranks()
        single, ranks = [], []
        for _ in range(forwards):
            single.append(self.one_device())
            ranks.append(self.ranks())
        return statistics.median(single) / statistics.median(ranks)

    def close(self):
        self.coord.close()
        torch.set_num_threads(self.cores)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU ranks W (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="CLI runs and independent timings, alternated")
    parser.add_argument("--forwards", type=int, default=9, help="timed forwards per configuration per round")
    args = parser.parse_args(argv)
    if args.devices < 2 or args.rounds < 1 or args.forwards < 1:
        parser.error("need --devices >= 2, --rounds >= 1, --forwards >= 1")

    cli, independent = [], []
    with tempfile.TemporaryDirectory() as tmp:
        timing = IndependentTiming(args.devices, tmp)
        try:
            for _ in range(args.rounds):
                cli.append(cli_speedup(args.devices, tmp))
                independent.append(round(timing.speedup(args.forwards), 4))
                print(f"cli {cli[-1]:.3f}  independent {independent[-1]:.3f}", file=sys.stderr)
        finally:
            timing.close()
    cli_s, independent_s = statistics.median(cli), statistics.median(independent)
    ratio = cli_s / independent_s
    print(json.dumps({
        "devices": args.devices, "cores": os.cpu_count(), "rounds": args.rounds, "forwards": args.forwards,
        "cli_speedup": cli_s, "independent_speedup": round(independent_s, 4),
        "cli_speedup_by_round": cli, "independent_speedup_by_round": independent,
        "cli_vs_independent": round(ratio, 4), "target": f"within {TARGET:.0%}",
        "target_met": abs(ratio - 1) <= TARGET,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
