#!/usr/bin/env python3
"""What checking "the same DiT file on every rank" costs: file_identity against a full SHA-256.

Writes a safetensors file of --gib GiB (one U8 tensor of random bytes) into a temporary
directory (--dir, default the system's), removed at the end, then measures in this process:

  identity   comfy/multidevice/weights/file_identity.py file_identity(path): the header and 64
             chunks of 1 MiB, hashed (its cache cleared before each timing)
  full       hashlib.sha256 over every byte of the file, read in 8 MiB pieces
  cached     a second file_identity call on the unchanged file (its per-process cache)

each cold, then warm. Cold: the file's pages are dropped from the page cache before the timing
(fsync + posix_fadvise(POSIX_FADV_DONTNEED) on this file: no root needed, nothing else's cache
dropped); `cold_disk_bytes` (the process's /proc/self/io read_bytes during the timing) shows
they came from storage. Warm: right after, with what the cold run read still cached.

Last line, JSON: per method the bytes read and seconds (cold, warm), `identity_vs_full_cold` and
`identity_vs_full_warm` (identity seconds / full seconds, same run), the full hash's rate, and
`full_sha256_s_at_19_5_gib` (19.5 GiB at that cold rate: a projection, not a measurement).

  python bench/bench_file_identity.py [--gib 1] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench_weights import drop_from_page_cache  # noqa: E402  (this folder: the same fsync + fadvise)
from comfy.multidevice.weights.file_identity import (clear_file_identities, file_identity,  # noqa: E402
                                                     identity_bytes_read)

H3_GIB = 19.5
WRITE_PIECE = 64 << 20
READ_PIECE = 8 << 20


def write_checkpoint(path: str, total: int) -> None:
    """A valid safetensors file of `total` bytes: one U8 tensor of random bytes."""
    def header_for(data: int) -> bytes:
        text = json.dumps({"w": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}).encode()
        return text + b" " * (-(8 + len(text)) % 8)  # the data 8-byte aligned, as writers do
    data = total - 8
    for _ in range(4):  # the header's length depends on the digits of the data's size
        header = header_for(data)
        data = total - 8 - len(header)
    header = header_for(data)
    if 8 + len(header) + data != total:
        raise SystemExit(f"cannot lay out a safetensors file of exactly {total} bytes; pick another --gib")
    piece = os.urandom(WRITE_PIECE)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = data
        while left:
            n = min(left, WRITE_PIECE)
            f.write(piece[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def disk_read_bytes() -> int | None:
    """This process's reads from storage so far (/proc/self/io read_bytes), None where absent."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration):
        return None


def full_sha256(path: str) -> tuple[str, int]:
    digest, read = hashlib.sha256(), 0
    buffer = bytearray(READ_PIECE)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                return digest.hexdigest(), read
            digest.update(view[:n])
            read += n


def timed_identity(path: str) -> tuple[float, int]:
    before = identity_bytes_read()
    start = time.perf_counter()
    file_identity(path)
    return time.perf_counter() - start, identity_bytes_read() - before


def timed_full(path: str) -> tuple[float, int]:
    start = time.perf_counter()
    _, read = full_sha256(path)
    return time.perf_counter() - start, read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gib", type=float, default=1.0, help="file size in GiB (default 1)")
    parser.add_argument("--dir", default=None,
                        help="where to write the file (default: the system's temp dir)")
    args = parser.parse_args()
    if not hasattr(os, "posix_fadvise"):
        parser.error("this benchmark drops pages with posix_fadvise (Linux)")
    total = int(args.gib * 2**30)
    if total < 1 << 20:
        parser.error(f"--gib {args.gib} is under 1 MiB; the sample alone is 64 MiB")

    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = os.path.join(folder, "dit.safetensors")
        start = time.perf_counter()
        write_checkpoint(path, total)
        print(f"wrote {total} bytes in {time.perf_counter() - start:.1f} s: {path}", file=sys.stderr)

        runs = {}
        for name, timed in (("identity", timed_identity), ("full", timed_full)):
            figures = {}
            for state in ("cold", "warm"):
                clear_file_identities()
                if state == "cold":
                    drop_from_page_cache(path)
                disk_before = disk_read_bytes()
                seconds, read = timed(path)
                disk = None if disk_before is None else disk_read_bytes() - disk_before
                figures.update({"bytes_read": read, f"{state}_s": round(seconds, 4),
                                f"{state}_disk_bytes": disk})
                print(f"{name} {state}: {read} bytes read ({disk} from storage) in {seconds:.3f} s",
                      file=sys.stderr)
            runs[name] = figures
            if name == "identity":  # its cache now holds the warm run's identity
                seconds, read = timed_identity(path)
                runs["cached"] = {"bytes_read": read, "seconds": round(seconds, 6)}

    full_cold_rate = total / runs["full"]["cold_s"] / 2**30
    result = {
        "file_bytes": total,
        **runs,
        "identity_vs_full_cold": round(runs["identity"]["cold_s"] / runs["full"]["cold_s"], 5),
        "identity_vs_full_warm": round(runs["identity"]["warm_s"] / runs["full"]["warm_s"], 5),
        "identity_bytes_vs_full": round(runs["identity"]["bytes_read"] / runs["full"]["bytes_read"], 5),
        "full_gib_per_s_cold": round(full_cold_rate, 3),
        "full_gib_per_s_warm": round(total / runs["full"]["warm_s"] / 2**30, 3),
        "full_sha256_s_at_19_5_gib": round(H3_GIB / full_cold_rate, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
