"""A real ComfyUI server for tests: a copy of a ComfyUI tree with this project installed by our
own installer, and `main.py --cpu` on 127.0.0.1 (tests/upstream/test_server.py, tests/e2e).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180


def request(url: str, data=None, timeout: float = 10):
    """(status, JSON answer) of a GET, or of a POST of `data` as JSON."""
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def fetch_bytes(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class Server:
    url: str
    tree: Path
    log: Path
    process: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


class NodeTexts:
    """The lines of text the server shows on nodes (ComfyUI's binary websocket event TEXT: a
    4-byte event type, a 4-byte node id length, the node id, the text), as a page receives
    them: (node id, text) in order, read by a websocket client on a thread of its own."""

    TEXT_EVENT = 3  # ComfyUI's protocol.BinaryEventTypes.TEXT

    def __init__(self, server: "Server"):
        import threading
        self.url = server.url.replace("http://", "ws://") + "/ws?clientId=node-texts"
        self.seen: list[tuple[str, str]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "NodeTexts":
        self._thread.start()
        if not self._ready.wait(30):
            raise AssertionError(f"no websocket at {self.url}")
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _run(self):
        import asyncio
        import struct

        import aiohttp  # ComfyUI's own dependency: in every tree's Python

        async def listen():
            async with aiohttp.ClientSession() as session:
                async with session.ws_connect(self.url) as ws:
                    self._ready.set()
                    while not self._stop.is_set():
                        try:
                            message = await ws.receive(timeout=0.2)
                        except asyncio.TimeoutError:
                            continue
                        if message.type != aiohttp.WSMsgType.BINARY or len(message.data) < 8:
                            continue
                        event, length = struct.unpack(">II", message.data[:8])
                        if event == self.TEXT_EVENT:
                            node = message.data[8:8 + length].decode()
                            self.seen.append((node, message.data[8 + length:].decode()))
        asyncio.run(listen())


def installed_copy(source: Path, root: Path) -> Path:
    """root/ComfyUI: a copy of the tree at `source` with this project installed the way a user
    installs it (on a tree that already has this version installed: a no-op)."""
    tree = root / "ComfyUI"
    shutil.copytree(source, tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    install = subprocess.run(["bash", str(REPO / "install_deps_minimax_h3.sh"), "--comfyui", str(tree), "--no-deps"],
                             capture_output=True, text=True, timeout=300)
    if install.returncode != 0:
        raise RuntimeError(f"the installer failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}")
    return tree


def _sitecustomize(root: Path) -> Path:
    """torchvision/torchaudio stand-ins for the server process (tests/upstream/standins.py),
    loaded by file path so nothing else of this repository is importable there."""
    site = root / "site"
    site.mkdir(exist_ok=True)
    standins = REPO / "tests" / "upstream" / "standins.py"
    (site / "sitecustomize.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('_standins', {str(standins)!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); mod.install()\n")
    return site


PORT_TAKEN = "is already in use"  # main.py's words when another process bound the port first
START_ATTEMPTS = 3


def start(tree: Path, root: Path, env: dict | None = None, args: tuple = ()) -> Server:
    """`main.py --cpu` of `tree` on a free port (its log in root/comfyui.log), once it answers;
    `env` adds variables, `args` adds options. A port taken between our pick and the server's
    bind (another job on the machine) is retried with a new one."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start_once(tree, root, env, args)
        except RuntimeError as exc:
            if PORT_TAKEN not in str(exc) or attempt == START_ATTEMPTS:
                raise


def process_env(root: Path, env: dict | None = None) -> dict:
    """This environment plus `env`, for a process of the tree's Python (the server, or a command
    run with it): the stand-ins (a sitecustomize.py in root/site) load first there."""
    env = {**os.environ, **(env or {})}
    site = _sitecustomize(root)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _start_once(tree: Path, root: Path, env: dict | None, args: tuple) -> Server:
    env = process_env(root, env)
    port = free_port()
    log = root / "comfyui.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                                    "--disable-auto-launch", *args], cwd=tree, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", tree, log, process)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {process.returncode}:\n{server.log_text()[-3000:]}")
        try:
            if request(f"{server.url}/system_stats", timeout=2)[0] == 200:
                return server
        except (urllib.error.URLError, ConnectionError, socket.timeout):
            pass
        if time.monotonic() > deadline:
            stop(server)
            raise RuntimeError(f"ComfyUI did not answer in {START_TIMEOUT_S} s:\n{server.log_text()[-3000:]}")
        time.sleep(0.5)


def stop(server: Server) -> None:
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.process.wait(timeout=20)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.process.wait(timeout=20)
