"""ComfyUI's Cancel inside a DiT forward (comfy_cancel.py): its per-layer check steps aside,
so the block-start check stops every rank together, here with rank threads (a worker pool:
tests/workers/test_pool.py). Stand-ins for comfy.ops and comfy.model_management here;
tests/upstream/test_cancel.py runs it against upstream's own."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

from comfy.multidevice.comfy_cancel import checks_at_block_starts
from comfy.multidevice.comm.collectives import SharedBlockFlag
from comfy.multidevice.comm.errors import CollectiveError
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from tests.helpers import comfy_cancel_stand_ins, Interrupted
from tests.sp_cases import FP32_TOL, make_inputs, rel_diff, replicas, tiny_model


@pytest.fixture
def comfy_modules(monkeypatch):
    state = {"flag": False, "checks": 0}
    mm = types.ModuleType("comfy.model_management")
    mm.interrupt_processing_mutex = threading.RLock()

    def processing_interrupted():
        with mm.interrupt_processing_mutex:
            return state["flag"]

    def run_every_op():  # what upstream's does: raise and clear when the flag is set
        state["checks"] += 1
        with mm.interrupt_processing_mutex:
            if state["flag"]:
                state["flag"] = False
                raise Interrupted()
    mm.processing_interrupted = processing_interrupted
    ops = types.ModuleType("comfy.ops")
    ops.run_every_op = run_every_op
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.ops", ops)
    return state, ops, run_every_op


def test_a_set_flag_is_left_for_the_block_start_and_the_check_comes_back(comfy_modules):
    state, ops, original = comfy_modules
    with checks_at_block_starts():
        ops.run_every_op()  # no Cancel: upstream's check runs as usual
        assert state["checks"] == 1
        state["flag"] = True
        ops.run_every_op()  # a Cancel: not raised inside the block, still set for the block start
        assert state["flag"] and state["checks"] == 1
        with checks_at_block_starts():  # nested (a forward inside a forward): restored once, at the end
            ops.run_every_op()
        assert ops.run_every_op is not original
    assert ops.run_every_op is original
    with pytest.raises(Interrupted):
        ops.run_every_op()


def test_the_check_comes_back_when_the_forward_raises(comfy_modules):
    _, ops, original = comfy_modules
    with pytest.raises(RuntimeError):
        with checks_at_block_starts():
            raise RuntimeError("a rank failed")
    assert ops.run_every_op is original


def test_without_comfyui_nothing_changes(monkeypatch):
    monkeypatch.setitem(sys.modules, "comfy.ops", None)
    with checks_at_block_starts():
        pass


# ----------------------------------------------------------------------------- a DiT forward's Cancel

@pytest.mark.parametrize("dit_weights", ["replicate", "shard"])
@pytest.mark.parametrize("pressed_in", [0, 1])
def test_rank_threads_stop_together_one_block_after_the_cancel_and_stay_usable(backend, monkeypatch, pressed_in,
                                                                              dit_weights):
    """Cancel pressed while rank 0 runs block `pressed_in` of the 3-block miniature (every rank's
    layers then check the flag, as ComfyUI's ops do): rank 0 sees it as the next block starts and
    every rank stops as the one after starts (after the last block: at the forward's end), none
    inside a block, the same way a worker pool stops (tests/workers/test_pool.py). ComfyUI's
    interrupt is raised, the flag cleared, nothing aborted; the next forward equals one device
    (with shard, the block gathers, prefetched on a lane with peer, stay paired across the cancel)."""
    state = comfy_cancel_stand_ins(monkeypatch)
    model = tiny_model()
    x, t, ctx, kw = make_inputs("plain")
    with torch.inference_mode():
        reference = model(x, t, ctx, **kw)
    with SequenceParallelCoordinator(["cpu"] * 3, backend=backend, timeout_s=30) as coord:
        models = replicas(model, 3)
        sp = enable_sequence_parallel(models, coord, dit_weights=dit_weights)
        entered = [[] for _ in models]
        armed = {"once": True}
        for rank, replica in enumerate(models):
            for index, block in enumerate(replica.blocks):
                def check(module, args, rank=rank, index=index):
                    entered[rank].append(index)
                    if rank == 0 and index == pressed_in and armed.pop("once", False):
                        state["flag"] = True  # the user presses Cancel while block `pressed_in` runs
                    sys.modules["comfy.ops"].run_every_op()
                block.mlp.register_forward_pre_hook(check)
        with torch.inference_mode(), pytest.raises(Interrupted):
            sp(x, t, ctx, **kw)
        assert entered == [list(range(pressed_in + 2))] * 3  # every rank stopped at the same place
        assert not state["flag"] and not coord.closed
        for ran in entered:
            ran.clear()
        with torch.inference_mode():
            assert rel_diff(sp(x, t, ctx, **kw), reference) <= FP32_TOL
        assert entered == [[0, 1, 2]] * 3
        sp.close()
    ops, mm = sys.modules["comfy.ops"], sys.modules["comfy.model_management"]
    assert ops.run_every_op is mm.throw_exception_if_processing_interrupted  # ComfyUI's check is back


def test_the_threads_flag_is_read_one_block_late_and_refuses_a_read_before_rank_0_posted():
    flag = SharedBlockFlag(2)
    assert flag.post(0, True) is False  # block 0: nothing posted before it
    assert flag.post(1) is False
    assert flag.post(0) is True and flag.post(1) is True  # block 1: block 0's yes, on both ranks
    late = SharedBlockFlag(2)
    late.post(1)
    with pytest.raises(CollectiveError, match="before rank 0 posted"):
        late.settle(1)  # rank 1 ran ahead of rank 0: no collective ordered them
    done = SharedBlockFlag(2)
    done.post(0, False), done.post(1)
    assert done.settle(0) is False and done.settle(1) is False and done.settle(1) is False
