"""What the node tells the user in the page beside the log (progress.node_text): a worker pool
stopped because the node ran again shows its line on the node."""

from __future__ import annotations

import sys
import types

import torch

from comfy.multidevice.progress import node_text
from comfy.multidevice.roles import apply as roles_apply
from comfy.multidevice.roles.plan import plan_roles
from tests.node_cases import inputs


def _fake_server(monkeypatch) -> list:
    sent = []
    instance = types.SimpleNamespace(send_progress_text=lambda text, node_id: sent.append((node_id, text)))
    monkeypatch.setitem(sys.modules, "server", types.SimpleNamespace(PromptServer=types.SimpleNamespace(instance=instance)))
    return sent


def test_node_text_reaches_comfyuis_page_and_is_silent_elsewhere(monkeypatch):
    node_text(None)("no node: nothing sent")  # and no server module needed
    monkeypatch.setitem(sys.modules, "server", None)  # outside ComfyUI: importing it fails
    node_text("12")("outside ComfyUI")
    sent = _fake_server(monkeypatch)
    node_text("12")("hello")
    assert sent == [("12", "hello")]


def test_a_pool_stopped_by_the_node_is_shown_on_the_node(monkeypatch):
    monkeypatch.setattr(roles_apply, "stop_unused_pool", lambda why: f"stopped the worker pool: {why}")
    told = []
    model, clip, video, audio = inputs()
    roles_apply.apply_role_plan(plan_roles(1), [torch.device("cpu")], model, clip, video, audio, tell=told.append)
    assert told == ["stopped the worker pool: the MultiNPUParallelConfig node ran again (the DiT on 1 card(s))"]
    monkeypatch.setattr(roles_apply, "stop_unused_pool", lambda why: None)  # no pool ran: nothing shown
    told.clear()
    roles_apply.apply_role_plan(plan_roles(1), [torch.device("cpu")], model, clip, video, audio, tell=told.append)
    assert told == []


def test_card_progress_shows_a_line_on_the_running_node_and_stops_on_cancel(monkeypatch):
    import time as time_module

    import pytest

    from comfy.multidevice import progress

    shown = []
    monkeypatch.setattr(progress, "executing_node_text", lambda: shown.append)
    card = progress.CardProgress("DiT replica", 2)
    card.done("cpu", 2 ** 30, "copied", time_module.monotonic())
    assert shown == ["DiT replica: 1/2 cards ready"]

    class Interrupted(BaseException):
        pass

    flag = {"set": True}

    def throw():
        flag["set"] = False
        raise Interrupted()
    monkeypatch.setitem(sys.modules, "comfy.model_management", types.SimpleNamespace(
        processing_interrupted=lambda: flag["set"], throw_exception_if_processing_interrupted=throw))
    with pytest.raises(Interrupted):  # ComfyUI's Cancel while the copies are built
        card.done("cpu", 2 ** 30, "copied", time_module.monotonic())
    assert shown[-1] == "DiT replica: 2/2 cards ready" and not flag["set"]


def test_executing_node_text_names_the_node_comfyui_runs(monkeypatch):
    sent = _fake_server(monkeypatch)
    context = types.SimpleNamespace(node_id="7")
    monkeypatch.setitem(sys.modules, "comfy_execution.utils", types.SimpleNamespace(get_executing_context=lambda: context))
    from comfy.multidevice.progress import executing_node_text
    executing_node_text()("starting 3 worker(s) for the DiT: 0/3 loaded")
    assert sent == [("7", "starting 3 worker(s) for the DiT: 0/3 loaded")]


def test_a_rank_thread_shows_its_line_on_the_servers_last_executing_node(monkeypatch):
    # ComfyUI's executing context is a context variable: a rank thread does not see it
    sent = _fake_server(monkeypatch)
    sys.modules["server"].PromptServer.instance.last_node_id = "5"
    monkeypatch.setitem(sys.modules, "comfy_execution.utils", types.SimpleNamespace(get_executing_context=lambda: None))
    from comfy.multidevice.progress import executing_node_text
    executing_node_text()("DiT replica: 1/3 cards ready")
    assert sent == [("5", "DiT replica: 1/3 cards ready")]
