"""The e2e suite's ComfyUI server: a copy of COMFYUI_DIR with this project installed by our own
installer, the test-only custom node that shrinks upstream's loaders, the tiny model files, and
`main.py --cpu` on 127.0.0.1. One per test session (the browser reuses it for every workflow).
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

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


def post_json(url: str, data, timeout: float = 10):
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


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


def prepare_tree(source: Path, root: Path) -> Path:
    """A copy of the ComfyUI at `source` with this project installed the way a user installs
    it, the tiny models under the released names and the test-only node in custom_nodes/."""
    from tests.e2e.tiny_models import make_models
    tree = root / "ComfyUI"
    shutil.copytree(source, tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    # as a user installs it (on a tree that already has this version installed: a no-op)
    install = subprocess.run(["bash", str(REPO / "install_deps_minimax_h3.sh"), "--comfyui", str(tree), "--no-deps"],
                             capture_output=True, text=True, timeout=300)
    if install.returncode != 0:
        raise RuntimeError(f"the installer failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}")
    node = tree / "custom_nodes" / "tiny_loaders"
    node.mkdir()
    shutil.copy(HERE / "tiny_loaders" / "__init__.py", node / "__init__.py")
    shutil.copy(HERE / "shrink.py", node / "shrink.py")
    make_models(tree / "models")
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


def start(tree: Path, root: Path) -> Server:
    site = _sitecustomize(root)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    port = free_port()
    log = root / "comfyui.log"
    with open(log, "w") as out:
        # --cache-classic: ComfyUI keeps the last prompt's node outputs only. Its default (RAM
        # pressure caching) keeps every earlier prompt's outputs until RAM runs short, so the
        # server's RSS would grow with each prompt by design and hide a leak of ours.
        process = subprocess.Popen([sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                                    "--disable-auto-launch", "--cache-classic"], cwd=tree, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", tree, log, process)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"ComfyUI exited with {process.returncode}:\n{server.log_text()[-3000:]}")
        try:
            get_json(f"{server.url}/system_stats", timeout=2)
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
