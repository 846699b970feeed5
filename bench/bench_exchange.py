#!/usr/bin/env python3
"""The exchanges of sequence-parallel attention against raw collectives of the same bytes.

Every figure is a ratio of times measured side by side in one run (rounds interleaved, medians).

Two gloo processes (one rank each, `DistributedComm`, cores/2 intra-op threads each), H3's shapes
(56 heads x 128, bf16, S = --seq packed rows; q/k/v are [1, 56, S_r, 128] views of each rank's
fused qkv rows [S_r, 3 x 7168], as H3's attention makes them):
  h3_layout_allgather_vs_raw   the K/V all-gather the allgather mode runs per block (one
                               exchange of K and V with the shard plan and the forward's
                               buffers, as the SP adapter drives it) / two raw
                               `all_gather_into_tensor` of the same bytes, sequence-major and dense
  h3_layout_allgather_vs_raw_p2p   the same / raw isend-irecv of those dense bytes straight into
                               place (the transport's own best; ours goes point to point on gloo)
  ulysses_vs_raw_all_to_all    the Ulysses exchange of one block as the SP adapter drives it
                               (q, k, v in, the attention output back as the [1, S_r, H x D]
                               tensor the caller gets; the shard plan known, the forward's
                               buffers; the attention replaced by a ready output) / two raw
                               `all_to_all_single` of the same bytes, packed in advance (q, k, v
                               in one, the output in the other): median of the per-round ratios,
                               with their interquartile range in `..._spread`; `..._per_tensor`
                               against four raw calls (q, k, v and the output apart)
  ulysses_separate_qk_vs_raw_all_to_all   the same with q and k as separate tensors and v a
                               view of the fused rows (how H3's attention hands them over: its RMS
                               norm and RoPE make new q and k): the path that packs the peers'
                               head blocks here and writes its own straight into the result;
                               target 1.15 (median) too
  ulysses_collectives_per_block   collectives ours runs per block (one per tensor of each
                               all_to_all_v: a library call on NCCL/HCCL, a set of point-to-point
                               transfers on gloo); target 2
  ulysses_vs_raw_p2p           the same / raw isend-irecv of those packed tensors
  ulysses_vs_raw_p2p_plus_layout_copies   the same / (raw isend-irecv + the copies H3's layout
                               forces on any Ulysses over transports that take dense buffers:
                               q/k/v's peer head blocks packed, the output's peer heads put
                               back in place; timed alone): how far ours is from that floor
  ulysses_vs_yunchang          the same against yunchang's all_to_all_4D, when yunchang is
                               installed (else reported skipped, not faked)
In-process rank threads (W = 2 and 4, the peer backend and the fake HCCL library):
  peer_vs_copy_bound           the K/V exchange (shard plan and buffers as the SP adapter
                               passes them) / one dense copy of the same output bytes per rank
                               (what any exchange has to write at least)
  barrier_us                   the fixed cost of one exchange of a tiny tensor at W = 4

Prints one JSON object on the last line.

  .venv/bin/python bench/bench_exchange.py [--seq 16384] [--iters 2] [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from comfy.multidevice.comm.group import SequenceParallelCoordinator  # noqa: E402
from comfy.multidevice.comm.layout import displacements  # noqa: E402
from comfy.multidevice.sp.plan import shard_sizes  # noqa: E402
from tests.fakes.build import build_fake  # noqa: E402

HEADS, HEAD_DIM = 56, 128
WIDTH = HEADS * HEAD_DIM
TARGETS = {"h3_layout_allgather_vs_raw": 1.10, "ulysses_vs_raw_all_to_all": 1.15,
           "ulysses_separate_qk_vs_raw_all_to_all": 1.15,  # H3's own hand-over (its median)
           "ulysses_collectives_per_block": 2}


def _figure(value):
    """A target's figure: the value, or the median of a spread."""
    return value["median"] if isinstance(value, dict) else value


# ----------------------------------------------------------------------------- two processes

