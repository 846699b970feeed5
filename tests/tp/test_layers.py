"""The tensor-parallel layers and head plan (comfy/multidevice/tp/layers.py): GQA head grouping,
the errors for heads that cannot be split, and the row-parallel bias."""

import pytest
import torch

from comfy.multidevice.tp.layers import (ColumnParallelLinear, RowParallelLinear, TensorParallelError,
                                         check_head_split, head_shard)
from tests.tp.tp_cases import FP32_REL_TOL, coordinator, rel_err


# ----------------------------------------------------------------------------- head plan

def test_head_plan_matches_gqa_grouping():
    # Query head h reads KV head h // (q/kv); every rank's query heads must read exactly
    # the KV heads that rank holds.
    for q, kv in [(8, 2), (64, 8), (8, 8), (8, 1)]:
        for world in [w for w in (1, 2, 4, 8, 16, 32, 64) if q % w == 0 and (kv % w == 0 or w % kv == 0)]:
            for rank in range(world):
                s = head_shard(q, kv, world, rank)
                assert s.q_count == q // world and s.kv_count == max(kv // world, 1)
                needed = {h // (q // kv) for h in range(s.q_start, s.q_start + s.q_count)}
                assert needed == set(range(s.kv_start, s.kv_start + s.kv_count))


@pytest.mark.parametrize("q,kv,world,words", [
    (8, 2, 3, ["8 query heads", "W=3"]),
    (12, 4, 3, ["4 KV heads", "W=3"]),
    (12, 4, 6, ["4 KV heads", "W=6"]),
    (8, 3, 2, ["8 query heads", "3 KV heads"]),
])
def test_unsplittable_heads_error_names_counts(q, kv, world, words):
    with pytest.raises(TensorParallelError) as info:
        check_head_split(q, kv, world)
    for word in words:
        assert word in str(info.value)
    assert "use W in" in str(info.value) or "KV heads" in str(info.value)


# ----------------------------------------------------------------------------- row-parallel layer

def test_row_parallel_bias_is_added_once(backend):
    gen = torch.Generator().manual_seed(11)
    weight, bias, x = torch.randn(5, 8, generator=gen), torch.randn(5, generator=gen), torch.randn(3, 8, generator=gen)
    want = torch.nn.functional.linear(x, weight, bias)

    def run(rank, comm):
        col = ColumnParallelLinear.from_full(torch.eye(8), None, [(rank * 4, 4)], comm.device)
        row = RowParallelLinear.from_full(weight, bias, rank * 4, 4, comm)
        return row(col(x))

    with coordinator(2, backend) as coord:
        outs = coord.run(run)
    for out in outs:
        assert rel_err(out, want) <= FP32_REL_TOL
