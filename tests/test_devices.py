"""Card selection (devices.py): the node's `devices` input, where every malformed value is refused
by the node's own error (InvalidDeviceList) naming the entry and the fix, before anything is
cloned or started; the card count and kind checks with the visible cards and the variable in
each message; and the probe through torch_npu."""

from __future__ import annotations

import sys
import textwrap
import threading
import types

import pytest
import torch

from comfy.multidevice.cards import DeviceInventory, DeviceSelectionError, InvalidDeviceList, MixedDeviceKinds, TooFewDevices, UnsupportedCardCount, parse_device_list, select_devices
from comfy.multidevice.devices import chip_name
from comfy.multidevice.roles import apply as roles_apply
from comfy_extras.nodes_multinpu import configure_parallel
from tests.node_cases import assert_same, inputs, inventory, rank_threads, snapshot

FIX = "write 'npu:i', 'cuda:i' or 'cpu'"
NPUS = DeviceInventory(counts={"npu": 4, "cuda": 0}, env={"ASCEND_RT_VISIBLE_DEVICES": None})

MALFORMED = [
    ("cpu:x", "devices entry 'cpu:x' is not a device"),
    ("npu:x,npu:1", "devices entry 'npu:x' is not a device"),
    ("npu:0,npu:1,cpu:", "devices entry 'cpu:' is not a device"),
    ("npu:-1,npu:0", "devices entry 'npu:-1' is not a device"),
    ("npu:\u0663,npu:0", "devices entry 'npu:\u0663' is not a device"),  # an Arabic-Indic 3
    ("npu:1.0,npu:0", "devices entry 'npu:1.0' is not a device"),
    ("npu,npu:1", "devices entry 'npu' is not a device"),
    ("npu:0,3", "devices entry '3' is not a device"),
    ("tpu:0,npu:1", "devices entry 'tpu:0' is not a device"),
    ("npu:0,,npu:1", "devices entry 2 is empty"),
    ("npu:0,npu:1,", "devices entry 3 is empty"),
    (",", "devices entry 1 is empty"),
    ("npu:1,npu:1", "devices lists npu:1 more than once"),
    ("npu:01,npu:1", "devices lists npu:1 more than once"),
    (3, "devices=3 is of type int, not text"),
    (2.5, "devices=2.5 is of type float, not text"),
    (True, "devices=True is of type bool, not text"),
    (0, "devices=0 is of type int, not text"),
    ({"npu:0": 1}, "is of type dict, not text"),
    (["npu:0", 1], "devices entry 2 (1) is of type int, not text"),
    (["npu:0", None], "devices entry 2 (None) is of type NoneType, not text"),
    (["npu:0", ""], "devices entry 2 is empty"),
]


@pytest.mark.parametrize("value, message", MALFORMED)
def test_malformed_devices_get_the_nodes_error_naming_the_entry(value, message):
    with pytest.raises(InvalidDeviceList) as info:
        select_devices(2, devices=value, inventory=NPUS)
    text = str(info.value)
    assert message in text, text
    assert FIX in text or "list distinct cards" in text, text


def test_well_formed_lists_still_parse():
    assert parse_device_list(" npu:0 , NPU : 2 ") == [("npu", 0), ("npu", 2)]
    assert parse_device_list(["cuda:1", "cuda:0"]) == [("cuda", 1), ("cuda", 0)]
    assert parse_device_list("cpu,cpu:0") == [("cpu", None), ("cpu", 0)]
    assert parse_device_list("   ") == []
    assert select_devices(2, devices="npu:3,npu:1", inventory=NPUS) == ["npu:3", "npu:1"]
    assert select_devices(2, devices="cpu, cpu") == ["cpu", "cpu"]


@pytest.mark.parametrize("value, message", [MALFORMED[0], MALFORMED[9], MALFORMED[14]])
def test_the_node_refuses_them_before_touching_anything(value, message):
    objs = inputs()
    before, threads, coords = snapshot(*objs), rank_threads(), dict(roles_apply._COORDINATORS)
    with pytest.raises(InvalidDeviceList, match=message):
        configure_parallel(*objs, npu_count=2, device_kind="auto", devices=value, inventory=NPUS)
    assert_same(before, snapshot(*objs))
    assert rank_threads() == threads and roles_apply._COORDINATORS == coords


def test_unsupported_count_names_the_visible_cards():
    with pytest.raises(UnsupportedCardCount) as info:
        select_devices(3, inventory=inventory(npu=3, ASCEND_RT_VISIBLE_DEVICES="0,1,2"))
    msg = str(info.value)
    assert "npu_count=3" in msg and "npu: 3 (ASCEND_RT_VISIBLE_DEVICES=0,1,2)" in msg and "set npu_count to 2" in msg


def test_too_few_devices_says_asked_found_variable_and_fix():
    inv = inventory(npu=2, ASCEND_RT_VISIBLE_DEVICES="0,1")
    with pytest.raises(TooFewDevices) as info:
        select_devices(4, inventory=inv)
    msg = str(info.value)
    for part in ("npu_count is 4", "2 npu card(s) are visible", "ASCEND_RT_VISIBLE_DEVICES=0,1", "set npu_count to 2",
                 "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3"):
        assert part in msg, msg
    with pytest.raises(TooFewDevices, match=r"npu_count is 8 but 3 cuda card\(s\) are visible \(CUDA_VISIBLE_DEVICES unset\)"):
        select_devices(8, kind="cuda", inventory=inventory(cuda=3))


