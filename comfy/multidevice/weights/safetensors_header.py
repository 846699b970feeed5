"""Our own parser and validator for the safetensors header.

A safetensors file is: an 8-byte little-endian header length N, N bytes of UTF-8 JSON,
then the data section. The JSON is an object mapping tensor names to
{"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the data section),
plus an optional "__metadata__" object of string -> string.

Every violation raises CheckpointError naming the file, the tensor and the problem. The
checks follow the format's reference implementation: the tensors must tile the data
section exactly (no overlap, no gap, nothing after the last one), so a file that passes
here is one the reference loader accepts too. Where Python's JSON reader is looser than the
reference's, the reference's rules are applied on top: at most 127 nested arrays/objects,
no lone UTF-16 surrogate escape in any string, numbers within a double's range, `-0` and
integers beyond 64 bits read as floats (so never a dimension or an offset), and the element
count multiplied out dimension by dimension without passing 2**64. A dimension must also fit
torch's int64 sizes, and an empty tensor's shape must be one torch can view (its strides fit).
tests/weights/test_safetensors_header.py checks this against the reference on generated files.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import torch

HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
MAX_JSON_DEPTH = 127             # the reference's JSON reader stops at 128 nested containers
U64_LIMIT = 2**64                # the reference counts sizes in 64-bit unsigned integers
MAX_DIMENSION = 2**63 - 1        # torch sizes are int64
METADATA_KEY = "__metadata__"

# safetensors dtype name -> torch dtype name; entries torch does not have are left out.
_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
}
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, tname) for name, tname in _DTYPE_NAMES.items() if hasattr(torch, tname)}
DTYPE_TO_SAFETENSORS: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used: the message names the file, the tensor and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the header; begin/end are byte offsets into the data section."""
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    header_bytes: int                 # N, the JSON length
    tensors: dict[str, TensorInfo]    # in file order of their data
    metadata: dict[str, str]          # "__metadata__", {} when absent

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


# ----------------------------------------------------------------------------- parsing

