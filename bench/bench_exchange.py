#!/usr/bin/env python3
"""Exchange throughput of the coordinator's backends against the memory-copy bound.

W rank threads each hold a K and a V shard shaped like H3's ([S/W, 56, 128], bf16) and
all-gather them. The bound is the same output bytes produced by torch.cat of local
tensors in the same threads. Also measures the fixed cost of one exchange of tiny
tensors at W=4 (`barrier_us`). Prints one JSON object on the last line.

  .venv/bin/python bench/bench_exchange.py [--seq 16384] [--iters 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from tests.fakes.build import build_fake  # noqa: E402

HEADS, HEAD_DIM = 56, 128


def shard_rows(seq: int, world: int, rank: int) -> int:
    return seq * (rank + 1) // world - seq * rank // world


def timed_loop(coord, iters: int, body) -> float:
    """Seconds per iteration of body(rank, comm, state), timed between two barriers."""

    def job(rank, comm):
        state = body(rank, comm, None)  # warm-up, also allocates
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            body(rank, comm, state)
        comm.barrier()
        return (time.perf_counter() - start) / iters

    return max(coord.run(job))


def kv_shards(seq: int, world: int):
    shards = []
    for r in range(world):
        rows = shard_rows(seq, world, r)
        shards.append((torch.randn(rows, HEADS, HEAD_DIM).to(torch.bfloat16),
                       torch.randn(rows, HEADS, HEAD_DIM).to(torch.bfloat16)))
    return shards


def measure(world: int, seq: int, iters: int, rounds: int, hccl_path: str) -> dict:
    shards = kv_shards(seq, world)
    out_bytes = 2 * seq * HEADS * HEAD_DIM * 2  # gathered K and V, bf16, per rank

    def exchange_body(rank, comm, state):
        k, v = shards[rank]
        return comm.exchange([k, v], [0, 0])

    # Copy bound: each rank builds the same full-size K and V from W local pieces.
    local_pieces = [[(k.clone(), v.clone()) for k, v in shards] for _ in range(world)]

    def memcpy_body(rank, comm, state):
        pieces = local_pieces[rank]
        return (torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]))

    os.environ["HCCL_SO_PATH"] = hccl_path
    memcpy_t, peer_t, hccl_t = [], [], []
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer") as peer, \
            SequenceParallelCoordinator(["cpu"] * world, backend="hccl") as hccl:
        for _ in range(rounds):  # interleaved, so drift in machine load hits all three alike
            memcpy_t.append(timed_loop(peer, iters, memcpy_body))
            peer_t.append(timed_loop(peer, iters, exchange_body))
            hccl_t.append(timed_loop(hccl, iters, exchange_body))
    memcpy_s, peer_s, hccl_s = (statistics.median(t) for t in (memcpy_t, peer_t, hccl_t))

    def gbps(seconds):  # aggregate: every rank produces out_bytes
        return world * out_bytes / seconds / 1e9

    return {"world_size": world, "bytes_per_rank": out_bytes,
            "memcpy_gbps": round(gbps(memcpy_s), 3), "peer_gbps": round(gbps(peer_s), 3),
            "peer_vs_memcpy": round(memcpy_s / peer_s, 3),
            "hccl_fake_gbps": round(gbps(hccl_s), 3)}


def barrier_cost_us(world: int, iters: int) -> float:
    tiny = torch.zeros(1)
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer") as coord:
        def job(rank, comm):
            samples = []
            for _ in range(iters):
                start = time.perf_counter()
                comm.exchange([tiny], 0)
                samples.append(time.perf_counter() - start)
            return samples
        samples = coord.run(job)
    per_iter = [max(s[i] for s in samples) for i in range(iters)]  # slowest rank per exchange
    return statistics.median(per_iter[iters // 10:]) * 1e6  # skip warm-up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384, help="packed sequence length S (default 16384)")
    parser.add_argument("--iters", type=int, default=5, help="timed exchanges per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--tiny-iters", type=int, default=2000, help="exchanges for barrier_us")
    args = parser.parse_args()
    if args.seq < 4 or args.iters < 1 or args.rounds < 1 or args.tiny_iters < 10:
        parser.error("need --seq >= 4, --iters >= 1, --rounds >= 1, --tiny-iters >= 10")

    hccl_path = build_fake("fake_hccl")
    results = {}
    for world in (2, 4):
        results[world] = measure(world, args.seq, args.iters, args.rounds, hccl_path)
        print(f"W={world}: {results[world]}", file=sys.stderr)
    barrier_us = barrier_cost_us(4, args.tiny_iters)
    summary = dict(results[4])
    summary.update({
        "seq": args.seq,
        "threads": torch.get_num_threads(),
        "w2": results[2],
        "barrier_us": round(barrier_us, 1),
        "targets": {"peer_vs_memcpy": ">= 0.7", "barrier_us": "<= 200"},
        "targets_met": summary["peer_vs_memcpy"] >= 0.7 and barrier_us <= 200,
    })
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
