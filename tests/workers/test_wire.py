"""What crosses between rank 0 and the workers (comfy/multidevice/workers/wire.py): every kind of
value round-trips exactly, real messages too; a pickle (or any other bytes) is refused without
running anything or allocating what it claims; what cannot travel is refused at encode time,
naming where it sits."""

from __future__ import annotations

import enum
import json
import math
import pathlib
import pickle
import struct
import uuid
from dataclasses import dataclass

import pytest
import torch

from comfy.multidevice.weights.block_shards import BlockShardPlan
from comfy.multidevice.workers.control import BUILD, ControlChannel, FORWARD, MAX_MESSAGE_BYTES
from comfy.multidevice.workers.recipe import ModelRecipe
from comfy.multidevice.workers.repeats import ReceivedTensors, Repeat, SentTensors
from comfy.multidevice.workers import wire
from comfy.multidevice.workers.wire import (decode, DTYPES, encode, MAGIC, PREFIX, SCHEMA_VERSION, wire_record,
                                            WireError, WireTypeError)

CAP = 1 << 20


def round_trip(value):
    return decode(encode(value), max_bytes=CAP, what="a test message")


@wire_record("test_wire.point")
@dataclass(frozen=True)
class Point:
    x: int
    label: object = None


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN payloads and -0.0 included)."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def random_tensor(dtype: torch.dtype, shape) -> torch.Tensor:
    """Random bytes as a tensor (any bit pattern; 0 or 1 for bool)."""
    raw = torch.randint(0, 2 if dtype == torch.bool else 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    return raw.view(dtype).reshape(shape)


def test_plain_values_round_trip_with_their_types():
    value = [None, True, False, 0, -7, 2 ** 80, 1.5, -0.0, 1e-310, "text", "ünï", [], [[1], [2.0]], (), (1, (2, "3")),
             {"a": 1, 2: "b", None: [], (1, "x"): {}, 2.5: True, False: 0}]
    out = round_trip(value)
    assert out == value
    assert [type(v) for v in out] == [type(v) for v in value]
    assert type(out[-1][(1, "x")]) is dict and type(out[14][1]) is tuple
    assert str(out[7]) == "-0.0"


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_non_finite_floats_round_trip(text):
    out = round_trip({"v": float(text)})["v"]
    assert repr(out) == text


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (2, 3, 5)])
def test_tensors_of_every_dtype_and_shape_round_trip_bit_for_bit(name, shape):
    t = random_tensor(DTYPES[name], shape)
    out = round_trip({"t": t})["t"]
    assert same_bits(out, t) and out.device.type == "cpu"


def test_non_contiguous_views_parameters_and_conjugates_arrive_as_plain_cpu_tensors():
    base = torch.randn(4, 6)
    values = {"transposed": base.t(), "strided": base[::2, 1::3], "expanded": torch.randn(3, 1).expand(3, 5),
              "parameter": torch.nn.Parameter(torch.randn(2, 2)), "conj": torch.randn(3, dtype=torch.complex64).conj()}
    out = round_trip(values)
    for name, t in values.items():
        got = out[name]
        assert type(got) is torch.Tensor and got.is_contiguous() and not got.is_conj(), name
        assert torch.equal(got, t.detach().resolve_conj()), name


def test_tensors_are_views_of_the_received_buffer_not_copies():
    big = torch.randn(256, 1024)  # 1 MiB
    data = encode([big])
    buffer = torch.frombuffer(data, dtype=torch.uint8).clone()  # a torch allocation, as the control channel receives into
    got = decode(buffer.numpy(), max_bytes=len(data), what="a big message")[0]
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert start <= got.data_ptr() and got.data_ptr() + got.nbytes <= end
    assert got.data_ptr() % 64 == 0  # aligned like a torch allocation
    assert torch.equal(got, big)


def test_bytes_dtypes_devices_uuids_and_records_round_trip():
    u = uuid.uuid4()
    shared = Point(1, "shared")
    value = {"bytes": b"\x00\xff" * 50, "empty": b"", "array": bytearray(b"abc"), "dtypes": [torch.bfloat16, torch.bool],
             "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")], "uuid": u,
             "points": [shared, Point(2, torch.arange(3)), shared, (shared,)]}
    out = round_trip(value)
    assert out["bytes"] == value["bytes"] and out["empty"] == b"" and out["array"] == b"abc"
    assert out["dtypes"] == value["dtypes"] and out["devices"] == value["devices"] and out["uuid"] == u
    points = out["points"]
    assert points[0] == shared and torch.equal(points[1].label, torch.arange(3))
    assert points[0] is points[2] is points[3][0]  # one object sent once, shared again on arrival


