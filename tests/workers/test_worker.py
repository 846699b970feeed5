"""The worker process's own helpers (comfy/multidevice/workers/worker.py) that need no pool.

The processes themselves, a CPU pool's lane included, are tested in tests/workers/test_pool.py
and tests/upstream/.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from comfy.multidevice.workers import worker


@pytest.mark.parametrize("kind", ["npu", "cuda"])
def test_a_card_gets_no_block_gather_lane(kind, monkeypatch, caplog):
    """On a card the lane would be a second HCCL / NCCL group driven from a helper thread
    beside the forward's K/V exchange, which a card does not allow: no group is made (every
    rank decides alike, so none waits for a new_group the others skip) and the block gathers
    go through the forward's group. Said once."""
    monkeypatch.setattr(dist, "new_group", lambda *a, **k: pytest.fail("a second process group was made"))
    monkeypatch.setattr(worker, "_no_lane_logged", False)
    card = SimpleNamespace(type=kind, index=1)  # torch.device("npu") needs torch_npu
    with caplog.at_level(logging.INFO, logger=worker.__name__):
        assert worker.block_gather_lane(card, 30.0) is None
        assert worker.block_gather_lane(card, 30.0) is None
    said = [r.getMessage() for r in caplog.records if "no prefetch" in r.getMessage()]
    assert said == [f"sharded DiT weights: no prefetch on {kind} cards: a card runs one collective at a "
                    "time, so each block is gathered on the forward's process group just before it runs, "
                    "in the same order on every rank"]

