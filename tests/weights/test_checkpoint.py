"""Shared read-only checkpoint base, per-rank hot caches, patches and the header validator.

Replicas are compared with the tensors written to the file (bit-exact: building a replica
copies or casts, it computes nothing) and with a reference module loaded the ordinary way.
"""

import copy
import gc
import json
import logging
import math
import os
import struct
import sys
import threading
import time
import types
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import comfy.multidevice.weights.checkpoint as sc
from comfy.multidevice.comm.settings import WEIGHT_BASE_ENV
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.weights.safetensors_header import (SAFETENSORS_DTYPES, parse_safetensors_prefix)
from comfy.multidevice.weights.safetensors_header import CheckpointError
from comfy.multidevice.weights.comfy_replicas import comfy_diffusion_model_replicas
from comfy.multidevice.weights.offload import model_stage_unload, offload_components, release_cached_device_memory
from comfy.multidevice.weights.replicas import RankReplica, RankReplicas
from comfy.multidevice.weights.read_only import ReadOnlyWeightError, is_read_only
from comfy.multidevice.weights.checkpoint import (SharedCheckpoint, clear_shared_checkpoints, shared_checkpoint_sources, total_bytes_read)

THREAD_LIMIT_S = 30


@pytest.fixture(autouse=True)
def clean_registry():
    clear_shared_checkpoints()
    yield
    clear_shared_checkpoints()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a tensor of any dtype (bitwise comparison, NaN-safe)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))


def sample_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {
        "f32": torch.randn(5, 7, generator=gen),
        "f16": torch.randn(3, 4, generator=gen).half(),
        "bf16": torch.randn(6, generator=gen).bfloat16(),
        "f64": torch.randn(2, 3, generator=gen).double(),
        "i64": torch.randint(-10**12, 10**12, (4,), generator=gen),
        "i32": torch.randint(-1000, 1000, (3, 2), generator=gen, dtype=torch.int32),
        "i16": torch.randint(-300, 300, (5,), generator=gen, dtype=torch.int16),
        "i8": torch.randint(-100, 100, (7,), generator=gen, dtype=torch.int8),
        "u8": torch.randint(0, 255, (9,), generator=gen, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (5,), generator=gen).bool(),
        "scalar": torch.tensor(3.25),
        "empty": torch.zeros(0, 4),
    }
    out["c64"] = torch.randn(3, generator=gen, dtype=torch.complex64)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu"):
        if hasattr(torch, name):
            out[name] = torch.rand(8, generator=gen).add(0.5).to(getattr(torch, name))
    for name in ("uint16", "uint32", "uint64"):  # few ops exist for these; casting does
        if hasattr(torch, name):
            out[name] = torch.randint(0, 60000, (4,), generator=gen).to(getattr(torch, name))
    return out


def write(path, tensors, metadata=None):
    save_file(tensors, str(path), metadata=metadata)
    return path


