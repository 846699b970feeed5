"""Which bytes a checkpoint path holds here: a fingerprint of bounded cost, compared across ranks.

Worker ranks load the DiT from "the same path" as rank 0, on this server or another. A file
replaced at that path (or a different file at it on another server) would give wrong output
and no error; rank 0 sends its FileIdentity and every rank checks its own file against it.

    file_identity(path)          FileIdentity(size, header_sha256, sampled_sha256, sampled_bytes)
    file_identity(path, fd=fd)   the same for a file this process holds open (rank 0's loaded
                                 file, even when the path has been replaced since)
    check_same_file(path, expected, where)   raises FileMismatchError naming what differs
    FileIdentity.to_data() / from_data(dict)  a plain JSON-able dict, validated on the way in

What is hashed (SHA-256): the header, i.e. the 8-byte length and the JSON of a safetensors file
(for any other file its first HEAD_BYTES bytes), and a sample of the rest: SAMPLE_CHUNKS chunks
of CHUNK_BYTES at evenly spaced offsets, the first at the data's start, the last ending at the
file's last byte (a data section up to SAMPLE_CHUNKS x CHUNK_BYTES is hashed whole). So the
bytes read are the header + 64 MiB whatever the size (H3's header: tens of KB).

Measured (bench/bench_file_identity.py --gib 4, three runs, on a 2-core development VM with a
virtio disk and other work running; "cold": the file's pages dropped with fsync +
posix_fadvise(DONTNEED), /proc/self/io confirming every byte came from storage, though the
host may have cached the disk): file_identity read 64 MiB + the 88-byte header in 0.19-0.77 s
cold and 0.08-0.15 s warm; a second call read 0 bytes in < 0.4 ms. Its reads do not grow with
the file, so the same holds at H3's 19.5 GiB. A full SHA-256 of the same file ran at
0.31-0.47 GiB/s cold and 0.64-0.99 GiB/s warm (hashlib's SHA-256 alone: ~1.3 GiB/s on this
CPU), i.e. 42-62 s cold and 20-30 s warm for 19.5 GiB, on every rank at every start: the
identity took 1.7-6% of the full hash's time in the same runs. That is why the digest is
sampled.

What the sample misses: any change confined to bytes outside the header and the sampled
chunks, which at 19.5 GiB are 99.7% of the data (one 1 MiB chunk every ~312 MiB). So it is no
check against bit rot or a damaged download of the right size. What it is for, a different file
at the path, it catches: another release, quantisation or dtype changes the size or the header
(names, dtypes, shapes, offsets); a truncated or still-copying file changes the size; other
weights in the same layout (a fine-tune, a merged LoRA) differ in nearly every chunk that holds
a changed tensor, and with about one chunk per H3 block (50 blocks in 19.5 GiB) only a change
confined to a few tensors (norms, one block) could slip between them. An attacker who writes
crafted bytes into the unsampled gaps of that path already owns the file system: out of scope.

Why not size + mtime alone: across servers the mtime is whatever the copy made it (cp sets
now, rsync -t and scp -p keep it, `touch` sets anything), so equal files can differ in mtime
and different files can share size and mtime (two quantisations of one model can be the same
size). Inside a process, (real path, device, inode, size, mtime_ns, ctime_ns) only decides when
to hash again: a second call on an unchanged file reads nothing; a file changed in place (new
mtime or size) or replaced (new inode) is hashed again. ctime is in the key because os.utime
can set mtime back but not ctime.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from typing import Any

from comfy.multidevice.weights.safetensors_header import (CheckpointError, HEADER_LENGTH_BYTES,
                                                          parse_header_length, short_repr)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
SAMPLE_CHUNKS = 64
HEAD_BYTES = 1 << 20  # a non-safetensors file: this many first bytes stand for its header
# Names the sampling above; a rank that samples otherwise would report every file as different.
SCHEME = f"sha256/head-{HEAD_BYTES}/{SAMPLE_CHUNKS}x{CHUNK_BYTES}"

_DIGEST_CHARS = 64  # hex SHA-256


class FileMismatchError(RuntimeError):
    """A rank's file at the shared path is missing or is not the file rank 0 loaded."""


class IdentityDataError(ValueError):
    """A FileIdentity's data (as sent by another rank) is malformed."""


