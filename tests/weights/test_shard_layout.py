"""One process's shard (weights/shard_layout.py), as ranks as processes make them: each rank's
plan is what one replica of the checkpoint gives, the same in every process, and a rank whose
plan differs from rank 0's refuses to serve, naming what differs."""

from __future__ import annotations

import dataclasses

import pytest

from comfy.multidevice.miniature.h3 import save_miniature
from comfy.multidevice.weights.block_shards import block_tensors, BlockShardError
from comfy.multidevice.workers.recipe import miniature_shard_from_shared_checkpoint
from tests.sp_cases import tiny_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("layout") / "tiny.safetensors"
    save_miniature(tiny_model(seed=3), out)
    return str(out)


def test_every_rank_keeps_its_own_block_tensors_by_one_plan(path):
    shards = [miniature_shard_from_shared_checkpoint(path, "cpu", rank=r, world_size=3) for r in range(3)]
    plans = [s.layout.plan for s in shards]
    assert plans[1] == plans[0] and plans[2] == plans[0]  # made apart, the same
    held = [{(i, n) for i, b in enumerate(s.module.blocks) for n, t in block_tensors(b).items() if t.numel()}
            for s in shards]
    assert not (held[0] & held[1]) and not (held[0] & held[2]) and not (held[1] & held[2])
    every = {(i, n) for i, b in enumerate(plans[0].nbytes) for n in b}
    assert held[0] | held[1] | held[2] == every  # each tensor kept by exactly one rank


def test_a_rank_with_another_plan_than_rank_0s_refuses_naming_the_block(path):
    plan = miniature_shard_from_shared_checkpoint(path, "cpu", rank=0, world_size=2).layout.plan
    other = dataclasses.replace(plan, nbytes=plan.nbytes[:1] + ({**plan.nbytes[1], "extra": 4},) + plan.nbytes[2:])
    with pytest.raises(BlockShardError, match=r"rank 1: the DiT's block tensors differ from rank 0's \(block 1\); "
                                              "every server must have the same model file"):
        miniature_shard_from_shared_checkpoint(path, "cpu", rank=1, world_size=2, plan=other)
    moved = dataclasses.replace(plan, owner=tuple({n: 1 - r for n, r in b.items()} for b in plan.owner))
    with pytest.raises(BlockShardError, match="the shard plan differs from rank 0's"):
        miniature_shard_from_shared_checkpoint(path, "cpu", rank=1, world_size=2, plan=moved)
