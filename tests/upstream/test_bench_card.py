"""bench/bench_card.py with COMFYUI_DIR: it measures upstream's own DiTBlock (small dims on the
CPU), whose attention goes through the project's exchange at W > 1; on a ComfyUI whose blocks
take no `attention` argument (v0.33.0) it refuses, naming the fix."""

from __future__ import annotations

import pytest
import torch

from bench import bench_card


@pytest.fixture
def cpu_card():
    before = torch.get_num_threads()
    yield bench_card.find_card(cpu=True)  # one intra-op thread for the run
    torch.set_num_threads(before)


def run_small(card):
    return bench_card.run(card, bench_card.CPU_DIMS, ("768p_5s",), (1, 8), bench_card.CPU_TOKEN_DIVISOR, 1, 2,
                          "cpu", log=lambda line: None)


def test_the_bench_runs_upstreams_block_and_its_exchange(upstream, monkeypatch, cpu_card):
    monkeypatch.setenv("COMFYUI_DIR", str(upstream.tree))
    if not upstream.has_attention_hook:
        with pytest.raises(SystemExit, match="takes no `attention` argument.*update ComfyUI"):
            run_small(cpu_card)
        return
    calls = []
    exchange = bench_card.OneRankOfW.exchange

    def counted(self, *args, **kwargs):
        calls.append(self.world_size)
        return exchange(self, *args, **kwargs)

    monkeypatch.setattr(bench_card.OneRankOfW, "exchange", counted)
    result = run_small(cpu_card)
    assert result["card"]["block"].startswith("upstream DiTBlock")
    assert all(p["error"] is None and p["block_s"] > 0 for p in result["points"])
    assert calls == [8] * 3  # every call of the W=8 block (1 warm-up, 2 timed) gathered K/V
