"""bench/bench_mixed_split.py runs end to end at its smallest (`--quick`): every figure present,
both splits within the SP tolerance of one device, auto's weights favour the fast rank (rank 1
sleeps as long again as it computes, so its probe is about twice rank 0's). Timings are only
checked to be there (they depend on the machine's load)."""

import pytest

from tests.helpers import bench_json


@pytest.mark.timeout(180)
def test_bench_mixed_split_quick_prints_every_figure_and_auto_gives_the_fast_rank_more_rows():
    result = bench_json("bench_mixed_split.py", "--quick", timeout=170)
    for key in ("mixed_auto_vs_even_step_ratio", "step_s_auto", "step_s_even", "step_s_auto_rounds",
                "step_s_even_rounds", "slowdown", "world", "tokens", "seconds"):
        assert key in result, key
    assert result["equal_within_tolerance"] is True
    assert result["max_rel_diff_auto"] <= 1e-5 and result["max_rel_diff_even"] <= 1e-5
    assert len(result["weights_chosen"]) == 2 and result["weights_chosen"][0] > result["weights_chosen"][1]
    assert result["rows_even"][0] - result["rows_even"][1] in (0, 1)
    assert sum(result["rows_auto"]) == sum(result["rows_even"]) == result["tokens"]
    assert result["rows_auto"][0] > result["rows_auto"][1]
