#!/usr/bin/env python3
"""MiniMax-H3 multi-device command line.

  run      the parallel pipeline: without weights, the dry run on a small model with random
           weights, on W ranks against one device (parity check, traffic, timing)
  doctor   what this machine offers: devices, backends, a self-test exchange
  tryout   try the pack without the weights: tiny random-weight files and a try-out node
           in a ComfyUI folder (run it with ComfyUI's Python), or --remove them

Examples:
  minimax_h3_parallel.py run                        all visible cards (or 4 CPU ranks)
  minimax_h3_parallel.py run --devices 4 --sp-mode auto
  torchrun --nproc-per-node 2 minimax_h3_parallel.py run      one rank per process
  minimax_h3_parallel.py doctor --json
  minimax_h3_parallel.py tryout --comfyui ../ComfyUI          then --remove to undo it
"""
# Each subcommand registers its options in `add_<name>_arguments` and runs in `<name>_main`;
# the work itself lives in the package comfy/multidevice/, so ComfyUI and the tests use it too.

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


# ----------------------------------------------------------------------------- run

def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from comfy.multidevice.cli.dry_run_settings import add_arguments
    add_arguments(parser, repo_dir=Path(__file__).resolve().parent)
    parser.set_defaults(handler=run_main)


def run_main(args: argparse.Namespace) -> int:
    """The dry run: miniature DiT, W ranks (threads, or processes under torchrun) vs one device."""
    from comfy.multidevice.comm.settings import launched_by_torchrun
    if launched_by_torchrun():  # one rank per process instead of rank threads
        from comfy.multidevice.cli.torchrun_run import run_distributed
        return run_distributed(args)
    from comfy.multidevice.cli.dry_run import run
    return run(args)


# ----------------------------------------------------------------------------- doctor

def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    """Devices, backends, environment and a self-test exchange (comfy/multidevice/cli/doctor.py)."""
    from comfy.multidevice.cli.doctor import add_arguments, main
    add_arguments(parser)
    parser.set_defaults(handler=main)


# ----------------------------------------------------------------------------- tryout

def add_tryout_arguments(parser: argparse.ArgumentParser) -> None:
    """Tiny model files and the try-out node into a ComfyUI, or out (comfy/multidevice/cli/tryout.py)."""
    from comfy.multidevice.cli.tryout import add_arguments
    add_arguments(parser)


# ----------------------------------------------------------------------------- main

RUN_DESCRIPTION = """\
The dry run: a small model with H3's structure and random weights (written to --cache once)
samples a short clip on W ranks and once on one device, and compares the two. Prints progress,
then one JSON report on the last line (also in --out/report.json).
Exit status: 0 the ranks match one device, 1 they do not (or a file could not be written, or,
under torchrun, a rank failed: one line per rank, the traceback with --debug), 2 a bad option,
environment variable or backend that cannot start (said before anything runs), 130 stopped by
Ctrl-C, 143 stopped by SIGTERM (neither leaves a half-written file in --cache)."""

DOCTOR_DESCRIPTION = """\
Lists the visible NPUs/GPUs, which collective libraries load (HCCL, NCCL) and the settings in
the environment, then runs one exchange between the selected devices and checks it.
Exit status: 0 the selected set-up works, 1 it does not (the report says why), 2 a bad option
or environment variable (said before the self-test runs), 130 Ctrl-C, 143 SIGTERM."""

TRYOUT_DESCRIPTION = """\
Puts tiny random-weight model files under the seven released names into the ComfyUI folder's
models/ and a try-out node into its custom_nodes/ (it makes upstream's H3 loaders build the
matching tiny models; ComfyUI logs a TRY-OUT line at each start), so one of the pack's templates
runs at 4 CPU cards in minutes: noise in, noise out, the pack at work. Run it with ComfyUI's
Python, from a checkout or a clone of this project. It refuses when a file of a released name is
already there (the real weights). --remove deletes exactly what it wrote, recorded with each
file's sha256; a file changed since is left in place and named.
Exit status: 0 done (or nothing to do), 1 refused, or a changed file left in place, 2 not a
ComfyUI folder or ComfyUI cannot be imported, 130 Ctrl-C, 143 SIGTERM."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minimax_h3_parallel.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add, description, help_text in (
            ("run", add_run_arguments, RUN_DESCRIPTION, "run the parallel pipeline (dry run by default)"),
            ("doctor", add_doctor_arguments, DOCTOR_DESCRIPTION, "check devices and backends"),
            ("tryout", add_tryout_arguments, TRYOUT_DESCRIPTION,
             "try the pack without the weights (tiny random models), or --remove that")):
        add(sub.add_parser(name, help=help_text, description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter))
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every `finally` runs (temporary files go)."""


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.handler is None:
        print(f"minimax_h3_parallel.py: {args.unavailable}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return int(args.handler(args) or 0)
    except (KeyboardInterrupt, Terminated) as exc:
        how, number = ("Ctrl-C", signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else \
            ("SIGTERM", signal.SIGTERM)
        print(f"minimax_h3_parallel.py {args.command}: stopped by {how}; run it again to start over",
              file=sys.stderr)
        return 128 + number
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_process(code: int) -> None:
    """Exit with `code`. A torchrun worker skips the interpreter's teardown: after the process
    group is destroyed, torch's gloo teardown at interpreter exit sometimes aborts the process
    ("terminate called without an active exception", seen about once in 30 runs here), which
    would turn a finished, successful run into a failed rank."""
    if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
