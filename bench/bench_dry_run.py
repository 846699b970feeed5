#!/usr/bin/env python3
"""Is the dry run's `speedup` true? The CLI's figure beside an independent timing, same run,
on a quiet machine and under load.

Per round, alternately:
  cli           `minimax_h3_parallel.py run --cpu --devices W` in its own process, as a user
                runs it; its report's `speedup` (one device on all cores / W ranks: the median of
                the per-step ratios, each pair of steps run back to back) and `machine_load`
  independent   the same model, weights and inputs (built by the dry run's own builders), timed
                here without the CLI's sampler: --forwards forwards of one device on all the
                cores and of W rank threads with cores/W intra-op threads each (set inside the
                rank threads), each pair back to back; speedup = the median of the pairs' ratios
The CLI and the independent timing never run at the same time. Two cases, one after the other:
  quiet         nothing else started
  loaded        one CPU hog (`python -c 'while 1: pass'`) started here before the case and
                stopped by its pid after it: the CLI must still agree with the independent
                timing, and its report must say the machine was loaded
Prints one JSON object on the last line: per case both speedups (medians over the rounds, and
each round's), `cli_vs_independent` = cli / independent with the issue's target (within 10%),
and whether the CLI reported the load (`cli_saw_load`, every round).

  .venv/bin/python bench/bench_dry_run.py [--devices 2] [--rounds 3] [--forwards 9] [--case quiet|loaded|both]
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

TARGET = 0.10  # |cli / independent - 1|


def cli_run(devices: int, out_dir: str) -> dict:
    """The report of one dry run, in a process of its own."""
    done = subprocess.run([sys.executable, str(REPO / "minimax_h3_parallel.py"), "run", "--cpu",
                           "--devices", str(devices), "--out", out_dir, "--no-progress"],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


class IndependentTiming:
    """One device and W CPU rank threads on the dry run's model and inputs."""

    def __init__(self, devices: int, out_dir: str):
        args = minimax_h3_parallel.build_parser().parse_args(
            ["run", "--cpu", "--devices", str(devices), "--out", out_dir, "--no-progress"])
        settings = make_settings(args)
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
        ratios = []
        for _ in range(forwards):
            single = self.one_device()
            ratios.append(single / self.ranks())
        return statistics.median(ratios)

    def close(self):
        self.coord.close()
        torch.set_num_threads(self.cores)


class CpuHog:
    """One busy process for the loaded case, stopped by its pid."""

    def __enter__(self):
        self.process = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
        time.sleep(0.5)  # running before the case starts
        return self

    def __exit__(self, *exc):
        self.process.kill()
        self.process.wait(timeout=30)


def measure_case(timing: IndependentTiming, devices: int, rounds: int, forwards: int, out_dir: str) -> dict:
    cli, independent, saw_load = [], [], []
    for _ in range(rounds):
        report = cli_run(devices, out_dir)
        cli.append(report["speedup"])
        saw_load.append(bool(report["machine_load"] and report["machine_load"]["loaded"]))
        independent.append(round(timing.speedup(forwards), 4))
        print(f"cli {cli[-1]:.3f} (load reported: {saw_load[-1]})  independent {independent[-1]:.3f}",
              file=sys.stderr)
    cli_s, independent_s = statistics.median(cli), statistics.median(independent)
    ratio = cli_s / independent_s
    return {"cli_speedup": cli_s, "independent_speedup": round(independent_s, 4),
            "cli_speedup_by_round": cli, "independent_speedup_by_round": independent,
            "cli_saw_load": saw_load, "cli_vs_independent": round(ratio, 4),
            "target_met": abs(ratio - 1) <= TARGET}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU ranks W (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="CLI runs and independent timings, alternated")
    parser.add_argument("--forwards", type=int, default=9, help="timed forwards per configuration per round")
    parser.add_argument("--case", choices=("quiet", "loaded", "both"), default="both")
    args = parser.parse_args(argv)
    if args.devices < 2 or args.rounds < 1 or args.forwards < 1:
        parser.error("need --devices >= 2, --rounds >= 1, --forwards >= 1")

    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        timing = IndependentTiming(args.devices, tmp)
        try:
            if args.case in ("quiet", "both"):
                cases["quiet"] = measure_case(timing, args.devices, args.rounds, args.forwards, tmp)
            if args.case in ("loaded", "both"):
                with CpuHog():
                    cases["loaded"] = measure_case(timing, args.devices, args.rounds, args.forwards, tmp)
        finally:
            timing.close()
    print(json.dumps({
        "devices": args.devices, "cores": os.cpu_count(), "rounds": args.rounds, "forwards": args.forwards,
        **cases, "target": f"cli_vs_independent within {TARGET:.0%} in every case; the load reported "
                           "in the loaded case and not in the quiet one",
        "target_met": all(c["target_met"] for c in cases.values())
        and all(cases["loaded"]["cli_saw_load"] if "loaded" in cases else [True])
        and not any(cases["quiet"]["cli_saw_load"] if "quiet" in cases else [False]),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
