"""The shared read-only checkpoint base (weights/checkpoint.py): one read per file, views equal
to what was written, the registry under concurrent opens, and the base's memory (a read-only
mapping of the file, or pinned RAM).

Views are compared with the tensors written to the file, bit for bit (a view computes nothing).
"""

import gc
import logging
import os
import struct
import threading
import time
import weakref

import pytest
import torch

import comfy.multidevice.weights.checkpoint as sc
from comfy.multidevice.comm.settings import WEIGHT_BASE_ENV
from comfy.multidevice.weights.safetensors_header import CheckpointError
from comfy.multidevice.weights.read_only import ReadOnlyWeightError, is_read_only
from comfy.multidevice.weights.checkpoint import (SharedCheckpoint, shared_checkpoint_sources, total_bytes_read)
from tests.weights.weight_cases import THREAD_LIMIT_S, bit_equal, raw_file, sample_tensors, write


# ----------------------------------------------------------------------------- the base

def test_open_reads_once_keeps_metadata_and_views_equal_written(tmp_path):
    tensors = sample_tensors()
    path = write(tmp_path / "model.safetensors", tensors, metadata={"format": "pt", "note": "x"})
    before = total_bytes_read()
    ckpt = SharedCheckpoint.open(path)
    size = os.path.getsize(path)
    assert ckpt.bytes_read == size and total_bytes_read() - before == size
    assert ckpt.file_bytes == size
    assert ckpt.metadata == {"format": "pt", "note": "x"}
    assert set(ckpt) == set(tensors)
    for name, want in tensors.items():
        view = ckpt[name]
        assert is_read_only(view), name
        assert bit_equal(view, want), name
    assert shared_checkpoint_sources() == [ckpt.key]


def test_second_open_reuses_and_reads_nothing(tmp_path, caplog):
    path = write(tmp_path / "m.safetensors", sample_tensors())
    first = SharedCheckpoint.open(path)
    before = total_bytes_read()
    with caplog.at_level(logging.INFO, logger="comfy.multidevice.weights"):
        second = SharedCheckpoint.open(str(path))
    assert second is first
    assert total_bytes_read() == before
    assert "Reusing shared checkpoint source" in caplog.text


def test_second_open_through_a_symlink_is_the_same_source(tmp_path):
    path = write(tmp_path / "m.safetensors", sample_tensors())
    link = tmp_path / "link.safetensors"
    link.symlink_to(path)
    first = SharedCheckpoint.open(path)
    before = total_bytes_read()
    assert SharedCheckpoint.open(link) is first and total_bytes_read() == before


def test_concurrent_opens_from_four_threads_read_once(tmp_path, monkeypatch):
    path = write(tmp_path / "m.safetensors", sample_tensors())
    real_read = SharedCheckpoint._read.__func__
    calls = []

    def slow_read(cls, *args):
        calls.append(threading.current_thread().name)
        time.sleep(0.3)  # long enough for the other threads to arrive while the read runs
        return real_read(cls, *args)

    monkeypatch.setattr(SharedCheckpoint, "_read", classmethod(slow_read))
    start = threading.Barrier(4)
    results, errors = [None] * 4, []

    def opener(i):
        try:
            start.wait(timeout=THREAD_LIMIT_S)
            results[i] = SharedCheckpoint.open(path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    before = total_bytes_read()
    threads = [threading.Thread(target=opener, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_LIMIT_S)
    assert not any(t.is_alive() for t in threads), "an opener hung"
    assert not errors, errors
    assert len(calls) == 1
    assert all(r is results[0] for r in results)
    assert total_bytes_read() - before == os.path.getsize(path)


def test_failed_concurrent_open_fails_every_waiter_and_leaves_registry_clean(tmp_path, monkeypatch):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"[1] ")

    real_read = SharedCheckpoint._read.__func__

    def slow_read(cls, *args):
        time.sleep(0.2)
        return real_read(cls, *args)

    monkeypatch.setattr(SharedCheckpoint, "_read", classmethod(slow_read))
    errors = []

    def opener():
        try:
            SharedCheckpoint.open(path)
        except CheckpointError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=opener, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_LIMIT_S)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == 4 and all("not an object" in str(e) for e in errors)
    assert shared_checkpoint_sources() == [] and not sc._pending


def test_changed_file_is_a_new_source_and_old_views_stay_valid(tmp_path):
    path = tmp_path / "m.safetensors"
    v1 = {"w": torch.arange(6.0).view(2, 3)}
    write(path, v1)
    first = SharedCheckpoint.open(path)
    old_view = first["w"]
    v2 = {"w": -torch.arange(6.0).view(2, 3)}  # same size on disk
    write(path, v2)
    st_ = os.stat(path)
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))  # a coarse clock could hide the change
    before = total_bytes_read()
    second = SharedCheckpoint.open(path)
    assert second is not first
    assert total_bytes_read() - before == os.path.getsize(path)
    assert torch.equal(second["w"], v2["w"])
    assert torch.equal(old_view, v1["w"])
    assert shared_checkpoint_sources() == [second.key]


