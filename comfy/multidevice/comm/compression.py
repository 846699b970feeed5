"""Leaf: the compressed exchange formats (int8, fp8) as byte records, and their error bounds.

A tensor is cut along its last dim (the head dim in every SP exchange) into blocks of
`DEFAULT_BLOCK` values (128; smaller when the last dim is, and it must divide the last
dim). Each row of the last dim becomes one uint8 record:

    [ n payload bytes | n / block scales, bfloat16 little-endian (2 bytes each) ]

  int8  payload = round(x / scale) in [-127, 127] as int8 bytes, scale = amax / 127
  fp8   payload = (x / scale) as float8_e4m3fn bytes, scale = amax / 448 (E4M3's largest
        finite value, so nothing clamps)

amax is the block's largest |x|. The scale is rounded to bfloat16 (never below amax / 127 or
amax / 448) *before* quantizing, so the
payload is coded against the scale the receiver reads (a bf16 scale adds no error of its own,
and keeps fp32's range: no block underflows). An all-zero block gets scale 1. Per 128 values a
record has 128 + 2 bytes: (128 + 2) / 256 = 0.508 of bf16, 0.254 of fp32. Non-finite values are
not carried (a block holding inf or nan decodes to nan): `exact` carries them.

Error of one value: int8 at most scale / 2 = amax / 254 (rounding); fp8 E4M3 at most 2^-4 of
the value (3 mantissa bits, round to nearest) above E4M3's smallest normal, amax * 2^-9 / 448
below it. The bounds of a block's and a step's output (`*_REL_ERROR_BOUND`) are what
bench/bench_exchange_precision.py measures against, with a margin; see there and the README.
"""

from __future__ import annotations

import torch

EXACT = "exact"
EXCHANGE_PRECISIONS = (EXACT, "int8", "fp8")
DEFAULT_BLOCK = 128
SCALE_DTYPE = torch.bfloat16
_SCALE_BYTES = 2
_INT8_MAX = 127.0
_FP8_NAME = "float8_e4m3fn"
_FP8_MAX = 448.0  # E4M3's largest finite value

# Documented bounds of the relative error (||out - exact|| / ||exact||, Frobenius) of the
# output against the exact exchange at the same W. bench/bench_exchange_precision.py measured,
# bf16, random weights: one block at H3's dims (5376, 56 x 128) int8 6.8e-4, fp8 1.2e-3; the
# step of a 4-block miniature (8 x 128 heads) int8 1.8e-3, fp8 2.9e-3; the same at W = 2, 4
# and 8 (every value is rounded once, whatever W). The bounds leave a margin of about 4x;
# tests and the bench fail above them. Random weights only: see the README for real weights.
BLOCK_REL_ERROR_BOUND = {"int8": 0.003, "fp8": 0.006}
STEP_REL_ERROR_BOUND = {"int8": 0.008, "fp8": 0.015}


class ExchangePrecisionError(ValueError):
    """An exchange precision this torch, device or tensor cannot use; the message names the fix."""


def fp8_dtype() -> torch.dtype | None:
    """torch's float8_e4m3fn, or None where this torch has none."""
    return getattr(torch, _FP8_NAME, None)


def check_precision(precision: str) -> str:
    """The precision name, checked: one of EXCHANGE_PRECISIONS and usable with this torch."""
    name = (precision or EXACT).strip().lower()
    if name not in EXCHANGE_PRECISIONS:
        raise ExchangePrecisionError(f"exchange_precision={precision!r} is unknown: set exchange_precision "
                                     f"to one of {', '.join(EXCHANGE_PRECISIONS)}.")
    if name == "fp8" and fp8_dtype() is None:
        raise ExchangePrecisionError(
            f"exchange_precision is fp8, which needs torch's {_FP8_NAME} and torch {torch.__version__} lacks "
            "it: set exchange_precision to int8, or install a torch of 2.1 or newer.")
    return name