def parse_header_length(first_bytes: bytes, file_size: int, source: str) -> int:
    """Validate the 8-byte length field against the file size; return N."""
    if file_size < HEADER_LENGTH_BYTES or len(first_bytes) < HEADER_LENGTH_BYTES:
        raise CheckpointError(
            f"{source}: file is truncated: it has {min(file_size, len(first_bytes))} bytes, fewer "
            f"than the {HEADER_LENGTH_BYTES}-byte header length field; re-download or re-save it")
    (length,) = struct.unpack("<Q", first_bytes[:HEADER_LENGTH_BYTES])
    if length < 2:
        raise CheckpointError(
            f"{source}: bad header length {length}: the JSON header needs at least 2 bytes ('{{}}'); "
            "this is not a safetensors file")
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{source}: bad header length {length}: above the format's limit of {MAX_HEADER_BYTES} "
            "bytes; this is not a safetensors file (or its first 8 bytes are damaged)")
    if length > file_size - HEADER_LENGTH_BYTES:
        raise CheckpointError(
            f"{source}: bad header length {length}: the file has only "
            f"{file_size - HEADER_LENGTH_BYTES} bytes after the length field; the file is truncated "
            "or not a safetensors file")
    return length


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _json_int(text: str):
    """An integer literal as the reference reads it: `-0` and anything outside 64 bits become
    floats (so they are never valid sizes), and one beyond a double's range is an error."""
    if text == "-0":
        return -0.0
    value = int(text)
    if -2**63 <= value < U64_LIMIT:
        return value
    return float(value)  # OverflowError beyond the double range


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _check_json_limits(obj: Any) -> None:
    """Raise ValueError where the reference's JSON reader refuses what Python's accepts:
    nesting deeper than MAX_JSON_DEPTH, a lone surrogate (e.g. from "\\ud800") in a string."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")  # fails exactly on a lone surrogate
            except UnicodeEncodeError:
                raise ValueError(f"the string {short_repr(value)} holds a lone UTF-16 surrogate "
                                 "escape") from None
        elif isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"arrays/objects nested more than {MAX_JSON_DEPTH} deep")
            items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
            for key, item in items:
                if key is not None:
                    stack.append((key, depth))
                stack.append((item, depth + 1))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_header_json(header: bytes, data_size: int, source: str) -> SafetensorsHeader:
    """Parse and validate the JSON header against a data section of `data_size` bytes."""
    try:
        text = header.decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant,
                         parse_int=_json_int, parse_float=_json_float)
        _check_json_limits(obj)
    # JSONDecodeError and UnicodeDecodeError are ValueErrors; OverflowError: an int beyond a double
    except (ValueError, RecursionError, OverflowError) as exc:
        raise CheckpointError(f"{source}: bad JSON in the header: {exc}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{source}: the header is JSON {type(obj).__name__}, not an object of tensor entries")

    metadata = obj.get(METADATA_KEY)
    metadata = {} if metadata is None else metadata  # the reference takes null for "none"
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{source}: '{METADATA_KEY}' must be an object of string -> string, "
                              f"got {short_repr(metadata)}")

    infos = [_parse_entry(name, entry, data_size, source)
             for name, entry in obj.items() if name != METADATA_KEY]
    tensors = _check_layout(infos, data_size, source)
    return SafetensorsHeader(header_bytes=len(header), tensors=tensors, metadata=dict(metadata))


# ----------------------------------------------------------------------------- validation

def short_repr(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _parse_entry(name: str, entry: Any, data_size: int, source: str) -> TensorInfo:
    where = f"{source}: tensor {name!r}"
    if isinstance(entry, list):  # serde reads a struct from a list of its fields; no writer makes one
        raise CheckpointError(f"{where}: entry must be an object with dtype, shape and data_offsets, "
                              f"not a list ({short_repr(entry)}); re-save the file with safetensors' "
                              "save_file to get the object form")
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: entry must be an object with dtype, shape and data_offsets, "
                              f"got {short_repr(entry)}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise CheckpointError(f"{where}: entry lacks {', '.join(missing)}")

    dtype_name = entry["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: unknown dtype {short_repr(dtype_name)}; supported: "
                              f"{', '.join(sorted(SAFETENSORS_DTYPES))}")
    dtype = SAFETENSORS_DTYPES[dtype_name]

    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers, "
                              f"got {short_repr(shape)}")
    if any(d > MAX_DIMENSION for d in shape):
        raise CheckpointError(f"{where}: shape {short_repr(shape)} has a dimension above "
                              f"{MAX_DIMENSION}, more than torch can hold")
    elements = 1
    for d in shape:  # in order, as the reference multiplies: it refuses any overflow on the way
        elements *= d
        if elements >= U64_LIMIT:
            raise CheckpointError(f"{where}: shape {short_repr(shape)}: the element count overflows "
                                  "64 bits")
    if elements == 0:  # huge dimensions pass the byte count: ask torch, as the loader's .view() will
        try:
            torch.empty(0, dtype=dtype).view(shape)
        except RuntimeError as exc:
            raise CheckpointError(f"{where}: shape {short_repr(shape)}: torch cannot make an empty tensor "
                                  f"of this shape ({exc})") from None

    offsets = entry["data_offsets"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_is_int(o) and o >= 0 for o in offsets)):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] with non-negative "
                              f"integers, got {short_repr(offsets)}")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
    if end > data_size:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] are out of range: the data section has "
            f"{data_size} bytes (file truncated?)")

    itemsize = dtype.itemsize
    expected = elements * itemsize
    if expected != end - begin:
        raise CheckpointError(
            f"{where}: shape {shape} x {itemsize} bytes ({dtype_name}) = {expected} bytes, but "
            f"data_offsets [{begin}, {end}] hold {end - begin} bytes")
    return TensorInfo(name, dtype, tuple(shape), begin, end)


def _check_layout(infos: list[TensorInfo], data_size: int, source: str) -> dict[str, TensorInfo]:
    """Tensors must tile [0, data_size) exactly: no overlap, no gap, nothing trailing."""
    ordered = sorted(infos, key=lambda t: (t.begin, t.end))
    position, previous = 0, None
    for info in ordered:
        if info.begin < position:
            raise CheckpointError(
                f"{source}: tensor {info.name!r} data_offsets [{info.begin}, {info.end}] overlap "
                f"tensor {previous.name!r} [{previous.begin}, {previous.end}]")
        if info.begin > position:
            raise CheckpointError(
                f"{source}: tensor {info.name!r} starts at data byte {info.begin} but the previous "
                f"tensor ends at {position}: a gap of {info.begin - position} unaccounted bytes")
        if info.end > position:
            position, previous = info.end, info
    if position != data_size:
        raise CheckpointError(
            f"{source}: the tensors cover {position} bytes but the data section has {data_size}: "
            f"{data_size - position} trailing bytes belong to no tensor")
    return {t.name: t for t in ordered}
