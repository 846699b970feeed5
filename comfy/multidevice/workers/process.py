"""One worker process, started here: its command, its environment, its log.

Rank 0's pool (workers/pool.py) and a joining server (workers/join.py) both start workers
this way: `python -m comfy.multidevice.workers.worker ...` with this process's import path,
its stderr copied line by line into this process's log under its rank, the last lines kept
for an error message. A worker runs in a session of its own: a Ctrl-C in the terminal of
ComfyUI (or of a join command) reaches that process alone, which ends its workers itself (rank
0's exit closes their live links; the join command kills them), instead of each worker printing
a KeyboardInterrupt traceback into the log.
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

LOG_TAIL = 20  # lines of each worker's stderr kept for an error message


def worker_arguments(rank: int, world_size: int, rendezvous: str, generation: int, device,
                     timeout_s: float, threads: int | None) -> list[str]:
    """The worker's command after `python` (`rendezvous`: rank 0's door)."""
    return (["-m", "comfy.multidevice.workers.worker", "--rank", str(rank), "--world", str(world_size),
             "--rendezvous", rendezvous, "--generation", str(generation), "--device", str(device),
             "--timeout", f"{timeout_s:g}"] + (["--threads", str(threads)] if threads else []))


def worker_env(gloo_ifname: str | None = None) -> dict:
    """This process's environment, with its import path (a worker imports what this one does)
    and the interface its gloo groups bind to."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    if gloo_ifname:
        env["GLOO_SOCKET_IFNAME"] = gloo_ifname
    return env


class WorkerProcess:
    """A started worker and the thread that copies its stderr into this process's log. The
    pool's key reaches it on its stdin: never in its command line or environment, which other
    users of the server can read."""

    def __init__(self, rank: int, arguments: list[str], key: bytes, env: dict | None = None):
        self.rank = rank
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL)
        self.process = subprocess.Popen([sys.executable, *arguments], env=worker_env() if env is None else env,
                                        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True, errors="replace",
                                        start_new_session=True)  # no terminal's SIGINT: see above
        try:
            self.process.stdin.write(key.hex() + "\n")
            self.process.stdin.close()
        except OSError:  # it ended at once: describe() tells how
            pass
        self._reader = threading.Thread(target=self._forward_log, name=f"worker-{rank}-log", daemon=True)
        self._reader.start()

    def _forward_log(self):
        for line in self.process.stderr:
            line = line.rstrip()
            if line:
                self.tail.append(line)
                log.info("[rank %d] %s", self.rank, line)

    def ended(self) -> bool:
        return self.process.poll() is not None

    def describe(self) -> str:
        """Its rank, pid and how it ended (or that it still runs), with its last line."""
        code = self.process.poll()
        state = "still runs" if code is None else (f"was killed by signal {-code}" if code < 0 else f"exited with {code}")
        self._reader.join(0.5)  # its last lines, when it has ended
        last = self.tail[-1] if self.tail else "(it wrote nothing)"
        return f"rank {self.rank} (pid {self.process.pid}) {state}; its last line: {last}"

    def wait(self, timeout: float | None = None) -> int:
        return self.process.wait(timeout)

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def key_from_stdin() -> bytes:
    """A worker's side: the pool's key, the one line its starter wrote on its stdin."""
    line = sys.stdin.readline(200).strip()
    try:
        key = bytes.fromhex(line)
    except ValueError:
        key = b""
    if len(key) != 32:
        raise RuntimeError("no pool key on stdin: a worker is started by its pool or a join command, "
                           "which write it there")
    return key
