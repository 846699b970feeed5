"""One DiT across two servers: two network namespaces joined by a veth pair stand for two
servers on one machine (root makes them; only addresses inside them are used). The first runs
rank 0 (tests/workers/two_servers_driver.py) with one local worker, the second the pool's join
command (workers/join.py) for ranks 2 and 3, rendezvous over TCP between them, gloo underneath,
both with the same cluster secret file. A stranger on the second server (the join command with
another secret, and a torch.distributed store client at the rendezvous port) is refused, named
in rank 0's log by its address, and stops saying why; the pool goes on with the right ranks.

Exact against one device; a worker on the second server killed with SIGKILL fails the next
forward naming its rank and that server's address within the timeout, and a fresh pool, which
the join command's ranks join again by themselves, is exact; so is the pool of a new rank 0
at the same address (ComfyUI restarted), which the join command finds again. Where namespaces cannot be made (no root,
no `ip`), the same runs over loopback and the test says so in its report.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import warnings

import pytest

from comfy.multidevice.miniature.h3 import save_miniature
from tests.sp_cases import FP32_TOL, tiny_model
from tests.comfyui_server import REPO
from tests.helpers import free_port
from tests.two_servers import child_pid, two_servers

TIMEOUT_S = 30
# a stranger at rank 0's rendezvous port: a pickle that would create the file argv[3] if any
# process unpickled it, then a torch.distributed store client (the audit's stranger read the
# pool's generation there); prints STORE-OK if the port answered as a store
STRANGER = """
import datetime, pickle, socket, sys, torch.distributed as dist
class Marker:
    def __reduce__(self):
        return open, (sys.argv[3], "w")
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
    conn.sendall(pickle.dumps(Marker()) + b"\\n")
    print("door:", conn.recv(4096)[:200])
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=datetime.timedelta(seconds=5))
print(store.get("generation"), "STORE-OK")
"""
pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def servers():
    with two_servers() as pair:
        if not pair.namespaces:
            warnings.warn("network namespaces could not be made here: the two servers run over loopback")
        yield pair.run_a, pair.address_a, pair.run_b, pair.namespaces


def test_one_dit_over_two_servers_exact_a_killed_remote_worker_named_and_a_restart_found(servers, tmp_path, record_property):
    run_a, address, run_b, namespaces = servers
    record_property("network_namespaces", namespaces)
    path = tmp_path / "tiny.safetensors"
    save_miniature(tiny_model(seed=3), path)
    secret = tmp_path / "pool.secret"
    secret.write_text(os.urandom(32).hex())
    other = tmp_path / "other.secret"
    other.write_text(os.urandom(32).hex())
    env = {**os.environ, "PYTHONPATH": str(REPO), "COMFYUI_MULTI_DEVICE_SECRET_FILE": str(secret)}
    port = free_port()

    def start_driver(*extra):
        return subprocess.Popen([*run_a, sys.executable, str(REPO / "tests" / "workers" / "two_servers_driver.py"),
                                 "--address", address, "--port", str(port), "--checkpoint", str(path),
                                 "--timeout", str(TIMEOUT_S), *extra],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=open(tmp_path / "driver.log", "a"), text=True, env=env, cwd=REPO)
    driver = start_driver()
    join = None

    def read(expected):
        line = driver.stdout.readline().split(" ", 1)
        assert line[0].strip() == expected, (line, (tmp_path / "driver.log").read_text()[-3000:])
        return line[1].strip() if len(line) > 1 else ""

    try:
        command = shlex.split(read("JOIN"))
        assert command[:3] == ["python", "-m", "comfy.multidevice.workers.join"], command
        # a stranger first: the join command with another secret, and a store client at the port
        stranger = subprocess.run([*run_b, sys.executable, *command[1:]], cwd=REPO, timeout=60,
                                  env={**env, "COMFYUI_MULTI_DEVICE_SECRET_FILE": str(other)},
                                  capture_output=True, text=True)
        assert stranger.returncode == 3, stranger.stderr[-2000:]
        assert "does not prove the pool's secret" in stranger.stderr and "This join command stops" in stranger.stderr
        marker = tmp_path / "marker"
        probe = subprocess.run([*run_b, sys.executable, "-c", STRANGER, address, str(port), str(marker)], cwd=REPO,
                               env=env, capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "STORE-OK" not in probe.stdout, probe.stdout
        assert "refused" in probe.stdout, probe.stdout + probe.stderr[-2000:]
        join = subprocess.Popen([*run_b, sys.executable, *command[1:]], env=env, cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "join.log", "w"))
        assert float(read("EXACT")) <= FP32_TOL
        read("KILL-NOW")
        rank3 = child_pid(join.pid, 3)
        os.kill(rank3, signal.SIGKILL)  # rank 3, on the second server
        driver.stdin.write("killed\n")
        driver.stdin.flush()
        seconds, message = read("FAILED").split(" ", 1)
        assert float(seconds) < TIMEOUT_S + 10
        assert "rank 3 on " in message and f"[{'10.213.0.2' if namespaces else '127.0.0.1'}]" in message, message
        assert "ended (its connection closed)" in message
        assert float(read("EXACT")) <= FP32_TOL  # the join command's ranks came back by themselves
        read("DONE")
        assert join.poll() is None, (tmp_path / "join.log").read_text()[-3000:]  # it waits for the next pool
        log = (tmp_path / "join.log").read_text()
        assert "joining pool 1 " in log and "joining pool 2 " in log and "was killed by signal 9" in log, log[-3000:]
        assert driver.wait(timeout=60) == 0
        driver_log = (tmp_path / "driver.log").read_text()
        stranger_address = "10.213.0.2" if namespaces else "127.0.0.1"
        assert f"refused {stranger_address}:" in driver_log and "does not prove the pool's secret" in driver_log, \
            driver_log[-3000:]
        assert "sent a line that is not JSON" in driver_log and not marker.exists()  # nobody unpickled it

        # ComfyUI restarted: a new rank 0 at the same address; the join command finds it by itself
        driver = start_driver("--exact-only")
        read("JOIN")
        assert float(read("EXACT")) <= FP32_TOL
        read("DONE")
        assert driver.wait(timeout=60) == 0
        log = (tmp_path / "join.log").read_text()
        assert "reconnecting" in log and log.count("joining pool 1 ") == 2, log[-3000:]
    finally:
        for p in [driver, join]:
            if p is not None and p.poll() is None:
                p.kill()

