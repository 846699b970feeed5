#!/usr/bin/env python3
"""The node's two sequence-parallel exchanges side by side, one run: Ulysses against the all-gather.

The miniature H3 DiT with 8 heads (so plain Ulysses runs at W = 2, 4 and 8), fp32, on CPU
ranks; the baseline is the all-gather, every ratio is Ulysses over it. Each mode is what the
node's `sp_mode` input hands the DiT roles (sp/mode_choice.py `choose_sp_mode(...)`), run through those roles: rank threads by roles/dit.py
`sequence_parallel_dit` on one coordinator (peer backend; a bare DiT module: the node's MODEL
differs in how the replicas are made, not in the exchange), ranks as processes by a
workers/pool.py `WorkerPool`, the pool that workers/pool_runner.py `workers_on_patcher` makes for a
MODEL (here over a miniature checkpoint, as bench/bench_workers.py does), rank 0 here and W-1
worker processes over gloo. The DiT is attention bound (hidden 64 against an attention width of
8 x 64, S = 2,240 packed tokens by default), so that K/V are large against the linear layers;
on CPU the attention still costs far more than copying its K/V, and exchange_share says how
much of a step the exchange is.

1. Bytes (rank threads, W in --byte-worlds): the coordinator's logical bytes received per
   rank in one forward of each mode. The attention's exchanges are separated from the final
   all-gather of the hidden state by op: that gather is one `exchange` call in both modes, the
   only one in Ulysses (whose blocks go by `all_to_all_v`), while the all-gather's K/V go by
   `exchange` too (one call a block); so Ulysses' `exchange` bytes (the same call with the
   same shapes, checked by the call counts) are subtracted from the all-gather's per
   rank. Per block on the busiest rank:
     ulysses_vs_allgather_bytes_wW         measured Ulysses / all-gather (expected 2/W, 1.0 at W = 2)
     ulysses_vs_allgather_bytes_model_wW   cost_model.attention_traffic's ratio, busiest rank
     bytes_wW                              both modes' bytes per block, the final gather's, 2/W
   processes_rank0_bytes_match_threads_wW: rank 0's bytes by op over gloo (DistributedComm's
   counters, W in --time-worlds) equal the rank threads' in both modes.
2. Time per step (one DiT forward; W in --time-worlds): the median forward of each mode.
     threads    both modes' DiTs on one coordinator, forwards alternating (the order flips
                each round), --rounds rounds after one warm-up each; cores/W intra-op threads
                set inside each rank thread before every forward
     processes  one pool at a time (torch.distributed has one default group per process):
                per round a pool per mode (order flipping), one warm-up and --forwards timed
                forwards each, its start not timed; cores/W intra-op threads (the pool's)
   ulysses_vs_allgather_step_ratio_{threads,processes}_wW is the median of the rounds' ratios;
   step_s_* the medians; exchange_share_* rank 0's time inside its collectives (waits for the
   peers included) over the step. At W > cores the ranks oversubscribe the cores (one
   intra-op thread each); timings on a loaded machine swing, hence the per-round lists.
3. Memory per rank (rank threads, W in --memory-worlds), against the memory plan's estimate
   (cost_model.activation_bytes, its mode and degree, the DiT shape read as the memory plan
   reads it, fp32: itemsize 4). Measured: the peak of the live bytes of the tensor storages
   each rank allocated during one forward, tracked by a torch dispatch mode entered inside each
   rank thread (a storage counts from the op that made it until its last tensor is freed; a
   peer's storage that a rank reads is not its own). Not seen: what a kernel allocates inside
   itself (the fused attention's scratch) and the allocator's slack. Also the exchange buffers
   alone: the storages in the strategy's workspaces as the forward's last block ends (kept for
   all its blocks), against cost_model.exchanged_bytes. The estimate states no margin; the
   ratios are reported as they come (measured_vs_estimate).
4. cpu_threads_allgather_faster_w2 / _w4: whether the all-gather's step is the shorter one on
   rank threads (sp/mode_choice.py's rule has no CPU case because these came out null): true
   or false by the median ratio, null when 1.0 lies between the rounds' quartiles.

Prints human lines, then one JSON object on the last line. `--quick`: the test's smallest run.

  .venv/bin/python bench/bench_sp_modes.py [--quick] [--video-rows 2048] [--blocks 4] [--rounds 7]
      [--time-worlds 2 4] [--memory-worlds 4 8] [--byte-worlds 2 4 8] [--forwards 3]
      [--process-rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.miniature.h3 import MiniatureConfig, build_miniature, save_miniature  # noqa: E402
from comfy.multidevice.roles.dit import sequence_parallel_dit  # noqa: E402
from comfy.multidevice.roles.memory_plan import dit_shape_of  # noqa: E402
from comfy.multidevice.sp.cost_model import activation_bytes, attention_traffic, exchanged_bytes  # noqa: E402
from comfy.multidevice.sp.mode_choice import choose_sp_mode  # noqa: E402
from comfy.multidevice.workers.pool import WorkerPool  # noqa: E402
from comfy.multidevice.workers.recipe import ModelRecipe  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_sp_scaling import inputs  # noqa: E402  (this folder: the same seeded inputs)

MODES = ("allgather", "ulysses")
HEADS = 8
ITEMSIZE = 4  # the miniature runs in fp32
TEXT_TOKENS, AUDIO_FRAMES = 64, 64
QUICK = ["--video-rows", "256", "--blocks", "2", "--rounds", "1", "--forwards", "1", "--process-rounds", "1",
         "--time-worlds", "2", "--memory-worlds", "4"]


def bench_config(blocks: int, head_dim: int, hidden: int) -> MiniatureConfig:
    return MiniatureConfig(hidden_size=hidden, num_layers=blocks, token_refiner_num_layers=1,
                           num_attention_heads=HEADS, attention_head_dim=head_dim, ffn_hidden_size=hidden,
                           text_dim=32, timestep_input_dim=32, time_embed_hidden_size=64,
                           time_embed_dim=32, rope_inv_freq_len=head_dim // 8)


def node_mode(choice: str, world: int, head_dim: int) -> str:
    """What the node hands the DiT roles for its sp_mode `choice` on CPU ranks."""
    return choose_sp_mode(choice, world, HEADS, head_dim).mode


def timed(forward) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        forward()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- bytes

def received(counts: dict, op: str) -> int:
    return counts["by_op"].get(op, {}).get("received", 0)


def calls(counts: dict, op: str) -> int:
    return counts["by_op"].get(op, {}).get("calls", 0)


def attention_bytes(by_mode: dict, blocks: int) -> dict:
    """Per rank, the attention's received bytes of one forward of each mode (see the docstring)."""
    gather, ulysses = by_mode["allgather"], by_mode["ulysses"]
    if {calls(c, "exchange") for c in gather} != {blocks + 1} or \
            {calls(c, "exchange") for c in ulysses} != {1} or \
            {calls(c, "all_to_all_v") for c in ulysses} != {2 * blocks}:
        raise RuntimeError(f"unexpected collectives per forward: {by_mode}")
    final = [received(c, "exchange") for c in ulysses]
    return {"allgather": [received(c, "exchange") - f for c, f in zip(gather, final)],
            "ulysses": [received(c, "all_to_all_v") for c in ulysses],
            "final_rows": final}


