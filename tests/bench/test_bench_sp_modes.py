"""bench/bench_sp_modes.py runs end to end at its smallest (`--quick`): every figure present, and
the ones that do not depend on the machine's load checked: Ulysses receives 2/W of the
all-gather's attention bytes per block (measured, and the cost model agreeing), rank 0's
bytes are the same over gloo processes as over rank threads, and the all-gather's exchange
buffers are what cost_model.exchanged_bytes says. Timings are only checked to be there."""

import pytest

from tests.helpers import bench_json

MODES = ("allgather", "ulysses")


@pytest.mark.timeout(180)
def test_bench_sp_modes_quick_prints_every_figure_and_ulysses_moves_2_over_w():
    result = bench_json("bench_sp_modes.py", "--quick", timeout=170)
    for world in (2, 4, 8):
        measured = result[f"ulysses_vs_allgather_bytes_w{world}"]
        assert measured == pytest.approx(2 / world, rel=0.05), (world, measured)
        assert result[f"ulysses_vs_allgather_bytes_model_w{world}"] == pytest.approx(measured, rel=0.05)
        detail = result[f"bytes_w{world}"]
        assert detail["two_over_w"] == round(2 / world, 4) and detail["final_rows_rank0"] > 0
    for key in ("ulysses_vs_allgather_step_ratio_threads_w2", "ulysses_vs_allgather_step_ratio_processes_w2",
                "step_s_threads_w2", "step_s_processes_w2", "exchange_share_threads_w2",
                "exchange_share_processes_w2", "cpu_threads_allgather_faster_w2", "tokens", "seconds"):
        assert key in result, key
    assert result["processes_rank0_bytes_match_threads_w2"] is True
    for key in ("activation_estimate_bytes_w4", "activation_measured_bytes_w4", "activation_measured_vs_estimate_w4",
                "exchange_buffers_estimate_bytes_w4", "exchange_buffers_measured_bytes_w4"):
        assert set(result[key]) == set(MODES), key
        assert all(v > 0 for v in result[key].values()), key
    # the full K and V; Ulysses' received head blocks and its packed K/V (cost_model.exchanged_bytes)
    assert result["exchange_buffers_measured_vs_estimate_w4"] == {"allgather": 1.0, "ulysses": 1.0}
    # the whole activation peak within the estimate's stated margin (bench/h3_costs.py ACTIVATION_MARGIN),
    # and Ulysses' below the all-gather's, as the memory plan counts them
    from bench.h3_costs import ACTIVATION_MARGIN
    assert all(r <= ACTIVATION_MARGIN for r in result["activation_measured_vs_estimate_w4"].values()), result
    assert result["activation_measured_bytes_w4"]["ulysses"] < result["activation_measured_bytes_w4"]["allgather"]
