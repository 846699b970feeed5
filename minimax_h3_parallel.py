#!/usr/bin/env python3
"""MiniMax-H3 multi-device command line.

  run      the parallel pipeline; without weights it is the dry run on the miniature model
  doctor   what this machine offers: devices, backends, a self-test exchange

Each subcommand registers its options in `add_<name>_arguments` and runs in `<name>_main`;
the work itself lives in the package comfy/multidevice/, so ComfyUI and the tests can use it too.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


# ----------------------------------------------------------------------------- run

def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    from comfy.multidevice.cli.dry_run import add_arguments
    add_arguments(parser, repo_dir=Path(__file__).resolve().parent)
    parser.set_defaults(handler=run_main)


def run_main(args: argparse.Namespace) -> int:
    """The dry run: miniature DiT, W ranks (threads, or processes under torchrun) vs one device."""
    from comfy.multidevice.comm.torch_dist import launched_by_torchrun
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


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minimax_h3_parallel.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    add_run_arguments(sub.add_parser("run", help="run the parallel pipeline (dry run by default)"))
    add_doctor_arguments(sub.add_parser("doctor", help="check devices and backends"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.handler is None:
        print(f"minimax_h3_parallel.py: {args.unavailable}", file=sys.stderr)
        return 2
    return int(args.handler(args) or 0)


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