def test_views_keep_memory_and_source_alive(tmp_path):
    tensors = {"a": torch.randn(64, 64), "b": torch.randn(33)}
    path = write(tmp_path / "m.safetensors", tensors)
    ckpt = SharedCheckpoint.open(path)
    source_ref = weakref.ref(ckpt)
    view = ckpt["a"][3:9]
    del ckpt
    gc.collect()
    churn = [torch.full((64, 64), 7.0) for _ in range(50)]  # reuse of freed memory would show here
    assert torch.equal(view, tensors["a"][3:9])
    before = total_bytes_read()
    assert SharedCheckpoint.open(path) is source_ref()   # still in use: reused, not re-read
    assert total_bytes_read() == before
    del view, churn
    gc.collect()
    assert source_ref() is None            # nothing uses it any more: its memory is released
    assert shared_checkpoint_sources() == []


def test_misaligned_tensor_gets_an_aligned_read_only_copy(tmp_path):
    # A 1-byte tensor first puts the f32 tensor at data offset 1, which cannot be viewed in place.
    f32 = torch.arange(4, dtype=torch.float32)
    header = {"u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "f": {"dtype": "F32", "shape": [4], "data_offsets": [1, 17]}}
    path = tmp_path / "odd.safetensors"
    path.write_bytes(raw_file(header, b"\x05" + f32.numpy().tobytes()))
    ckpt = SharedCheckpoint.open(path)
    assert torch.equal(ckpt["f"], f32) and ckpt["u"].item() == 5
    with pytest.raises(ReadOnlyWeightError):
        ckpt["f"].add_(1)
    assert ckpt.bytes_read == os.path.getsize(path)


def test_from_state_dict_copy_and_zero_copy():
    original = {"x": torch.randn(4, 4), "y": torch.arange(3)}
    before = total_bytes_read()
    packed = SharedCheckpoint.from_state_dict(original)
    wrapped = SharedCheckpoint.from_state_dict(original, copy=False)
    assert total_bytes_read() == before and shared_checkpoint_sources() == []
    for base in (packed, wrapped):
        assert torch.equal(base["x"], original["x"]) and is_read_only(base["x"])
        with pytest.raises(ReadOnlyWeightError):
            base["x"].mul_(2)
    assert wrapped["x"].data_ptr() == original["x"].data_ptr()   # zero-copy
    assert packed["x"].data_ptr() != original["x"].data_ptr()
    with pytest.raises(ValueError, match="meta"):
        SharedCheckpoint.from_state_dict({"z": torch.empty(2, device="meta")})


# ----------------------------------------------------------------------------- the base's memory

def _mapping_of(address: int) -> str:
    """The /proc/self/maps line whose range holds `address` ('' when none does)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms, *rest = line.split()
            start, end = (int(x, 16) for x in span.split("-"))
            if start <= address < end:
                return f"{perms} {rest[-1] if len(rest) >= 4 else ''}"
    return ""


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_default_base_is_a_read_only_shared_mapping_of_the_file(tmp_path, monkeypatch):
    monkeypatch.delenv(WEIGHT_BASE_ENV, raising=False)
    written = sample_tensors()
    path = write(tmp_path / "m.safetensors", written)
    before = total_bytes_read()
    ckpt = SharedCheckpoint.open(path)
    assert ckpt.mode == "map" and ckpt.bytes_read == os.path.getsize(path)
    assert total_bytes_read() - before == os.path.getsize(path)
    for name in written:
        perms, _, where = _mapping_of(ckpt[name].data_ptr()).partition(" ")
        if ckpt[name].nbytes:
            # no anonymous copy: the bytes are the file's page cache, mapped read-only and shared
            assert where == os.path.realpath(path) and perms.startswith("r-") and perms[3] == "s", (name, perms)
    for name, t in written.items():
        assert bit_equal(ckpt[name], t)
    again = SharedCheckpoint.open(path, mode="pin")  # one base per file: the live one, nothing read
    assert again is ckpt and total_bytes_read() - before == os.path.getsize(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")
def test_pin_mode_reads_into_anonymous_ram(tmp_path, monkeypatch):
    written = sample_tensors()
    path = write(tmp_path / "m.safetensors", written)
    monkeypatch.setenv(WEIGHT_BASE_ENV, "PIN")
    ckpt = SharedCheckpoint.open(path)
    assert ckpt.mode == "pin" and ckpt.bytes_read == os.path.getsize(path)
    big = max(written, key=lambda n: written[n].nbytes)
    assert os.path.realpath(path) not in _mapping_of(ckpt[big].data_ptr())
    for name, t in written.items():
        assert bit_equal(ckpt[name], t)
    with pytest.raises(ReadOnlyWeightError):
        ckpt[big].add_(1)


def test_bad_base_mode_is_refused_naming_the_value_and_the_choices(tmp_path, monkeypatch):
    path = write(tmp_path / "m.safetensors", {"w": torch.ones(2)})
    monkeypatch.setenv(WEIGHT_BASE_ENV, "locked")
    with pytest.raises(ValueError, match=r"COMFYUI_MULTI_DEVICE_WEIGHT_BASE='locked' .* map, pin"):
        SharedCheckpoint.open(path)
    with pytest.raises(ValueError, match=r"mode='copy' .* map, pin"):
        SharedCheckpoint.open(path, mode="copy")
    assert shared_checkpoint_sources() == []
