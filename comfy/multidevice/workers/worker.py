"""One worker process of a pool: rank r of W on its own card, driven by rank 0.

Started by `WorkerPool` (or by workers/join.py on another server) as
`python -m comfy.multidevice.workers.worker --rank r ...`, the pool's key on its stdin. It
proves that key at rank 0's door (workers/door.py), which checks rank 0's proof too, joins
the process group of one pool (its generation's store, reached through the door), builds its
DiT from the recipe rank 0 sends, then runs every forward rank 0 announces on its share of the
sequence (the K/V exchange over the process group; with a sharded recipe also the gathers of
the block weights it does not hold), until told to stop. Between forwards it waits on the
door for rank 0's "go", for as long as rank 0 beats there. Anything that goes wrong ends the
process with one line on stderr and a non-zero status: the peers' collectives then fail at
once (gloo sees the closed connection) instead of waiting for a rank that will never come.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import socket
import sys
import time
import traceback

import torch

from comfy.multidevice.comfy_cancel import CancelledAtBlock
from comfy.multidevice.comm.settings import parse_rendezvous
from comfy.multidevice.comm.torch_dist import dist_backend_for, DistributedComm, init_process_group
from comfy.multidevice.devices import copy_for_rank, resolve_device
from comfy.multidevice.sp.fan_out import options_position, transformer_options_of
from comfy.multidevice.sp.minimax_h3 import H3RankSetup
from comfy.multidevice.weights.block_shards import OwnRankLane
from comfy.multidevice.workers.control import BlockFlag, BUILD, ControlChannel, FORWARD
from comfy.multidevice.workers.dit_file import DitFile
from comfy.multidevice.workers.door_client import RankLink, store_through_door
from comfy.multidevice.workers.process import key_from_stdin
from comfy.multidevice.workers.repeats import ReceivedTensors

log = logging.getLogger("comfy.multidevice.workers.worker")  # its name also when run as __main__


def control_group(device: torch.device):
    """The CPU group that carries control: the default group itself when it is gloo."""
    import torch.distributed as dist
    return None if device.type == "cpu" else dist.new_group(backend="gloo")


_no_lane_logged = False  # block_gather_lane said once that cards get no prefetch lane


def _say_once_that_cards_have_no_lane(device: torch.device) -> None:
    global _no_lane_logged
    if not _no_lane_logged:
        _no_lane_logged = True
        log.info("sharded DiT weights: no prefetch on %s cards: a card runs one collective at a time, "
                 "so each block is gathered on the forward's process group just before it runs, in "
                 "the same order on every rank", device.type)


def block_gather_lane(device: torch.device, timeout_s: float) -> OwnRankLane | None:
    """A sharded recipe's prefetch lane: its block gathers on a process group of their own
    beside the forward's. Every rank makes it at the same point (after the build message,
    before the build), as torch.distributed requires of a new group.

    None on a card: its group would be a second HCCL / NCCL communicator driven from a helper
    thread while the forward's runs the K/V exchange, which CANN forbids ("one card cannot
    invoke multiple collective operation APIs at a time") and NCCL calls unsafe (CARDS.md).
    Then each block is gathered on the forward's group, from the rank's thread, in the same
    order on every rank. Every rank decides alike (a pool's ranks share one device kind, as its
    default group has one backend), so no rank makes a group the others do not. A CPU (gloo)
    pool keeps its lane."""
    if device.type != "cpu":
        _say_once_that_cards_have_no_lane(device)
        return None
    import torch.distributed as dist
    group = dist.new_group(backend=dist_backend_for(device), timeout=datetime.timedelta(seconds=timeout_s))
    return OwnRankLane(DistributedComm(device, group=group))


def serve(comm, control: ControlChannel, device: torch.device, timeout_s: float, link: RankLink,
          started: float) -> int:
    """Build, then follow rank 0's forwards until it says stop; the exit status. `started`:
    the process's start (time.monotonic()), for its one start-up line."""
    if not link.wait_for_go():
        return 0
    kind, recipe, sp_mode, dit_file, split = control.receive()
    if kind != BUILD:
        raise RuntimeError(f"rank {comm.rank}: expected the build message first, got {kind!r}")
    lane = block_gather_lane(device, timeout_s) if recipe.sharded else None
    problem, model, block_weights = None, None, None
    try:
        if dit_file is not None:  # the same weights as rank 0's, or no build at all
            DitFile.from_data(dit_file).check(f"rank {comm.rank} on {socket.gethostname()}")
        model, block_weights = recipe.build(device, comm.rank, comm.world_size)
        if block_weights is not None:
            block_weights.family.use_lane(lane, timeout_s)
    except Exception as exc:  # reported to rank 0 through the statuses, not only here
        problem = f"{type(exc).__name__}: {exc}"
    link.say_built()  # a long load waits here, not in a collective that would time out
    if not link.wait_for_go():
        return 0
    if any(p for p, _, _ in control.statuses((problem, socket.gethostname(), os.getpid()))):
        return 1
    log.info("worker rank %d of %d on %s: %s, %d intra-op thread(s), pid %d, ready in %.1f s", comm.rank,
             comm.world_size, socket.gethostname(), device, torch.get_num_threads(), os.getpid(),
             time.monotonic() - started)
    received = ReceivedTensors()
    # rank 0 says at every block whether ComfyUI's Cancel was pressed (comfy_cancel.py)
    setup = H3RankSetup(comm, sp_mode, block_weights, BlockFlag(control.group), split)
    while True:
        if not link.wait_for_go():  # idle: no collective timeout here
            return 0
        message = control.receive()
        if message[0] != FORWARD:
            raise RuntimeError(f"rank {comm.rank}: unknown message {message[0]!r}")
        _, method, args, kwargs, new = message
        args, kwargs = received.unpack((args, kwargs), new)
        # held tensors are reused by the next forward: a block that writes into its input must
        # not reach them (on a card the move to it is a copy anyway)
        args, kwargs = copy_for_rank((list(args), dict(kwargs)), device, copy_tensors=device.type == "cpu")
        forward = model if method is None else getattr(model, method)
        setup.install(model, transformer_options_of(args, kwargs, options_position(forward)))
        try:
            with torch.inference_mode():
                forward(*args, **kwargs)
        except CancelledAtBlock as cancelled:  # every rank stopped at the same block: wait for the next
            log.info("rank %d: the forward was cancelled at block %d", comm.rank, cancelled.block)