def test_a_forward_message_with_repeated_tensors_round_trips():
    sent, received = SentTensors(min_bytes=1024), ReceivedTensors()
    context = torch.randn(64, 32)
    options = {"sigmas": torch.tensor([0.5]), "uuids": [uuid.uuid4()], "cond_or_uncond": [0],
               "patches_replace": {"dit": {}}, "prefetch_dynamic_vbars": False}
    for step in range(2):
        latents = [torch.randn(1, 24, 2, 4, 6) + step, torch.randn(1, 32, 2, 5)]
        args, kwargs = [latents, torch.tensor([640.0]), context], {"transformer_options": options}
        (packed_args, packed_kwargs), new = sent.pack((args, kwargs))
        message = decode(encode((FORWARD, None, packed_args, packed_kwargs, new)), max_bytes=CAP, what="a forward")
        kind, method, got_args, got_kwargs, got_new = message
        assert (kind, method) == (FORWARD, None)
        assert isinstance(got_args[2], Repeat) and (step == 0) == (got_args[2].digest in got_new)
        got_args, got_kwargs = received.unpack((got_args, got_kwargs), got_new)
        assert torch.equal(got_args[0][0], latents[0]) and torch.equal(got_args[2], context)
        assert got_kwargs["transformer_options"]["uuids"] == options["uuids"]


def test_a_build_message_with_a_sharded_recipe_round_trips():
    plan = BlockShardPlan.balanced([{"a": 8, "b": 4}, {"a": 8, "b": 4}], 2)
    recipe = ModelRecipe("comfy.multidevice.workers.recipe", "miniature_shard_from_shared_checkpoint",
                         {"path": "/models/tiny.safetensors", "plan": plan, "dtype": torch.bfloat16}, sharded=True)
    kind, got, sp_mode, watch = round_trip((BUILD, recipe, "allgather", ("127.0.0.1", 29601)))
    assert kind == BUILD and sp_mode == "allgather" and watch == ("127.0.0.1", 29601)
    assert got == recipe and type(got.kwargs["plan"]) is BlockShardPlan and got.kwargs["plan"].owned_bytes(0) == 12


def test_the_split_travels_in_the_build_message_as_a_record():
    from comfy.multidevice.sp.split import RowSplit
    for split in (RowSplit(), RowSplit("weights", (3.0, 1.0)), RowSplit("auto", caps=(0.4, 1.0))):
        *_, got = round_trip((BUILD, "recipe", "allgather", None, split))
        assert got == split and type(got) is RowSplit


def test_encode_refuses_what_cannot_travel_naming_where_it_sits():
    class Color(enum.IntEnum):
        RED = 1

    class Sub(torch.Tensor):
        pass

    cases = {
        r"transformer_options\['foo'\]\[2\]: a function \(.*<lambda>\) cannot travel": {"foo": [1, 2, lambda: 0]},
        r"transformer_options\['f'\]: a function \(json.dumps\)": {"f": json.dumps},
        r"transformer_options\['m'\]: a torch module \(Linear\)": {"m": torch.nn.Linear(1, 1)},
        r"transformer_options\['c'\]: a class": {"c": torch.nn.Linear},
        r"transformer_options\['s'\]: a builtins.set": {"s": {1, 2}},
        r"transformer_options\['e'\]: a .*Color": {"e": Color.RED},
        r"transformer_options\['t'\]: a tensor subclass \(Sub": {"t": torch.zeros(2).as_subclass(Sub)},
        r"transformer_options\['meta'\]: a torch.strided tensor on meta": {"meta": torch.zeros(2, device="meta")},
        r"transformer_options\['p'\].label: a builtins.object": {"p": Point(1, object())},
        r"transformer_options<key <object": {object(): 1},
    }
    for pattern, value in cases.items():
        with pytest.raises(WireTypeError, match=pattern):
            encode(value, name="transformer_options")
    nested: list = []
    nested.append(nested)
    with pytest.raises(WireTypeError, match="nested deeper than 64 levels"):
        encode(nested)


def forged(header: dict, raw: bytes = b"", version: int = SCHEMA_VERSION, magic: bytes = MAGIC) -> bytes:
    body = json.dumps(header).encode()
    return PREFIX.pack(magic, version, len(body)) + body + raw


