"""bench/bench_exchange_precision.py runs end to end at its smallest (`--quick`): every figure
present, int8's bytes at most 0.6 of exact, and each format's block and step error under the
documented bound (comm/compression.py), yet above zero (the exchange was compressed); the
activation peak with int8 within the memory plan's margin of its estimate."""

import pytest

from comfy.multidevice.comm.compression import BLOCK_REL_ERROR_BOUND, STEP_REL_ERROR_BOUND
from tests.helpers import bench_json


@pytest.mark.timeout(180)
def test_bench_exchange_precision_quick_is_within_the_documented_bounds():
    result = bench_json("bench_exchange_precision.py", "--quick", timeout=170)
    assert result["int8_bytes_ratio"] <= 0.6
    assert result["int8_bytes_ratio"] == pytest.approx((128 + 2) / 256, rel=0.01)
    for precision in ("int8", "fp8"):
        assert 0 < result[f"{precision}_block_rel_error"] <= BLOCK_REL_ERROR_BOUND[precision], result
        assert 0 < result[f"{precision}_step_rel_error"] <= STEP_REL_ERROR_BOUND[precision], result
        for world in (2, 4):
            for mode in ("allgather", "ulysses"):
                assert f"{mode}_w{world}" in result["block_rel_error"][precision]
                assert f"{mode}_w{world}" in result["step_rel_error"][precision]
    assert result["within_bounds"] is True
    assert result["int8_processes_step_ratio"] > 0
    assert set(result["processes_step"]["w2"]["step_s"]) == {"exact", "int8"}
    # the whole activation peak of a forward within the plan's stated margin, int8's records counted
    from bench.h3_costs import ACTIVATION_MARGIN
    assert set(result["activation_measured_vs_estimate"]) == {"exact", "int8"}
    assert all(0 < r <= ACTIVATION_MARGIN for r in result["activation_measured_vs_estimate"].values()), result
