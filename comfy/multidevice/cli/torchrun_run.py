"""The dry run with one rank per process, for `torchrun ... minimax_h3_parallel.py run`.

`comfy/multidevice/cli/dry_run.py` drives W rank threads in one process. Under torchrun every
process is one rank instead: it joins the process group (comfy/multidevice/comm/torch_dist.py: gloo on CPU,
nccl on CUDA, hccl on Ascend), builds its own replica of the miniature from the cached
checkpoint, and runs every forward itself with the H3 adapter installed for its rank
(`install_rank_sequence_parallel`), exchanging K/V through the process group. The dry
run's options, inputs, sampler and report are reused unchanged.

Rank 0 also runs the single-device reference, checks parity, prints the report (the last
line is the JSON object) and writes the outputs; every rank exits with the same code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from comfy.multidevice.cli import dry_run as dry
from comfy.multidevice.cli.dry_run_settings import (checked_split, DryRunError, make_settings, planned_rows,
                                                    rows_text, RunSettings, sequence_length)
from comfy.multidevice.cli.report import (parity_figures, parity_line, REPORT_KEYS, speedup_baseline, steady_seconds,
                                           write_outputs)
from comfy.multidevice.comm.settings import local_world_size, read_torchrun_env, SettingError
from comfy.multidevice.comm.torch_dist import DistributedComm, init_from_env
from comfy.multidevice.devices import copy_for_rank
from comfy.multidevice.sp.minimax_h3 import install_rank_sequence_parallel
from comfy.multidevice.tensor_bytes import module_bytes
from comfy.multidevice.sp.strategies import SPMode
from comfy.multidevice.weights.block_shards import ShardedBlockWeights
from comfy.multidevice.weights.dispatch_warm_up import start_dispatch_warm_up


def _settings(args: argparse.Namespace, world: int) -> RunSettings:
    if args.devices is not None and args.devices != world:
        raise DryRunError(f"--devices {args.devices} under torchrun: the ranks are the "
                          f"{world} processes; leave --devices out or start {args.devices} "
                          "processes (torchrun --nproc-per-node / --nnodes)")
    # The dry run picks the devices of one process; here each process has its own device,
    # so validate every other option with a single CPU rank.
    settings = make_settings(argparse.Namespace(**{**vars(args), "devices": 1, "cpu": True, "split": "even"}))
    if sequence_length(settings) < world:
        raise DryRunError(f"{sequence_length(settings)} tokens cannot be split over {world} ranks")
    settings.split = checked_split(args, world)  # for the processes, not the one rank validated above
    return settings


def _ensure_checkpoint_once(settings: RunSettings, comm: DistributedComm, local_rank: int):
    """Rank 0 builds the cached checkpoint, then the first process of every other machine
    (its own disk), then the rest read it: never two writers of one file."""
    result = None
    for turn in (comm.rank == 0, local_rank == 0, True):
        if turn and result is None:
            result = dry.ensure_checkpoint(settings)
        comm.barrier()
    return result


def _one_replica(path, device):
    """This process's replica, through the dry run's own builder, and how it was built."""
    built = dry.build_replicas(path, [str(device)])
    return built.modules[0], built.source


def run_distributed(args: argparse.Namespace, out=sys.stdout) -> int:
    """Validate every option, join the process group, run. A failure on this rank (a lost
    peer process above all) is one line on stderr and exit status 1; `--debug` re-raises it
    for the traceback."""
    env = None
    try:  # every rank validates the same options: all stop here, before joining the group
        env = read_torchrun_env()
        settings = _settings(args, env.world_size)
    except (DryRunError, SettingError) as exc:
        if env is None or env.rank == 0:
            print(f"minimax_h3_parallel.py run: {exc}", file=sys.stderr)
        return 2
    start_dispatch_warm_up()  # torch's one-time import for read-only views, during the rendezvous
    try:
        comm = init_from_env(device="cpu" if args.cpu else None)
        with comm:
            return _run(args, settings, comm, env.local_rank, out)
    except Exception as exc:
        if args.debug:
            raise
        print(f"minimax_h3_parallel.py run: rank {env.rank} of {env.world_size} stops: "
              f"{_one_line(exc)} (--debug shows the traceback)", file=sys.stderr, flush=True)
        return 1


def _per_rank(comm: DistributedComm, value: int) -> list[int]:
    """One integer from every rank, in rank order (a collective: every rank calls it)."""
    return [int(v) for v in comm.exchange([torch.tensor([value], dtype=torch.int64)], 0)[0].tolist()]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}" if text else type(exc).__name__


def _run(args, settings: RunSettings, comm: DistributedComm, local_rank: int, out) -> int:
    lead = comm.rank == 0
    say = (lambda text: print(text, file=out, flush=True)) if lead else (lambda text: None)
    cfg, world, device = settings.config, comm.world_size, comm.device
    say(f"MiniMax-H3 dry run under torchrun: miniature DiT (hidden {cfg.hidden_size}, {cfg.num_layers} "
        f"blocks), {args.dtype}, seed {args.seed}, {world} processes")

    path, reused = _ensure_checkpoint_once(settings, comm, local_rank)
    say(f"[weights] {path} ({'reused from the cache' if reused else 'built and saved'})")
    replica, weights_source = _one_replica(path, device)
    reference, block_weights = replica, None
    if args.dit_weights == "shard":  # this process keeps its rank's share of the block weights
        reference = _one_replica(path, device)[0] if comm.rank == 0 and not args.no_reference else None
        family = ShardedBlockWeights([replica if r == comm.rank else None for r in range(comm.world_size)],
                                     lambda m: m.blocks,  # H3 contract: the blocks are model.blocks
                                     [device if r == comm.rank else None for r in range(comm.world_size)])
        block_weights = family.rank_view(comm.rank)

    index = torch.tensor([device.index if device.index is not None else -1])
    indices = comm.exchange([index], 0)[0].tolist()
    devices = [device.type if i < 0 else f"{device.type}:{i}" for i in indices]
    seq_len = sequence_length(settings)
    tokens_per_rank = planned_rows(settings.split, seq_len, world)
    backend = f"torch.distributed {comm.backend_name}"
    say(f"[ranks] {world} processes ({', '.join(devices)}), backend {backend}, sp mode {args.sp_mode}")
    say(f"[sequence] {seq_len} tokens; tokens per rank {rows_text(tokens_per_rank)}")

    x, context, kwargs = dry.make_inputs(settings)
    x, context, kwargs = [z.to(device) for z in x], context.to(device), copy_for_rank(kwargs, torch.device(device))
    sigmas = dry.sigma_schedule(args.steps, cfg.sigma_shift_video)
    shards = []
    sp_mode = SPMode(args.sp_mode, args.sp_overlap, exchange_precision=args.exchange_precision)

    def rank_forward(latents, timestep, text, **kw):
        options: dict = {}  # a fresh copy per forward, as the thread fan-out makes
        # the set-up of the first forward is reused by every later one
        shards.append(install_rank_sequence_parallel(replica, comm, options, sp_mode,
                                                     setup=shards[-1] if shards else None,
                                                     block_weights=block_weights, split=settings.split))
        return replica(latents, timestep, text, transformer_options=options, **kw)

    # The processes of one machine share its cores: each takes its share while they sample
    # together; the lead's reference then runs alone with all of them.
    all_threads = torch.get_num_threads()
    if device.type == "cpu":
        local_world = local_world_size(world)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    rank_threads = torch.get_num_threads()
    received = []
    before = [comm.byte_counts()["received"]]

    def after_step():
        now = comm.byte_counts()["received"]
        received.append(now - before[0])
        before[0] = now

    latents, seconds = dry.euler_sample(
        rank_forward, x, context, kwargs, sigmas,
        dry.Progress(f"sampling on {world} processes", args.steps, lead and not args.no_progress),
        after_step=after_step)
    if tokens_per_rank is None:
        tokens_per_rank = _per_rank(comm, shards[-1].tokens)
        say(f"[split] auto: tokens per rank {tokens_per_rank}")
    if shards[-1].tokens != tokens_per_rank[comm.rank]:
        raise RuntimeError(f"rank {comm.rank} held {shards[-1].tokens} tokens, expected "
                           f"{tokens_per_rank[comm.rank]}")
    # Bytes all ranks together received per step (the thread run reports the same sum).
    bytes_per_step = int(comm.all_reduce(torch.tensor([float(max(received))]), "sum").item())
    sp_seconds = steady_seconds(seconds)
    say(f"[sampling] {world} processes: {args.steps} steps, {sp_seconds:.3f} s/step, "
        f"exchanged {bytes_per_step / 2 ** 20:.2f} MiB/step between ranks")

    report = {
        "world_size": world, "backend": backend, "sp_mode": args.sp_mode, "devices": devices,
        "tokens": seq_len, "tokens_per_rank": tokens_per_rank, "steps": args.steps,
        "max_abs_diff": None, "rel_diff": None, "tolerance": settings.tolerance, "parity": "skipped",
        "seconds_per_step": round(sp_seconds, 6), "reference_seconds_per_step": None, "speedup": None,
        "exchanged_bytes_per_step": bytes_per_step, "dtype": args.dtype,
        "cpu_threads_per_rank": rank_threads if device.type == "cpu" else None,
        "reference_cpu_threads": all_threads if device.type == "cpu" else None,
        "speedup_baseline": speedup_baseline(devices, all_threads if device.type == "cpu" else None),
        "checkpoint": str(path), "checkpoint_reused": reused, "weights_source": weights_source,
        "out": str(args.out), "launcher": "torchrun", "dit_weights": args.dit_weights,
        "dit_weight_bytes_per_rank": _per_rank(comm, module_bytes(replica)),
        "dit_gathered_bytes_per_step": _per_rank(
            comm, 0 if block_weights is None else block_weights.family.gathered_bytes[comm.rank] // args.steps),
    }
    for key in REPORT_KEYS:  # keys the thread run has and this mode does not measure
        report.setdefault(key, None)
    failed = 0.0
    ref_latents = None
    if lead and not args.no_reference:  # the others wait in the all_reduce below
        torch.set_num_threads(all_threads)
        ref_latents, rs = dry.euler_sample(
            reference, x, context, kwargs, sigmas, dry.Progress("reference on 1 device", args.steps,
                                                              not args.no_progress))
        ref_seconds = steady_seconds(rs)
        report.update(parity_figures(latents, ref_latents, settings.tolerance),
                      reference_seconds_per_step=round(ref_seconds, 6),
                      speedup=round(ref_seconds / sp_seconds, 4))
        failed = 1.0 if report["parity"] == "fail" else 0.0
        say(f"[reference] 1 device: {args.steps} steps, {ref_seconds:.3f} s/step")
        say(parity_line(report))
    failed = float(comm.all_reduce(torch.tensor([failed], device=device), "max").item())
    if lead:
        write_outputs(Path(args.out), latents, ref_latents, report)
        say(f"[output] {Path(args.out) / 'latents.safetensors'}, {Path(args.out) / 'report.json'}")
        print(json.dumps(report), file=out, flush=True)
    return 1 if failed else 0