def model_bytes(mode: str, tokens: int, world: int, head_dim: int) -> int:
    return max(attention_traffic(mode, tokens, world, r, HEADS, head_dim, ITEMSIZE).received
               for r in range(world))


# ----------------------------------------------------------------------------- memory

class LiveStorageBytes(TorchDispatchMode):
    """Live bytes of the storages the ops of one thread allocated, and their peak.

    An op's output whose storage is none of its inputs' is a new storage (counted until the
    last tensor over it is freed); one over an input's storage is a view or an in-place result
    (counted with its storage when that is ours, else a peer's, not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage address -> [bytes, live tensors over it]
        self.now = self.peak = 0
        self.lock = threading.Lock()  # finalizers may run on another thread

    def _release(self, key: int) -> None:
        with self.lock:
            entry = self.live[key]
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[key]
                self.now -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            with self.lock:
                entry = self.live.get(key)
                if entry is None:
                    if key in given or not nbytes:
                        continue  # a view of a storage this thread did not make
                    entry = self.live[key] = [nbytes, 0]
                    self.now += nbytes
                    self.peak = max(self.peak, self.now)
                entry[1] += 1
            weakref.finalize(t, self._release, key)
        return out


@contextmanager
def tracked_ranks(coord: SequenceParallelCoordinator, trackers: list):
    """Every coord.run job runs inside its rank's tracker (the rank job's own inference-mode
    guard resets the dispatch keys a mode entered in an earlier job, so it is entered per job)."""
    run = coord.run

    def tracked_run(fn, *per_rank, **options):
        def inside(rank, comm, *args):
            with trackers[rank]:
                return fn(rank, comm, *args)
        return run(inside, *per_rank, **options)

    coord.run = tracked_run
    try:
        yield
    finally:
        del coord.run


def storage_bytes(value, seen: dict) -> dict:
    """{storage address: bytes} of the tensors in nested dicts / lists."""
    if isinstance(value, torch.Tensor):
        seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
    elif isinstance(value, dict):
        for v in value.values():
            storage_bytes(v, seen)
    elif isinstance(value, (list, tuple)):
        for v in value:
            storage_bytes(v, seen)
    return seen


@contextmanager
def watched_exchange_buffers(strategies: list, held: list):
    """held[rank]: the bytes in the rank's strategy workspaces as its forward's blocks end."""
    for rank, strategy in enumerate(strategies):
        def end_forward(rank=rank, strategy=strategy, original=strategy.end_forward):
            spaces = getattr(strategy, "workspace", None) or getattr(strategy, "workspaces", None) or {}
            held[rank] = sum(storage_bytes(spaces, {}).values())
            original()
        strategy.end_forward = end_forward
    try:
        yield
    finally:
        for strategy in strategies:
            del strategy.end_forward


# ----------------------------------------------------------------------------- collectives' time

@contextmanager
def collective_clock(obj, ops=("exchange", "all_to_all_v"), rank: int | None = None):
    """Seconds spent in `obj`'s collectives (the coordinator's: rank `rank`'s calls only)."""
    clock = {"s": 0.0}

    def wrap(original):
        def call(*args, **kwargs):
            if rank is not None and args[0] != rank:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                clock["s"] += time.perf_counter() - start
        return call

    for op in ops:
        setattr(obj, op, wrap(getattr(obj, op)))
    try:
        yield clock
    finally:
        for op in ops:
            delattr(obj, op)


