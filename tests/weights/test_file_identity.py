"""file_identity: equal for the same bytes anywhere, different (and named) for a changed header,
sampled data or size, or a file replaced at the same path; cached per process; bounded cost."""

import json
import os
import random
import re
import shutil
import struct

import pytest

from comfy.multidevice.weights import file_identity as fi
from comfy.multidevice.weights.file_identity import (check_same_file, clear_file_identities, file_identity,
                                                     FileIdentity, FileMismatchError, IdentityDataError,
                                                     identity_bytes_read, sample_offsets)
from comfy.multidevice.weights.safetensors_header import CheckpointError

WHERE = "rank 2 on server b [10.0.0.2]"
SMALL_CHUNK, SMALL_CHUNKS = 4096, 8  # 32 KiB sampled from a 1 MiB file: most bytes unsampled


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_file_identities()
    yield
    clear_file_identities()


@pytest.fixture
def small_sample(monkeypatch):
    monkeypatch.setattr(fi, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(fi, "SAMPLE_CHUNKS", SMALL_CHUNKS)


def header_bytes(data_bytes: int, name: str = "w") -> bytes:
    entry = {"dtype": "U8", "shape": [data_bytes], "data_offsets": [0, data_bytes]}
    text = json.dumps({name: entry}).encode()
    return struct.pack("<Q", len(text)) + text


def write_checkpoint(path, data_bytes: int = 1 << 20, seed: int = 0) -> int:
    """A safetensors file of one U8 tensor of random bytes; returns where its data starts."""
    header = header_bytes(data_bytes)
    with open(path, "wb") as f:
        f.write(header + random.Random(seed).randbytes(data_bytes))
    return len(header)


def flip_byte(path, offset: int) -> None:
    """Change one byte in place (same inode) and move the mtime on, as a rewrite would."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_the_same_file_is_equal_and_the_second_call_reads_nothing(tmp_path):
    path = tmp_path / "dit.safetensors"
    data_start = write_checkpoint(path)
    before = identity_bytes_read()
    first = file_identity(path)
    assert identity_bytes_read() - before == data_start + (1 << 20)  # a 1 MiB data section: whole
    assert (first.size, first.sampled_bytes) == (data_start + (1 << 20), 1 << 20)
    read = identity_bytes_read()
    assert file_identity(str(path)) == first
    assert identity_bytes_read() == read  # the cache answered


def test_a_copy_elsewhere_is_equal(tmp_path, small_sample):
    write_checkpoint(tmp_path / "a.safetensors")
    (tmp_path / "other").mkdir()
    shutil.copyfile(tmp_path / "a.safetensors", tmp_path / "other" / "a.safetensors")
    assert os.stat(tmp_path / "a.safetensors").st_ino != os.stat(tmp_path / "other/a.safetensors").st_ino
    expected = file_identity(tmp_path / "a.safetensors")
    assert check_same_file(tmp_path / "other" / "a.safetensors", expected, WHERE) == expected


def test_one_header_byte_changed_names_the_header(tmp_path, small_sample):
    path = tmp_path / "dit.safetensors"
    write_checkpoint(path)
    expected = file_identity(path)
    flip_byte(path, 10)  # inside the JSON
    assert file_identity(path).differences(expected) == ["header"]
    with pytest.raises(FileMismatchError, match=r"differs from rank 0's in its header \(here:"):
        check_same_file(path, expected, WHERE)


def test_a_changed_sampled_chunk_names_the_sampled_data_and_an_unsampled_byte_is_missed(tmp_path,
                                                                                         small_sample):
    path = tmp_path / "dit.safetensors"
    data_start = write_checkpoint(path)
    chunks = sample_offsets(data_start, os.path.getsize(path))
    expected = file_identity(path)
    flip_byte(path, chunks[3][0] + 100)
    assert file_identity(path).differences(expected) == ["sampled data"]
    with pytest.raises(FileMismatchError, match=r"in its sampled data \(here:"):
        check_same_file(path, expected, WHERE)
    # the documented blind spot: a change between two sampled chunks goes unseen
    flip_byte(path, chunks[3][0] + 100)  # back
    assert file_identity(path) == expected
    gap = chunks[3][0] + SMALL_CHUNK + 10
    assert gap < chunks[4][0]
    flip_byte(path, gap)
    assert file_identity(path) == expected


def test_a_file_replaced_at_the_same_path_differs_with_size_and_mtime_set_equal(tmp_path, small_sample):
    path = tmp_path / "dit.safetensors"
    write_checkpoint(path, seed=0)
    expected = file_identity(path)
    old = os.stat(path)
    write_checkpoint(tmp_path / "new.safetensors", seed=1)
    os.utime(tmp_path / "new.safetensors", ns=(old.st_atime_ns, old.st_mtime_ns))
    os.replace(tmp_path / "new.safetensors", path)
    new = os.stat(path)
    assert (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert new.st_ino != old.st_ino
    assert file_identity(path).differences(expected) == ["sampled data"]
    with pytest.raises(FileMismatchError, match="in its sampled data"):
        check_same_file(path, expected, WHERE)


def test_a_held_file_keeps_its_identity_after_the_path_is_replaced(tmp_path, small_sample):
    # rank 0 takes its identity from the file it opened, not from what the path names later
    path = tmp_path / "dit.safetensors"
    write_checkpoint(path, seed=0)
    with open(path, "rb") as held:
        loaded = file_identity(path, fd=held.fileno())
        write_checkpoint(tmp_path / "new.safetensors", seed=1)
        os.replace(tmp_path / "new.safetensors", path)
        assert file_identity(path, fd=held.fileno()) == loaded
        assert file_identity(path) != loaded


def test_a_changed_size_is_named_and_hashed_again(tmp_path, small_sample):
    path = tmp_path / "dit.safetensors"
    write_checkpoint(path)
    expected = file_identity(path)
    read = identity_bytes_read()
    with open(path, "ab") as f:
        f.write(b"\0" * 7)
    mine = file_identity(path)
    assert identity_bytes_read() > read  # same inode, new size: not the cached identity
    assert mine.size == expected.size + 7 and "size" in mine.differences(expected)
    sizes = rf"here: {expected.size + 7} bytes .*rank 0: {expected.size} bytes"
    with pytest.raises(FileMismatchError, match=sizes):
        check_same_file(path, expected, WHERE)


def test_a_file_changed_in_place_is_hashed_again(tmp_path, small_sample):
    path = tmp_path / "dit.safetensors"
    data_start = write_checkpoint(path)
    first = file_identity(path)
    read = identity_bytes_read()
    flip_byte(path, data_start)  # the first sampled chunk; same size, new mtime
    assert file_identity(path) != first
    assert identity_bytes_read() - read == first.size - (1 << 20) + first.sampled_bytes


def test_the_sample_is_bounded_whatever_the_size(tmp_path):
    path = tmp_path / "big.safetensors"
    data = 1 << 30
    header = header_bytes(data)
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(len(header) + data)  # sparse: 1 GiB on paper, nothing on disk
    chunks = sample_offsets(len(header), len(header) + data)
    assert len(chunks) == fi.SAMPLE_CHUNKS and {n for _, n in chunks} == {fi.CHUNK_BYTES}
    assert chunks[0][0] == len(header) and sum(chunks[-1]) == len(header) + data
    gaps = {b[0] - a[0] for a, b in zip(chunks, chunks[1:])}
    assert max(gaps) - min(gaps) <= 1  # evenly spaced
    before = identity_bytes_read()
    identity = file_identity(path)
    assert identity_bytes_read() - before == len(header) + fi.SAMPLE_CHUNKS * fi.CHUNK_BYTES
    assert identity.sampled_bytes == fi.SAMPLE_CHUNKS * fi.CHUNK_BYTES


def test_a_file_that_is_not_safetensors_hashes_its_first_bytes_as_the_header(tmp_path, small_sample):
    path = tmp_path / "model.ckpt"
    path.write_bytes(b"PK\x03\x04" + random.Random(2).randbytes(2 << 20))
    expected = file_identity(path)
    assert expected.sampled_bytes == SMALL_CHUNK * SMALL_CHUNKS
    flip_byte(path, 2)
    assert file_identity(path).differences(expected) == ["header"]


def test_to_data_round_trips_through_json():
    identity = FileIdentity(20_937_965_568, "a" * 64, "0123456789abcdef" * 4, 64 << 20)
    assert FileIdentity.from_data(json.loads(json.dumps(identity.to_data()))) == identity
    assert "19.50 GiB" in identity.describe() and "aaaaaaaaaaaaaaaa" in identity.describe()


@pytest.mark.parametrize("change, message", [
    (lambda d: [d], "must be a dict, got list"),
    (lambda d: {k: v for k, v in d.items() if k != "size"}, r"missing \['size'\]"),
    (lambda d: {**d, "mtime": 1}, r"unknown \['mtime'\]"),
    (lambda d: {**d, "scheme": "md5"}, "same version of the node pack"),
    (lambda d: {**d, "size": True}, "size must be a non-negative int, got True"),
    (lambda d: {**d, "size": -1}, "size must be a non-negative int, got -1"),
    (lambda d: {**d, "size": "123"}, "size must be a non-negative int, got '123'"),
    (lambda d: {**d, "header_sha256": "ab"}, "header_sha256 must be 64 lowercase hex digits, got 'ab'"),
    (lambda d: {**d, "sampled_sha256": "A" * 64}, "sampled_sha256 must be 64 lowercase hex digits"),
    (lambda d: {**d, "sampled_sha256": None}, "sampled_sha256 must be 64 lowercase hex digits, got None"),
    (lambda d: {**d, "sampled_bytes": 10**12}, "sampled_bytes 1000000000000 exceeds the file size"),
])
def test_from_data_refuses_garbage(change, message):
    good = FileIdentity(1 << 30, "a" * 64, "b" * 64, 64 << 20).to_data()
    with pytest.raises(IdentityDataError, match=message):
        FileIdentity.from_data(change(good))


def test_the_mismatch_error_names_the_path_where_and_the_fix(tmp_path, small_sample):
    path = tmp_path / "dit.safetensors"
    write_checkpoint(path, seed=0)
    expected = file_identity(path)
    write_checkpoint(path, seed=1)
    os.utime(path, ns=(0, 10**18))
    with pytest.raises(FileMismatchError) as caught:
        check_same_file(path, expected, WHERE)
    text = str(caught.value)
    assert f"the DiT file at {path} on {WHERE} differs from rank 0's" in text
    assert "copy the same file to every server, or restart ComfyUI after replacing it" in text


def test_a_missing_file_is_a_clear_error(tmp_path):
    expected = FileIdentity(1 << 30, "a" * 64, "b" * 64, 64 << 20)
    path = tmp_path / "gone.safetensors"
    missing = f"the DiT file at {path} does not exist on {WHERE}"
    with pytest.raises(FileMismatchError, match=re.escape(missing)):
        check_same_file(path, expected, WHERE)
    with pytest.raises(CheckpointError, match=re.escape(f"{path}: no such file; check the path")):
        file_identity(path)
    with pytest.raises(CheckpointError, match="not a regular file"):
        file_identity(tmp_path)
    with pytest.raises(FileMismatchError, match=re.escape(f"cannot be checked on {WHERE} against rank 0's")):
        check_same_file(tmp_path, expected, WHERE)
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(CheckpointError, match="not a regular file"):  # refused without opening (no hang)
        file_identity(tmp_path / "pipe")