def test_no_accelerator_at_all():
    with pytest.raises(TooFewDevices) as info:
        select_devices(4, inventory=inventory())
    msg = str(info.value)
    assert "npu_count is 4 but this server sees no NPU or CUDA card" in msg and "device_kind to cpu" in msg and "doctor" in msg


def test_mixed_kinds_visible_or_listed():
    with pytest.raises(MixedDeviceKinds) as info:
        select_devices(4, inventory=inventory(npu=4, cuda=2, CUDA_VISIBLE_DEVICES="0,1"))
    msg = str(info.value)
    assert "npu: 4" in msg and "cuda: 2 (CUDA_VISIBLE_DEVICES=0,1)" in msg and "device_kind" in msg
    with pytest.raises(MixedDeviceKinds, match="mixes kinds"):
        select_devices(2, devices="npu:0,cuda:0", inventory=inventory(npu=2, cuda=2))
    with pytest.raises(MixedDeviceKinds, match="device_kind is cuda but devices lists npu"):
        select_devices(2, kind="cuda", devices="npu:0,npu:1", inventory=inventory(npu=2, cuda=2))


def test_device_list_errors_and_success():
    inv = inventory(npu=8, ASCEND_RT_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert select_devices(4, devices="npu:0, npu:2,npu:4,npu:6", inventory=inv) == [
        "npu:0", "npu:2", "npu:4", "npu:6"]
    with pytest.raises(InvalidDeviceList, match="lists 2 card"):
        select_devices(4, devices="npu:0,npu:1", inventory=inv)
    with pytest.raises(InvalidDeviceList, match="more than once"):
        select_devices(2, devices="npu:1,npu:1", inventory=inv)
    with pytest.raises(InvalidDeviceList, match="'3' is not a device"):
        select_devices(2, devices="npu:0,3", inventory=inv)
    with pytest.raises(TooFewDevices, match="npu:9.*only 8 npu"):
        select_devices(2, devices="npu:0,npu:9", inventory=inv)
    with pytest.raises(DeviceSelectionError, match="device_kind='tpu'"):
        select_devices(2, kind="tpu", inventory=inv)


def test_successful_selection():
    assert select_devices(4, inventory=inventory(npu=8)) == ["npu:0", "npu:1", "npu:2", "npu:3"]
    assert select_devices(2, inventory=inventory(cuda=2)) == ["cuda:0", "cuda:1"]
    assert select_devices(2, kind="cuda", inventory=inventory(npu=4, cuda=2)) == ["cuda:0", "cuda:1"]
    assert select_devices(8, kind="cpu") == ["cpu"] * 8
    assert select_devices(2, devices="cpu,cpu") == ["cpu", "cpu"]


def fake_torch_npu(tmp_path, monkeypatch, body):
    """A torch_npu module on the path (its import runs `body`); the real one never exists here."""
    folder = tmp_path / "fake_npu"
    folder.mkdir()
    (folder / "torch_npu.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)


def test_probe_counts_npus_through_torch_npu_and_reads_the_variable(tmp_path, monkeypatch):
    from comfy.multidevice.cards import probe_devices
    fake_torch_npu(tmp_path, monkeypatch, "")  # importing it registers torch.npu (below)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 4), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    inv = probe_devices()
    assert (inv.count("npu"), inv.count("cuda"), inv.notes) == (4, 0, ())
    assert inv.env_text("npu") == "ASCEND_RT_VISIBLE_DEVICES=4,5,6,7"
    assert select_devices(4) == ["npu:0", "npu:1", "npu:2", "npu:3"]  # probed, not given
    with pytest.raises(TooFewDevices, match=r"npu_count is 8 but 4 npu card\(s\) are visible \(ASCEND_RT_VISIBLE_DEVICES=4,5,6,7\)"):
        select_devices(8)


def test_probe_survives_a_broken_npu_stack_and_says_why(tmp_path, monkeypatch):
    from comfy.multidevice.cards import probe_devices
    fake_torch_npu(tmp_path, monkeypatch, "raise RuntimeError('libascendcl.so: cannot open shared object file')")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    inv = probe_devices()
    assert (inv.count("npu"), inv.count("cuda")) == (0, 2)
    assert inv.notes == ("npu probe failed: RuntimeError: libascendcl.so: cannot open shared object file",)
    assert "npu probe failed" in inv.describe()
    assert select_devices(2) == ["cuda:0", "cuda:1"]  # auto: the one kind that is visible
    with pytest.raises(TooFewDevices, match=r"npu_count is 4 but 0 npu card.*npu probe failed: RuntimeError: libascendcl"):
        select_devices(4, kind="npu")  # the cause of "0 NPUs" reaches the user


def test_chip_name_asks_torch_npu_on_a_thread_that_made_the_card_current(monkeypatch):
    """The chip name decides HCCL's exchange (comm/hccl.py); asking for it must not touch a card
    from a thread without its device set (torch_npu would open card 0 there, CARDS.md)."""
    calls = []
    fake_npu = types.SimpleNamespace(
        set_device=lambda d: calls.append(("set_device", d, threading.get_ident())),
        get_device_name=lambda d: calls.append(("get_device_name", d, threading.get_ident())) or "Ascend910ProA")
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    card = types.SimpleNamespace(type="npu", index=3)
    assert chip_name(card) == "Ascend910ProA"
    assert [c[:2] for c in calls] == [("set_device", card), ("get_device_name", card)]
    assert calls[0][2] == calls[1][2] != threading.get_ident()
    assert chip_name(torch.device("cpu")) is None