# ----------------------------------------------------------------------------- rank threads

def threads_world(model, world: int, x, t, ctx, args, head_dim: int) -> dict:
    cores = os.cpu_count() or 1
    rank_threads = max(1, cores // world)
    shape = dit_shape_of(model)
    blocks = shape.blocks
    out: dict = {}
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=600) as coord:
        dits = {m: sequence_parallel_dit(model, ["cpu"] * world, coord, sp_mode=node_mode(m, world, head_dim))
                for m in MODES}

        def forward(mode):
            coord.run(lambda rank, comm: torch.set_num_threads(rank_threads))
            dits[mode](x, t, ctx)

        counts = {}
        for mode in MODES:  # also each mode's warm-up
            coord.reset_byte_counts()
            timed(lambda: forward(mode))
            counts[mode] = coord.byte_counts()
        tokens = sum(dits["allgather"].tokens_per_rank())
        used = {m: {s.strategy.name for s in dits[m].fan_out.runner.last_rank_states} for m in MODES}
        if used != {m: {m} for m in MODES}:
            raise RuntimeError(f"the ranks ran {used}, not the modes asked")
        if world in args.byte_worlds:
            per_rank = attention_bytes(counts, blocks)
            measured = {m: max(per_rank[m]) / blocks for m in MODES}
            modelled = {m: model_bytes(m, tokens, world, head_dim) for m in MODES}
            out[f"ulysses_vs_allgather_bytes_w{world}"] = round(measured["ulysses"] / measured["allgather"], 4)
            out[f"ulysses_vs_allgather_bytes_model_w{world}"] = round(modelled["ulysses"] / modelled["allgather"], 4)
            out[f"bytes_w{world}"] = {
                "allgather_per_block": int(measured["allgather"]), "ulysses_per_block": int(measured["ulysses"]),
                "allgather_model": modelled["allgather"], "ulysses_model": modelled["ulysses"],
                "two_over_w": round(2 / world, 4), "final_rows_rank0": per_rank["final_rows"][0],
                "calls_rank1": {m: counts[m][1]["by_op"] for m in MODES}}
            out[f"rank0_by_op_w{world}"] = {m: counts[m][0]["by_op"] for m in MODES}
        if world in args.memory_worlds:
            out.update(memory(coord, dits, forward, shape, tokens, world))
        if world in args.time_worlds:
            out.update(thread_times(coord, forward, world, args.rounds))
        out[f"threads_per_rank_w{world}"] = rank_threads
        out["tokens"] = tokens
    return out


