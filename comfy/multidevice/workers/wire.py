"""What crosses between rank 0 and the worker processes: data with a fixed, versioned schema.

Never a pickle: a pickle names functions the receiver calls, so whoever reaches the rendezvous
could run code in every process. A message here is

    MAGIC | schema version (u32) | header length (u64) | JSON header | raw bytes

The header holds the value tree: JSON's own None, bool, int, str, finite float and list, and
objects tagged {"$": kind, ...} for the rest: tuple, dict (any keys), non-finite float, tensor,
bytes, dtype, device, uuid, a registered record (one of our own dataclasses, by its fields) and
a reference to a record met earlier in the same message (shared objects stay shared). Tensors
and bytes are raw little-endian bytes after the header (64-byte aligned), named by offset and
length in the header. Decoding checks every offset, length, shape and dtype against the data
and the whole against `max_bytes` before it makes a tensor (a view of the received buffer, not
a copy); it imports nothing, and calls nothing a message names beyond making a registered
record from its fields. Encoding refuses anything else, naming where it sits in the value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import sys
import uuid
from typing import Any, Callable

import torch

SCHEMA_VERSION = 1
MAGIC = b"MMH3WIRE"
PREFIX = struct.Struct("<8sIQ")  # magic, schema version, header length
ALIGN = 64  # each raw part starts on a 64-byte boundary, as a torch allocation does
MAX_DEPTH = 64  # containers nested deeper are refused both ways (no recursion blow-up)
# The JSON tree is parsed into Python objects many times its size; real headers are KBs to a
# few MB (a LoRA's thousands of keys), the bulk of a message is its raw bytes
MAX_HEADER_BYTES = 64 << 20

# The dtypes a tensor may have, by the name the header uses; a newer torch's extra ones only
# where this torch has them (a name it lacks is refused when it arrives).
DTYPES = {name: getattr(torch, name) for name in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2") if isinstance(getattr(torch, name, None), torch.dtype)}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WireError(RuntimeError):
    """Data that does not parse as a message of this schema; the message names what and why."""


class WireTypeError(WireError, TypeError):
    """A value the schema cannot carry, named by its path inside what was being sent."""


@dataclasses.dataclass(frozen=True)
class _RecordSchema:
    cls: type
    fields: tuple[str, ...]
    make: Callable[..., Any]


_RECORDS: dict[str, _RecordSchema] = {}
_RECORD_NAMES: dict[type, str] = {}


def register_record(cls: type, name: str, *, fields: tuple[str, ...] | None = None,
                    make: Callable[..., Any] | None = None) -> type:
    """Let instances of `cls` (exactly that class) travel as `name` with `fields` (default: a
    dataclass's init fields); the receiver makes one with `make(**fields)` (default `cls`)."""
    fields = tuple(f.name for f in dataclasses.fields(cls) if f.init) if fields is None else tuple(fields)
    known = _RECORDS.get(name)
    if known is not None and (known.cls.__module__, known.cls.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"wire record {name!r} is {known.cls.__qualname__} already; give {cls.__qualname__} another name")
    _RECORDS[name] = _RecordSchema(cls, fields, cls if make is None else make)
    _RECORD_NAMES[cls] = name
    return cls


def wire_record(name: str, *, make: Callable[..., Any] | None = None):
    """Class decorator: `register_record(cls, name, make=make)`."""
    return lambda cls: register_record(cls, name, make=make)


# ----------------------------------------------------------------------------- encoding

# A path inside a value is (parent path, step), formatted only for an error message
_STEP_TEXT = {"root": "{}", "index": "[{}]", "item": "[{!r}]", "key": "<key {!r}>", "field": ".{}"}


def _path_text(path) -> str:
    steps = []
    while path is not None:
        path, (kind, at) = path
        steps.append(_STEP_TEXT[kind].format(at))
    return "".join(reversed(steps))


def _what_it_is(value) -> str:
    if isinstance(value, torch.nn.Module):
        return f"a torch module ({type(value).__name__})"
    if callable(value) and hasattr(value, "__qualname__"):
        kind = "a class" if isinstance(value, type) else "a function"
        return f"{kind} ({getattr(value, '__module__', '?')}.{value.__qualname__})"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


class _Encoder:
    """The header tree of a value, and its raw parts (None: only check the value)."""

    def __init__(self, collect: bool):
        self.parts: list | None = [] if collect else None
        self.records: dict[int, int] = {}  # id(record) -> its index, once encoded
        self.open: set[int] = set()  # records whose fields are being encoded
        self.keep: list = []  # the records numbered: their ids stay theirs until the end

    def refuse(self, path, problem: str):
        raise WireTypeError(f"{_path_text(path)}: {problem} cannot travel to another process")

    def part(self, data) -> int:
        if self.parts is None:
            return -1
        self.parts.append(data)
        return len(self.parts) - 1

    def node(self, value, path, depth: int = 0):
        if depth > MAX_DEPTH:
            self.refuse(path, f"a value nested deeper than {MAX_DEPTH} levels")
        kind = type(value)
        if value is None or kind in (bool, int, str):
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$": "float", "value": repr(value)}
        if kind is list:
            return [self.node(v, (path, ("index", i)), depth + 1) for i, v in enumerate(value)]
        if kind is tuple:
            return {"$": "tuple", "items": [self.node(v, (path, ("index", i)), depth + 1) for i, v in enumerate(value)]}
        if kind is dict:
            return {"$": "dict", "items": [[self.node(k, (path, ("key", k)), depth + 1),
                                            self.node(v, (path, ("item", k)), depth + 1)] for k, v in value.items()]}
        if kind in (torch.Tensor, torch.nn.Parameter):
            return self.tensor(value, path)
        if kind in (bytes, bytearray):  # a bytearray arrives as bytes
            return {"$": "bytes", "part": self.part(value)}
        if kind is torch.dtype:
            if value not in DTYPE_NAMES:
                self.refuse(path, f"the dtype {value}")
            return {"$": "dtype", "name": DTYPE_NAMES[value]}
        if kind is torch.device:
            return {"$": "device", "type": value.type, "index": value.index}
        if kind is uuid.UUID:
            return {"$": "uuid", "hex": value.hex}
        if kind in _RECORD_NAMES:
            return self.record(value, path, depth)
        if torch.is_tensor(value):
            self.refuse(path, f"a tensor subclass ({type(value).__name__}; send its plain tensors)")
        self.refuse(path, _what_it_is(value))

    def tensor(self, t: torch.Tensor, path):
        if t.dtype not in DTYPE_NAMES:
            self.refuse(path, f"a tensor of dtype {t.dtype}")
        if t.layout != torch.strided or t.device.type == "meta":
            self.refuse(path, f"a {t.layout} tensor on {t.device} (only values in memory travel)")
        part = -1
        if self.parts is not None:  # the receiver gets a CPU tensor of the same values
            plain = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
            part = self.part(plain)
        return {"$": "tensor", "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "part": part}

    def record(self, value, path, depth: int):
        key = id(value)
        if key in self.records:
            return {"$": "ref", "index": self.records[key]}
        if key in self.open:
            self.refuse(path, f"a {type(value).__name__} that contains itself")
        self.open.add(key)
        name = _RECORD_NAMES[type(value)]
        fields = {f: self.node(getattr(value, f), (path, ("field", f)), depth + 1) for f in _RECORDS[name].fields}
        self.open.discard(key)
        self.records[key] = len(self.records)
        self.keep.append(value)
        return {"$": "record", "name": name, "fields": fields}


def check_sendable(value: Any, *, name: str = "the value") -> None:
    """Raise WireTypeError, naming the path inside `value` (called `name`), if any part of it
    cannot travel; copies nothing."""
    _Encoder(collect=False).node(value, (None, ("root", name)))


def _raw(part) -> memoryview:
    if isinstance(part, torch.Tensor):
        return memoryview(part.reshape(-1).view(torch.uint8).numpy())
    return memoryview(part)


def encode(value: Any, *, name: str = "the message") -> bytearray:
    """`value` as one message (a bytearray, so the control channel sends it without another
    copy); WireTypeError names what cannot travel."""
    if sys.byteorder != "little":
        raise WireError("this schema's tensors are little-endian; this machine is big-endian")
    encoder = _Encoder(collect=True)
    tree = encoder.node(value, (None, ("root", name)))
    raws = [_raw(p) for p in encoder.parts]
    spans, at = [], 0
    for raw in raws:
        at = -(-at // ALIGN) * ALIGN
        spans.append([at, raw.nbytes])
        at += raw.nbytes
    header = json.dumps({"value": tree, "parts": spans}, separators=(",", ":"), allow_nan=False).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise WireTypeError(f"{name}: its structure needs a {len(header)}-byte header, more than the "
                            f"{MAX_HEADER_BYTES} a receiver parses; send fewer, larger tensors")
    start = -(-(PREFIX.size + len(header)) // ALIGN) * ALIGN
    out = bytearray(start + at)
    PREFIX.pack_into(out, 0, MAGIC, SCHEMA_VERSION, start - PREFIX.size)
    out[PREFIX.size:PREFIX.size + len(header)] = header
    out[PREFIX.size + len(header):start] = b" " * (start - PREFIX.size - len(header))  # JSON allows trailing blanks
    for raw, (offset, size) in zip(raws, spans):
        out[start + offset:start + offset + size] = raw.cast("B")
    return out


# ----------------------------------------------------------------------------- decoding

def _refuse_constant(text: str):
    raise ValueError(f"the JSON constant {text} (non-finite floats are tagged)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is not a finite float")
    return value


class _Decoder:
    def __init__(self, view: memoryview, start: int, parts: list, what: str):
        self.view, self.start, self.parts, self.what = view, start, parts, what
        self.records: list = []

    def fail(self, problem: str):
        raise WireError(f"{self.what}: {problem}")

    def fields(self, node: dict, *names: str) -> list:
        if set(node) != {"$", *names}:
            self.fail(f"a {node['$']!r} entry has the fields {sorted(node)}, not {sorted({'$', *names})}")
        return [node[n] for n in names]

    def node(self, node, depth: int = 0):
        if depth > MAX_DEPTH:
            self.fail(f"values nested deeper than {MAX_DEPTH} levels")
        kind = type(node)
        if node is None or kind in (bool, int, float, str):
            return node
        if kind is list:
            return [self.node(v, depth + 1) for v in node]
        if kind is not dict or not isinstance(node.get("$"), str):
            self.fail(f"a JSON {kind.__name__} without a kind tag where a value belongs")
        read = self.KINDS.get(node["$"])
        if read is None:
            self.fail(f"unknown kind {node['$'][:40]!r}")
        return read(self, node, depth + 1)

    def items(self, node, depth) -> list:
        (items,) = self.fields(node, "items")
        if type(items) is not list:
            self.fail(f"a {node['$']} whose items are not a list")
        return items

    def kind_tuple(self, node, depth):
        return tuple(self.node(v, depth) for v in self.items(node, depth))

    def kind_dict(self, node, depth):
        out = {}
        for pair in self.items(node, depth):
            if type(pair) is not list or len(pair) != 2:
                self.fail("a dict item that is not a [key, value] pair")
            key, value = self.node(pair[0], depth), self.node(pair[1], depth)
            try:
                out[key] = value
            except TypeError:
                self.fail(f"a dict key of type {type(key).__name__} (unhashable)")
        return out

    def kind_float(self, node, depth):
        (text,) = self.fields(node, "value")
        if text not in ("nan", "inf", "-inf"):
            self.fail(f"a non-finite float written {str(text)[:40]!r}, not nan, inf or -inf")
        return float(text)

    def dtype(self, name) -> torch.dtype:
        if type(name) is not str or name not in DTYPES:
            self.fail(f"unknown dtype {str(name)[:40]!r} (this process knows {', '.join(DTYPES)})")
        return DTYPES[name]

    def kind_dtype(self, node, depth):
        return self.dtype(*self.fields(node, "name"))

    def kind_device(self, node, depth):
        kind, index = self.fields(node, "type", "index")
        if type(kind) is not str or not (index is None or (type(index) is int and index >= 0)):
            self.fail(f"a device {str(kind)[:40]!r}:{str(index)[:20]} that is no device")
        try:
            return torch.device(kind, index)
        except RuntimeError as exc:
            self.fail(f"a device this torch does not know ({exc})")

    def kind_uuid(self, node, depth):
        (text,) = self.fields(node, "hex")
        if type(text) is not str or len(text) != 32:
            self.fail(f"a uuid written {str(text)[:40]!r}, not 32 hex digits")
        try:
            return uuid.UUID(hex=text)
        except ValueError:
            self.fail(f"a uuid written {text!r}, not 32 hex digits")

    def span(self, index) -> tuple[int, int]:
        if type(index) is not int or not 0 <= index < len(self.parts):
            self.fail(f"raw part {str(index)[:20]} of {len(self.parts)}")
        return self.parts[index]

    def kind_bytes(self, node, depth):
        (index,) = self.fields(node, "part")
        offset, size = self.span(index)
        return bytes(self.view[self.start + offset:self.start + offset + size])

    def kind_tensor(self, node, depth):
        dtype_name, shape, index = self.fields(node, "dtype", "shape", "part")
        dtype = self.dtype(dtype_name)
        if type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape):
            self.fail(f"a tensor shape {str(shape)[:60]} that is not a list of sizes >= 0")
        offset, size = self.span(index)
        numel = math.prod(shape)
        if numel * dtype.itemsize != size:
            self.fail(f"a {dtype_name} tensor of shape {shape} needs {numel * dtype.itemsize} bytes, "
                      f"its part has {size}")
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(self.view, dtype=dtype, count=numel, offset=self.start + offset).view(shape)
        if dtype == torch.bool and bool(t.view(torch.uint8).gt(1).any()):
            self.fail("a bool tensor with bytes other than 0 and 1")
        return t

    def kind_record(self, node, depth):
        name, fields = self.fields(node, "name", "fields")
        record = _RECORDS.get(name) if type(name) is str else None
        if record is None:
            self.fail(f"unknown record {str(name)[:60]!r} (this process has {', '.join(sorted(_RECORDS))})")
        if type(fields) is not dict or set(fields) != set(record.fields):
            got = sorted(fields) if type(fields) is dict else type(fields).__name__
            self.fail(f"record {name!r} with the fields {got}, not {sorted(record.fields)}")
        values = {f: self.node(v, depth) for f, v in fields.items()}  # in the sender's order
        try:
            made = record.make(**values)
        except Exception as exc:  # noqa: BLE001 - whatever the record refuses is a bad message
            raise WireError(f"{self.what}: record {name!r} refused its fields: {type(exc).__name__}: {exc}") from exc
        self.records.append(made)
        return made

    def kind_ref(self, node, depth):
        (index,) = self.fields(node, "index")
        if type(index) is not int or not 0 <= index < len(self.records):
            self.fail(f"a reference to record {str(index)[:20]}, of {len(self.records)} met so far")
        return self.records[index]

    KINDS = {"tuple": kind_tuple, "dict": kind_dict, "float": kind_float, "dtype": kind_dtype,
             "device": kind_device, "uuid": kind_uuid, "bytes": kind_bytes, "tensor": kind_tensor,
             "record": kind_record, "ref": kind_ref}


def decode(data, *, max_bytes: int, what: str) -> Any:
    """The value of one message (`data`: bytes, bytearray or a uint8 array; tensors are views
    of it unless it is read-only); WireError names `what` (e.g. "rank 2's status") and the fault."""
    view = memoryview(data).cast("B")
    if view.nbytes > max_bytes:
        raise WireError(f"{what}: {view.nbytes} bytes, more than the {max_bytes} this process takes")
    if view.nbytes < PREFIX.size:
        raise WireError(f"{what}: {view.nbytes} bytes, shorter than a message's {PREFIX.size}-byte prefix")
    magic, version, header_size = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"{what}: it starts with {magic!r}, not {MAGIC!r}: not a message of this project "
                        "(a pickle, another program, or a torn message)")
    if version != SCHEMA_VERSION:
        raise WireError(f"{what}: schema version {version}, this process reads {SCHEMA_VERSION}; run the "
                        "same version of this project on every rank")
    if header_size > view.nbytes - PREFIX.size:
        raise WireError(f"{what}: a {header_size}-byte header in {view.nbytes} bytes (truncated)")
    if header_size > MAX_HEADER_BYTES:
        raise WireError(f"{what}: a {header_size}-byte header, more than the {MAX_HEADER_BYTES} this process parses")
    start = PREFIX.size + header_size
    try:
        header = json.loads(bytes(view[PREFIX.size:start]), parse_constant=_refuse_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"{what}: its header is not JSON of this schema ({str(exc)[:200]})") from None
    if type(header) is not dict or set(header) != {"value", "parts"} or type(header["parts"]) is not list:
        raise WireError(f"{what}: its header is not {{value, parts}}")
    data_size = view.nbytes - start
    for span in header["parts"]:
        if not (type(span) is list and len(span) == 2 and all(type(n) is int and n >= 0 for n in span)
                and span[0] + span[1] <= data_size):
            raise WireError(f"{what}: raw part {str(span)[:60]} is not within its {data_size} bytes of raw data")
    if view.readonly:  # tensors must not alias an immutable bytes object
        view = memoryview(bytearray(view))
    try:
        return _Decoder(view, start, header["parts"], what).node(header["value"])
    except RecursionError:
        raise WireError(f"{what}: values nested too deep") from None
