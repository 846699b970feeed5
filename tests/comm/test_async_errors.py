"""In ComfyUI's process a failed or stuck torch.distributed collective must raise, not end the
server (comm/async_errors.py): the variables PyTorch and torch_npu read when a process group is
made are set before it is made, the user's own values are kept, and HCCL's execution timeout is
ordered below the group's."""

import logging
import os
from types import SimpleNamespace

import pytest
import torch

from comfy.multidevice.comm import async_errors, torch_dist
from comfy.multidevice.comm.async_errors import hccl_exec_timeout_below, set_collective_error_handling
from comfy.multidevice.workers.pool import WorkerPool

NAMES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING",
         "HCCL_EXEC_TIMEOUT")


@pytest.fixture(autouse=True)
def nothing_set_yet(monkeypatch):
    monkeypatch.setattr(async_errors, "_set_here", {})


@pytest.fixture
def clean_env(monkeypatch):
    """The process environment without the variables (restored after the test)."""
    for name in NAMES:
        monkeypatch.setenv(name, "recorded")  # so monkeypatch restores its absence too
        monkeypatch.delenv(name)
    return os.environ


def test_comfyui_process_with_nccl_aborts_and_raises(caplog):
    env = {}
    with caplog.at_level(logging.INFO, logger=async_errors.__name__):
        done = set_collective_error_handling("nccl", 600.0, server_process=True, environ=env)
    assert env == done == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert any("set TORCH_NCCL_ASYNC_ERROR_HANDLING=2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name,value", [("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
                                        ("NCCL_ASYNC_ERROR_HANDLING", "1")])  # the older name counts too
def test_the_users_nccl_handling_is_kept_and_named_when_it_ends_the_process(name, value, caplog):
    env = {name: value}
    with caplog.at_level(logging.WARNING, logger=async_errors.__name__):
        assert set_collective_error_handling("nccl", 600.0, server_process=True, environ=env) == {}
    assert env == {name: value}
    assert any(f"={value} is kept" in r.getMessage() and "ends ComfyUI's process" in r.getMessage()
               for r in caplog.records)


def test_a_worker_process_keeps_the_libraries_defaults():
    env = {}
    assert set_collective_error_handling("nccl", 600.0, server_process=False, environ=env) == {}
    assert set_collective_error_handling("gloo", 600.0, server_process=True, environ=env) == {}
    assert env == {}


def test_comfyui_process_with_hccl_and_an_exec_timeout_below_the_groups():
    env = {}
    done = set_collective_error_handling("hccl", 600.0, server_process=True, environ=env)
    # 544 = 8 x 68 s: below 600 s, and what the Atlas training series' 68 s steps keep as it is
    assert env == done == {"HCCL_ASYNC_ERROR_HANDLING": "0", "HCCL_EXEC_TIMEOUT": "544"}


def test_an_hccl_worker_orders_the_exec_timeout_only():
    env = {}
    assert set_collective_error_handling("hccl", 1800.0, server_process=False, environ=env) == \
        {"HCCL_EXEC_TIMEOUT": "1768"}


@pytest.mark.parametrize("value", ["1836", "600", "0", "soon"])
def test_a_users_exec_timeout_not_below_the_groups_is_kept_and_warned(value, caplog):
    env = {"HCCL_EXEC_TIMEOUT": value, "HCCL_ASYNC_ERROR_HANDLING": "0"}
    with caplog.at_level(logging.WARNING, logger=async_errors.__name__):
        assert set_collective_error_handling("hccl", 600.0, server_process=True, environ=env) == {}
    assert env["HCCL_EXEC_TIMEOUT"] == value
    assert any(f"HCCL_EXEC_TIMEOUT={value} is kept" in r.getMessage() and "below 600" in r.getMessage()
               for r in caplog.records)


def test_a_users_exec_timeout_below_the_groups_is_kept_quietly(caplog):
    env = {"HCCL_EXEC_TIMEOUT": "300"}
    with caplog.at_level(logging.WARNING, logger=async_errors.__name__):
        set_collective_error_handling("hccl", 600.0, server_process=False, environ=env)
    assert env == {"HCCL_EXEC_TIMEOUT": "300"} and not caplog.records


def test_the_exec_timeout_set_here_follows_a_later_groups_timeout():
    env = {}
    set_collective_error_handling("hccl", 1800.0, server_process=False, environ=env)
    set_collective_error_handling("hccl", 600.0, server_process=False, environ=env)
    assert env == {"HCCL_EXEC_TIMEOUT": "544"}


@pytest.mark.parametrize("timeout_s,expected", [(600.0, 544), (544.0, 476), (544.5, 544), (100.0, 68),
                                                (68.0, 67), (30.0, 29)])
def test_exec_timeout_below(timeout_s, expected):
    assert hccl_exec_timeout_below(timeout_s) == expected < timeout_s


class _Stop(Exception):
    pass


@pytest.mark.parametrize("device_backend,variable,value", [("nccl", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
                                                           ("hccl", "HCCL_ASYNC_ERROR_HANDLING", "0")])
def test_the_variables_are_set_before_the_group_is_made(clean_env, monkeypatch, device_backend, variable, value):
    seen = {}

    def made(backend, **kwargs):  # stands in for torch.distributed.init_process_group
        seen.update({name: os.environ.get(name) for name in NAMES})
        raise _Stop()
    monkeypatch.setattr(torch.distributed, "init_process_group", made)
    with pytest.raises(_Stop):
        torch_dist.init_process_group(0, 2, "cpu", backend=device_backend, timeout_s=600, store=object(),
                                      server_process=True)
    assert seen[variable] == value
    with pytest.raises(_Stop):  # a worker's group: the libraries' defaults
        monkeypatch.setattr(async_errors, "_set_here", {})
        monkeypatch.delenv(variable)
        torch_dist.init_process_group(1, 2, "cpu", backend=device_backend, timeout_s=600, store=object())
    assert seen[variable] is None


def test_a_worker_pool_joins_as_comfyuis_process(monkeypatch):
    calls = []

    def joined(*args, **kwargs):
        calls.append(kwargs)
        return "comm"
    monkeypatch.setattr("comfy.multidevice.workers.pool.init_process_group", joined)
    pool = SimpleNamespace(world_size=2, devices=[torch.device("cpu")], timeout_s=30.0, workers=[])
    assert WorkerPool._join(pool, store="store") == "comm"
    assert calls[0]["server_process"] is True
