"""The real server: a copy of COMFYUI_DIR with this project installed by our own installer,
`main.py --cpu` on 127.0.0.1, the node in `/object_info` with its schema, and a queued prompt
that the server checks against that schema.

Where upstream's loaders stop tiny files: `CLIPLoader` (minimax) and `VAELoader` build the
released sizes (Qwen3-VL-32B, the full video VAE) whatever the file holds, so a prompt that
runs the node end to end needs the real model files; the DiT, text encoder and VAE paths the
node drives are covered with upstream's own classes in the other files of this suite.
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
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url, data=None, timeout=10):
    body = None if data is None else json.dumps(data).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def fetch_bytes(url, timeout=10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def server(upstream, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    tree = root / "ComfyUI"
    shutil.copytree(upstream.tree, tree, ignore=shutil.ignore_patterns("__pycache__", ".git"))
    install = subprocess.run(["bash", str(REPO / "install_deps_minimax_h3.sh"), "--comfyui", str(tree), "--no-deps"],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    assert (tree / "comfy" / "multidevice" / "__init__.py").is_file()
    # torchvision/torchaudio stand-ins for the server process too, loaded by file path so that
    # nothing of this repository but what the installer put into the tree is importable there
    site = root / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('_standins', {str(Path(__file__).with_name('standins.py'))!r})\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); mod.install()\n")
    models = root / "h3-models"
    (models / "diffusion_models").mkdir(parents=True)
    (models / "diffusion_models" / "from_the_variable.safetensors").write_bytes(b"")
    env = dict(os.environ, MINIMAX_H3_MODELS=str(models))
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    port = free_port()
    log = open(root / "comfyui.log", "w")
    proc = subprocess.Popen([sys.executable, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                             "--disable-auto-launch"], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"ComfyUI exited with {proc.returncode}:\n{(root / 'comfyui.log').read_text()[-3000:]}")
            try:
                if request(f"{base}/system_stats", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError, socket.timeout):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"ComfyUI did not answer in {START_TIMEOUT_S}s:\n{(root / 'comfyui.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_the_server_lists_the_node_with_its_schema(server):
    status, info = request(f"{server}/object_info/MultiNPUParallelConfig")
    assert status == 200 and "MultiNPUParallelConfig" in info
    node = info["MultiNPUParallelConfig"]
    required = node["input"]["required"]
    assert [required[k][0] for k in ("model", "clip", "video_vae", "audio_vae")] == ["MODEL", "CLIP", "VAE", "VAE"]
    assert node["output"] == ["MODEL", "CLIP", "VAE", "VAE"]
    assert node["output_name"] == ["model", "clip", "video_vae", "audio_vae"]
    assert node["category"] == "advanced/multigpu"
    assert {"multi gpu", "sequence parallel"} <= set(node.get("search_aliases", []))
    assert all(node.get("output_tooltips", [None] * 4))


def test_a_prompt_with_a_bad_card_count_is_refused_by_the_servers_validation(server):
    prompt = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "missing.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "MultiNPUParallelConfig",
              "inputs": {"model": ["1", 0], "clip": ["1", 0], "video_vae": ["1", 0], "audio_vae": ["1", 0],
                         "npu_count": 3, "backend": "default", "device_kind": "auto", "devices": ""}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    }
    status, answer = request(f"{server}/prompt", {"prompt": prompt})
    assert status == 400, answer
    errors = json.dumps(answer)
    assert "npu_count" in errors  # the node's own option list, enforced by the real server


def test_the_node_pack_adds_the_model_folders_of_minimax_h3_models(server):
    status, names = request(f"{server}/models/diffusion_models")
    assert status == 200 and "from_the_variable.safetensors" in names


PACK = REPO / "custom_nodes" / "ComfyUI-MultiNPU"


def test_the_templates_browser_lists_the_packs_example_workflows(server):
    status, templates = request(f"{server}/workflow_templates")
    assert status == 200
    ours = sorted(p.stem for p in (PACK / "example_workflows").glob("*.json"))
    assert len(ours) == 6 and sorted(templates.get("ComfyUI-MultiNPU", [])) == ours
    status, data = fetch_bytes(f"{server}/api/workflow_templates/ComfyUI-MultiNPU/{ours[0]}.json")
    assert status == 200 and data == (PACK / "example_workflows" / f"{ours[0]}.json").read_bytes()


def test_the_server_serves_the_nodes_help_page(server):
    status, data = fetch_bytes(f"{server}/extensions/ComfyUI-MultiNPU/docs/MultiNPUParallelConfig.md")
    assert status == 200
    assert data == (PACK / "web" / "docs" / "MultiNPUParallelConfig.md").read_bytes()
