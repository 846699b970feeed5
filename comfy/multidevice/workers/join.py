"""Another server's DiT ranks: the command its user runs once, joining every pool of rank 0.

    python -m comfy.multidevice.workers.join --rendezvous 10.0.0.1:29600 --first-rank 8 \
        --devices npu:0,npu:1,npu:2,npu:3,npu:4,npu:5,npu:6,npu:7

It waits at rank 0's rendezvous (the ComfyUI server's COMFYUI_MULTI_DEVICE_RENDEZVOUS) for
each new pool, starts one worker process per device for ranks first-rank, first-rank + 1, ...
of that pool, waits for them to end (the pool closed, or failed: a killed or stuck worker
ends its pool on every rank) and waits for the next pool. A ComfyUI server that restarts is
found again. Their logs go to this command's stderr, each line under its rank.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from comfy.multidevice.comm.settings import DEFAULT_TIMEOUT_S, parse_rendezvous
from comfy.multidevice.workers.process import WorkerProcess, worker_arguments
from comfy.multidevice.workers.rendezvous import PoolFollower, RendezvousError, format_address

log = logging.getLogger("comfy.multidevice.workers.join")

RETRY_S = 2.0  # between tries to reach a rank 0 that is not (yet) serving


def join_command(rendezvous: str, first_rank: int, devices, timeout_s: float, threads: int | None = None) -> str:
    """The command a user runs once on another server for its ranks `first_rank`, ... on `devices`."""
    return " ".join(["python", "-m", "comfy.multidevice.workers.join", "--rendezvous", rendezvous,
                     "--first-rank", str(first_rank), "--devices", ",".join(map(str, devices)),
                     "--timeout", f"{timeout_s:g}"] + (["--threads", str(threads)] if threads else []))


def _connect(host: str, port: int, timeout_s: float) -> PoolFollower:
    said = False
    while True:
        try:
            return PoolFollower(host, port, timeout_s)
        except RendezvousError as exc:
            if not said:
                log.info("%s; waiting for it (every %g s)", exc, RETRY_S)
                said = True
            time.sleep(RETRY_S)


def serve_pools(host: str, port: int, first_rank: int, devices: list[str], timeout_s: float,
                threads: int | None, pools: int | None = None) -> int:
    """Join pools until `pools` were served (None: for ever); the worst exit status."""
    rendezvous = format_address(host, port)
    follower, served, worst, count = None, 0, 0, 0
    while pools is None or count < pools:
        try:
            follower = follower or _connect(host, port, timeout_s)
            generation, world = follower.next_pool(served)
        except Exception as exc:  # noqa: BLE001 - rank 0 went away (restarted): find it again
            log.info("lost rank 0 at %s (%s); reconnecting", rendezvous, " ".join(str(exc).split())[:200])
            follower, served = None, 0
            continue
        served, count = generation, count + 1
        last = first_rank + len(devices) - 1
        if last >= world:
            log.error("pool %d has %d ranks, so ranks %d-%d of this server do not fit: set "
                      "COMFYUI_MULTI_DEVICE_REMOTE_RANKS on the ComfyUI server to count them, or "
                      "--first-rank / --devices here", generation, world, first_rank, last)
            worst = max(worst, 2)
            continue
        log.info("joining pool %d (%d ranks) as ranks %d-%d on %s", generation, world, first_rank, last,
                 ", ".join(devices))
        workers = [WorkerProcess(first_rank + i, worker_arguments(first_rank + i, world, rendezvous, generation,
                                                                   device, timeout_s, threads))
                   for i, device in enumerate(devices)]
        for worker in workers:
            code = worker.wait()
            worst = max(worst, 0 if code == 0 else 1)
            log.info("pool %d: %s", generation, worker.describe())
    return worst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="run this server's MiniMax-H3 DiT ranks in the worker "
                                                 "pools of a ComfyUI server (rank 0)")
    parser.add_argument("--rendezvous", required=True, help="rank 0's COMFYUI_MULTI_DEVICE_RENDEZVOUS, HOST:PORT")
    parser.add_argument("--first-rank", type=int, required=True,
                        help="this server's first rank (rank 0's server holds 0 to its card count - 1)")
    parser.add_argument("--devices", required=True, help="this server's cards for its ranks, e.g. npu:0,npu:1")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="collective timeout, seconds")
    parser.add_argument("--threads", type=int, help="intra-op threads per rank (CPU ranks share the cores)")
    parser.add_argument("--pools", type=int, help="stop after this many pools (default: never)")
    args = parser.parse_args(argv)
    address = parse_rendezvous(args.rendezvous)
    if address is None:
        parser.error(f"--rendezvous {args.rendezvous!r} is not HOST:PORT (rank 0's "
                     "COMFYUI_MULTI_DEVICE_RENDEZVOUS)")
    if address[1] == 0:
        parser.error("--rendezvous needs rank 0's fixed port, not 0")
    if args.first_rank < 1:
        parser.error(f"--first-rank {args.first_rank}: rank 0 is the ComfyUI process; give 1 or more")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    if not devices:
        parser.error("--devices names no device")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return serve_pools(*address, args.first_rank, devices, args.timeout, args.threads, args.pools)


if __name__ == "__main__":
    sys.exit(main())
