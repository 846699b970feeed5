"""Shared inputs of the weights tests: tensors of every stored dtype, a tiny net (a buffer, a
non-persistent buffer, a tied weight), writing them as a safetensors file, parsing a header from
its bytes, bitwise comparison, and a ModelPatcher stand-in."""

import json
import struct
import types

import torch
from safetensors.torch import save_file

from comfy.multidevice.weights.safetensors_header import (CheckpointError, HEADER_LENGTH_BYTES, parse_header_json,
                                                          parse_header_length, SafetensorsHeader)

THREAD_LIMIT_S = 30


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


def raw_file(header, data: bytes, length: int | None = None, header_bytes: bytes | None = None) -> bytes:
    """A safetensors file's bytes from a header (as JSON, or `header_bytes` as they are), its data
    and the length field (the header's own length unless `length` is given)."""
    body = header_bytes if header_bytes is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def fake_patcher(diffusion_model, path=None, patches=None):
    """A ModelPatcher as far as the replicas read it: its diffusion model, patches and file."""
    return types.SimpleNamespace(
        model=types.SimpleNamespace(diffusion_model=diffusion_model), patches=patches or {}, backup={},
        cached_patcher_init=(lambda *a: None, (str(path), {})) if path else None)


def parse_safetensors_prefix(prefix: bytes, file_size: int | None = None,
                             source: str = "<bytes>") -> SafetensorsHeader:
    """A header parsed from the first bytes of a file of `file_size` bytes (default: len(prefix))
    by the two steps weights/checkpoint.py reads a file with: the length field, then the JSON."""
    size = len(prefix) if file_size is None else file_size
    length = parse_header_length(prefix, size, source)
    header = prefix[HEADER_LENGTH_BYTES:HEADER_LENGTH_BYTES + length]
    if len(header) < length:
        raise CheckpointError(f"{source}: file is truncated inside the header: {len(header)} of "
                              f"{length} header bytes present")
    return parse_header_json(header, size - HEADER_LENGTH_BYTES - length, source)
