#!/usr/bin/env python3
"""The shared weight base against the real alternatives a ComfyUI user has, W rank threads.

Writes a synthetic BF16 checkpoint (--size-mb) into a temporary directory (--dir, default the
system's), then measures each method in a fresh child process with W CPU rank threads, each
rank building its weights and checksumming every byte of them (what moving them to a card
would touch; included in the build time):

  upstream_mmap      every rank calls upstream ComfyUI's comfy.utils.load_torch_file(path):
                     safetensors' mmap, pages shared through the page cache (what one card's
                     load does; the fastest a load can be)
  upstream_multigpu  upstream's multi-GPU path: every card's clone reloads the file through
                     its loader (load_torch_file) and holds a private copy of the weights
                     (on a CPU "card": an anonymous copy)
  ours               every rank calls SharedCheckpoint.open(path) (one read-only shared mapping
                     per process) and builds its RankReplica from it; then --reloads
                     unload/reload cycles (the bytes they read are reported)
  ours_pin           the same with COMFYUI_MULTI_DEVICE_WEIGHT_BASE=pin (anonymous RAM, for NFS)

Each method runs cold, then warm. Cold: the file's pages are dropped from the page cache with
posix_fadvise(POSIX_FADV_DONTNEED) after an fsync (no root needed, so no drop_caches; pages
another process maps stay cached, which this run avoids). Warm: the same child again right
after, with the file in the page cache.

Before measuring, every child does one op on a ReadOnlyTensor: torch imports its DTensor
modules the first time an op dispatches on a tensor subclass with __torch_dispatch__ (about
0.4 s and ~40 MB, once per process; a ComfyUI server has paid it before its first prompt);
that one-time cost is reported as first_subclass_op_seconds. Two more runs, warm only, are
fresh processes that paid nothing in advance, as the CLI and a torchrun rank start:
upstream_mmap_standalone and ours_standalone (which starts that import on a thread first, as
the CLI and torchrun do, comfy/multidevice/weights/dispatch_warm_up.py start_dispatch_warm_up): their
ratio is standalone_build_vs_upstream_mmap (target <= 1.2).

Per run: build seconds, disk bytes (the child's /proc/self/io read_bytes: storage reads,
mmap page faults included), PSS and anonymous memory added by the build (/proc/self/smaps_rollup,
after - before, with every rank's weights alive). The upstream methods need upstream ComfyUI:
COMFYUI_DIR names a checkout (run with a Python that has its requirements); without it they
are reported skipped and the ratios against them are null.

Last line, JSON: warm_build_ratio_vs_upstream_mmap (ours / upstream_mmap, warm; target <= 1.2),
pss_ratio (ours' PSS / file, warm; target <= 1.01), anon_ratio (ours' anonymous / file; ~0),
disk_read_ratio (ours' disk bytes / file, cold; target 1.00),
phys_mem_advantage_vs_upstream_multigpu (upstream_multigpu PSS / ours; target >= 3.5), and
every run's figures under "runs".

  python bench/bench_weights.py [--size-mb 1024] [--ranks 4] [--reloads 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
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
METHODS = ("upstream_mmap", "upstream_multigpu", "ours", "ours_pin")
UPSTREAM = ("upstream_mmap", "upstream_multigpu")
# warm only, in a fresh process that has paid nothing in advance (the CLI, a torchrun rank)
STANDALONE = ("upstream_mmap_standalone", "ours_standalone")


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

def memory_counters() -> dict[str, int]:
    """Pss and Anonymous of this process, bytes (Linux smaps_rollup)."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Pss", "Anonymous"):
                out[key.lower()] = int(rest.split()[0]) * 1024
    return out


def disk_read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


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


def import_upstream_loader():
    tree = os.environ.get("COMFYUI_DIR")
    if not tree:
        raise RuntimeError("COMFYUI_DIR is not set")
    sys.path.append(tree)  # after this repository: comfy.multidevice stays ours
    import comfy.utils
    return comfy.utils.load_torch_file


def run_child(method: str, path: str, ranks: int, reloads: int) -> dict:
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.weights.checkpoint import SharedCheckpoint, total_bytes_read
    from comfy.multidevice.weights.replicas import RankReplica

    from comfy.multidevice.weights.dispatch_warm_up import start_dispatch_warm_up
    from comfy.multidevice.weights.read_only import ReadOnlyMemory, read_only_view
    standalone = method in STANDALONE
    method = method.removesuffix("_standalone")
    load_torch_file = import_upstream_loader() if method in UPSTREAM else None
    mode = "pin" if method == "ours_pin" else "map"
    first_op_seconds = None
    if standalone:  # as the CLI and a torchrun rank start: the one-time import on its way
        start_dispatch_warm_up()
    else:
        start = time.perf_counter()
        probe = torch.zeros(2)
        read_only_view(probe, ReadOnlyMemory(probe.untyped_storage(), "probe"), "probe").sum()
        first_op_seconds = round(time.perf_counter() - start, 3)

    def build(rank, comm):
        if method == "upstream_mmap":
            state = load_torch_file(path)
        elif method == "upstream_multigpu":  # the clone's own reload, then its private weights
            state = {name: t.clone() for name, t in load_torch_file(path).items()}
        else:
            state = RankReplica(SharedCheckpoint.open(path, mode=mode), comm.device, rank=rank).load()
            return state, checksum(state.state_dict())
        return state, checksum(state)

    result: dict = {"method": method, "first_subclass_op_seconds": first_op_seconds}
    with SequenceParallelCoordinator(["cpu"] * ranks, backend="peer", timeout_s=CHILD_TIMEOUT_S) as coord:
        before, disk_before, read_before = memory_counters(), disk_read_bytes(), total_bytes_read()
        start = time.perf_counter()
        built = coord.run(build)
        result["build_seconds"] = time.perf_counter() - start
        after = memory_counters()
        result["disk_read_bytes"] = disk_read_bytes() - disk_before
        result["pss_bytes"] = after["pss"] - before["pss"]
        result["anon_bytes"] = after["anonymous"] - before["anonymous"]
        if method.startswith("ours"):
            replicas = [state for state, _ in built]
            result["logical_bytes_read"] = total_bytes_read() - read_before
            after_build = total_bytes_read()
            for _ in range(reloads):
                for replica in replicas:
                    replica.unload()
                coord.run(lambda rank, comm: replicas[rank].load() and None)
            result["reload_bytes_read"] = total_bytes_read() - after_build
        sums = {cs for _, cs in built}
        result["ranks_identical"] = len(sums) == 1
        result["checksum"] = sums.pop()
    return result