def stop_now(rank: int, lost: Exception) -> None:
    """Rank 0 dropped the pool (or vanished) while this worker may be blocked in a collective
    that would only fail at its timeout: end the process now, its peers then fail at once too."""
    try:
        print(f"worker rank {rank} stops: {type(lost).__name__}: {lost}", file=sys.stderr, flush=True)
    except OSError:  # rank 0 ended, and with it the pipe of this stderr: end all the same
        pass
    os._exit(1)


def _address(text: str) -> tuple[str, int]:
    parsed = parse_rendezvous(text)
    if parsed is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return parsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="a MiniMax-H3 worker rank (started by WorkerPool)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rendezvous", required=True, type=_address, help="rank 0's door, HOST:PORT")
    parser.add_argument("--generation", type=int, required=True, help="the pool to join at it")
    parser.add_argument("--device", required=True)
    parser.add_argument("--timeout", type=float, required=True, help="collective timeout, seconds")
    parser.add_argument("--threads", type=int, help="intra-op threads (CPU ranks share a server's cores)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    # One start-up line per rank (serve's): ComfyUI's own start-up lines (its root logger: memory,
    # device, attention) and our modules' per-rank ones repeat what rank 0's log says already, once
    # per worker and pool. Warnings and errors of every module still pass.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    global _no_lane_logged
    _no_lane_logged = True  # rank 0 says it for the pool
    device = resolve_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        key = key_from_stdin()
        link = RankLink(*args.rendezvous, key, args.rank, args.generation,  # open until this process ends
                        on_lost=lambda lost: stop_now(args.rank, lost))
        if not link.wait_for_go():  # every rank is admitted: meet (however long the other servers' ranks took)
            return 0
        store, _tunnel = store_through_door(*args.rendezvous, key, args.rank, args.generation, args.timeout)
        comm = init_process_group(args.rank, args.world, device, timeout_s=args.timeout, store=store)
        return serve(comm, ControlChannel(control_group(device)), device, args.timeout, link, started)
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        print(f"worker rank {args.rank} stops: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