def check_device_support(precision: str, device) -> str:
    """The checked precision, refused by name where `device` cannot make its payload (a tiny
    cast on the device: fp8 needs the cast to float8_e4m3fn there)."""
    name = check_precision(precision)
    if name == "fp8":
        try:
            torch.ones(2, device=device).to(fp8_dtype()).float()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            raise ExchangePrecisionError(
                f"exchange_precision is fp8, which {device} cannot make with this torch ({exc}): set "
                "exchange_precision to int8.") from exc
    return name


def block_size(width: int) -> int:
    """The block used for a last dim of `width` values: DEFAULT_BLOCK, or `width` when it is smaller."""
    size = min(DEFAULT_BLOCK, width)
    if size < 1 or width % size:
        raise ExchangePrecisionError(
            f"a compressed exchange cuts the last dim ({width} values) into blocks of {size}: it "
            "must divide it: set exchange_precision to exact for this model.")
    return size


def record_width(width: int) -> int:
    """Bytes of one record (one row of `width` values)."""
    return width + width // block_size(width) * _SCALE_BYTES


def bytes_ratio(width: int, dtype: torch.dtype) -> float:
    """Bytes of a record over the bytes of the row it codes (0.508 for 128 bf16 values)."""
    return record_width(width) / (width * torch.empty((), dtype=dtype).element_size())


def quantize(x: torch.Tensor, precision: str) -> torch.Tensor:
    """x [..., n] (floating) -> its records [..., record_width(n)] uint8, contiguous."""
    n = x.shape[-1]
    size = block_size(n)
    blocks = x.to(torch.float32, copy=True).unflatten(-1, (n // size, size))  # [..., n/b, b], coded in place
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    top = _INT8_MAX if precision == "int8" else _FP8_MAX
    # the nearest bf16, one bf16 step up where that lies below amax / top: |x| / scale <= top,
    # nothing clamps
    scale = (amax / top).to(SCALE_DTYPE)
    scale = torch.where(scale.float() * top < amax, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    coded = blocks.div_(scale.float())
    if precision == "int8":
        payload = coded.round_().clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    elif precision == "fp8":
        payload = coded.to(fp8_dtype())
    else:
        raise ExchangePrecisionError(f"quantize: no format {precision!r}; use int8 or fp8")
    out = torch.empty((*x.shape[:-1], record_width(n)), dtype=torch.uint8, device=x.device)
    out[..., :n].view(payload.dtype).copy_(payload.flatten(-2))
    out[..., n:].copy_(scale.squeeze(-1).contiguous().view(torch.uint8))  # bf16 bytes, little-endian
    return out


def dequantize(records: torch.Tensor, precision: str, dtype: torch.dtype, width: int) -> torch.Tensor:
    """records [..., record_width(width)] uint8 (any strides) -> [..., width] of `dtype`, contiguous."""
    size = block_size(width)
    count = width // size
    if records.shape[-1] != record_width(width):
        raise ExchangePrecisionError(f"dequantize: records of {records.shape[-1]} bytes, expected "
                                     f"{record_width(width)} for {width} values")
    # Decoded straight into `dtype` and scaled in place: no fp32 copy of what was received (at
    # 768p 15 s a block's gathered K and V are GBs). The same values as decoding in fp32 and
    # rounding once: the codes (int8, E4M3) are exact in bf16 and fp32, and torch multiplies
    # bf16 in fp32 and rounds once. fp16 (or another dtype) takes the fp32 route.
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    scales = records[..., width:].contiguous().view(SCALE_DTYPE).to(work)  # [..., n/b]
    raw = records[..., :width]
    payload = raw.view(torch.int8 if precision == "int8" else fp8_dtype())  # one byte each: any strides
    values = payload.to(work).unflatten(-1, (count, size))
    values.mul_(scales.unsqueeze(-1))
    return values.flatten(-2).to(dtype)
