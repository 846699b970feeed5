"""The kept coordinators of roles/apply.py at process exit: on cards they are closed before
torch_npu's own exit handler resets the devices (CARDS.md: atexit runs last registered first,
so the close is registered once, after the first card coordinator was made)."""

from __future__ import annotations

from comfy.multidevice.roles import apply as roles_apply


class _Coordinator:
    closed = False

    def close(self):
        self.closed = True


def test_card_coordinators_are_closed_at_exit_before_the_runtime_resets_the_cards(monkeypatch):
    registered = []
    monkeypatch.setattr(roles_apply.atexit, "register", registered.append)
    monkeypatch.setattr(roles_apply, "_CLOSE_AT_EXIT", [])
    monkeypatch.setattr(roles_apply, "_COORDINATORS", {})
    cpu = roles_apply._kept((("cpu", "cpu"), "peer", "roles"), _Coordinator)
    assert registered == []  # CPU ranks: nothing to tear down before any runtime's exit
    cards = roles_apply._kept((("npu:0", "npu:1"), "hccl", "roles"), _Coordinator)
    lane = roles_apply._kept((("npu:0", "npu:1"), "hccl", "block weights"), _Coordinator)
    assert registered == [roles_apply.close_shared_coordinators]  # once, not per coordinator
    registered[0]()  # what the interpreter runs at exit
    assert cpu.closed and cards.closed and lane.closed and roles_apply._COORDINATORS == {}
