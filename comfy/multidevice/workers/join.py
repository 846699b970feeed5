"""Another server's DiT ranks: the command its user runs once, joining every pool of rank 0.

    python -m comfy.multidevice.workers.join --rendezvous 10.0.0.1:29600 --first-rank 8 \
        --devices npu:0,npu:1,npu:2,npu:3,npu:4,npu:5,npu:6,npu:7

It waits at rank 0's rendezvous (the ComfyUI server's COMFYUI_MULTI_DEVICE_RENDEZVOUS) for
each new pool, starts one worker process per device for ranks first-rank, first-rank + 1, ...
of that pool, waits for them to end (the pool closed, or failed: a killed or stuck worker
ends its pool on every rank) and waits for the next pool. A ComfyUI server that restarts is
found again. Their logs go to this command's stderr, each line under its rank.

It needs the cluster secret of the ComfyUI server (COMFYUI_MULTI_DEVICE_SECRET_FILE, the same
file on both): it follows rank 0 only once rank 0 proved it, and stops, saying so, when the
program at the address does not (another secret, or not rank 0 at all), or when rank 0
refuses this server's ranks (overlapping another server's, or rank 0's own).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

from comfy.multidevice.comm.settings import DEFAULT_TIMEOUT_S, parse_rendezvous
from comfy.multidevice.commands import module_command
from comfy.multidevice.workers.admission import AdmissionError, cluster_secret, SecretError
from comfy.multidevice.workers.door import format_address, RendezvousError
from comfy.multidevice.workers.door_client import Following, RankZeroLost
from comfy.multidevice.workers.process import WorkerProcess, worker_arguments, worker_env
from comfy.multidevice.workers.rendezvous import interface_towards

log = logging.getLogger("comfy.multidevice.workers.join")

RETRY_S = 2.0  # between tries to reach a rank 0 that is not (yet) serving
REFUSED = 3  # the exit status when rank 0 refused this server or did not prove the secret


def join_command(rendezvous: str, first_rank: int, devices, timeout_s: float, threads: int | None = None) -> str:
    """The command a user runs once on another server for its ranks `first_rank`, ... on `devices`
    (with the cluster secret placed there: COMFYUI_MULTI_DEVICE_SECRET_FILE), from the folder
    this install's commands start from (commands.py: ComfyUI's for a clone in custom_nodes/)."""
    return module_command("comfy.multidevice.workers.join", "--rendezvous", rendezvous, "--first-rank",
                          str(first_rank), "--devices", ",".join(map(str, devices)), "--timeout", f"{timeout_s:g}",
                          *(["--threads", str(threads)] if threads else []))


def _follow(host: str, port: int, base: bytes, first_rank: int, count: int) -> Following:
    """Rank 0's door, once it serves and proves the secret; retried every RETRY_S while it is
    not there (ComfyUI restarting), with one log line."""
    said = False
    while True:
        try:
            return Following(host, port, base, first_rank, count)
        except RendezvousError as exc:
            if not said:
                log.info("%s; waiting for it (every %g s)", exc, RETRY_S)
                said = True
            time.sleep(RETRY_S)


def _fits(generation: int, world: int, local: int, first_rank: int, count: int) -> str | None:
    """Why this server's ranks cannot take part in an announced pool, or None."""
    last = first_rank + count - 1
    if last >= world:
        return (f"pool {generation} has {world} ranks, so ranks {first_rank}-{last} of this server do not fit: set "
                "COMFYUI_MULTI_DEVICE_REMOTE_RANKS on the ComfyUI server to count them, or --first-rank / "
                "--devices here")
    if first_rank < local:
        return (f"pool {generation} runs ranks 0-{local - 1} on the ComfyUI server, so --first-rank {first_rank} "
                f"overlaps them: give --first-rank {local} or more")
    return None


def serve_pools(host: str, port: int, first_rank: int, devices: list[str], timeout_s: float,
                threads: int | None, pools: int | None = None, base: bytes | None = None) -> int:
    """Join pools until `pools` were served (None: for ever); the worst exit status. `base`:
    the cluster secret (default: this server's COMFYUI_MULTI_DEVICE_SECRET_FILE)."""
    base = cluster_secret(required=True) if base is None else base
    rendezvous = format_address(host, port)
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") or interface_towards(host, port)
    following, served, worst, count = None, 0, 0, 0
    while pools is None or count < pools:
        try:
            following = following or _follow(host, port, base, first_rank, len(devices))
            generation, world, local, key = following.next_pool()
        except AdmissionError as exc:  # not our rank 0, another secret, or these ranks refused
            log.error("%s. This join command stops.", exc)
            return REFUSED
        except RankZeroLost as exc:  # rank 0 went away (restarted): find it again
            log.info("lost rank 0 at %s (%s); reconnecting in %g s", rendezvous, " ".join(str(exc).split())[:200],
                     RETRY_S)
            following.close()
            following, served = None, 0
            time.sleep(RETRY_S)  # never a tight loop, whatever rank 0 did
            continue
        if generation <= served:
            log.warning("rank 0 announced pool %d after pool %d; skipping it", generation, served)
            continue
        served, count = generation, count + 1
        problem = _fits(generation, world, local, first_rank, len(devices))
        if problem:
            log.error("%s", problem)
            worst = max(worst, 2)
            continue
        last = first_rank + len(devices) - 1
        log.info("joining pool %d (%d ranks) as ranks %d-%d on %s", generation, world, first_rank, last,
                 ", ".join(devices))
        workers = []
        try:
            for i, device in enumerate(devices):
                workers.append(WorkerProcess(first_rank + i, worker_arguments(
                    first_rank + i, world, rendezvous, generation, device, timeout_s, threads), key,
                    env=worker_env(ifname)))
            for worker in workers:
                code = worker.wait()
                worst = max(worst, 0 if code == 0 else 1)
                log.info("pool %d: %s", generation, worker.describe())
        except BaseException:  # Ctrl-C: the workers run in sessions of their own, so it never reached them
            for worker in workers:
                worker.kill()
            raise
    if following is not None:
        following.close()
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
    try:
        base = cluster_secret(required=True)
    except SecretError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        return serve_pools(*address, args.first_rank, devices, args.timeout, args.threads, args.pools, base)
    except KeyboardInterrupt:
        log.info("stopped by Ctrl-C, and this server's workers with it; rank 0's next pool waits for "
                 "their ranks until this command runs again")
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