@pytest.mark.parametrize("data, fault", [
    (b"", "shorter than a message's 20-byte prefix"),
    (b"garbage that is long enough to read", "not a message of this project"),
    (forged({"value": 1, "parts": []}, version=SCHEMA_VERSION + 1), "schema version 2, this process reads 1"),
    (PREFIX.pack(MAGIC, SCHEMA_VERSION, 1 << 40) + b"{}", "header in 22 bytes \\(truncated\\)"),
    (forged({"value": 1}), "header is not {value, parts}"),
    (PREFIX.pack(MAGIC, SCHEMA_VERSION, 8) + b'{"value"', "header is not JSON"),
    (PREFIX.pack(MAGIC, SCHEMA_VERSION, 3) + b"NaN", "header is not JSON"),
    (PREFIX.pack(MAGIC, SCHEMA_VERSION, 6) + b"1e9999", "header is not JSON"),
    (PREFIX.pack(MAGIC, SCHEMA_VERSION, 200_000) + b"[" * 200_000, "(header is not JSON|nested)"),
    (forged({"value": {"$": "tensor", "dtype": "float32", "shape": [1 << 40], "part": 0}, "parts": [[0, 4]]},
            b"\0" * 4), "needs 4398046511104 bytes, its part has 4"),
    (forged({"value": {"$": "tensor", "dtype": "float32", "shape": [-1], "part": 0}, "parts": [[0, 4]]}, b"\0" * 4),
     "not a list of sizes >= 0"),
    (forged({"value": {"$": "tensor", "dtype": "float32", "shape": [1], "part": 0}, "parts": [[8, 4]]}, b"\0" * 4),
     "not within its 4 bytes of raw data"),
    (forged({"value": {"$": "tensor", "dtype": "float32", "shape": [1], "part": 3}, "parts": []}), "raw part 3 of 0"),
    (forged({"value": {"$": "tensor", "dtype": "float128", "shape": [1], "part": 0}, "parts": [[0, 16]]},
            b"\0" * 16), "unknown dtype 'float128'"),
    (forged({"value": {"$": "tensor", "dtype": "bool", "shape": [2], "part": 0}, "parts": [[0, 2]]}, b"\x01\x07"),
     "bool tensor with bytes other than 0 and 1"),
    (forged({"value": {"$": "record", "name": "os.system", "fields": {}}, "parts": []}), "unknown record 'os.system'"),
    (forged({"value": {"$": "record", "name": "repeat", "fields": {"digest": "a", "extra": 1}}, "parts": []}),
     "record 'repeat' with the fields \\['digest', 'extra'\\]"),
    (forged({"value": {"$": "record", "name": "repeat", "fields": {"digest": 5}}, "parts": []}),
     "record 'repeat' refused its fields: TypeError"),
    (forged({"value": {"$": "ref", "index": 0}, "parts": []}), "reference to record 0, of 0 met so far"),
    (forged({"value": {"$": "pickle", "data": "gASV"}, "parts": []}), "unknown kind 'pickle'"),
    (forged({"value": {"$": "tuple", "items": [], "extra": 1}, "parts": []}), "has the fields"),
    (forged({"value": {"$": "dict", "items": [[[1], 2]]}, "parts": []}), "unhashable"),
    (forged({"value": {"$": "device", "type": "nowhere", "index": 0}, "parts": []}), "a device this torch does not know"),
    (forged({"value": {"$": "float", "value": "1e400"}, "parts": []}), "not nan, inf or -inf"),
    (forged({"value": {"$": "uuid", "hex": "z" * 32}, "parts": []}), "not 32 hex digits"),
    (forged({"value": {"x": 1}, "parts": []}), "without a kind tag"),
])
def test_what_does_not_parse_is_a_wire_error_naming_the_fault(data, fault):
    with pytest.raises(WireError, match=f"a test message: .*{fault}"):
        decode(data, max_bytes=CAP, what="a test message")


def test_a_message_over_the_cap_or_truncated_anywhere_is_refused(monkeypatch):
    data = encode({"t": torch.randn(100), "s": "x" * 100})
    with pytest.raises(WireError, match=rf"{len(data)} bytes, more than the 100 this process takes"):
        decode(data, max_bytes=100, what="a test message")
    for cut in range(0, len(data), 7):
        with pytest.raises(WireError):
            decode(data[:cut], max_bytes=CAP, what="a test message")
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 64)  # the header cap, small enough to test cheaply
    with pytest.raises(WireError, match=r"a \d+-byte header, more than the 64 this process parses"):
        decode(data, max_bytes=CAP, what="a test message")
    with pytest.raises(WireTypeError, match=r"the message: its structure needs a \d+-byte header, more than the 64"):
        encode({"t": torch.randn(100), "s": "x" * 100})


