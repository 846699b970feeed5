"""COMFYUI_MULTI_DEVICE_BACKEND / _TIMEOUT_S / _RENDEZVOUS / _REMOTE_RANKS: one parser, one wording,
refused before any work; the per-user cache folder from XDG_CACHE_HOME."""

from __future__ import annotations

from pathlib import Path

import pytest

from comfy.multidevice.comm.settings import (backend_from_env, check_environment, check_timeout, DEFAULT_TIMEOUT_S,
                                             remote_ranks_from_env, rendezvous_from_env, SettingError,
                                             timeout_from_env, user_cache_dir)


@pytest.mark.parametrize("raw, seconds", [("30", 30.0), (" 2.5 ", 2.5), (".5", 0.5), ("86400", 86400.0),
                                          ("", DEFAULT_TIMEOUT_S), ("  ", DEFAULT_TIMEOUT_S)])
def test_valid_timeouts(monkeypatch, raw, seconds):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_TIMEOUT_S", raw)
    assert timeout_from_env() == seconds


@pytest.mark.parametrize("raw", ["nan", "NaN", "inf", "-inf", "1e3", "1_0", "\uff11\uff10", "ten", "-0", "0",
                                 "86400.5"])
def test_invalid_timeouts_name_the_variable_the_value_and_the_fix(monkeypatch, raw):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_TIMEOUT_S", raw)
    with pytest.raises(SettingError) as info:
        timeout_from_env()
    text = str(info.value)
    assert text.startswith(f"environment variable COMFYUI_MULTI_DEVICE_TIMEOUT_S={raw!r} ")
    assert "set it to seconds above 0 and at most 86400, or unset it for the default 600" in text


def test_backend_errors_say_whether_the_variable_or_the_option_was_wrong(monkeypatch):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "gloo")
    with pytest.raises(SettingError, match=r"^environment variable COMFYUI_MULTI_DEVICE_BACKEND='gloo' "
                                           r"is not a backend; set it to one of auto, hccl, nccl, peer"):
        backend_from_env()
    assert backend_from_env("peer") == "peer"  # an option given wins over the variable
    with pytest.raises(SettingError, match=r"^unknown multi-device backend 'mpi'; valid values"):
        backend_from_env("mpi")
    with pytest.raises(SettingError, match=r"unknown multi-device backend 4"):
        backend_from_env(4)
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", " NCCL ")
    assert backend_from_env() == "nccl"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0, -3, 86401, True, None, "5"])
def test_timeout_arguments(value):
    with pytest.raises(SettingError, match="must be a number of seconds above 0 and at most 86400"):
        check_timeout(value, "timeout_s")
    assert check_timeout(3) == 3.0


def test_the_node_refuses_a_bad_variable_before_touching_anything(monkeypatch):
    from comfy.multidevice.roles import apply as roles_apply
    from comfy_extras.nodes_multinpu import configure_parallel
    from tests.node_cases import assert_same, inputs, rank_threads, snapshot
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_TIMEOUT_S", "inf")
    objs = inputs()
    before, threads, coords = snapshot(*objs), rank_threads(), dict(roles_apply._COORDINATORS)
    with pytest.raises(SettingError, match="environment variable COMFYUI_MULTI_DEVICE_TIMEOUT_S='inf'"):
        configure_parallel(*objs, npu_count=4, device_kind="cpu")
    assert_same(before, snapshot(*objs))
    assert rank_threads() == threads and roles_apply._COORDINATORS == coords


def test_the_run_watchdog_and_the_weight_base_variables(monkeypatch):
    from comfy.multidevice.comm.settings import (check_environment, DEFAULT_RUN_TIMEOUT_S, run_timeout_from_env,
                                                 weight_base_from_env)
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S", raising=False)
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_WEIGHT_BASE", raising=False)
    assert run_timeout_from_env() == DEFAULT_RUN_TIMEOUT_S == 3600 and weight_base_from_env() == "map"
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S", "7200")
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_WEIGHT_BASE", " PIN ")
    assert run_timeout_from_env() == 7200.0 and weight_base_from_env() == "pin"
    assert weight_base_from_env("map") == "map"  # an argument given wins over the variable
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_WEIGHT_BASE", "bogus")
    with pytest.raises(SettingError, match=r"^environment variable COMFYUI_MULTI_DEVICE_WEIGHT_BASE='bogus' "
                                           r"is not a weight base mode; set it to one of map, pin"):
        check_environment()
    with pytest.raises(SettingError, match=r"^mode=3 is not a weight base mode"):
        weight_base_from_env(3)


