"""Rank 0 of tests/workers/test_servers.py, run on the first "server" (a network namespace):
a pool with two local ranks and two from the other server, driven line by line.

stdout: `JOIN <command>` (the other server's join command: start it now), `EXACT <rel_diff>`,
`KILL-NOW` (kill one of its workers, then write a line to stdin), `FAILED <seconds> <message>`,
`EXACT` for a fresh pool (the joined server's ranks back by themselves), `DONE`. With
`--exact-only` (ComfyUI restarted: a new rank 0 at the same address) `JOIN`, `EXACT`, `DONE`.
Exits non-zero on anything unexpected.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from comfy.multidevice.workers.pool import WorkerPool, WorkerPoolError
from comfy.multidevice.workers.recipe import miniature_from_shared_checkpoint, ModelRecipe
from tests.sp_cases import make_inputs, rel_diff


def say(*words):
    print(*words, flush=True)


def exact(pool, reference, inputs) -> float:
    x, t, ctx, kw = inputs
    return rel_diff(pool.forward(x, t, ctx, **kw), reference)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--timeout", type=float, default=30)
    parser.add_argument("--exact-only", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    recipe = ModelRecipe("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint",
                         {"path": args.checkpoint})
    inputs = make_inputs("plain")
    with torch.inference_mode():
        reference = miniature_from_shared_checkpoint(args.checkpoint)(inputs[0], inputs[1], inputs[2], **inputs[3])

    def new_pool():
        return WorkerPool(["cpu"] * 2, recipe, remote=2, address=args.address, port=args.port, timeout_s=args.timeout)

    pool = new_pool()
    say("JOIN", pool.join_command(devices=["cpu", "cpu"], threads=1))
    pool.start()
    say("EXACT", exact(pool, reference, inputs))
    if args.exact_only:
        pool.close()
        say("DONE")
        return 0
    say("KILL-NOW")
    sys.stdin.readline()
    start = time.monotonic()
    try:
        exact(pool, reference, inputs)
        say("NOT-FAILED")
        return 1
    except WorkerPoolError as exc:
        say("FAILED", round(time.monotonic() - start, 2), " ".join(str(exc).split()))
    pool = new_pool().start()
    say("EXACT", exact(pool, reference, inputs))
    pool.close()
    say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