def memory(coord, dits, forward, shape, tokens: int, world: int) -> dict:
    measured, buffers = {}, {}
    for mode in MODES:
        trackers = [LiveStorageBytes() for _ in range(world)]
        held = [0] * world
        strategies = [s.strategy for s in dits[mode].fan_out.runner.last_rank_states]
        with watched_exchange_buffers(strategies, held), tracked_ranks(coord, trackers):
            timed(lambda: forward(mode))
        measured[mode], buffers[mode] = max(m.peak for m in trackers), max(held)
    estimate = {m: activation_bytes(shape, tokens, world, ITEMSIZE, mode=m) for m in MODES}
    exchange = {m: exchanged_bytes(shape, tokens, world, ITEMSIZE, mode=m) for m in MODES}
    return {f"activation_estimate_bytes_w{world}": estimate,
            f"activation_measured_bytes_w{world}": measured,
            f"activation_measured_vs_estimate_w{world}": {m: round(measured[m] / estimate[m], 3) for m in MODES},
            f"exchange_buffers_estimate_bytes_w{world}": exchange,
            f"exchange_buffers_measured_bytes_w{world}": buffers,
            f"exchange_buffers_measured_vs_estimate_w{world}": {m: round(buffers[m] / exchange[m], 3)
                                                                for m in MODES}}


def thread_times(coord, forward, world: int, rounds: int) -> dict:
    times = {m: [] for m in MODES}
    shares = {m: [] for m in MODES}
    ratios = []
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            with collective_clock(coord, rank=0) as clock:
                times[mode].append(timed(lambda: forward(mode)))
            shares[mode].append(clock["s"] / times[mode][-1])
        ratios.append(times["ulysses"][-1] / times["allgather"][-1])
        print(f"  threads W={world} round {r + 1}/{rounds}: " +
              ", ".join(f"{m} {times[m][-1]:.3f} s" for m in MODES), flush=True)
    return {f"ulysses_vs_allgather_step_ratio_threads_w{world}": round(statistics.median(ratios), 4),
            f"step_ratios_threads_w{world}": [round(x, 4) for x in ratios],
            f"step_s_threads_w{world}": {m: round(statistics.median(v), 4) for m, v in times.items()},
            f"exchange_share_threads_w{world}": {m: round(statistics.median(v), 3) for m, v in shares.items()}}


# ----------------------------------------------------------------------------- processes

def processes_world(path: str, world: int, x, t, ctx, args, head_dim: int) -> dict:
    recipe = ModelRecipe("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint", {"path": path})
    times = {m: [] for m in MODES}
    shares = {m: [] for m in MODES}
    rank0 = {}
    ratios = []
    for r in range(args.process_rounds):
        medians = {}
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            pool = WorkerPool(["cpu"] * world, recipe, node_mode(mode, world, head_dim), timeout_s=600).start()
            try:
                timed(lambda: pool.forward(x, t, ctx))  # warm-up
                before = pool.comm.byte_counts()["by_op"]
                mine = []
                for i in range(args.forwards):
                    with collective_clock(pool.comm) as clock:
                        mine.append(timed(lambda: pool.forward(x, t, ctx)))
                    shares[mode].append(clock["s"] / mine[-1])
                    if i == 0:
                        after = pool.comm.byte_counts()["by_op"]
                        rank0[mode] = {op: {k: after[op][k] - before.get(op, {}).get(k, 0) for k in after[op]}
                                       for op in after}
            finally:
                pool.close()
            times[mode] += mine
            medians[mode] = statistics.median(mine)
        ratios.append(medians["ulysses"] / medians["allgather"])
        print(f"  processes W={world} round {r + 1}/{args.process_rounds}: " +
              ", ".join(f"{m} {medians[m]:.3f} s" for m in MODES), flush=True)
    return {f"ulysses_vs_allgather_step_ratio_processes_w{world}": round(statistics.median(ratios), 4),
            f"step_ratios_processes_w{world}": [round(x, 3) for x in ratios],
            f"step_s_processes_w{world}": {m: round(statistics.median(v), 4) for m, v in times.items()},
            f"exchange_share_processes_w{world}": {m: round(statistics.median(v), 3) for m, v in shares.items()},
            f"processes_rank0_by_op_w{world}": rank0}


# ----------------------------------------------------------------------------- main

def allgather_faster(ratios: list) -> bool | None:
    """Whether the rounds' Ulysses / all-gather ratios say the all-gather is faster; None when
    1.0 lies between their quartiles (three rounds or more): the load's swing, not the modes."""
    if len(ratios) >= 3:
        low, _, high = statistics.quantiles(ratios, n=4)
        if low <= 1.0 <= high:
            return None
    return statistics.median(ratios) > 1


