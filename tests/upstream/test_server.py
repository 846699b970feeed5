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

import pytest

from tests import comfyui_server
from tests.comfyui_server import REPO, fetch_bytes, request


@pytest.fixture(scope="module")
def server(upstream, tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    tree = comfyui_server.installed_copy(upstream.tree, root)
    assert (tree / "comfy" / "multidevice" / "__init__.py").is_file()
    models = root / "h3-models"
    (models / "diffusion_models").mkdir(parents=True)
    (models / "diffusion_models" / "from_the_variable.safetensors").write_bytes(b"")
    running = comfyui_server.start(tree, root, env={"MINIMAX_H3_MODELS": str(models)})
    try:
        yield running.url
    finally:
        comfyui_server.stop(running)


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


PACK = REPO  # the repository root is the node pack


def test_the_templates_browser_lists_the_packs_example_workflows(server):
    status, templates = request(f"{server}/workflow_templates")
    assert status == 200
    ours = sorted(p.stem for p in (PACK / "example_workflows").glob("*.json"))
    assert len(ours) == 6 and sorted(templates.get("ComfyUI-MultiNPU", [])) == ours
    status, data = fetch_bytes(f"{server}/api/workflow_templates/ComfyUI-MultiNPU/{ours[0]}.json")
    assert status == 200 and data == (PACK / "example_workflows" / f"{ours[0]}.json").read_bytes()
    for name in ours:  # each card's picture (tools/make_thumbnails.py)
        status, picture = fetch_bytes(f"{server}/api/workflow_templates/ComfyUI-MultiNPU/{name}.jpg")
        assert status == 200 and picture == (PACK / "example_workflows" / f"{name}.jpg").read_bytes()


def test_the_server_serves_the_nodes_help_page(server):
    status, data = fetch_bytes(f"{server}/extensions/ComfyUI-MultiNPU/docs/MultiNPUParallelConfig.md")
    assert status == 200
    assert data == (PACK / "web" / "docs" / "MultiNPUParallelConfig.md").read_bytes()