@pytest.mark.parametrize("raw, expected", [("", ("127.0.0.1", 0)), ("10.0.0.1:29600", ("10.0.0.1", 29600)),
                                           (" node-a:1 ", ("node-a", 1)), ("[fd00::1]:29600", ("fd00::1", 29600))])
def test_the_rendezvous_variable(monkeypatch, raw, expected):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_RENDEZVOUS", raw)
    assert rendezvous_from_env() == expected


@pytest.mark.parametrize("raw", ["10.0.0.1", ":29600", "10.0.0.1:port", "10.0.0.1:65536", "10.0.0.1:-1",
                                 "10.0.0.1:\uff11"])
def test_a_bad_rendezvous_names_the_variable_and_the_fix(monkeypatch, raw):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_RENDEZVOUS", raw)
    with pytest.raises(SettingError, match=rf"^environment variable COMFYUI_MULTI_DEVICE_RENDEZVOUS={raw!r} "
                                           r"is not HOST:PORT; set it to this server's address"):
        rendezvous_from_env()


def test_remote_ranks_need_a_count_and_a_fixed_rendezvous_port(monkeypatch):
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_REMOTE_RANKS", raising=False)
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_RENDEZVOUS", raising=False)
    assert remote_ranks_from_env() == 0
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_REMOTE_RANKS", "4")
    with pytest.raises(SettingError, match=r"REMOTE_RANKS='4' needs a fixed rendezvous port .* set "
                                           r"COMFYUI_MULTI_DEVICE_RENDEZVOUS=ADDRESS:PORT too"):
        remote_ranks_from_env()
    with pytest.raises(SettingError, match="needs a fixed rendezvous port"):
        check_environment()  # the node's early check reads it too
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_RENDEZVOUS", "10.0.0.1:29600")
    assert remote_ranks_from_env() == 4
    for raw in ("-1", "two", "1.5", "5000"):
        monkeypatch.setenv("COMFYUI_MULTI_DEVICE_REMOTE_RANKS", raw)
        with pytest.raises(SettingError, match=rf"REMOTE_RANKS={raw!r} is not a number of ranks \(0 to 4096\)"):
            remote_ranks_from_env()


def test_trusted_modules_are_dotted_names_or_nothing(monkeypatch):
    from comfy.multidevice.comm.settings import trusted_modules_from_env
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_TRUSTED_MODULES", raising=False)
    assert trusted_modules_from_env() == ()
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_TRUSTED_MODULES", " tests.upstream.standins, my_pkg ,")
    assert trusted_modules_from_env() == ("tests.upstream.standins", "my_pkg")
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_TRUSTED_MODULES", "os:system")
    with pytest.raises(SettingError, match=r"TRUSTED_MODULES='os:system' names \['os:system'\], which are no Python "
                                           r"module names; list dotted module names"):
        trusted_modules_from_env()
    with pytest.raises(SettingError, match="TRUSTED_MODULES"):
        check_environment()


@pytest.mark.parametrize("environ, folder", [
    ({"XDG_CACHE_HOME": "/srv/cache", "HOME": "/home/u"}, "/srv/cache/minimax-h3-multinpu"),
    ({"HOME": "/home/u"}, "/home/u/.cache/minimax-h3-multinpu"),
    ({"XDG_CACHE_HOME": "", "HOME": "/home/u"}, "/home/u/.cache/minimax-h3-multinpu"),
    ({"XDG_CACHE_HOME": "rel/cache", "HOME": "/home/u"}, "/home/u/.cache/minimax-h3-multinpu"),  # XDG: ignored
])
def test_the_user_cache_folder_follows_xdg_cache_home(environ, folder):
    assert user_cache_dir(environ) == Path(folder)
