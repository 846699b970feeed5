"""The join command of another server (workers/join.py): refused arguments name the fix, and a
pool its ranks do not fit is skipped with the reason (its exact runs: tests/workers/test_servers.py)."""

from __future__ import annotations

import logging

import pytest

from comfy.multidevice.workers.join import join_command, main, serve_pools
from comfy.multidevice.workers.rendezvous import Rendezvous

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("args, says", [
    (["--rendezvous", "10.0.0.1", "--first-rank", "2", "--devices", "cpu"], "is not HOST:PORT"),
    (["--rendezvous", "10.0.0.1:0", "--first-rank", "2", "--devices", "cpu"], "needs rank 0's fixed port"),
    (["--rendezvous", "10.0.0.1:29600", "--first-rank", "0", "--devices", "cpu"], "rank 0 is the ComfyUI process"),
    (["--rendezvous", "10.0.0.1:29600", "--first-rank", "2", "--devices", " , "], "names no device"),
])
def test_bad_arguments_are_refused_naming_the_fix(capsys, args, says):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_a_pool_this_servers_ranks_do_not_fit_is_skipped_saying_why(caplog):
    rank0 = Rendezvous("127.0.0.1", 0, timeout_s=10)
    rank0.open(3)  # ranks 0-2; this server would be ranks 2-3
    with caplog.at_level(logging.ERROR):
        assert serve_pools("127.0.0.1", rank0.port, 2, ["cpu", "cpu"], 10, None, pools=1) == 2
    assert "pool 1 has 3 ranks, so ranks 2-3 of this server do not fit: set COMFYUI_MULTI_DEVICE_REMOTE_RANKS" \
        in caplog.text


def test_the_command_a_user_runs():
    assert join_command("10.0.0.1:29600", 8, ["npu:0", "npu:1"], 600) == (
        "python -m comfy.multidevice.workers.join --rendezvous 10.0.0.1:29600 --first-rank 8 "
        "--devices npu:0,npu:1 --timeout 600")