@dataclass(frozen=True)
class FileIdentity:
    """What a file holds, as far as a rank needs to know: size, header digest, sample digest."""
    size: int
    header_sha256: str
    sampled_sha256: str
    sampled_bytes: int

    def to_data(self) -> dict[str, Any]:
        return {"scheme": SCHEME, "size": self.size, "header_sha256": self.header_sha256,
                "sampled_sha256": self.sampled_sha256, "sampled_bytes": self.sampled_bytes}

    @classmethod
    def from_data(cls, data: Any) -> "FileIdentity":
        """The identity `to_data` made (maybe on another server); IdentityDataError on anything else."""
        if not isinstance(data, dict):
            raise IdentityDataError(f"file identity data must be a dict, got {type(data).__name__}: "
                                    f"{short_repr(data)}")
        fields = {"scheme", *cls.__dataclass_fields__}
        if set(data) != fields:
            raise IdentityDataError(f"file identity data {short_repr(data)}: keys must be {sorted(fields)}; "
                                    f"missing {sorted(fields - set(data))}, "
                                    f"unknown {sorted(set(data) - fields)}")
        if data["scheme"] != SCHEME:
            raise IdentityDataError(f"file identity made with scheme {short_repr(data['scheme'])}, this "
                                    f"process uses {SCHEME!r}: run the same version of the node pack on "
                                    "every server")
        for key in ("size", "sampled_bytes"):
            value = data[key]
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise IdentityDataError(f"file identity {key} must be a non-negative int, "
                                        f"got {short_repr(value)}")
        for key in ("header_sha256", "sampled_sha256"):
            value = data[key]
            if (not isinstance(value, str) or len(value) != _DIGEST_CHARS
                    or value.strip("0123456789abcdef")):
                raise IdentityDataError(f"file identity {key} must be {_DIGEST_CHARS} lowercase hex "
                                        f"digits, got {short_repr(value)}")
        if data["sampled_bytes"] > data["size"]:
            raise IdentityDataError(f"file identity sampled_bytes {data['sampled_bytes']} exceeds the "
                                    f"file size {data['size']}")
        return cls(data["size"], data["header_sha256"], data["sampled_sha256"], data["sampled_bytes"])

    def describe(self) -> str:
        return (f"{self.size} bytes ({self.size / 2**30:.2f} GiB), header sha256 "
                f"{self.header_sha256[:16]}, sample sha256 {self.sampled_sha256[:16]} over "
                f"{self.sampled_bytes} bytes")

    def differences(self, other: "FileIdentity") -> list[str]:
        """What differs from `other`, as words: "size", "header", "sampled data"."""
        found = []
        if self.size != other.size:
            found.append("size")
        if self.header_sha256 != other.header_sha256:
            found.append("header")
        if self.sampled_sha256 != other.sampled_sha256 or self.sampled_bytes != other.sampled_bytes:
            found.append("sampled data")
        return found


# ----------------------------------------------------------------------------- hashing

_counter_lock = threading.Lock()
_bytes_read = 0
_cache_lock = threading.Lock()
_cache: dict[tuple, FileIdentity] = {}  # stat key -> identity; one entry per real path


def identity_bytes_read() -> int:
    """Bytes this module has read from files in this process (a cache hit reads none)."""
    return _bytes_read


def clear_file_identities() -> None:
    """Forget the cached identities (the next call hashes again)."""
    with _cache_lock:
        _cache.clear()


def _read_at(fd: int, offset: int, n: int, real: str) -> bytes:
    global _bytes_read
    parts, got = [], 0
    while got < n:  # pread may return short (signals, network file systems)
        part = os.pread(fd, n - got, offset + got)
        if not part:
            raise CheckpointError(f"{real}: file ended at byte {offset + got} while reading {n} bytes "
                                  f"at {offset} (it shrank while being read?); try again once it is "
                                  "complete")
        parts.append(part)
        got += len(part)
    with _counter_lock:
        _bytes_read += n
    return b"".join(parts)


def _header_end(first: bytes, size: int, real: str) -> int:
    """Where the safetensors header ends (8 + N), or HEAD_BYTES (at most the size) for another file."""
    try:
        length = parse_header_length(first, size, real)
    except CheckpointError:  # not safetensors: its first bytes stand in for a header
        return min(size, HEAD_BYTES)
    return HEADER_LENGTH_BYTES + length


