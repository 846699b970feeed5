"""How a worker process is started (comfy/multidevice/workers/process.py): in a session of its
own, so a Ctrl-C in ComfyUI's terminal reaches ComfyUI alone and the workers end with it,
quietly, instead of each printing a KeyboardInterrupt traceback into ComfyUI's log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comfy.multidevice.miniature.h3 import save_miniature
from tests.sp_cases import tiny_model

REPO = Path(__file__).resolve().parents[2]

# Rank 0 as ComfyUI's main.py holds it: a pool started, then Ctrl-C: one line, its clean-up
# while the log still runs, and an exit that never closes the pool.
SERVER = r"""
import faulthandler, logging, signal, sys, time
# as started from a terminal: a shell's background job (CI's scripts) starts with Ctrl-C
# ignored, and Python then installs no KeyboardInterrupt handler of its own
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for every thread's stack if it hangs
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
from comfy.multidevice.workers.pool import WorkerPool
from comfy.multidevice.workers.recipe import ModelRecipe
pool = WorkerPool(["cpu"] * 3, ModelRecipe("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint",
                                           {"path": sys.argv[1]}), sp_mode="allgather", timeout_s=60).start()
try:  # the pids are said inside: a Ctrl-C that lands the moment they are read is caught too
    print(" ".join(str(w.process.pid) for w in pool.workers), flush=True)
    # ComfyUI's main thread runs an event loop that wakes for a signal whichever thread the
    # kernel handed it to; one long sleep would not wake when another thread took it
    while True:
        time.sleep(0.2)
except KeyboardInterrupt:
    logging.info("Stopped server")
    time.sleep(3)
"""


def running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie no reaper collected has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
@pytest.mark.timeout(240)
def test_a_ctrl_c_in_comfyuis_terminal_ends_the_workers_without_a_traceback(tmp_path):
    path = tmp_path / "tiny.safetensors"
    save_miniature(tiny_model(seed=3), path)
    log = tmp_path / "server.log"
    with open(log, "w") as err:
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=err, text=True, start_new_session=True,  # its own terminal group
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            pids = [int(p) for p in server.stdout.readline().split()]
            assert len(pids) == 2, log.read_text()[-3000:]
            os.killpg(server.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(server.pid, signal.SIGUSR1)  # every thread's stack into the log, then fail with it
                time.sleep(2)
                pytest.fail("rank 0 did not end within 60 s of Ctrl-C; its threads:\n" + log.read_text()[-6000:])
            assert server.returncode == 0, log.read_text()[-3000:]
        finally:
            if server.poll() is None:
                server.kill()
    text = log.read_text()
    assert "Stopped server" in text and "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    deadline = time.monotonic() + 60  # rank 0's exit closed their live links
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(running(p) for p in pids), pids
