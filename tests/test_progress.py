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