def print_threads(world: int, found: dict) -> None:
    """The human lines of one W's rank-thread figures."""
    if f"bytes_w{world}" in found:
        b = found[f"bytes_w{world}"]
        print(f"W={world} bytes per block, busiest rank: allgather {b['allgather_per_block']:,} "
              f"(model {b['allgather_model']:,}), ulysses {b['ulysses_per_block']:,} "
              f"(model {b['ulysses_model']:,}); ulysses/allgather {found[f'ulysses_vs_allgather_bytes_w{world}']} "
              f"measured, {found[f'ulysses_vs_allgather_bytes_model_w{world}']} model, {b['two_over_w']} = 2/W",
              flush=True)
    if f"activation_measured_bytes_w{world}" in found:
        for m in MODES:
            est, got = (found[f"activation_estimate_bytes_w{world}"][m],
                        found[f"activation_measured_bytes_w{world}"][m])
            xe, xg = (found[f"exchange_buffers_estimate_bytes_w{world}"][m],
                      found[f"exchange_buffers_measured_bytes_w{world}"][m])
            print(f"W={world} {m} memory per rank: activations estimate {est:,} measured {got:,} ({got / est:.2f}); "
                  f"exchange buffers estimate {xe:,} measured {xg:,} ({xg / xe:.2f})", flush=True)
    if f"step_s_threads_w{world}" in found:
        print(f"W={world} threads step: {found[f'step_s_threads_w{world}']}, ulysses/allgather "
              f"{found[f'ulysses_vs_allgather_step_ratio_threads_w{world}']}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smallest run (the test's): " + " ".join(QUICK))
    parser.add_argument("--video-rows", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="rank threads: alternating rounds")
    parser.add_argument("--process-rounds", type=int, default=3, help="processes: rounds of one pool per mode")
    parser.add_argument("--forwards", type=int, default=3, help="processes: timed forwards per pool")
    parser.add_argument("--byte-worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--time-worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--memory-worlds", type=int, nargs="+", default=[4, 8])
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args((QUICK if "--quick" in argv else []) + argv)
    worlds = sorted({*args.byte_worlds, *args.time_worlds, *args.memory_worlds})
    if any(w < 2 or HEADS % w for w in worlds):
        parser.error(f"every world must be at least 2 and divide the {HEADS} heads")
    if min(args.rounds, args.process_rounds, args.forwards, args.blocks, args.video_rows) < 1 or args.head_dim < 16:
        parser.error("--rounds, --process-rounds, --forwards, --blocks and --video-rows: at least 1; "
                     "--head-dim: at least 16")

    started = time.perf_counter()
    cfg = bench_config(args.blocks, args.head_dim, args.hidden)
    model = build_miniature(cfg, seed=0)
    x, t, ctx, _ = inputs(args.video_rows, cfg, TEXT_TOKENS, AUDIO_FRAMES)
    cores = os.cpu_count() or 1
    summary: dict = {"bench": "sp_modes", "model": f"miniature H3, {args.blocks} blocks, hidden {args.hidden}, "
                     f"{HEADS} heads x {args.head_dim}, fp32, CPU ranks", "cores": cores,
                     "oversubscribed_worlds": [w for w in worlds if w > cores]}
    for world in worlds:
        found = threads_world(model, world, x, t, ctx, args, args.head_dim)
        summary.update(found)
        print_threads(world, found)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "miniature.safetensors")
        save_miniature(model, path)
        for world in args.time_worlds:
            found = processes_world(path, world, x, t, ctx, args, args.head_dim)
            summary.update(found)
            print(f"W={world} processes step: {found[f'step_s_processes_w{world}']}, ulysses/allgather "
                  f"{found[f'ulysses_vs_allgather_step_ratio_processes_w{world}']}", flush=True)
    for world in args.time_worlds:  # the same collectives on rank 0 either way
        threads, processes = summary.pop(f"rank0_by_op_w{world}", None), summary.pop(f"processes_rank0_by_op_w{world}")
        if threads is not None:
            summary[f"processes_rank0_bytes_match_threads_w{world}"] = all(
                received({"by_op": threads[m]}, op) == received({"by_op": processes[m]}, op)
                for m in MODES for op in {*threads[m], *processes[m]})
    for world in (2, 4):
        ratios = summary.get(f"step_ratios_threads_w{world}")
        if ratios is not None:
            faster = allgather_faster(ratios)
            summary[f"cpu_threads_allgather_faster_w{world}"] = faster
            said = {True: "shorter", False: "longer", None: "not told apart (1.0 inside the rounds' quartiles)"}
            print(f"CPU rank threads, W={world}: the all-gather's step is {said[faster]}: Ulysses / all-gather "
                  f"{summary[f'ulysses_vs_allgather_step_ratio_threads_w{world}']} (rounds {ratios})", flush=True)
    for key in [k for k in summary if k.startswith("rank0_by_op_w")]:
        del summary[key]  # compared above where both ran
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
