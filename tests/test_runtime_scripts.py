"""additional_files/runtime/restart-v1.sh and stop-v1.sh against a stand-in ComfyUI.

The stand-in main.py (written below) is a tiny HTTP server on the loopback address that
reports its environment; env STANDIN_MODE makes it crash at start, never open its port,
ignore SIGTERM, log an out-of-memory error, or leave its listening socket open a moment after
it exits (`linger`: a child in its own session holds it, as a worker process or the kernel's
slow teardown of a big process can). It ends by itself after STANDIN_MAX_S seconds,
and every test stops what it started, so nothing outlives the test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port

REPO = Path(__file__).resolve().parent.parent
RUNTIME_SRC = REPO / "additional_files" / "runtime"
SCRIPT_TIMEOUT_S = 60

STANDIN_MAIN = r'''
import argparse, json, os, signal, sys, threading, time
from http.server import BaseHTTPRequestHandler, HTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--listen", default="127.0.0.1")
parser.add_argument("--port", type=int, default=8188)
args, _ = parser.parse_known_args()
mode = os.environ.get("STANDIN_MODE", "serve")
deadline = threading.Timer(float(os.environ.get("STANDIN_MAX_S", "60")), lambda: os._exit(3))
deadline.daemon = True  # a bounded life that never keeps a crashing stand-in alive
deadline.start()
print("stand-in ComfyUI starting", flush=True)
if mode == "crash":
    try:
        raise RuntimeError("device count mismatch: asked for 4 NPUs, found 2 (ASCEND_RT_VISIBLE_DEVICES=0,1)")
    except RuntimeError:
        import traceback
        traceback.print_exc()
    print("ValueError: a later, unrelated error", flush=True)
    sys.exit(1)
if mode == "harmless_then_fatal":
    try:  # ComfyUI logs an optional custom node's failed import and carries on
        raise ImportError("No module named 'optional_pack'")
    except ImportError:
        import traceback
        traceback.print_exc()
    print("Cannot import custom_nodes/optional_pack module for custom nodes", flush=True)
    raise RuntimeError("HCCL init failed: device 3 is held by another process")
if mode == "hang":
    time.sleep(3600)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
KEYS = ("ASCEND_RT_VISIBLE_DEVICES", "COMFYUI_MULTI_DEVICE_BACKEND", "PYTORCH_NPU_ALLOC_CONF",
        "PYTORCH_CUDA_ALLOC_CONF", "MINIMAX_H3_MODELS")

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/oom":  # ComfyUI logs an OOM and keeps serving, memory fragmented
            print("torch.OutOfMemoryError: NPU out of memory. Tried to allocate 2.00 GiB", flush=True)
        body = json.dumps({"pid": os.getpid(), "env": {k: os.environ.get(k) for k in KEYS},
                           "cwd": os.getcwd()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

server = HTTPServer((args.listen, args.port), Handler)
if mode == "linger" and os.fork() == 0:
    # The child: outside the server's process group (a stop waits for that group only), it
    # keeps the inherited listening socket until STANDIN_LINGER_S (2) s after the server has
    # gone, then ends.
    os.setsid()
    parent, start = os.getppid(), time.monotonic()
    while os.getppid() == parent and time.monotonic() - start < 60:
        time.sleep(0.05)
    time.sleep(float(os.environ.get("STANDIN_LINGER_S", "2")))
    os._exit(0)
server.serve_forever()
'''


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


class Home:
    """A ComfyUI-shaped folder with the stand-in main.py and our runtime/ scripts."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True)
        (root / "main.py").write_text(STANDIN_MAIN)
        shutil.copytree(RUNTIME_SRC, root / "runtime")
        self.port = free_port()
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("ASCEND_RT_VISIBLE_DEVICES", "COMFYUI_MULTI_DEVICE_BACKEND",
                                 "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF",
                                 "MINIMAX_H3_MODELS", "COMFYUI_DIR", "COMFYUI_ARGS")}
        self.env.update(COMFYUI_PYTHON=sys.executable, COMFYUI_PORT=str(self.port),
                        COMFYUI_START_TIMEOUT_S="30", COMFYUI_STOP_TIMEOUT_S="5", STANDIN_MAX_S="60")
        self.pid_file = root / "runtime" / "comfyui.pid"
        self.seen_pids: set[int] = set()

    def run(self, script: str, **env) -> subprocess.CompletedProcess:
        result = subprocess.run(["bash", str(self.root / "runtime" / script)],
                                env={**self.env, **env}, capture_output=True, text=True,
                                timeout=SCRIPT_TIMEOUT_S)
        if self.pid_file.exists():
            self.seen_pids.add(self.pid())
        return result

    def pid(self) -> int:
        return int(self.pid_file.read_text().split()[0])

    def get(self, path: str = "/") -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return json.loads(r.read())

    def cleanup(self) -> None:
        if self.pid_file.exists():
            subprocess.run(["bash", str(self.root / "runtime" / "stop-v1.sh")], env=self.env,
                           capture_output=True, timeout=SCRIPT_TIMEOUT_S)
        for pid in self.seen_pids:  # last resort, by the pid we started, never by name
            if running(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


@pytest.fixture
def home(tmp_path):
    h = Home(tmp_path / "ComfyUI")
    yield h
    h.cleanup()


@pytest.fixture(autouse=True)
def _linux_only():
    if not Path("/proc/self/stat").exists():
        pytest.skip("the runtime scripts use /proc (Linux)")


@pytest.mark.timeout(120)
def test_restart_starts_server_with_environment_pid_file_and_log(home):
    result = home.run("restart-v1.sh", COMFYUI_MULTI_DEVICE_BACKEND="peer")
    assert result.returncode == 0, result.stderr
    assert "ComfyUI is up" in result.stdout
    pid_text = home.pid_file.read_text().split()
    assert len(pid_text) == 2 and all(p.isdigit() for p in pid_text)  # pid and start time
    info = home.get("/env")
    assert info["pid"] == home.pid()
    assert info["env"] == {
        "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3",
        "COMFYUI_MULTI_DEVICE_BACKEND": "peer",  # a value the caller set is kept
        "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "MINIMAX_H3_MODELS": str(home.root / "models"),
    }
    assert Path(info["cwd"]).resolve() == home.root.resolve()
    assert "stand-in ComfyUI starting" in (home.root / "runtime" / "comfyui.log").read_text()

    stop = home.run("stop-v1.sh")
    assert stop.returncode == 0 and "stopped" in stop.stdout
    assert not home.pid_file.exists() and not running(info["pid"])


@pytest.mark.timeout(120)
def test_restart_after_out_of_memory_starts_a_clean_process(home):
    assert home.run("restart-v1.sh").returncode == 0
    old_pid = home.pid()
    home.get("/oom")  # the server logs an OOM and keeps running, as ComfyUI does
    result = home.run("restart-v1.sh")
    assert result.returncode == 0, result.stderr
    new_pid = home.pid()
    assert new_pid != old_pid and not running(old_pid)
    assert home.get()["pid"] == new_pid
    previous = (home.root / "runtime" / "comfyui.previous.log").read_text()
    assert "OutOfMemoryError" in previous
    assert "OutOfMemoryError" not in (home.root / "runtime" / "comfyui.log").read_text()


@pytest.mark.timeout(120)
def test_start_failure_prints_the_exception_that_ended_it_and_exits_nonzero(home):
    result = home.run("restart-v1.sh", STANDIN_MODE="crash")
    assert result.returncode != 0
    assert ("the exception that ended it" in result.stderr and "RuntimeError: device count mismatch: asked "
            "for 4 NPUs, found 2" in result.stderr)
    assert "a later, unrelated error" not in result.stderr
    assert "exited (status 1)" in result.stderr
    assert not home.pid_file.exists()


@pytest.mark.timeout(120)
def test_port_that_never_answers_times_out_and_stops_the_process(home):
    result = home.run("restart-v1.sh", STANDIN_MODE="hang", COMFYUI_START_TIMEOUT_S="3")
    assert result.returncode != 0
    assert "did not answer" in result.stderr and "within 3s" in result.stderr
    assert home.seen_pids or "no exception in the log" in result.stderr
    assert not home.pid_file.exists()
    assert not any(running(pid) for pid in home.seen_pids)


@pytest.mark.timeout(120)
def test_stale_pid_file_of_an_exited_process_is_removed(home):
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    home.pid_file.write_text(f"{gone.pid} 12345\n")
    result = home.run("restart-v1.sh")
    assert result.returncode == 0, result.stderr
    assert "stale pid file" in result.stdout
    assert home.pid() != gone.pid and home.get()["pid"] == home.pid()


@pytest.mark.timeout(120)
def test_stale_pid_file_pointing_at_another_process_leaves_it_alone(home):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        home.pid_file.write_text(f"{bystander.pid} 1\n")  # same pid, other start time
        result = home.run("stop-v1.sh")
        assert result.returncode == 0
        assert "belongs to another process" in result.stdout
        assert bystander.poll() is None  # still running: never signalled
        assert not home.pid_file.exists()
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


@pytest.mark.timeout(120)
def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(home):
    assert home.run("restart-v1.sh", STANDIN_MODE="stubborn").returncode == 0
    pid = home.pid()
    result = home.run("stop-v1.sh", COMFYUI_STOP_TIMEOUT_S="2")
    assert result.returncode == 0, result.stderr
    assert "SIGKILL" in result.stdout and not running(pid)


@pytest.mark.timeout(60)
def test_stop_without_pid_file_does_nothing(home):
    result = home.run("stop-v1.sh")
    assert result.returncode == 0 and "no server of ours is running" in result.stdout


@pytest.mark.timeout(60)
def test_restart_refuses_a_folder_without_main_py(home):
    (home.root / "main.py").unlink()
    result = home.run("restart-v1.sh")
    assert result.returncode != 0 and "no main.py" in result.stderr


@pytest.mark.timeout(120)
def test_start_failure_names_the_fatal_exception_not_an_earlier_harmless_one(home):
    result = home.run("restart-v1.sh", STANDIN_MODE="harmless_then_fatal")
    assert result.returncode != 0
    assert "RuntimeError: HCCL init failed: device 3 is held by another process" in result.stderr
    assert "optional_pack" not in result.stderr
    assert not home.pid_file.exists()


@pytest.mark.timeout(120)
def test_a_port_taken_by_another_server_is_an_error_naming_it(home):
    other = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(home.port)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=home.root)
    try:
        for _ in range(100):  # until the other server listens
            try:
                socket.create_connection(("127.0.0.1", home.port), timeout=1).close()
                break
            except OSError:
                import time
                time.sleep(0.1)
        result = home.run("restart-v1.sh")
        assert result.returncode != 0
        assert f"port {home.port} on 127.0.0.1 is already in use by pid {other.pid}" in result.stderr
        assert "http.server" in result.stderr and "COMFYUI_PORT" in result.stderr
        assert not home.pid_file.exists()  # nothing of ours was started
        assert other.poll() is None  # and the other server was left alone
    finally:
        other.kill()
        other.wait(timeout=10)


