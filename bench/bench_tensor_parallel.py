#!/usr/bin/env python3
"""Tensor-parallel text encoder: forward time at W=1 and W=2, and weight bytes per rank.

The miniature Llama/Qwen decoder (tests/qwen_decoder.py) at a size
where the matmuls dominate (default: hidden 1024, 8 query / 2 KV heads of 128, MLP
4096, 4 layers, 256 tokens, fp32). W=1 is the plain single-device model; W=2 splits it
over two CPU "devices" (rank threads) with the peer-copy all-reduce. Every rank runs
with ONE intra-op thread (so W=2 uses two cores and W=1 one; the speedup is what
splitting buys per core added). Runs alternate W=1 / W=2 in each round and the medians
are compared, since a shared machine is noisy.

  .venv/bin/python bench/bench_tensor_parallel.py [--layers 4] [--seq 256] [--rounds 5]

Last stdout line, JSON: speedup_w2 (= W=1 time / W=2 time), weight_bytes_ratio_w2
(= the larger rank's weight bytes / the whole model's), two_thread_bound (the same
machine's speedup for plain matmuls on two threads, measured in the same rounds: the
ceiling for speedup_w2 on this host), the two medians in seconds,
per-rank and total weight bytes, the W=2 result's max relative difference from W=1,
and the sizes used.
"""

from __future__ import annotations

import os

# One intra-op thread per rank, fixed before torch starts its thread pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.tp.decoder import build_tensor_parallel_decoder  # noqa: E402
from comfy.multidevice.tensor_bytes import storage_bytes
from tests.qwen_decoder import MiniatureDecoderConfig, build_miniature_decoder


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=2, help="forwards per timed sample")
    p.add_argument("--rounds", type=int, default=5, help="alternating W=1/W=2 samples")
    return p.parse_args(argv)


def two_thread_bound(embeds: torch.Tensor, cfg, iters: int):
    """A (sequential, concurrent) timing pair for the machine's own two-thread matmul scaling.

    The same MLP-sized matmul work is done twice on one thread, then once on each of two
    threads at the same time. Their ratio is the best speedup W=2 could show here: on a
    shared or hyperthreaded host it is well below 2.
    """
    import threading

    weight = torch.randn(cfg.intermediate_size, cfg.hidden_size)
    x = embeds[0]

    def unit():
        torch.set_num_threads(1)
        for _ in range(iters * cfg.num_hidden_layers):
            torch.nn.functional.linear(x, weight)

    start = time.perf_counter()
    unit()
    unit()
    sequential = time.perf_counter() - start
    threads = [threading.Thread(target=unit) for _ in range(2)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sequential, time.perf_counter() - start


def seconds_per_forward(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)
    cfg = MiniatureDecoderConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim)
    model = build_miniature_decoder(cfg, seed=0)
    embeds = torch.randn(1, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))

    with torch.inference_mode(), SequenceParallelCoordinator(["cpu", "cpu"], backend="peer") as coord:
        coord.run(lambda rank, comm: torch.set_num_threads(1))  # per-thread setting on the ranks
        tp = build_tensor_parallel_decoder(model, coord)
        single = lambda: model(embeds=embeds.clone())[0]  # noqa: E731  (the blocks write in place)
        split = lambda: tp(embeds=embeds)[0]  # noqa: E731
        want, got = single(), split()  # warm-up, and the accuracy figure
        max_rel_diff = ((got - want).abs().max() / want.abs().max()).item()
        w1, w2, bound_seq, bound_par = [], [], [], []
        for _ in range(args.rounds):
            w1.append(seconds_per_forward(single, args.iters))
            w2.append(seconds_per_forward(split, args.iters))
            seq_s, par_s = two_thread_bound(embeds, cfg, args.iters)
            bound_seq.append(seq_s)
            bound_par.append(par_s)
        rank_bytes = [storage_bytes(s) for s in tp.shards]

    total_bytes = storage_bytes(model)
    t1, t2 = statistics.median(w1), statistics.median(w2)
    result = {
        "speedup_w2": round(t1 / t2, 3),
        "weight_bytes_ratio_w2": round(max(rank_bytes) / total_bytes, 4),
        "two_thread_bound": round(statistics.median(bound_seq) / statistics.median(bound_par), 3),
        "seconds_w1": round(t1, 4),
        "seconds_w2": round(t2, 4),
        "weight_bytes_total": total_bytes,
        "weight_bytes_per_rank_w2": rank_bytes,
        "max_rel_diff_w2": max_rel_diff,
        "config": {"hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                   "head_dim": args.head_dim, "intermediate": args.intermediate,
                   "layers": args.layers, "vocab": args.vocab, "seq": args.seq,
                   "dtype": "float32", "threads_per_rank": 1, "rounds": args.rounds,
                   "iters": args.iters},
    }
    print(f"W=1 {t1 * 1e3:.1f} ms, W=2 {t2 * 1e3:.1f} ms per forward (this machine's two-thread "
          f"matmul bound: {result['two_thread_bound']}x); rank weights "
          f"{max(rank_bytes) / 2**20:.1f} of {total_bytes / 2**20:.1f} MiB")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
