"""One DiT over two servers from a real ComfyUI server (COMFYUI_DIR, the pack installed by our
installer): server A runs ComfyUI with 2 CPU cards and COMFYUI_MULTI_DEVICE_REMOTE_RANKS=2,
server B the join command for ranks 2 and 3 (workers/join.py), each in its own network
namespace joined by a veth pair (tests/two_servers.py), rendezvous over TCP, gloo.

The node's dit_ranks=auto (processes, as other servers' ranks are set) and sp_mode=auto (Ulysses
over other servers' network, 16 heads on 4 ranks) samples through the server's KSampler (comfy.sample.sample) like 1 card; a rank on B killed with SIGKILL while a
40-step prompt samples fails that prompt naming the rank and B's address within the timeout;
the next prompt, with B's ranks back by themselves, is exact again. A stranger on B that sends
the rendezvous port a pickle (which would create a marker file if unpickled) is refused, named
in ComfyUI's log by its address, and nothing is unpickled. Where namespaces cannot be
made, both servers are loopback and the test says so. On v0.33.0 sequence parallel is refused
by design (test_install_ways.py), so this file skips there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest

from tests.comfyui_server import REPO
from tests.e2e.test_install_ways import make_tree, MAX_LEVELS
from tests.e2e.test_install_ways import tiny_models  # noqa: F401 - a fixture
from tests.helpers import free_port
from tests.two_servers import child_pid, two_servers

TIMEOUT_S = 60  # the collective timeout on both servers
STRANGER = """
import pickle, socket, sys, time
class Marker:
    def __reduce__(self):
        return open, (sys.argv[3], "w")
for _ in range(600):  # the door opens with the first prompt that uses the other server
    try:
        conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        time.sleep(0.25)
conn.sendall(pickle.dumps(Marker()) + bytes([10]))
print("door:", conn.recv(4096)[:200])
"""
pytestmark = pytest.mark.timeout(900)


def test_one_dit_over_two_servers_through_the_node(upstream, tiny_models, tmp_path, record_property):  # noqa: F811
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_install_ways.py checks that)")
    tree = make_tree(upstream, tmp_path, "patch", tiny_models)
    with two_servers() as servers:
        record_property("network_namespaces", servers.namespaces)
        if not servers.namespaces:
            warnings.warn("network namespaces could not be made here: the two servers run over loopback")
        rendezvous = f"{servers.address_a}:{free_port()}"
        secret = tmp_path / "pool.secret"  # the README's cluster secret, the same file on both servers
        secret.write_text(os.urandom(32).hex())
        with_secret = {**os.environ, "COMFYUI_MULTI_DEVICE_SECRET_FILE": str(secret)}
        driver = subprocess.Popen(
            [*servers.run_a, sys.executable, str(REPO / "tests" / "e2e" / "two_servers_driver.py"), "--tree", str(tree),
             "--root", str(tmp_path), "--rendezvous", rendezvous, "--timeout", str(TIMEOUT_S)],
            stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.log", "w"), text=True, cwd=REPO, env=with_secret)
        join = stranger = None

        def read(expected):
            line = driver.stdout.readline().split(" ", 1)
            logs = [(tmp_path / name) for name in ("driver.log", "comfyui.log", "join.log")]
            assert line[0].strip() == expected, (line, *[p.read_text()[-2500:] for p in logs if p.exists()])
            return line[1].strip() if len(line) > 1 else ""

        try:
            read("READY")
            # server B: the same files at the same paths (the README's requirement), ComfyUI's tree
            # on the import path as on server A, the stand-ins of this machine's torch too
            env = {**with_secret, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(tree)])}
            # a stranger on server B first: a pickle that would create `marker` if ComfyUI unpickled it
            marker = tmp_path / "marker"
            host, port = rendezvous.rsplit(":", 1)
            stranger = subprocess.Popen([*servers.run_b, sys.executable, "-c", STRANGER, host, port, str(marker)],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            join = subprocess.Popen(
                [*servers.run_b, sys.executable, "-m", "comfy.multidevice.workers.join", "--rendezvous", rendezvous,
                 "--first-rank", "2", "--devices", "cpu,cpu", "--threads", "1", "--timeout", str(TIMEOUT_S)],
                cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "join.log", "w"))
            assert float(read("EXACT")) <= MAX_LEVELS
            out, err = stranger.communicate(timeout=60)
            assert "refused" in out, out + err[-2000:]
            read("KILL-NOW")
            os.kill(child_pid(join.pid, 3), signal.SIGKILL)
            seconds, message = read("FAILED").split(" ", 1)
            record_property("failed_after_kill_s", float(seconds))
            assert float(seconds) < TIMEOUT_S + 10, message
            assert "rank 3 on " in message and f"[{servers.address_b}]" in message, message
            assert float(read("EXACT")) <= MAX_LEVELS
            read("DONE")
            assert driver.wait(timeout=60) == 0
            assert join.poll() is None  # still there for the next pool
            log = (tmp_path / "join.log").read_text()
            assert "was killed by signal 9" in log and "[rank 2]" in log, log[-3000:]
            server_log = (tmp_path / "comfyui.log").read_text()
            assert f"refused {servers.address_b}:" in server_log and "not JSON" in server_log, server_log[-3000:]
            assert not marker.exists()  # the server unpickled nothing
            assert "ranks 2-3 run on other servers: start them there once" in server_log
            # the node's default sp_mode auto: 4 ranks and the try-out DiT's 16 heads, other servers'
            # network: Ulysses, which then ran the exact prompts above across the two servers
            assert "DiT sp_mode ulysses: auto: ulysses receives 0.50 of the all-gather's bytes per block over " \
                   "other servers' network" in server_log, server_log[-3000:]
        finally:
            for p in (driver, join, stranger):
                if p is not None and p.poll() is None:
                    p.kill()
