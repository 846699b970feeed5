"""The worker process's own helpers (comfy/multidevice/workers/worker.py), and what a worker
started with the real entry point writes into rank 0's log at the start of a pool.

The processes' work, a CPU pool's lane included, is tested in tests/workers/test_pool.py and
tests/upstream/.
"""

from __future__ import annotations

import logging
import re
import socket
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
from comfy.multidevice.miniature.h3 import save_miniature
from comfy.multidevice.workers import worker
from comfy.multidevice.workers.pool import WorkerPool
from comfy.multidevice.workers.recipe import miniature_from_shared_checkpoint, ModelRecipe
from tests.sp_cases import tiny_model


def comfyui_like_build(path: str, device="cpu"):
    """A recipe builder that logs as ComfyUI does while a worker imports it and loads a MODEL
    (its root logger: start-up lines at INFO, now and then a warning), then builds the miniature."""
    logging.info("Total VRAM 0 MB, total RAM 1024 MB")
    logging.info("Device: cpu")
    logging.warning("a warning of the load")
    return miniature_from_shared_checkpoint(path, device)


@pytest.mark.timeout(240)
def test_a_worker_logs_its_start_in_one_line_and_comfyuis_warnings_only(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(TRUSTED_MODULES_ENV, __name__)  # the workers inherit it
    path = tmp_path / "tiny.safetensors"
    save_miniature(tiny_model(seed=3), path)
    with caplog.at_level(logging.INFO, logger="comfy.multidevice.workers.process"):
        pool = WorkerPool(["cpu"] * 3, ModelRecipe(__name__, "comfyui_like_build", {"path": str(path)}),
                          sp_mode="allgather", timeout_s=60).start()
        workers = list(pool.workers)
        pool.close()
        for started in workers:
            started._reader.join(10)  # the rest of its stderr, into the log
    for rank in (1, 2):
        lines = [r.getMessage().split(" ", 2)[2] for r in caplog.records
                 if r.getMessage().startswith(f"[rank {rank}] ")]
        assert "WARNING root: a warning of the load" in lines, lines
        info = [line for line in lines if line.startswith("INFO ")]
        assert len(info) == 1 and re.fullmatch(
            rf"INFO comfy\.multidevice\.workers\.worker: worker rank {rank} of 3 on {re.escape(socket.gethostname())}: "
            rf"cpu, \d+ intra-op thread\(s\), pid {workers[rank - 1].process.pid}, ready in [\d.]+ s", info[0]), lines


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

