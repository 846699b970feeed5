"""Upstream's Fun ControlNet with ranks as processes (workers/pool_runner.py `travelling_options`, workers/towers.py):
the block patches travel as data, the tower once per pool; every rank drives the control stream
(sp/fun_controlnet.py). The stand-ins of tests/sp/test_fun_controlnet.py (a tower whose math needs
the whole sequence, upstream's block patch semantics on one card for the reference); W worker
ranks give the single-device result (FP32_TOL of tests/sp_cases.py)."""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
from comfy.multidevice.miniature.h3 import save_miniature
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.workers.pool_runner import travelling_options
from comfy.multidevice.workers.pool import WorkerPool
from comfy.multidevice.workers.recipe import miniature_from_shared_checkpoint, ModelRecipe
from comfy.multidevice.workers.wire import encode
from tests.sp.test_fun_controlnet import _fun_options, _FunBlockPatchStandIn
from tests.sp_cases import FP32_TOL, make_inputs, rel_diff, tiny_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def trusted_stand_ins(monkeypatch):
    """The stand-in tower's module, trusted here and by the workers (they inherit the variable)."""
    monkeypatch.setenv(TRUSTED_MODULES_ENV, "tests.sp.test_fun_controlnet")


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    out = tmp_path_factory.mktemp("fun") / "tiny.safetensors"
    save_miniature(tiny_model(seed=3), out)
    return str(out)


def forward(pool, x, t, ctx, kw, options, sent_towers):
    """One forward: rank 0 with the real patches, the workers with their travelling form."""
    sent = dict(kw, transformer_options=travelling_options(options, sent_towers))
    return pool.forward_method(None, pool.model, [x, t, ctx], dict(kw, transformer_options=options),
                               sent=([x, t, ctx], sent))


@pytest.mark.parametrize("world", [2, 3])
def test_fun_controlnet_over_worker_processes_equals_one_device(path, world):
    x, t, ctx, kw = make_inputs("plain")
    options, _ = _fun_options()
    with torch.inference_mode():
        reference = miniature_from_shared_checkpoint(path)(x, t, ctx, transformer_options=options, **kw)
        plain = miniature_from_shared_checkpoint(path)(x, t, ctx, **kw)
    assert rel_diff(reference, plain) > 1e-3  # the control acts
    options, control = _fun_options()
    recipe = ModelRecipe("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint", {"path": path})
    with WorkerPool(["cpu"] * world, recipe, timeout_s=60) as pool:
        towers = {}
        first = forward(pool, x, t, ctx, kw, options, towers)
        second = forward(pool, x, t, ctx, kw, options, towers)  # the tower is named, not sent again
        assert rel_diff(first, reference) <= FP32_TOL and rel_diff(second, reference) <= FP32_TOL
        assert list(towers.values()) == [control.model_patch.model]
        control.active = False  # its wrapper turns it off for a step: the workers follow
        assert rel_diff(forward(pool, x, t, ctx, kw, options, towers), plain) <= FP32_TOL
    assert not hasattr(control, "stream")  # the shared patch object was never used for rank state


def test_the_tower_travels_once_and_other_block_patches_are_refused_naming_them():
    options, control = _fun_options()
    towers = {}
    first = encode(travelling_options(options, towers))
    later = encode(travelling_options(options, towers))
    assert len(later) < len(first)  # the tower's key only
    dit = options["patches_replace"]["dit"]
    with pytest.raises(SequenceParallelError, match=r"block patches \[\('double_block', 1\)\] of this forward"):
        travelling_options({"patches_replace": {"dit": {**dit, ("double_block", 1): lambda a, e: e}}}, {})
    chained = _FunBlockPatchStandIn(control, 0, previous=lambda a, e: e["original_block"](a))
    with pytest.raises(SequenceParallelError, match="what the Fun ControlNet at block 0 chains"):
        travelling_options({"patches_replace": {"dit": {**dit, ("double_block", 0): chained}}}, {})
