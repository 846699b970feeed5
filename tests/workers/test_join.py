"""The join command of another server (workers/join.py): refused arguments name the fix, a
pool its ranks do not fit is skipped with the reason, and a program at the rendezvous that
does not prove the cluster secret (an impostor, or another secret) makes it stop saying so, and
a Ctrl-C stops its workers with it (its exact runs: tests/workers/test_servers.py)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from comfy.multidevice.workers import admission, join
from comfy.multidevice.workers.door import Door
from comfy.multidevice.workers.join import join_command, main, REFUSED, serve_pools

pytestmark = pytest.mark.timeout(60)


BASE = b"c" * 32  # a cluster secret as cluster_secret() derives it


@pytest.fixture
def secret_file(tmp_path, monkeypatch):
    path = tmp_path / "pool.secret"
    path.write_text("f" * 64)
    monkeypatch.setenv(admission.SECRET_FILE_ENV, str(path))
    return path


@pytest.mark.parametrize("args, says", [
    (["--rendezvous", "10.0.0.1", "--first-rank", "2", "--devices", "cpu"], "is not HOST:PORT"),
    (["--rendezvous", "10.0.0.1:0", "--first-rank", "2", "--devices", "cpu"], "needs rank 0's fixed port"),
    (["--rendezvous", "10.0.0.1:29600", "--first-rank", "0", "--devices", "cpu"], "rank 0 is the ComfyUI process"),
    (["--rendezvous", "10.0.0.1:29600", "--first-rank", "2", "--devices", " , "], "names no device"),
])
def test_bad_arguments_are_refused_naming_the_fix(capsys, args, says, secret_file):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    assert says in capsys.readouterr().err


def test_without_the_cluster_secret_it_stops_before_connecting(capsys, monkeypatch):
    monkeypatch.delenv(admission.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(admission.SECRET_ENV, raising=False)
    with pytest.raises(SystemExit) as info:
        main(["--rendezvous", "10.0.0.1:29600", "--first-rank", "2", "--devices", "cpu"])
    assert info.value.code == 2
    assert "COMFYUI_MULTI_DEVICE_SECRET_FILE" in capsys.readouterr().err


@pytest.mark.parametrize("world, local, says", [
    (3, 2, "pool 1 has 3 ranks, so ranks 2-3 of this server do not fit: set COMFYUI_MULTI_DEVICE_REMOTE_RANKS"),
    (5, 3, "pool 1 runs ranks 0-2 on the ComfyUI server, so --first-rank 2 overlaps them: give --first-rank 3"),
])
def test_a_pool_this_servers_ranks_do_not_fit_is_skipped_saying_why(caplog, world, local, says):
    rank0 = Door("127.0.0.1", 0, timeout_s=10, base_secret=BASE)
    try:
        rank0.open_pool(world, local)
        with caplog.at_level(logging.ERROR):
            assert serve_pools("127.0.0.1", rank0.port, 2, ["cpu", "cpu"], 10, None, pools=1, base=BASE) == 2
        assert says in caplog.text
    finally:
        rank0.close()


def test_another_secret_at_rank0_stops_it_saying_so(caplog):
    rank0 = Door("127.0.0.1", 0, timeout_s=10, base_secret=b"d" * 32)
    try:
        with caplog.at_level(logging.ERROR):
            assert serve_pools("127.0.0.1", rank0.port, 2, ["cpu"], 10, None, pools=1, base=BASE) == REFUSED
        assert "does not prove the pool's secret" in caplog.text and "This join command stops" in caplog.text
    finally:
        rank0.close()


def test_an_impostor_at_the_rendezvous_is_never_followed(caplog):
    """The audit's reverse direction: another program holding the port while ComfyUI restarts
    answered the join command's workers, who unpickled what it sent. Here it answers as a pool
    would, announcing one, without the secret: nothing is started, the command stops."""
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        def answer():
            conn, _ = impostor.accept()
            admission.LineReader(conn, "join").read(5)
            admission.send_line(conn, {**admission.versions(), "nonce": "n", "proof": "0" * 64})
            admission.send_line(conn, {"pool": 1, "world": 4, "local": 2, "nonce": "x"})
            time.sleep(1)
            conn.close()
        threading.Thread(target=answer, daemon=True).start()
        with caplog.at_level(logging.INFO):
            assert serve_pools("127.0.0.1", impostor.getsockname()[1], 2, ["cpu", "cpu"], 10, None, pools=1,
                               base=BASE) == REFUSED
    assert "does not prove the pool's secret" in caplog.text and "joining pool" not in caplog.text


def test_the_command_a_user_runs():
    assert join_command("10.0.0.1:29600", 8, ["npu:0", "npu:1"], 600) == (
        "python -m comfy.multidevice.workers.join --rendezvous 10.0.0.1:29600 --first-rank 8 "
        "--devices npu:0,npu:1 --timeout 600")


def test_a_ctrl_c_stops_this_servers_workers_with_the_command(monkeypatch):
    """The workers run in sessions of their own (workers/process.py), so the terminal's Ctrl-C
    reaches the join command alone: it kills the workers it started before it ends."""
    started = []

    class Worker:
        def __init__(self, rank, arguments, key, env=None):
            self.rank, self.killed = rank, False
            started.append(self)

        def wait(self):
            raise KeyboardInterrupt

        def kill(self):
            self.killed = True

    monkeypatch.setattr(join, "WorkerProcess", Worker)
    rank0 = Door("127.0.0.1", 0, timeout_s=10, base_secret=BASE)
    try:
        rank0.open_pool(4, 2)
        with pytest.raises(KeyboardInterrupt):
            serve_pools("127.0.0.1", rank0.port, 2, ["cpu", "cpu"], 10, None, pools=1, base=BASE)
    finally:
        rank0.close()
    assert [(w.rank, w.killed) for w in started] == [(2, True), (3, True)]


def test_a_ctrl_c_ends_the_command_with_one_line_and_status_130(monkeypatch, caplog, secret_file):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(join, "serve_pools", interrupted)
    with caplog.at_level(logging.INFO):
        assert main(["--rendezvous", "10.0.0.1:29600", "--first-rank", "2", "--devices", "cpu"]) == 130
    assert [r.getMessage() for r in caplog.records] == [
        "stopped by Ctrl-C, and this server's workers with it; rank 0's next pool waits for their ranks until "
        "this command runs again"]
