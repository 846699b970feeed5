"""bench/bench_workers.py runs end to end at its smallest (W = 2, one timed pair): every figure
present, and the one that does not depend on the machine's load checked: what rank 0 sends per
step is its latents and timestep and little more (pickling's framing), the conditioning having
gone with the first step."""

import pytest

from tests.helpers import bench_json


@pytest.mark.timeout(300)
def test_bench_workers_prints_every_figure_and_rank0_sends_the_inputs_only():
    result = bench_json("bench_workers.py", "--worlds", "2", "--forwards", "1", timeout=280)
    for key in ("workers_vs_threads_step_ratio_w2", "rank0_bytes_per_step_w2", "pool_start_s_w2",
                "worker_anonymous_bytes_w2", "thread_rank_anonymous_bytes_w2", "worker_extra_rss_ratio_w2",
                "bare_torch_process_anonymous_bytes", "target_met"):
        assert key in result, key
    assert 1.0 <= result["rank0_bytes_vs_model_w2"] <= 1.05  # the latents and timestep: the conditioning went once
    assert 1.0 <= result["rank0_first_bytes_vs_model_w2"] <= 1.05  # the first step: every input
    assert result["workers_vs_threads_step_ratio_w2"] > 0 and result["pool_start_s_w2"] > 0