# ----------------------------------------------------------------------------- parent side

def drop_from_page_cache(path: Path) -> None:
    """Evict the file's clean pages (fsync first: dirty pages cannot be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def measure(method: str, path: Path, ranks: int, reloads: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, "--path", str(path),
           "--ranks", str(ranks), "--reloads", str(reloads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{method} child failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratio(a, b, digits=3):
    return None if a is None or b in (None, 0) else round(a / b, digits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024, help="synthetic checkpoint size in MiB")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--reloads", type=int, default=3, help="unload/reload cycles of our base")
    parser.add_argument("--dir", help="where the temporary file goes (a disk, not tmpfs, for cold runs)")
    parser.add_argument("--child", choices=METHODS + STANDALONE, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(args.child, args.path, args.ranks, args.reloads)))
        return 0
    if args.size_mb < 1 or args.ranks < 1 or args.reloads < 0:
        parser.error("--size-mb and --ranks must be positive, --reloads non-negative")
    if not (os.path.exists("/proc/self/smaps_rollup") and hasattr(os, "posix_fadvise")):
        parser.error("this benchmark reads /proc/self/smaps_rollup and uses posix_fadvise (Linux)")

    skipped = None if os.environ.get("COMFYUI_DIR") else (
        "COMFYUI_DIR is not set: upstream_mmap and upstream_multigpu need upstream ComfyUI's loader")
    methods = [m for m in METHODS if skipped is None or m not in UPSTREAM]
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_weights_", dir=args.dir) as tmp:
        path = Path(tmp) / "synthetic.safetensors"
        write_synthetic(path, args.size_mb << 20)
        file_bytes = path.stat().st_size
        for method in methods:
            drop_from_page_cache(path)
            runs[f"{method}_cold"] = measure(method, path, args.ranks, args.reloads)
            runs[f"{method}_warm"] = measure(method, path, args.ranks, args.reloads)
        for method in STANDALONE:
            if skipped is None or method.removesuffix("_standalone") not in UPSTREAM:
                runs[f"{method}_warm"] = measure(method, path, args.ranks, args.reloads)

    def get(run, key):
        return runs[run][key] if run in runs else None

    for run in runs.values():
        run["pss_ratio"] = round(run["pss_bytes"] / file_bytes, 4)
        run["anon_ratio"] = round(run["anon_bytes"] / file_bytes, 4)
        run["disk_read_ratio"] = round(run["disk_read_bytes"] / file_bytes, 4)
        run["build_seconds"] = round(run["build_seconds"], 4)
    checksums = {r["checksum"] for r in runs.values()}
    summary = {
        "file_bytes": file_bytes,
        "ranks": args.ranks,
        "upstream_skipped": skipped,
        "warm_build_ratio_vs_upstream_mmap": ratio(get("ours_warm", "build_seconds"),
                                                   get("upstream_mmap_warm", "build_seconds")),
        "standalone_build_vs_upstream_mmap": ratio(get("ours_standalone_warm", "build_seconds"),
                                                   get("upstream_mmap_standalone_warm", "build_seconds")),
        "cold_build_ratio_vs_upstream_mmap": ratio(get("ours_cold", "build_seconds"),
                                                   get("upstream_mmap_cold", "build_seconds")),
        "pss_ratio": get("ours_warm", "pss_ratio"),
        "anon_ratio": get("ours_warm", "anon_ratio"),
        "disk_read_ratio": get("ours_cold", "disk_read_ratio"),
        "reload_bytes_read": get("ours_warm", "reload_bytes_read"),
        "phys_mem_advantage_vs_upstream_multigpu": ratio(get("upstream_multigpu_warm", "pss_bytes"),
                                                         get("ours_warm", "pss_bytes"), 2),
        "pin_anon_ratio": get("ours_pin_warm", "anon_ratio"),
        "weights_match": len(checksums) == 1 and all(r["ranks_identical"] for r in runs.values()),
        "runs": {name: {k: v for k, v in r.items() if k not in ("method", "checksum")} for name, r in runs.items()},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