class _Marker:
    """A pickle that, when unpickled, creates a file: what a hostile rank would send."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


class _ScriptedRanks:
    """torch.distributed as a ControlChannel of rank 0 (or of a worker) calls it, with the bytes
    rank 0 broadcasts (`message`) and the other ranks' statuses (`others`) given as raw bytes."""

    def __init__(self, monkeypatch, message: bytes = b"", others: tuple[bytes, ...] = (), announced: int | None = None):
        self.message, self.others = message, others
        self.announced = len(message) if announced is None else announced
        self.calls: list[str] = []
        for name in ("broadcast", "all_gather", "get_world_size", "get_rank"):
            monkeypatch.setattr(torch.distributed, name, getattr(self, name))

    def get_world_size(self, group=None):
        return 1 + len(self.others)

    def get_rank(self, group=None):
        return 0

    def broadcast(self, tensor, src, group=None):
        self.calls.append(f"broadcast {tensor.dtype}")
        if tensor.dtype == torch.int64:
            tensor[0] = self.announced
        else:
            tensor.copy_(torch.frombuffer(bytearray(self.message), dtype=torch.uint8))

    def all_gather(self, out, tensor, group=None):
        self.calls.append(f"all_gather {tensor.dtype}")
        out[0].copy_(tensor)
        for rank, data in enumerate(self.others, start=1):
            if tensor.dtype == torch.int64:
                out[rank][0] = len(data)
            else:
                out[rank].zero_()
                out[rank][:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def test_a_pickle_fed_to_the_control_channel_runs_nothing(tmp_path, monkeypatch):
    marker = tmp_path / "marker"
    payload = pickle.dumps(_Marker(marker))
    pickle.loads(payload)  # what the payload does to a process that unpickles it
    assert marker.exists()
    marker.unlink()
    _ScriptedRanks(monkeypatch, message=payload)
    with pytest.raises(WireError, match="rank 0's control message: it starts with .* not a message of this project"):
        ControlChannel().receive()
    _ScriptedRanks(monkeypatch, others=(encode((None, "host-a", 11)), payload))
    with pytest.raises(WireError, match="rank 2's status: it starts with"):
        ControlChannel().statuses((None, "host-0", 10))
    assert not marker.exists()


def test_statuses_gather_lengths_then_bytes_and_check_every_rank(monkeypatch):
    ranks = _ScriptedRanks(monkeypatch, others=(encode((None, "host-a", 11)), encode(("OSError: disk", "host-b", 12))))
    assert ControlChannel().statuses((None, "host-0", 10)) == [(None, "host-0", 10), (None, "host-a", 11),
                                                                 ("OSError: disk", "host-b", 12)]
    assert ranks.calls == ["all_gather torch.int64", "all_gather torch.uint8"]  # no *_object collective
    _ScriptedRanks(monkeypatch, others=(encode(("problem", "host-a", "11")),))
    with pytest.raises(WireError, match=r"rank 1's status is \('str', 'str', 'str'\), not \(problem"):
        ControlChannel().statuses((None, "host-0", 10))
    _ScriptedRanks(monkeypatch, others=(encode((None, "h" * 70_000, 11)),))
    with pytest.raises(WireError, match="rank 1's status: 70"):
        ControlChannel().statuses((None, "host-0", 10))


def test_a_worker_refuses_an_oversized_announcement_before_allocating(monkeypatch):
    ranks = _ScriptedRanks(monkeypatch, announced=MAX_MESSAGE_BYTES + 1)
    with pytest.raises(WireError, match=f"announced {MAX_MESSAGE_BYTES + 1} bytes, not 1 to {MAX_MESSAGE_BYTES}"):
        ControlChannel().receive()
    assert ranks.calls == ["broadcast torch.int64"]  # the bytes were never asked for


def test_a_message_sent_is_the_message_received(monkeypatch):
    sent: list[bytes] = []
    monkeypatch.setattr(torch.distributed, "broadcast",
                        lambda tensor, src, group=None: sent.append(bytes(tensor.numpy())))
    message = (FORWARD, "forward", [torch.randn(2, 3)], {"transformer_options": {"k": (1, None)}}, {})
    size = ControlChannel().send(message)
    assert struct.unpack("<q", sent[0])[0] == size == len(sent[1])
    _ScriptedRanks(monkeypatch, message=sent[1])
    got = ControlChannel().receive()
    assert got[:2] == message[:2] and torch.equal(got[2][0], message[2][0]) and got[3] == message[3]