def _h3_qkv(rows: int, seed: int):
    """q, k, v as H3's attention hands them over: [1, H, S_r, D] views of fused qkv rows."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, 3 * WIDTH, generator=gen).to(torch.bfloat16)
    return [qkv[:, i * WIDTH:(i + 1) * WIDTH].view(rows, HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)
            for i in range(3)]


def _timed(dist, fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _process(rank: int, world: int, init_file: str, seq: int, iters: int, rounds: int, out_file: str):
    import torch.distributed as dist

    from comfy.multidevice.comm.torch_dist import init_process_group
    from comfy.multidevice.sp.strategies import AllGatherKV
    from comfy.multidevice.sp.ulysses import UlyssesKV

    from comfy.multidevice.sp import attention_budget

    # The attention is replaced by a ready output here, so the CPU ranks' attention budget
    # (row pieces sized from the free RAM, joined by a copy) has nothing to bound: the
    # exchange alone is timed, as on a card.
    attention_budget.available_memory_bytes = lambda: None
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    comm = init_process_group(rank, world, "cpu", init_method=f"file://{init_file}", backend="gloo")
    sizes = shard_sizes(seq, world)
    rows = sizes[rank]
    q, k, v = _h3_qkv(rows, seed=rank)

    # the allgather mode's exchange as the SP adapter drives it: the shard plan known, the
    # buffers kept for the forward's blocks; the attention replaced by nothing
    allgather = AllGatherKV()
    allgather.begin_forward()

    def ours_allgather():
        allgather.attend(comm, lambda *a, **kw: None, q, k, v, HEADS, skip_reshape=True,
                         shard_sizes=sizes)

    raw_k = k[0].transpose(0, 1).contiguous()  # [S_r, H, D], the same bytes, dense
    raw_v = v[0].transpose(0, 1).contiguous()
    gathered = [torch.empty(seq, HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]

    def raw_allgather():
        for out, send in zip(gathered, (raw_k, raw_v)):
            dist.all_gather_into_tensor(out, send)

    peers = [(rank + step) % world for step in range(1, world)]  # ring order
    offsets = displacements(sizes)

    def raw_p2p_allgather():  # the same dense bytes by isend/irecv straight into place
        works = [dist.irecv(out[offsets[j]:offsets[j] + sizes[j]], j, tag=i)
                 for i, out in enumerate(gathered) for j in peers]
        for i, (out, send) in enumerate(zip(gathered, (raw_k, raw_v))):
            out[offsets[rank]:offsets[rank] + rows].copy_(send)  # the own part, as the collective copies it
            works += [dist.isend(send, j, tag=i) for j in peers]
        for work in works:
            work.wait()

    # Ulysses in + out as the SP adapter drives it (the shard plan known, the forward's buffers
    # kept); the attention is replaced by a ready output of its shape
    heads_mine = HEADS // world
    ready = torch.empty(1, seq, heads_mine * HEAD_DIM, dtype=torch.bfloat16)
    ulysses = UlyssesKV()
    ulysses.begin_forward()

    def ours_ulysses():
        ulysses.attend(comm, lambda *a, **kw: ready, q, k, v, HEADS, skip_reshape=True, shard_sizes=sizes)

    # H3's real hand-over: q and k are new tensors (its RMS norm and RoPE write them), v a view
    # of the fused qkv rows; these take the path that packs them into one buffer
    q_own, k_own = (t[0].transpose(0, 1).contiguous().transpose(0, 1).unsqueeze(0) for t in (q, k))
    separate = UlyssesKV()
    separate.begin_forward()

    def ours_ulysses_separate():
        separate.attend(comm, lambda *a, **kw: ready, q_own, k_own, v, HEADS, skip_reshape=True, shard_sizes=sizes)

    packed_in = [torch.empty(world, rows, heads_mine, HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)]
    for packed, t in zip(packed_in, (q, k, v)):  # packed in advance: what the raw call is given
        packed.copy_(t[0].transpose(0, 1).reshape(rows, world, heads_mine, HEAD_DIM).transpose(0, 1))
    recv_in = [torch.empty(seq * heads_mine * HEAD_DIM, dtype=torch.bfloat16) for _ in range(3)]
    in_splits = [n * heads_mine * HEAD_DIM for n in sizes]
    out_send = ready.view(-1)
    recv_out = torch.empty(rows * HEADS * HEAD_DIM, dtype=torch.bfloat16)

    def raw_ulysses_per_tensor():  # q, k, v and the output: four calls
        for packed, recv in zip(packed_in, recv_in):
            dist.all_to_all_single(recv, packed.view(-1), output_split_sizes=in_splits,
                                   input_split_sizes=[rows * heads_mine * HEAD_DIM] * world)
        dist.all_to_all_single(recv_out, out_send, output_split_sizes=[rows * heads_mine * HEAD_DIM] * world,
                               input_split_sizes=in_splits)

    # the same bytes in as few calls as ours makes: q/k/v packed together in advance, one call
    # in, one out
    packed_qkv = torch.stack(packed_in, dim=2).contiguous()  # [W, S_r, 3, h, D]
    recv_qkv = torch.empty(3 * seq * heads_mine * HEAD_DIM, dtype=torch.bfloat16)

    def raw_ulysses():
        dist.all_to_all_single(recv_qkv, packed_qkv.view(-1), output_split_sizes=[3 * n for n in in_splits],
                               input_split_sizes=[3 * rows * heads_mine * HEAD_DIM] * world)
        dist.all_to_all_single(recv_out, out_send, output_split_sizes=[rows * heads_mine * HEAD_DIM] * world,
                               input_split_sizes=in_splits)

    chunk = rows * heads_mine * HEAD_DIM  # elements of one packed chunk (every shard is `rows` long here)
    by_chunk = [(j * chunk, chunk) for j in range(world)]        # (offset, count) per rank
    by_rows = [(offsets[j] * heads_mine * HEAD_DIM, n) for j, n in enumerate(in_splits)]

    def p2p_all_to_all(send, send_parts, recv, recv_parts, tag):
        """Start one all-to-all by isend/irecv straight into place; the own part is copied."""
        def part(t, parts, j):
            return t.narrow(0, *parts[j])
        works = [dist.irecv(part(recv, recv_parts, j), j, tag=tag) for j in peers]
        works += [dist.isend(part(send, send_parts, j), j, tag=tag) for j in peers]
        part(recv, recv_parts, rank).copy_(part(send, send_parts, rank))
        return works

    def raw_p2p_ulysses():  # the same packed tensors, q/k/v back to back, then the output
        works = [w for t, (packed, recv) in enumerate(zip(packed_in, recv_in))
                 for w in p2p_all_to_all(packed.view(-1), by_chunk, recv, by_rows, t)]
        for work in works:
            work.wait()
        for work in p2p_all_to_all(out_send, by_rows, recv_out, by_chunk, 3):
            work.wait()

    # the copies H3's layout forces on any Ulysses over dense-buffer transports: each peer's
    # head block of q, k, v packed (strided rows), and the peers' heads of the output put
    # back into their strided place; timed alone
    layout_bufs = [torch.empty(rows, heads_mine, HEAD_DIM, dtype=torch.bfloat16) for _ in range(4)]
    layout_out = torch.empty(1, rows, HEADS, HEAD_DIM, dtype=torch.bfloat16)

    def layout_copies():
        for j in peers:
            heads_j = slice(j * heads_mine, (j + 1) * heads_mine)
            for buf, t in zip(layout_bufs, (q, k, v)):
                buf.copy_(t[0, heads_j].transpose(0, 1))
            layout_out[0, :, heads_j].copy_(layout_bufs[3])

    runs = {"ours_allgather": ours_allgather, "raw_allgather": raw_allgather,
            "raw_p2p_allgather": raw_p2p_allgather, "ours_ulysses": ours_ulysses,
            "ours_ulysses_separate": ours_ulysses_separate,
            "raw_ulysses": raw_ulysses, "raw_ulysses_per_tensor": raw_ulysses_per_tensor,
            "raw_p2p_ulysses": raw_p2p_ulysses, "ulysses_layout_copies": layout_copies}
    yunchang = importlib.util.find_spec("yunchang") is not None
    if yunchang:
        from yunchang.comm.all_to_all import all_to_all_4D  # optional comparison

        def yunchang_ulysses():
            qs = [t.transpose(1, 2) for t in (q, k, v)]  # its layout: [B, S_r, H, D]
            outs = [all_to_all_4D(t, scatter_idx=2, gather_idx=1) for t in qs]
            all_to_all_4D(ready.view(1, seq, heads_mine, HEAD_DIM), scatter_idx=1, gather_idx=2)
            return outs
        runs["yunchang_ulysses"] = yunchang_ulysses

    for fn in runs.values():  # warm-up (allocator, gloo pairs, the shape round of the plan)
        fn()
    counting = _CollectiveCounter(comm)  # one more block, counted
    ulysses.attend(counting, lambda *a, **kw: ready, q, k, v, HEADS, skip_reshape=True, shard_sizes=sizes)
    times = {name: [] for name in runs}
    for _ in range(rounds):  # the methods alternate inside every round
        for name, fn in runs.items():
            times[name].append(_timed(dist, lambda: [fn() for _ in range(iters)]) / iters)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"times": times, "yunchang": yunchang,
                                              "ulysses_collectives_per_block": counting.collectives}))
    comm.close()


class _CollectiveCounter:
    """A rank's comm that counts the collectives the transport runs: one per tensor of an
    all_to_all_v (one library call on NCCL/HCCL, one set of point-to-point transfers on gloo)."""

    def __init__(self, comm):
        self.comm, self.rank, self.world_size, self.device = comm, comm.rank, comm.world_size, comm.device
        self.collectives = 0

    def all_to_all_v(self, tensors, *args, **kwargs):
        self.collectives += 1 if torch.is_tensor(tensors) else len(tensors)
        return self.comm.all_to_all_v(tensors, *args, **kwargs)


def _ratio_spread(times: dict, ours: str, baseline: str) -> dict:
    """Per-round ratios (both timed in the same round): median and interquartile range."""
    ratios = sorted(a / b for a, b in zip(times[ours], times[baseline]))
    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
    return {"median": round(statistics.median(ratios), 3),
            "iqr": [round(quartiles[0], 3), round(quartiles[2], 3)], "rounds": len(ratios)}


def measure_processes(seq: int, iters: int, rounds: int, world: int = 2) -> dict:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file, out_file = os.path.join(tmp, "init"), os.path.join(tmp, "result.json")
        mp.start_processes(_process, args=(world, init_file, seq, iters, rounds, out_file),
                           nprocs=world, join=True, start_method="spawn")
        recorded = json.loads(Path(out_file).read_text())
    times = recorded["times"]
    t = {name: statistics.median(values) for name, values in times.items()}
    kv_bytes = 2 * seq * WIDTH * 2  # K and V gathered, bf16, per rank
    ulysses_spread = _ratio_spread(times, "ours_ulysses", "raw_ulysses")
    result = {
        "processes": world, "seq": seq, "seconds": {k: round(v, 4) for k, v in t.items()},
        "h3_layout_allgather_vs_raw": round(t["ours_allgather"] / t["raw_allgather"], 3),
        "raw_allgather_gbps": round(kv_bytes / t["raw_allgather"] / 1e9, 3),
        "h3_layout_allgather_vs_raw_p2p": round(t["ours_allgather"] / t["raw_p2p_allgather"], 3),
        "ulysses_vs_raw_all_to_all": ulysses_spread["median"],
        "ulysses_vs_raw_all_to_all_spread": ulysses_spread,
        "ulysses_vs_raw_all_to_all_per_tensor": _ratio_spread(times, "ours_ulysses", "raw_ulysses_per_tensor"),
        "ulysses_collectives_per_block": recorded["ulysses_collectives_per_block"],
        "ulysses_separate_qk_vs_raw_all_to_all": _ratio_spread(times, "ours_ulysses_separate", "raw_ulysses"),
        "ulysses_vs_raw_p2p": round(t["ours_ulysses"] / t["raw_p2p_ulysses"], 3),
        # the floor for H3's layout on dense-buffer transports: raw p2p plus the forced copies
        "ulysses_vs_raw_p2p_plus_layout_copies": round(
            t["ours_ulysses"] / (t["raw_p2p_ulysses"] + t["ulysses_layout_copies"]), 3),
        "raw_all_to_all_vs_raw_p2p_plus_layout_copies": round(
            t["raw_ulysses"] / (t["raw_p2p_ulysses"] + t["ulysses_layout_copies"]), 3),
    }
    result["ulysses_vs_yunchang"] = (round(t["ours_ulysses"] / t["yunchang_ulysses"], 3) if recorded["yunchang"]
                                     else "skipped: yunchang is not installed")
    return result


# ----------------------------------------------------------------------------- rank threads

def timed_loop(coord, iters: int, body) -> float:
    """Seconds per iteration of body(rank, comm), timed between two barriers (slowest rank)."""

    def job(rank, comm):
        body(rank, comm)  # warm-up, also allocates
        comm.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            body(rank, comm)
        comm.barrier()
        return (time.perf_counter() - start) / iters

    return max(coord.run(job))


def measure_threads(world: int, seq: int, iters: int, rounds: int, hccl_path: str) -> dict:
    sizes = shard_sizes(seq, world)
    qkv = [_h3_qkv(n, seed=r) for r, n in enumerate(sizes)]
    out_bytes = 2 * seq * WIDTH * 2  # gathered K and V, bf16, per rank
    sources = [torch.randn(seq, WIDTH).to(torch.bfloat16) for _ in range(world)]
    targets = [torch.empty_like(s) for s in sources]

    workspaces = [{} for _ in range(world)]  # as the SP adapter keeps them for a forward

    def exchange_body(rank, comm):
        _, k, v = qkv[rank]
        return comm.exchange([k, v], [2, 2], shard_sizes=sizes, workspace=workspaces[rank])

    def copy_bound_body(rank, comm):  # one dense copy of the K and V output bytes
        targets[rank].copy_(sources[rank])
        targets[rank].copy_(sources[rank])

    os.environ["HCCL_SO_PATH"] = hccl_path
    bound_t, peer_t, hccl_t = [], [], []
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer") as peer, \
            SequenceParallelCoordinator(["cpu"] * world, backend="hccl") as hccl:
        threads = max(1, (os.cpu_count() or 1) // world)
        for coord in (peer, hccl):  # per thread (OpenMP): set inside the rank threads
            coord.run(lambda rank, comm: torch.set_num_threads(threads))
        for _ in range(rounds):  # interleaved, so drift in machine load hits all three alike
            bound_t.append(timed_loop(peer, iters, copy_bound_body))
            peer_t.append(timed_loop(peer, iters, exchange_body))
            hccl_t.append(timed_loop(hccl, iters, exchange_body))
    bound_s, peer_s, hccl_s = (statistics.median(t) for t in (bound_t, peer_t, hccl_t))

    def gbps(seconds):  # aggregate: every rank produces out_bytes
        return world * out_bytes / seconds / 1e9

    return {"world_size": world, "bytes_per_rank": out_bytes,
            "copy_bound_gbps": round(gbps(bound_s), 3), "peer_gbps": round(gbps(peer_s), 3),
            "peer_vs_copy_bound": round(peer_s / bound_s, 3),
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


# ----------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384, help="packed sequence length S (default 16384)")
    parser.add_argument("--iters", type=int, default=2, help="timed exchanges per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians are reported")
    parser.add_argument("--tiny-iters", type=int, default=2000, help="exchanges for barrier_us")
    parser.add_argument("--skip-threads", action="store_true", help="only the two-process figures")
    args = parser.parse_args()
    if args.seq < 4 or args.iters < 1 or args.rounds < 1 or args.tiny_iters < 10:
        parser.error("need --seq >= 4, --iters >= 1, --rounds >= 1, --tiny-iters >= 10")

    summary = {"seq": args.seq, "cores": os.cpu_count()}
    processes = measure_processes(args.seq, args.iters, args.rounds)
    print(f"2 gloo processes: {processes}", file=sys.stderr)
    summary.update(processes)
    if not args.skip_threads:
        hccl_path = build_fake("fake_hccl")
        threads = {w: measure_threads(w, args.seq, args.iters, args.rounds, hccl_path) for w in (2, 4)}
        for w, r in threads.items():
            print(f"W={w} rank threads: {r}", file=sys.stderr)
        summary.update({"threads_w2": threads[2], "threads_w4": threads[4],
                        "barrier_us": round(barrier_cost_us(4, args.tiny_iters), 1)})
    summary["targets"] = {k: f"<= {v:.3g}" for k, v in TARGETS.items()}
    summary["targets_met"] = all(_figure(summary[k]) <= v for k, v in TARGETS.items())
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