@pytest.mark.timeout(60)
def test_a_pid_file_without_start_time_is_never_trusted(home):
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        home.pid_file.write_text(f"{bystander.pid}\n")  # an older or hand-written pid file
        result = home.run("stop-v1.sh")
        assert result.returncode == 0
        assert "no start time" in result.stdout and "signalled nothing" in result.stdout
        assert bystander.poll() is None
        assert not home.pid_file.exists()
    finally:
        bystander.kill()
        bystander.wait(timeout=10)


@pytest.mark.timeout(120)
def test_restart_waits_for_the_port_of_the_server_it_stopped(home):
    # The stopped server's socket outlives its process by 2 s: the restart waits for the port
    # to be free instead of refusing it as "already in use".
    assert home.run("restart-v1.sh", STANDIN_MODE="linger").returncode == 0
    old_pid = home.pid()
    result = home.run("restart-v1.sh", STANDIN_MODE="linger")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "waiting for port" in result.stdout
    assert home.pid() != old_pid and home.get()["pid"] == home.pid()


@pytest.mark.timeout(120)
def test_a_port_still_held_after_the_wait_names_the_wait(home):
    # held 30 s after the server's exit: well past the 1 s wait however slow the stop is
    assert home.run("restart-v1.sh", STANDIN_MODE="linger", STANDIN_LINGER_S="30").returncode == 0
    result = home.run("restart-v1.sh", COMFYUI_PORT_FREE_TIMEOUT_S="1")
    assert result.returncode != 0
    assert f"port {home.port} on 127.0.0.1 is still in use" in result.stderr
    assert "COMFYUI_PORT_FREE_TIMEOUT_S=1" in result.stderr
    assert not home.pid_file.exists()
