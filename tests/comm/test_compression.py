"""The int8 / fp8 byte records of a compressed exchange: layout, bytes, and the round trip's error."""

import pytest
import torch

from comfy.multidevice.comm import compression
from comfy.multidevice.comm.compression import (bytes_ratio, check_precision, dequantize, ExchangePrecisionError,
                                                quantize, record_width, SCALE_DTYPE)

FORMATS = ["int8", "fp8"]


def scales_of(records, width):
    return records[..., width:].contiguous().view(SCALE_DTYPE).float()


def test_record_layout_payload_then_bf16_scales():
    # one row of 256 values: 2 blocks of 128; the second block is 10x the first
    x = torch.cat([torch.linspace(-1, 1, 128), torch.linspace(-10, 10, 128)]).view(1, 256)
    rec = quantize(x, "int8")
    assert rec.dtype == torch.uint8 and rec.shape == (1, 256 + 2 * 2) and rec.is_contiguous()
    payload = rec[..., :256].view(torch.int8)
    # amax codes to +-127, or 126 where the bf16 scale had to step up (at most 2^-7)
    assert int(payload[0, 0]) in (-127, -126) and int(payload[0, 255]) in (126, 127)
    scales = scales_of(rec, 256)[0]
    assert scales[0] >= 1 / 127 and scales[1] >= 10 / 127  # never below amax / 127: nothing clamps
    assert float(scales[1] / scales[0]) == pytest.approx(10, rel=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_ratio_with_scales(dtype):
    per_value = torch.empty((), dtype=dtype).element_size()
    assert record_width(128) == 130 and record_width(256) == 260
    assert bytes_ratio(128, dtype) == pytest.approx(130 / (128 * per_value))
    assert bytes_ratio(128, torch.bfloat16) == pytest.approx(0.5078125)
    x = torch.randn(3, 56, 5, 128).to(dtype)
    assert quantize(x, "int8").numel() / (x.numel() * per_value) == pytest.approx(bytes_ratio(128, dtype))


@pytest.mark.parametrize("precision", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 56, 37, 128), (3, 5, 7, 128), (2, 1, 256), (5, 16)])
def test_round_trip_error_within_the_format_bound(precision, dtype, shape):
    # uneven rows (37, 7, 5), heads x 128 and small head dims (one block of 16)
    gen = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[-1])).to(dtype)
    rec = quantize(x, precision)
    y = dequantize(rec, precision, dtype, shape[-1])
    assert y.shape == x.shape and y.dtype == dtype
    block = min(128, shape[-1])
    err = (y.float() - x.float()).abs().unflatten(-1, (-1, block))
    scale = scales_of(rec, shape[-1]).unsqueeze(-1)
    # the dtype's own rounding of the decoded value comes on top (bf16: 2^-9 relative)
    own = y.float().abs().unflatten(-1, (-1, block)) * (2 ** -8 if dtype == torch.bfloat16 else 1e-6)
    if precision == "int8":
        bound = scale / 2 + own
    else:  # 3 mantissa bits: half an ulp is 2^-4 of the coded value; subnormals below 2^-6
        bound = x.float().abs().unflatten(-1, (-1, block)) * 2 ** -4 + scale * 2 ** -10 + own
    assert bool((err <= bound * 1.001).all())
    rel = float((y.float() - x.float()).norm() / x.float().norm())
    assert rel < (0.02 if precision == "int8" else 0.05)  # values spread over 6 decades in a block


@pytest.mark.parametrize("precision", FORMATS)
def test_strided_records_and_inputs_decode_the_same(precision):
    x = torch.randn(4, 6, 9, 32).transpose(1, 2)  # a non-contiguous view
    rec = quantize(x, precision)
    assert torch.equal(rec, quantize(x.contiguous(), precision))
    view = rec.transpose(0, 1)  # what a backend hands back: a view in its gather layout
    assert torch.equal(dequantize(view, precision, torch.float32, 32),
                       dequantize(view.contiguous(), precision, torch.float32, 32))



@pytest.mark.parametrize("precision", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_decoding_in_the_target_dtype_equals_decoding_in_fp32(precision, dtype):
    """dequantize scales in bf16 / fp32 in place (no fp32 copy of what was received): bit for bit
    the codes times the scales in fp32, rounded once to `dtype`."""
    x = (torch.randn(3, 5, 256) * torch.logspace(-3, 3, 5).view(1, 5, 1)).to(dtype)
    rec = quantize(x, precision)
    codes = rec[..., :256].contiguous().view(torch.int8 if precision == "int8" else compression.fp8_dtype())
    reference = (codes.float().unflatten(-1, (2, 128)) * scales_of(rec, 256).unsqueeze(-1)).flatten(-2).to(dtype)
    decoded = dequantize(rec, precision, dtype, 256)
    assert decoded.dtype == dtype and torch.equal(decoded, reference)

def test_zero_blocks_decode_to_zero():
    x = torch.zeros(2, 3, 128)
    for precision in FORMATS:
        assert torch.equal(dequantize(quantize(x, precision), precision, torch.float32, 128), x)


def test_blocks_that_do_not_divide_the_row_are_refused():
    with pytest.raises(ExchangePrecisionError, match="must divide"):
        quantize(torch.randn(2, 200), "int8")
    with pytest.raises(ExchangePrecisionError, match="expected 130"):
        dequantize(torch.zeros(2, 129, dtype=torch.uint8), "int8", torch.float32, 128)


def test_precision_names_and_fp8_without_the_dtype(monkeypatch):
    assert check_precision(None) == "exact" and check_precision(" INT8 ") == "int8"
    with pytest.raises(ExchangePrecisionError, match="exact, int8, fp8"):
        check_precision("int4")
    monkeypatch.setattr(compression, "fp8_dtype", lambda: None)
    with pytest.raises(ExchangePrecisionError, match="set exchange_precision to int8"):
        check_precision("fp8")
