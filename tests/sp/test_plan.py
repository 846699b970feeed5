"""The row split (comfy/multidevice/sp/plan.py): shard edges, modulation segments cut at them, and
per-row tables taken for one rank."""

import pytest
import torch

from comfy.multidevice.sp.plan import (is_even, SequenceParallelError, shard_sizes, shard_start, ShardPlan,
                                       slice_mod_segments, take_rows)
from tests.sp_cases import plan_edges


def test_shard_plan_edges():
    for s in range(4, 40):
        for w in range(1, 5):
            edges = plan_edges(s, w)
            assert edges[0][0] == 0 and edges[-1][1] == s
            assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))
            lengths = [b - a for a, b in edges]
            assert max(lengths) - min(lengths) <= 1 and min(lengths) >= 1
            assert [(ShardPlan(s, w, r).start, ShardPlan(s, w, r).stop) for r in range(w)] == edges
    with pytest.raises(ValueError, match="at most 3 ranks"):
        ShardPlan(3, 4, 0)


def test_slice_mod_segments_int_and_per_token_rows():
    per_token = torch.tensor([7, 8, 9, 10, 11])
    segments = [(0, 3, 4), (3, 8, per_token), (8, 10, 5)]
    full = [4, 4, 4, 7, 8, 9, 10, 11, 5, 5]
    for world in (1, 2, 3, 4):
        rebuilt = []
        for r in range(world):
            plan = ShardPlan(10, world, r)
            local = slice_mod_segments(segments, plan)
            assert local[0][0] == 0 and local[-1][1] == plan.length
            for a, b, row in local:
                rebuilt.extend(row.tolist() if torch.is_tensor(row) else [row] * (b - a))
        assert rebuilt == full
    with pytest.raises(SequenceParallelError, match="per-token rows"):
        slice_mod_segments([(0, 10, torch.arange(4))], ShardPlan(10, 2, 0))


def test_take_rows_checks_the_sequence_length():
    table = torch.randn(1, 12, 1, 3, 2, 2)
    assert torch.equal(take_rows(table, ShardPlan(12, 3, 1), 1), table[:, 4:8])
    assert take_rows(None, ShardPlan(12, 3, 1), 1) is None
    with pytest.raises(SequenceParallelError, match="expected 13 sequence rows"):
        take_rows(table, ShardPlan(13, 3, 1), 1)


def test_weighted_edges_cover_the_sequence_and_follow_the_weights():
    rng = __import__("random").Random(43)
    for _ in range(400):
        world = rng.randint(2, 8)
        seq = rng.randint(world, 3000)
        weights = [rng.uniform(0.05, 10.0) for _ in range(world)]
        edges = plan_edges(seq, world, weights)
        assert edges[0][0] == 0 and edges[-1][1] == seq
        assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))
        sizes = [b - a for a, b in edges]
        assert min(sizes) >= 1 and sizes == shard_sizes(seq, world, weights)
        assert sizes == ShardPlan(seq, world, 0, tuple(weights)).sizes
        # each share is within two rows of its exact weighted share of the spare rows
        total = sum(weights)
        for size, w in zip(sizes, weights):
            assert abs(size - 1 - (seq - world) * w / total) < 2
        assert [(ShardPlan(seq, world, r, weights).start, ShardPlan(seq, world, r, weights).stop)
                for r in range(world)] == edges


def test_equal_weights_give_the_even_edges_bit_for_bit():
    for s in range(4, 60):
        for w in range(1, 9):
            if s >= w:
                assert plan_edges(s, w, [2.5] * w) == plan_edges(s, w)
                assert [shard_start(s, w, r) for r in range(w)] == [s * r // w for r in range(w)]
    assert is_even(None) and is_even((3, 3)) and not is_even((3, 1))


@pytest.mark.parametrize("weights", [(1,), (1, 2, 3), (1, 0), (1, -2), (1, float("nan")),
                                     (float("inf"), 1), ("a", 1), 5])
def test_bad_weights_are_refused_naming_the_value_and_the_fix(weights):
    with pytest.raises(ValueError, match=r"split weights .* do not fit 2 rank\(s\): give one positive number per rank"):
        ShardPlan(10, 2, 0, weights)
    with pytest.raises(ValueError, match="or use split even"):
        shard_sizes(10, 2, weights)
