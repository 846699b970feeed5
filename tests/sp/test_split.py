"""Mixed cards (comfy/multidevice/sp/split.py): the node's split parsed, weights from probe times
capped by memory, and the SP DiT with uneven weights against one device (rank threads; the
worker processes' test is in tests/workers/test_pool.py)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from comfy.multidevice.sp.plan import SequenceParallelError, ShardPlan
from comfy.multidevice.sp.split import parse_split, RowSplit, SplitError, strategy_for_split, weights_from_times
from comfy.multidevice.sp.strategies import AllGatherKV, CompressedKV, make_kv_strategy, SPMode
from tests.sp_cases import CASES, FP32_TOL, make_inputs, plan_edges, rel_diff, replicas, run_sp


def test_parse_split_even_auto_and_weights():
    assert parse_split(None, 2) == parse_split("even", 2) == RowSplit("even")
    assert parse_split(" Auto ", 4) == RowSplit("auto")
    assert parse_split("3,1", 2) == RowSplit("weights", (3.0, 1.0))
    assert parse_split("3,1", 2).uneven and parse_split("auto", 2).uneven
    assert not parse_split("2,2", 2).uneven and not parse_split("even", 2).uneven
    assert parse_split("3,1", 2).describe() == "split 3,1"


@pytest.mark.parametrize("text", ["3", "3,1,1", "1,0", "x,1", "1,nan", "-1,2"])
def test_a_bad_split_names_the_value_and_the_fix(text):
    with pytest.raises(SplitError, match=rf"split='{text}' does not give 2 card\(s\) their shares: set split to "
                                         r"even, auto, or one positive number per card .*\(e.g. 2,1\)"):
        parse_split(text, 2)


def test_weights_follow_the_speed_and_keep_within_the_memory_caps():
    weights, reasons = weights_from_times([0.1, 0.2])
    assert weights == pytest.approx((2 / 3, 1 / 3), abs=1e-4)
    assert "0.50 of the fastest's speed" in reasons[1]
    # the fast card holds at most 0.4 of the rows: the slow ones share the rest by speed
    weights, reasons = weights_from_times([0.1, 0.2, 0.2], caps=[0.4, 1.0, 1.0])
    assert weights == pytest.approx((0.4, 0.3, 0.3), abs=1e-4)
    assert "capped by its free memory at 0.400" in reasons[0] and "capped" not in reasons[1]
    # together they cannot hold it: the caps' shape
    weights, _ = weights_from_times([0.1, 0.1], caps=[0.3, 0.1])
    assert weights == pytest.approx((0.75, 0.25), abs=1e-4)


def test_ulysses_with_an_uneven_split_is_refused_and_auto_becomes_the_allgather():
    with pytest.raises(SequenceParallelError, match="split 3,1 gives the ranks different rows, but sp_mode "
                                                    "ulysses .* set sp_mode to allgather or auto, or split to even"):
        strategy_for_split(make_kv_strategy("ulysses"), parse_split("3,1", 2))
    assert isinstance(strategy_for_split(make_kv_strategy("auto"), parse_split("auto", 2)), AllGatherKV)
    even = make_kv_strategy("ulysses")
    assert strategy_for_split(even, parse_split("1,1", 2)) is even


def test_an_uneven_split_keeps_the_exchange_precision():
    # sp_mode auto with exchange_precision int8: the all-gather it becomes still sends int8 records
    chosen = strategy_for_split(make_kv_strategy(SPMode("auto", exchange_precision="int8")), parse_split("auto", 2))
    assert isinstance(chosen, CompressedKV) and isinstance(chosen.strategy, AllGatherKV)
    assert chosen.precision == "int8" and chosen.name == "allgather"
    with pytest.raises(SequenceParallelError, match="sp_mode ulysses"):
        strategy_for_split(make_kv_strategy(SPMode("ulysses", exchange_precision="int8")), parse_split("3,1", 2))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_uneven_weights_match_one_device(model32, references, world):
    rng = random.Random(world)
    for case in CASES:
        weights = tuple(rng.uniform(0.2, 5.0) for _ in range(world))
        out, sp, _ = run_sp(model32, world, "peer", case, split=",".join(f"{w:.3f}" for w in weights))
        assert rel_diff(out, references[case]) <= FP32_TOL, (case, weights)
        seq_len = sum(sp.tokens_per_rank())
        rounded = tuple(float(f"{w:.3f}") for w in weights)
        assert sp.tokens_per_rank() == [b - a for a, b in plan_edges(seq_len, world, rounded)]


@pytest.mark.timeout(120)
def test_auto_probes_once_logs_each_rank_and_matches_one_device(model32, references, caplog, monkeypatch):
    # rank 1 is made 3x slower in the probe only: it must get the smallest share
    from comfy.multidevice.sp import split as split_module
    calls = []
    real = split_module.weights_from_times

    def slowed(seconds, caps=None):
        calls.append(list(seconds))
        return real([s * (3 if r == 1 else 1) for r, s in enumerate(seconds)], caps)
    monkeypatch.setattr(split_module, "weights_from_times", slowed)
    x, t, ctx, kw = make_inputs("plain")
    with caplog.at_level(logging.INFO, logger="comfy.multidevice.sp"), \
            SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 3), coord, sp_mode="auto", split="auto")
        with torch.inference_mode():
            for _ in range(2):
                out = sp(x, t, ctx, **kw)
                assert rel_diff(out, references["plain"]) <= FP32_TOL
    assert len(calls) == 3  # once per rank, at the first step only
    rows = sp.tokens_per_rank()
    assert rows[1] == min(rows) and sum(rows) == 35
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("split auto: rank")]
    assert len(lines) == 3 and "of the fastest's speed" in lines[1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split", ["auto", "1,3,2"])
def test_sharded_block_weights_with_an_uneven_split_match_one_device(model32, references, split):
    """dit_weights=shard: auto's probe runs block 0 with its gathered weights (bound once for the
    probe and the block), and the split's rows run on the owners' bytes."""
    x, t, ctx, kw = make_inputs("masked")
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 3), coord, sp_mode="allgather", dit_weights="shard",
                                      split=split)
        try:
            with torch.inference_mode():
                for _ in range(2):
                    assert rel_diff(sp(x, t, ctx, **kw), references["masked"]) <= FP32_TOL
        finally:
            sp.close()
    rows = sp.tokens_per_rank()
    assert min(rows) >= 1
    if split != "auto":
        assert rows == [b - a for a, b in plan_edges(sum(rows), 3, (1, 3, 2))]


def test_a_row_split_record_checks_itself():
    for kind, weights in (("halves", None), ("weights", None), ("even", (1.0, 1.0)), ("weights", (1.0, -1.0))):
        with pytest.raises(ValueError):
            RowSplit(kind, weights)


def test_the_probe_attends_to_as_many_keys_as_a_step(model32):
    """split auto's probe: a card's queries against the whole sequence's worth of keys (its own
    K and V repeated; nothing exchanged), as in the step that follows, so attention weighs in
    the timing as much as it does when the step runs."""
    seen = []  # (query rows, key rows) of every attention call, through an override set before ours

    def recording(func, q, k, v, *args, **kwargs):
        seen.append((q.shape[2], k.shape[2]))
        return func(q, k, v, *args, **kwargs)
    x, t, ctx, kw = make_inputs("plain")
    kw = {**kw, "transformer_options": {"optimized_attention_override": recording}}
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model32, 2), coord, split="auto")
        with torch.inference_mode():
            sp(x, t, ctx, **kw)
    seq_len = sum(sp.tokens_per_rank())
    probe_rows = ShardPlan(seq_len, 2, 0).length
    assert seen.count((probe_rows, seq_len)) >= 2 * 2  # two probe runs per rank, all keys each
    # the step's blocks attend to every key too (the text refiner's own attention, as many
    # queries as keys, aside)
    assert {keys for rows, keys in seen if rows != keys} == {seq_len}
