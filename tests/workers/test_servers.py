"""One DiT across two servers: two network namespaces joined by a veth pair stand for two
servers on one machine (root makes them; only addresses inside them are used). The first runs
rank 0 (tests/workers/two_servers_driver.py) with one local worker, the second two workers
started with the pool's join command, rendezvous over TCP between them, gloo underneath.

Exact against one device; a worker on the second server killed with SIGKILL fails the next
forward naming its rank and that server's address within the timeout, and a fresh pool with
the second server's ranks started again is exact. Where namespaces cannot be made (no root,
no `ip`), the same runs over loopback and the test says so in its report.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
import warnings

import pytest

from comfy.multidevice.miniature.h3 import save_miniature
from tests.sp_cases import FP32_TOL, tiny_model
from tests.comfyui_server import REPO

TIMEOUT_S = 30
pytestmark = pytest.mark.timeout(300)


def _ip(*args) -> bool:
    return subprocess.run(["ip", *args], capture_output=True, timeout=30).returncode == 0


@pytest.fixture
def servers():
    """(command prefix of server A, its address, command prefix of server B), namespaces made
    and removed here; loopback for both when they cannot be made."""
    tag = uuid.uuid4().hex[:6]
    a, b = f"h3a{tag}", f"h3b{tag}"
    va, vb = f"va{tag}", f"vb{tag}"
    made = []
    ok = os.geteuid() == 0 and shutil.which("ip") is not None
    for step in ([["netns", "add", a], ["netns", "add", b]] if ok else []):
        ok = ok and _ip(*step)
        if ok:
            made.append(step[2])
    steps = [["link", "add", va, "type", "veth", "peer", "name", vb], ["link", "set", va, "netns", a],
             ["link", "set", vb, "netns", b], ["-n", a, "addr", "add", "10.213.0.1/24", "dev", va],
             ["-n", b, "addr", "add", "10.213.0.2/24", "dev", vb], ["-n", a, "link", "set", va, "up"],
             ["-n", b, "link", "set", vb, "up"], ["-n", a, "link", "set", "lo", "up"],
             ["-n", b, "link", "set", "lo", "up"]]
    for step in steps if ok else []:
        ok = ok and _ip(*step)
    try:
        if ok:
            # gloo advertises the address of GLOO_SOCKET_IFNAME's interface (else the host name's,
            # which is loopback here): each server names its own
            yield (["ip", "netns", "exec", a, "env", f"GLOO_SOCKET_IFNAME={va}"], "10.213.0.1",
                   ["ip", "netns", "exec", b, "env", f"GLOO_SOCKET_IFNAME={vb}"], True)
        else:
            warnings.warn("network namespaces could not be made here: the two servers run over loopback")
            yield [], "127.0.0.1", [], False
    finally:
        for name in made:
            _ip("netns", "del", name)


def test_one_dit_over_two_servers_exact_and_a_killed_remote_worker_is_named(servers, tmp_path, record_property):
    run_a, address, run_b, namespaces = servers
    record_property("network_namespaces", namespaces)
    path = tmp_path / "tiny.safetensors"
    save_miniature(tiny_model(seed=3), path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen([*run_a, sys.executable, str(REPO / "tests" / "workers" / "two_servers_driver.py"),
                               "--address", address, "--checkpoint", str(path), "--timeout", str(TIMEOUT_S)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.log", "w"),
                              text=True, env=env, cwd=REPO)  # stderr: see below
    remote = []

    def start_second_server(init):
        return [subprocess.Popen([*run_b, sys.executable, "-m", "comfy.multidevice.workers.worker", "--rank", str(r),
                                  "--world", "4", "--init", init, "--device", "cpu", "--timeout", str(TIMEOUT_S),
                                  "--threads", "1"], env=env, cwd=REPO, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for r in (2, 3)]

    def read(expected):
        line = driver.stdout.readline().split(" ", 1)
        assert line[0].strip() == expected, (line, (tmp_path / "driver.log").read_text()[-3000:])
        return line[1].strip() if len(line) > 1 else ""

    try:
        remote += start_second_server(read("JOIN"))
        assert float(read("EXACT")) <= FP32_TOL
        read("KILL-NOW")
        os.kill(remote[1].pid, signal.SIGKILL)  # rank 3, on the second server
        remote[1].wait()
        driver.stdin.write("killed\n")
        driver.stdin.flush()
        seconds, message = read("FAILED").split(" ", 1)
        assert float(seconds) < TIMEOUT_S + 10
        assert "rank 3 on " in message and f"[{'10.213.0.2' if namespaces else '127.0.0.1'}]" in message, message
        assert "ended (its connection closed)" in message
        for p in remote:  # rank 2 sees its peers gone and ends too (its collective fails)
            p.wait(timeout=TIMEOUT_S + 10)
        remote += start_second_server(read("JOIN"))  # the second server back: a fresh pool
        assert float(read("EXACT")) <= FP32_TOL
        read("DONE")
        assert driver.wait(timeout=60) == 0
    finally:
        for p in [driver, *remote]:
            if p.poll() is None:
                p.kill()
