#!/usr/bin/env python3
"""Building W rank replicas from one shared read-only base vs. each rank loading the file.

Writes a synthetic BF16 checkpoint (--size-mb) into a temporary directory, then measures
each method in a fresh subprocess with W CPU rank threads:

  naive       every rank calls safetensors.torch.load_file(path, backend="pread") and keeps
              its copy: W reads, W copies in RAM
  naive_mmap  the same with load_file's default mmap backend (copy-on-write mapping of the
              file; pages become resident as they are touched)
  shared      every rank calls SharedCheckpoint.open(path) (one read in the process) and
              builds its RankReplica hot cache from it; then --reloads unload/reload cycles

In every method each rank then checksums every byte of its replica (what moving it to a
device would touch); build_seconds_* includes that. Peak resident memory is the child's
ru_maxrss; peak_rss_ratio_* = (peak RSS - RSS before loading) / file size, so the
interpreter and torch themselves are not counted. The file is freshly written, so every
method reads it from the page cache. Prints one JSON object on the last line; the
temporary directory is removed.

  .venv/bin/python bench/bench_weights.py [--size-mb 2048] [--ranks 4] [--reloads 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from comfy.multidevice.weights.safetensors_header import DTYPE_TO_SAFETENSORS  # noqa: E402

HIDDEN = 4096
BLOCKS = 16
CHILD_TIMEOUT_S = 3600


# ----------------------------------------------------------------------------- synthetic file

def synthetic_layout(size_bytes: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """BLOCKS big BF16 matrices (the bulk of the bytes) plus small FP32 norms, like a DiT."""
    rows = max(1, size_bytes // (BLOCKS * HIDDEN * 2))
    layout = []
    for i in range(BLOCKS):
        layout.append((f"blocks.{i}.mlp.fc1.weight", torch.bfloat16, (rows, HIDDEN)))
        layout.append((f"blocks.{i}.norm1.weight", torch.float32, (HIDDEN,)))
    return layout


def write_synthetic(path: Path, size_bytes: int, seed: int = 0) -> None:
    """Stream a safetensors file tensor by tensor (never the whole state dict in memory)."""
    layout = synthetic_layout(size_bytes)
    header, offset = {"__metadata__": {"format": "pt", "source": "bench_weights synthetic"}}, 0
    for name, dtype, shape in layout:
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": DTYPE_TO_SAFETENSORS[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    gen = torch.Generator().manual_seed(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, dtype, shape in layout:
            t = torch.empty(shape, dtype=dtype).normal_(generator=gen)
            f.write(t.view(-1).view(torch.uint8).numpy())


# ----------------------------------------------------------------------------- child side

def current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def checksum(state: dict[str, torch.Tensor]) -> int:
    """Integer checksum of the raw bits of every tensor: touches every byte, allocates nothing
    big (the bytes are read as int64 words; wrap-around addition is order-independent)."""
    total = 0
    for name in sorted(state):
        raw = state[name].reshape(-1).view(torch.uint8)
        words = raw.numel() // 8 * 8
        if words and raw.storage_offset() % 8 == 0:
            part = int(raw[:words].view(torch.int64).sum()) + int(raw[words:].to(torch.int64).sum())
        else:
            part = int(raw.to(torch.int64).sum())
        total = (total * 1_000_003 + part) % (1 << 61)
    return total


def load_naive(path: str, backend: str) -> dict[str, torch.Tensor]:
    import inspect

    from safetensors.torch import load_file
    if "backend" in inspect.signature(load_file).parameters:
        return load_file(path, backend=backend)
    if backend != "mmap":
        raise RuntimeError(f"this safetensors has no {backend!r} backend; install the pinned version")
    return load_file(path)


def run_child(method: str, path: str, ranks: int, reloads: int) -> dict:
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.weights.replicas import RankReplica, model_stage_unload
    from comfy.multidevice.weights.checkpoint import SharedCheckpoint, total_bytes_read

    def build(rank, comm):
        if method == "shared":
            state = RankReplica(SharedCheckpoint.open(path), comm.device, rank=rank).load()
            return state, checksum(state.state_dict())
        state = load_naive(path, "pread" if method == "naive" else "mmap")
        return state, checksum(state)

    result: dict = {"method": method}
    with SequenceParallelCoordinator(["cpu"] * ranks, backend="peer", timeout_s=CHILD_TIMEOUT_S) as coord:
        baseline = current_rss_bytes()
        read_before = total_bytes_read()
        start = time.perf_counter()
        built = coord.run(build)
        result["build_seconds"] = time.perf_counter() - start
        if method == "shared":
            replicas = [state for state, _ in built]
            result["bytes_read"] = total_bytes_read() - read_before
            after_build = total_bytes_read()
            for _ in range(reloads):
                model_stage_unload(replicas)
                coord.run(lambda rank, comm: replicas[rank].load() and None)
            result["reload_bytes_read"] = total_bytes_read() - after_build
            result["sources"] = len({id(r.base) for r in replicas})
        result["peak_rss_bytes"] = peak_rss_bytes()
        result["baseline_rss_bytes"] = baseline
        sums = {cs for _, cs in built}
        result["ranks_identical"] = len(sums) == 1
        result["checksum"] = sums.pop()
    return result


# ----------------------------------------------------------------------------- parent side

def measure(method: str, path: Path, ranks: int, reloads: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, "--path", str(path),
           "--ranks", str(ranks), "--reloads", str(reloads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{method} child failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=2048, help="synthetic checkpoint size in MiB")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reloads", type=int, default=3, help="unload/reload cycles of the shared base")
    parser.add_argument("--child", choices=("naive", "naive_mmap", "shared"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.path, args.ranks, args.reloads)))
        return 0
    if args.size_mb < 1 or args.ranks < 1 or args.reloads < 0:
        parser.error("--size-mb and --ranks must be positive, --reloads non-negative")

    with tempfile.TemporaryDirectory(prefix="bench_weights_") as tmp:
        path = Path(tmp) / "synthetic.safetensors"
        write_synthetic(path, args.size_mb << 20)
        file_bytes = path.stat().st_size
        naive = measure("naive", path, args.ranks, args.reloads)
        naive_mmap = measure("naive_mmap", path, args.ranks, args.reloads)
        shared = measure("shared", path, args.ranks, args.reloads)

    def rss_ratio(r: dict) -> float:
        return round((r["peak_rss_bytes"] - r["baseline_rss_bytes"]) / file_bytes, 3)

    summary = {
        "file_bytes": file_bytes,
        "ranks": args.ranks,
        "reloads": args.reloads,
        "bytes_read": shared["bytes_read"],
        "read_ratio": round(shared["bytes_read"] / file_bytes, 4),
        "reload_bytes_read": shared["reload_bytes_read"],
        "shared_sources": shared["sources"],
        "peak_rss_ratio_shared": rss_ratio(shared),
        "peak_rss_ratio_naive": rss_ratio(naive),
        "peak_rss_ratio_naive_mmap": rss_ratio(naive_mmap),
        "peak_rss_bytes_shared": shared["peak_rss_bytes"],
        "peak_rss_bytes_naive": naive["peak_rss_bytes"],
        "baseline_rss_bytes_shared": shared["baseline_rss_bytes"],
        "baseline_rss_bytes_naive": naive["baseline_rss_bytes"],
        "build_seconds_shared": round(shared["build_seconds"], 4),
        "build_seconds_naive": round(naive["build_seconds"], 4),
        "build_seconds_naive_mmap": round(naive_mmap["build_seconds"], 4),
        "build_speedup": round(naive["build_seconds"] / shared["build_seconds"], 3),
        "replicas_match": (shared["checksum"] == naive["checksum"] == naive_mmap["checksum"]
                           and all(r["ranks_identical"] for r in (shared, naive, naive_mmap))),
    }
    summary["targets_met"] = (summary["read_ratio"] == 1.0 and summary["reload_bytes_read"] == 0
                              and summary["peak_rss_ratio_shared"] <= 1.2 and summary["replicas_match"])
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