class TinyNet(torch.nn.Module):
    """Small model with a buffer, a non-persistent buffer and a tied weight."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.out = torch.nn.Linear(16, 8, bias=False)
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("offset", torch.arange(8.0), persistent=False)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.embed(x)))) * self.scale + self.offset


def tiny_reference(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet().eval()


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


# ----------------------------------------------------------------------------- read-only views

WRITES = {
    "add_": lambda t: t.add_(1),
    "copy_": lambda t: t.copy_(torch.zeros_like(t)),
    "setitem": lambda t: t.__setitem__(0, 5.0),
    "out=": lambda t: torch.add(t, 1, out=t),
    "relu inplace": lambda t: torch.nn.functional.relu(t, inplace=True),
    "view then write": lambda t: t.view(-1).__setitem__(1, 9.0),
    "transpose mul_": lambda t: t.t().mul_(2),
    ".data add_": lambda t: t.data.add_(1),
    "detach fill_": lambda t: t.detach().fill_(0),
    "init zeros_": lambda t: torch.nn.init.zeros_(t),
    "resize_": lambda t: t.resize_(1000),
    "iadd": lambda t: t.__iadd__(1),
    "foreach": lambda t: torch._foreach_add_([t], 1.0),
    "index_put_": lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(1.0)),
    "masked_fill_": lambda t: t.masked_fill_(t > 0, 0),
    "split piece": lambda t: t.split(1)[0].zero_(),
    "unbind piece": lambda t: t.unbind(0)[1].neg_(),
    "share_memory_": lambda t: t.share_memory_(),
    "as_subclass": lambda t: t.as_subclass(torch.Tensor),
    "in inference mode": lambda t: _in_inference(lambda: t.sub_(1)),
}


def _in_inference(fn):
    with torch.inference_mode():
        fn()


@pytest.mark.parametrize("how", sorted(WRITES))
def test_write_attempt_raises_and_base_is_unchanged(tmp_path, how):
    written = {"w": torch.randn(4, 3), "v": torch.randn(5)}
    path = write(tmp_path / "m.safetensors", written)
    ckpt = SharedCheckpoint.open(path)
    with pytest.raises(ReadOnlyWeightError, match=r"tensor 'w' of .*m\.safetensors"):
        WRITES[how](ckpt["w"])
    assert torch.equal(ckpt["w"], written["w"]) and torch.equal(ckpt["v"], written["v"])


def test_guard_is_per_thread_under_concurrent_rank_threads(tmp_path):
    written = {"w": torch.randn(64, 64)}
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", written))
    x = torch.randn(8, 64)

    def hammer(rank, comm):
        w, refused = ckpt["w"], 0
        for i in range(200):
            y = torch.nn.functional.linear(x, w)          # reads are fine
            assert torch.equal(y, torch.nn.functional.linear(x, written["w"]))
            try:
                w[i % 64].add_(1.0)
            except ReadOnlyWeightError:
                refused += 1
        return refused, torch._C._len_torch_dispatch_stack()

    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=THREAD_LIMIT_S) as coord:
        results = coord.run(hammer)
    assert results == [(200, 0)] * 4          # every write refused, no mode left on any thread
    assert torch.equal(ckpt["w"], written["w"])


def test_numpy_views_are_read_only_and_copies_are_writable(tmp_path):
    written = {"w": torch.randn(4, 3)}
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", written))
    import numpy as np
    for array in (ckpt["w"].numpy(), np.asarray(ckpt["w"])):
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1.0
    clone = ckpt["w"].clone()
    clone.add_(1)                               # a copy is private and writable
    deep = copy.deepcopy(ckpt["w"])
    deep.mul_(0)
    moved = ckpt["w"].to(torch.float64)
    moved.add_(1)
    assert not any(is_read_only(t) for t in (clone, deep, moved))
    assert torch.equal(ckpt["w"], written["w"])


def test_replica_module_weights_refuse_writes(tmp_path):
    ref = tiny_reference()
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", ref.state_dict()))
    replica = RankReplica(ckpt, "cpu", template=ref).load()
    with pytest.raises(ReadOnlyWeightError):
        replica.module.embed.weight.data.mul_(2)
    with pytest.raises(RuntimeError, match="read-only"):  # load_state_dict wraps the error
        replica.module.load_state_dict({k: torch.zeros_like(v) for k, v in ref.state_dict().items()})
    assert torch.equal(ckpt["embed.weight"], ref.embed.weight)


# ----------------------------------------------------------------------------- corrupt files

def raw_file(header, data: bytes, length: int | None = None, header_bytes: bytes | None = None) -> bytes:
    body = header_bytes if header_bytes is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


F32x6 = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}


def _corrupt_cases():
    good = {"blocks.0.weight": F32x6}
    data = bytes(24)
    valid = raw_file(good, data)
    two = lambda a, b: {"blocks.0.weight": a, "blocks.1.weight": b}  # noqa: E731
    return {
        "empty file": (b"", None, "truncated"),
        "shorter than the length field": (b"\x01\x02\x03", None, "truncated"),
        "truncated in the data": (valid[:-5], "blocks.0.weight", "out of range"),
        "length beyond the file": (raw_file(good, data, length=10**6), None, "bad header length"),
        "absurd length": (raw_file(good, data, length=2**63), None, "bad header length"),
        "length too small": (raw_file(good, data, length=1), None, "bad header length"),
        "bad JSON": (raw_file(None, b"", header_bytes=b'{"a": [1, '), None, "bad JSON"),
        "not UTF-8": (raw_file(None, b"", header_bytes=b'{"\xff\xfe": 1}'), None, "bad JSON"),
        "NaN in JSON": (raw_file(None, b"", header_bytes=b'{"x": NaN}'), None, "bad JSON"),
        "JSON list": (raw_file([1, 2], b""), None, "not an object"),
        "duplicate names": (raw_file(None, data, header_bytes=(
            b'{"blocks.0.weight": ' + json.dumps(F32x6).encode() + b', "blocks.0.weight": '
            + json.dumps(F32x6).encode() + b'}')), None, "duplicate key 'blocks.0.weight'"),
        "entry not an object": (raw_file({"blocks.0.weight": [1]}, b""), "blocks.0.weight",
                                "must be an object"),
        "entry lacks a field": (raw_file({"blocks.0.weight": {"dtype": "F32", "shape": [1]}}, b""),
                                "blocks.0.weight", "lacks data_offsets"),
        "unknown dtype": (raw_file({"blocks.0.weight": {**F32x6, "dtype": "F7"}}, data),
                          "blocks.0.weight", "unknown dtype 'F7'"),
        "dtype not a string": (raw_file({"blocks.0.weight": {**F32x6, "dtype": 4}}, data),
                               "blocks.0.weight", "unknown dtype 4"),
        "offsets out of range": (raw_file({"blocks.0.weight": {**F32x6, "data_offsets": [0, 48]}}, data),
                                 "blocks.0.weight", "out of range"),
        "offsets reversed": (raw_file({"blocks.0.weight": {**F32x6, "data_offsets": [24, 0]}}, data),
                             "blocks.0.weight", "end before they begin"),
        "offsets not a pair": (raw_file({"blocks.0.weight": {**F32x6, "data_offsets": [0, 12, 24]}}, data),
                               "blocks.0.weight", "data_offsets must be"),
        "offsets negative": (raw_file({"blocks.0.weight": {**F32x6, "data_offsets": [-1, 23]}}, data),
                             "blocks.0.weight", "data_offsets must be"),
        "overlapping offsets": (raw_file(two(F32x6, {"dtype": "F32", "shape": [3],
                                                     "data_offsets": [12, 24]}), data),
                                "blocks.1.weight", "overlap tensor 'blocks.0.weight'"),
        "gap between tensors": (raw_file(two({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                             {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}),
                                         data), "blocks.1.weight", "gap of 8"),
        "trailing bytes": (raw_file(good, data + b"junk"), None, "4 trailing bytes"),
        "shape x itemsize != size": (raw_file({"blocks.0.weight": {**F32x6, "shape": [2, 2]}}, data),
                                     "blocks.0.weight", r"shape \[2, 2\] x 4 bytes"),
        "shape not a list": (raw_file({"blocks.0.weight": {**F32x6, "shape": "2x3"}}, data),
                             "blocks.0.weight", "shape must be a list"),
        "negative dimension": (raw_file({"blocks.0.weight": {**F32x6, "shape": [-2, -3]}}, data),
                               "blocks.0.weight", "shape must be a list"),
        "boolean dimension": (raw_file({"blocks.0.weight": {**F32x6, "shape": [True, 6]}}, data),
                              "blocks.0.weight", "shape must be a list"),
        "float dimension": (raw_file({"blocks.0.weight": {**F32x6, "shape": [2.0, 3]}}, data),
                            "blocks.0.weight", "shape must be a list"),
        "metadata not strings": (raw_file({**good, "__metadata__": {"a": 1}}, data), None,
                                 "__metadata__"),
    }


CORRUPT = _corrupt_cases()


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_file_gives_its_specific_error_and_leaves_registry_clean(tmp_path, case):
    content, tensor, problem = CORRUPT[case]
    keeper = SharedCheckpoint.open(write(tmp_path / "good.safetensors", {"k": torch.ones(2)}))
    registered = shared_checkpoint_sources()
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        SharedCheckpoint.open(path)
    message = str(info.value)
    assert str(path) in message
    assert __import__("re").search(problem, message), message
    if tensor is not None:
        assert repr(tensor) in message, message
    assert shared_checkpoint_sources() == registered and not sc._pending
    # The registry is usable: the same path, repaired, opens and reads.
    write(path, {"k": torch.zeros(3)})
    assert torch.equal(SharedCheckpoint.open(path)["k"], torch.zeros(3))
    assert keeper is SharedCheckpoint.open(tmp_path / "good.safetensors")


def test_missing_file_and_directory_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        SharedCheckpoint.open(tmp_path / "absent.safetensors")
    with pytest.raises(CheckpointError, match="not a regular file|cannot open"):
        SharedCheckpoint.open(tmp_path)
    assert shared_checkpoint_sources() == []


# ----------------------------------------------------------------------------- property tests

def _check_invariants(header, file_size):
    data_size = file_size - 8 - header.header_bytes
    position = 0
    for info in header.tensors.values():  # in data order
        assert info.begin == position or (info.begin == info.end == position)
        assert info.nbytes == math.prod(info.shape) * info.dtype.itemsize
        position = max(position, info.end)
    assert position == data_size


def _parse_only_our_error(content: bytes, file_size=None):
    try:
        header = parse_safetensors_prefix(content, file_size, source="fuzz.safetensors")
    except CheckpointError as exc:
        assert "fuzz.safetensors" in str(exc)
        return
    _check_invariants(header, len(content) if file_size is None else file_size)


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(st.binary(max_size=96), st.one_of(st.none(), st.integers(0, 2**64)))
def test_parser_on_random_bytes_raises_only_checkpoint_error(content, file_size):
    _parse_only_our_error(content, file_size)


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=12)
entry_values = st.one_of(
    json_values,
    st.fixed_dictionaries({
        "dtype": st.one_of(st.sampled_from(sorted(SAFETENSORS_DTYPES) + ["F4", "f32", ""]), json_scalars),
        "shape": st.one_of(st.lists(st.integers(-2, 5), max_size=3), json_values),
        "data_offsets": st.one_of(st.lists(st.integers(-4, 80), min_size=2, max_size=2), json_values),
    }))


@PROPERTY_SETTINGS
@given(st.dictionaries(st.text(max_size=10), entry_values, max_size=4),
       st.one_of(st.none(), st.dictionaries(st.text(max_size=4), json_values, max_size=2)),
       st.integers(0, 96))
def test_parser_on_random_headers_raises_only_checkpoint_error(entries, metadata, data_size):
    header = dict(entries)
    if metadata is not None:
        header["__metadata__"] = metadata
    _parse_only_our_error(raw_file(header, bytes(data_size)))


def _valid_file() -> bytes:
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
              "c": {"dtype": "I64", "shape": [], "data_offsets": [22, 30]}}
    return raw_file(header, bytes(range(30)))


@PROPERTY_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["flip", "insert", "delete", "set"]),
                          st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6),
       st.integers(-40, 0))
def test_parser_on_mutated_valid_headers_raises_only_checkpoint_error(edits, cut):
    content = bytearray(_valid_file())
    for op, where, value in edits:
        i = where % (len(content) + 1)
        if op == "insert":
            content.insert(i, value)
        elif content and i < len(content):
            if op == "flip":
                content[i] ^= 1 << (value % 8)
            elif op == "delete":
                del content[i]
            else:
                content[i] = value
    if cut:
        del content[cut:]
    _parse_only_our_error(bytes(content))


def test_valid_header_parses_with_every_supported_dtype(tmp_path):
    path = write(tmp_path / "m.safetensors", sample_tensors(), metadata={"k": "v"})
    content = path.read_bytes()
    header = parse_safetensors_prefix(content)
    assert header.metadata == {"k": "v"} and len(header.tensors) == len(sample_tensors())
    _check_invariants(header, len(content))


# ----------------------------------------------------------------------------- hot caches

def test_four_rank_replicas_and_three_reload_cycles_read_the_file_once(tmp_path):
    ref = tiny_reference()
    path = write(tmp_path / "tiny.safetensors", ref.state_dict())
    file_size = os.path.getsize(path)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    want = ref.double()(x.double())   # replicas are built in float64: real copies, not views
    with torch.device("meta"):
        template = TinyNet()
    template.offset = torch.arange(8.0)  # non-persistent buffers carry no checkpoint values

    before = total_bytes_read()

    def build(rank, comm):
        base = SharedCheckpoint.open(path)   # every rank opens concurrently: one read
        return RankReplica(base, comm.device, rank=rank, template=template, dtype=torch.float64).load()

    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=THREAD_LIMIT_S) as coord:
        replicas = coord.run(build)
        assert len({id(r.base) for r in replicas}) == 1
        for cycle in range(4):
            for r in replicas:
                assert r.resident and r.resident_bytes > 0
                out = r.module(x.double())
                assert torch.equal(out, want), f"cycle {cycle} rank {r.rank}"
                for name, t in ref.state_dict().items():
                    assert torch.equal(r.state_dict()[name], t.double()), name
            if cycle == 3:
                break
            assert model_stage_unload(replicas) > 0
            for r in replicas:
                assert not r.resident and r.resident_bytes == 0
                assert is_read_only(r.module.embed.weight)      # back on the shared base
            coord.run(lambda rank, comm: replicas[rank].load() and None)
    assert total_bytes_read() - before == file_size


def test_cpu_replicas_in_the_stored_dtype_are_zero_copy_views(tmp_path):
    tensors = sample_tensors()
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", tensors))
    family = RankReplicas(ckpt, ["cpu"] * 4)
    for replica in family:
        assert replica.resident_bytes == 0
        for name, want in tensors.items():
            t = replica.state_dict()[name]
            assert is_read_only(t) and bit_equal(t, want)
            assert t.data_ptr() == ckpt[name].data_ptr()
    assert offload_components(family) == 0


def test_replica_with_prefix_and_tied_weights(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

    torch.manual_seed(1)
    model = Tied()
    path = write(tmp_path / "full.safetensors", {"model.diffusion_model.a.weight": model.a.weight.detach(),
                                                  "text.weight": torch.ones(2)})
    ckpt = SharedCheckpoint.open(path)
    replica = RankReplica(ckpt, "cpu", template=model, prefix="model.diffusion_model.",
                          dtype=torch.float64).load()
    assert replica.module.a.weight is replica.module.b.weight
    assert torch.equal(replica.module.b.weight, model.a.weight.double())


def test_replica_errors_name_the_tensor(tmp_path):
    ref = tiny_reference()
    sd = ref.state_dict()
    missing = dict(sd)
    del missing["norm.bias"]
    with pytest.raises(ValueError, match="norm.bias"):
        RankReplica(SharedCheckpoint.open(write(tmp_path / "a.safetensors", missing)), "cpu", template=ref)
    wrong = dict(sd, **{"out.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"'out.weight' has shape \(3, 3\) but the model expects \(8, 16\)"):
        RankReplica(SharedCheckpoint.open(write(tmp_path / "b.safetensors", wrong)), "cpu", template=ref)


def test_patches_reach_every_replica_and_survive_reload(tmp_path):
    ref = tiny_reference()
    path = write(tmp_path / "m.safetensors", {k: v.bfloat16() if v.dim() == 2 else v
                                              for k, v in ref.state_dict().items()})
    ckpt = SharedCheckpoint.open(path)
    written = {k: ckpt[k].clone() for k in ckpt}
    family = RankReplicas(ckpt, ["cpu"] * 4, ref)
    gen = torch.Generator().manual_seed(3)
    deltas = {"embed.weight": torch.randn(16, 8, generator=gen) * 0.01,
              "norm.bias": torch.randn(16, generator=gen)}
    strength = 0.75
    before = total_bytes_read()
    with pytest.raises(ValueError, match="unknown weight"):
        family.add_patches({"nope.weight": torch.zeros(1), **deltas})
    with pytest.raises(ValueError, match="shape"):
        family.add_patches({"embed.weight": torch.zeros(8, 16)})
    assert family.patches.names() == []        # a refused patch changes nothing
    assert sorted(family.add_patches(deltas, strength)) == sorted(deltas)
    expected = {k: (written[k].float() + strength * d).to(written[k].dtype) for k, d in deltas.items()}
    x = torch.randn(2, 8, generator=gen)
    for cycle in range(3):
        outs = []
        for replica in family:
            sd = replica.state_dict()
            for name, want in expected.items():
                assert bit_equal(sd[name], want), (cycle, replica.rank, name)
            assert is_read_only(sd["out.weight"])        # unpatched CPU weights stay zero-copy
            outs.append(_forward_float(replica.module, x))
        assert all(torch.equal(o, outs[0]) for o in outs)   # identical on every rank
        offload_components(family)
        family.load()
    for name, t in written.items():
        assert bit_equal(ckpt[name], t), name             # the base never changes
    assert total_bytes_read() == before                   # patches and reloads read nothing
    family.clear_patches()
    assert all(is_read_only(r.state_dict()["embed.weight"]) for r in family)


def _forward_float(module, x):
    # bf16 weights: run a float copy of the replica's weights through the reference module.
    ref = TinyNet()
    ref.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    return ref(x)


def test_patches_added_while_unloaded_apply_on_next_load(tmp_path):
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", {"w": torch.ones(3)}))
    family = RankReplicas(ckpt, ["cpu", "cpu"], load=False)
    family.add_patches({"w": torch.full((3,), 2.0)})
    assert all(torch.equal(r.state_dict()["w"], torch.ones(3)) for r in family)  # not resident yet
    family.load()
    assert all(torch.equal(r.state_dict()["w"], torch.full((3,), 3.0)) for r in family)


def test_release_cached_device_memory_uses_the_allocators_present(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(empty_cache=lambda: calls.append("npu")),
                        raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # what registers torch.npu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cuda"))
    assert release_cached_device_memory(["npu", "cpu", "cuda", "npu"]) == ["cuda", "npu"]
    assert calls == ["cuda", "npu"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert release_cached_device_memory(["cuda"]) == []    # never initialize CUDA just to empty it


def test_offload_components_unloads_every_family(tmp_path):
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", {"a": torch.ones(4), "b": torch.ones(2)}))
    dit = RankReplicas(ckpt, ["cpu"] * 2, dtype=torch.float64)
    text = RankReplicas(ckpt, ["cpu"] * 2, names=["b"], dtype=torch.float16)
    resident = sum(r.resident_bytes for r in (*dit, *text))
    assert resident == 2 * (4 * 8 + 2 * 8) + 2 * 2 * 2
    assert offload_components(dit, text) == resident
    assert not any(r.resident for r in (*dit, *text))
    with pytest.raises(ValueError, match="RankReplica"):
        model_stage_unload(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- ComfyUI helper

def _fake_comfy_lora(monkeypatch):
    """Stand-in for comfy.lora with ComfyUI's calculate_weight contract for 'diff' patches."""
    def calculate_weight(patches, weight, key):
        for strength, value, strength_model, *_ in patches:
            kind, (delta,) = value
            assert kind == "diff"
            weight = weight * strength_model + strength * delta.to(weight)
        return weight

    fake = types.ModuleType("comfy.lora")
    fake.calculate_weight = calculate_weight
    import comfy
    monkeypatch.setitem(sys.modules, "comfy.lora", fake)
    monkeypatch.setattr(comfy, "lora", fake, raising=False)


