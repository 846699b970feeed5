"""Fixtures of the sequence-parallel tests: the tiny fp32 DiT and its single-device outputs."""

import pytest
import torch

from tests.sp_cases import CASES, make_inputs, tiny_model


@pytest.fixture(scope="module")
def model32():
    return tiny_model()


@pytest.fixture(scope="module")
def references(model32):
    out = {}
    with torch.inference_mode():
        for case in CASES:
            x, t, ctx, kw = make_inputs(case)
            out[case] = model32(x, t, ctx, **kw)
    return out
