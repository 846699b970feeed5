"""The dry run's settings: which ranks it picks when --devices is left out or names too many."""

from __future__ import annotations

import pytest

from comfy.multidevice.cli import dry_run_settings


def test_default_devices_without_accelerators(monkeypatch):
    monkeypatch.setattr(dry_run_settings, "visible_accelerators", lambda: [])
    assert dry_run_settings.choose_devices(None, cpu=False) == ["cpu"] * 4
    monkeypatch.setattr(dry_run_settings, "visible_accelerators", lambda: ["npu:0", "npu:1"])
    assert dry_run_settings.choose_devices(None, cpu=False) == ["npu:0", "npu:1"]
    assert dry_run_settings.choose_devices(3, cpu=True) == ["cpu"] * 3
    with pytest.raises(ValueError, match="only 2 accelerator"):
        dry_run_settings.choose_devices(4, cpu=False)