def _fake_patcher(diffusion_model, path=None, patches=None):
    return types.SimpleNamespace(
        model=types.SimpleNamespace(diffusion_model=diffusion_model), patches=patches or {}, backup={},
        cached_patcher_init=(lambda *a: None, (str(path), {})) if path else None)


def test_comfy_replicas_share_the_base_and_apply_model_patches(tmp_path, monkeypatch):
    _fake_comfy_lora(monkeypatch)
    ref = tiny_reference()
    path = write(tmp_path / "dit.safetensors", {"model.diffusion_model." + k: v
                                                for k, v in ref.state_dict().items()})
    delta = torch.randn(16, 8, generator=torch.Generator().manual_seed(9))
    patcher = _fake_patcher(ref, path, {"diffusion_model.embed.weight": [(0.5, ("diff", (delta,)), 1.0, None, None)],
                                        "text_encoder.unrelated": [(1.0, ("diff", (delta,)), 1.0, None, None)]})
    before = total_bytes_read()
    first = comfy_diffusion_model_replicas(patcher, ["cpu"] * 3, load=True)
    second = comfy_diffusion_model_replicas(patcher, ["cpu"], load=True)   # reuses the base
    assert total_bytes_read() - before == os.path.getsize(path)
    want = ref.embed.weight.detach() + 0.5 * delta
    for replica in (*first, *second):
        assert replica.module is not ref and isinstance(replica.module, TinyNet)
        assert torch.equal(replica.module.embed.weight, want)
        assert torch.equal(replica.module.out.weight, ref.out.weight) and is_read_only(replica.module.out.weight)
    assert torch.equal(ref.embed.weight, SharedCheckpoint.open(path)["model.diffusion_model.embed.weight"])


def test_comfy_replicas_from_loaded_weights_read_nothing(monkeypatch):
    ref = tiny_reference()
    before = total_bytes_read()
    family = comfy_diffusion_model_replicas(_fake_patcher(ref), ["cpu", "cpu"], load=True)
    assert total_bytes_read() == before
    x = torch.randn(2, 8)
    for replica in family:
        assert torch.equal(replica.module(x), ref(x))
        assert replica.module.embed.weight.data_ptr() == ref.embed.weight.data_ptr()   # zero-copy
    with pytest.raises(ValueError, match="ModelPatcher"):
        comfy_diffusion_model_replicas(object(), ["cpu"])


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