def sample_offsets(start: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the chunks sampled from [start, size): all of it when short, else
    SAMPLE_CHUNKS chunks evenly spaced, the first at `start`, the last ending at `size`."""
    span = size - start
    if span <= SAMPLE_CHUNKS * CHUNK_BYTES:
        return [(o, min(CHUNK_BYTES, size - o)) for o in range(start, size, CHUNK_BYTES)]
    step = span - CHUNK_BYTES  # spread over the chunks' start offsets
    return [(start + i * step // (SAMPLE_CHUNKS - 1), CHUNK_BYTES) for i in range(SAMPLE_CHUNKS)]


def _hash(fd: int, size: int, real: str) -> FileIdentity:
    first = _read_at(fd, 0, min(HEADER_LENGTH_BYTES, size), real)
    header_end = _header_end(first, size, real)
    header = hashlib.sha256(first)
    for offset in range(len(first), header_end, CHUNK_BYTES):  # a header may be up to 100 MB: in chunks
        header.update(_read_at(fd, offset, min(CHUNK_BYTES, header_end - offset), real))
    sampled, total = hashlib.sha256(), 0
    for offset, length in sample_offsets(header_end, size):
        sampled.update(_read_at(fd, offset, length, real))
        total += length
    return FileIdentity(size, header.hexdigest(), sampled.hexdigest(), total)


def _key(real: str, st: os.stat_result) -> tuple:
    return (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_identity(path: str | os.PathLike, *, fd: int | None = None) -> FileIdentity:
    """The identity of the file at `path` (or of the open file `fd`, which `path` names in messages
    and whose bytes count even if `path` now names another file); cached per process by
    (real path, device, inode, size, mtime, ctime). CheckpointError: missing, not a regular file,
    unreadable, or changed while being hashed."""
    shown = os.fspath(path)
    real = os.path.realpath(shown)
    if fd is None:
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise CheckpointError(f"{shown}: no such file; check the path") from None
        except OSError as exc:
            raise CheckpointError(f"{shown}: cannot stat the file: {exc.strerror or exc}") from None
        if not stat.S_ISREG(st.st_mode):  # checked before opening: opening a FIFO would block
            raise CheckpointError(f"{shown}: not a regular file; pass the checkpoint file itself")
        with _cache_lock:
            hit = _cache.get(_key(real, st))
        if hit is not None:
            return hit
    try:
        handle = os.open(real, os.O_RDONLY) if fd is None else os.dup(fd)
    except FileNotFoundError:
        raise CheckpointError(f"{shown}: no such file; check the path") from None
    except OSError as exc:
        raise CheckpointError(f"{shown}: cannot open the file: {exc.strerror or exc}") from None
    try:
        st = os.fstat(handle)  # the key of the file opened, not of what the path named a moment ago
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{shown}: not a regular file; pass the checkpoint file itself")
        key = _key(real, st)
        with _cache_lock:
            hit = _cache.get(key)
        if hit is not None:
            return hit
        started = time.perf_counter()
        identity = _hash(handle, st.st_size, shown)
        if _key(real, os.fstat(handle)) != key:
            raise CheckpointError(f"{shown}: the file changed while being hashed (a copy still being "
                                  "written?); try again once it is complete")
    finally:
        os.close(handle)
    log.info("File identity of %s: %s (hashed in %.2f s)", real, identity.describe(),
             time.perf_counter() - started)
    with _cache_lock:
        for old in [k for k in _cache if k[0] == real]:
            del _cache[old]  # an older version of this path (a held one, fd=, is hashed again)
        _cache[key] = identity
    return identity


def check_same_file(path: str | os.PathLike, expected: FileIdentity, where: str) -> FileIdentity:
    """This process's identity of `path` when it equals `expected` (rank 0's); else
    FileMismatchError naming the path, `where` (e.g. "rank 2 on server b [10.0.0.2]") and what
    differs."""
    shown = os.fspath(path)
    fix = "copy the same file to every server, or restart ComfyUI after replacing it"
    if not os.path.exists(shown):
        raise FileMismatchError(f"the DiT file at {shown} does not exist on {where} (rank 0 has it: "
                                f"{expected.describe()}): {fix}")
    try:
        mine = file_identity(shown)
    except CheckpointError as exc:
        raise FileMismatchError(f"the DiT file at {shown} cannot be checked on {where} against rank 0's "
                                f"({exc}): {fix}") from None
    differs = mine.differences(expected)
    if differs:
        raise FileMismatchError(
            f"the DiT file at {shown} on {where} differs from rank 0's in its {', '.join(differs)} "
            f"(here: {mine.describe()}; rank 0: {expected.describe()}): {fix}")
    return mine
