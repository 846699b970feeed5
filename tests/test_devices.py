"""The node's `devices` input: every malformed value is refused by the node's own error
(InvalidDeviceList) naming the entry and the fix, before anything is cloned or started."""

from __future__ import annotations

import pytest

from comfy.multidevice.cards import DeviceInventory, InvalidDeviceList, parse_device_list, select_devices
from comfy.multidevice.roles import apply as roles_apply
from comfy_extras.nodes_multinpu import configure_parallel
from tests.test_nodes_multinpu import assert_same, inputs, rank_threads, snapshot

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
