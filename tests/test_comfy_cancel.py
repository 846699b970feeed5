"""ComfyUI's per-layer Cancel check steps aside inside a pool's forward (comfy_cancel.py),
so the pool's block-start check stops every rank together. Stand-ins for comfy.ops and
comfy.model_management here; tests/upstream/test_cancel.py runs it against upstream's own."""

from __future__ import annotations

import sys
import threading
import types

import pytest

from comfy.multidevice.comfy_cancel import checks_at_block_starts


class Interrupted(BaseException):
    pass


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
