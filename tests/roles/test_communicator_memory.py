"""The card memory of one communicator and which library the cards' coordinator uses
(roles/communicator_memory.py); the plan that adds them up: tests/roles/test_memory_plan.py."""

import logging

import pytest

from comfy.multidevice.roles import communicator_memory
from comfy.multidevice.roles.communicator_memory import card_kind, communicator_bytes, coordinator_library

MIB = 2 ** 20


def test_hccl_reserves_twice_its_buffer_size_in_mb():
    assert communicator_bytes("hccl", 4, {}) == 400 * MIB  # default HCCL_BUFFSIZE=200
    assert communicator_bytes("hccl", 8, {"HCCL_BUFFSIZE": "1024"}) == 2048 * MIB  # not by world size


def test_nccl_buffers_grow_with_the_peers():
    assert communicator_bytes("nccl", 2, {}) == 2 * 4 * MIB * 32
    assert communicator_bytes("nccl", 8, {}) == 2 * 4 * MIB * 32 * 7
    assert communicator_bytes("nccl", 4, {"NCCL_BUFFSIZE": "2097152", "NCCL_MAX_NCHANNELS": "4"}) == 2 * 2 * MIB * 4 * 3
    assert communicator_bytes("gloo", 4, {}) == communicator_bytes("peer", 4, {}) == 0


@pytest.mark.parametrize("value", ["0", "-5", "lots", "1.5"])
def test_a_bad_buffer_size_plans_with_the_default_and_says_so(value, caplog):
    with caplog.at_level(logging.WARNING, logger=communicator_memory.__name__):
        assert communicator_bytes("hccl", 4, {"HCCL_BUFFSIZE": value}) == 400 * MIB
    assert f"HCCL_BUFFSIZE={value!r} is not a whole number above 0" in caplog.text


def test_the_coordinators_library(monkeypatch):
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_BACKEND", raising=False)
    assert coordinator_library("npu", None) == "hccl" and coordinator_library("cuda", "auto") == "nccl"
    assert coordinator_library("npu", "peer") is None and coordinator_library("cpu", "hccl") is None
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "peer")
    assert coordinator_library("npu", None) is None  # the variable, when the node says default
    assert coordinator_library("npu", "hccl") == "hccl"  # the node's input wins


def test_card_kind_reads_names_and_devices():
    import torch
    assert card_kind("npu:3") == "npu" and card_kind(torch.device("cuda", 1)) == "cuda" and card_kind("cpu") == "cpu"
