"""The node's refusals as the real server reports them: prompts queued on `main.py --cpu` (the
try-out's tiny model files under the released names, loaded by upstream's own loaders),
and the `execution_error` that ComfyUI records in `/history/<prompt_id>` (the same message
its websocket sends the page): `exception_type` a plain ValueError / RuntimeError, and
`exception_message` one sentence naming the node input and the fix (tests/test_node_errors.py
checks every refusal the same way without a server).

The server runs with free_memory_hook/ in custom_nodes (test-only): every card reports
MINIMAX_H3_TEST_FREE_BYTES free, so a memory plan that does not fit can be asked for here.
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

import pytest

from comfy.multidevice.tryout.models import released_names
from tests import comfyui_server
from tests.comfyui_server import request
from tests.test_node_errors import assert_user_facing

HERE = Path(__file__).resolve().parent
FREE_BYTES = 4096  # far below what the tiny DiT's activations need at any plan_tokens
PROMPT_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server(upstream, tmp_path_factory):
    from comfy.multidevice.cli.tryout import install
    root = tmp_path_factory.mktemp("errors-server")
    tree = comfyui_server.installed_copy(upstream.tree, root)
    install(tree)  # the try-out: tiny files under the released names, and its node
    shutil.copytree(HERE / "free_memory_hook", tree / "custom_nodes" / "free_memory_hook",
                    ignore=shutil.ignore_patterns("__pycache__"))
    running = comfyui_server.start(tree, root, env={"MINIMAX_H3_TEST_FREE_BYTES": str(FREE_BYTES)})
    try:
        yield running, {role: name for role, (_, name) in released_names().items()}
    finally:
        comfyui_server.stop(running)


def prompt(names: dict, **widgets) -> dict:
    """The four loaders, the node with `widgets`, and an output node on its MODEL."""
    node = {"npu_count": 4, "backend": "default", "device_kind": "auto", "devices": "", "dit_weights": "auto",
            "plan_tokens": 109952, **widgets}
    return {
        "1": {"class_type": "UNETLoader",
              "inputs": {"unet_name": names["diffusion_model_ref2va"], "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader",
              "inputs": {"clip_name": names["text_encoder"], "type": "minimax", "device": "default"}},
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": names["video_vae"]}},
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": names["audio_vae"]}},
        "5": {"class_type": "MultiNPUParallelConfig",
              "inputs": {"model": ["1", 0], "clip": ["2", 0], "video_vae": ["3", 0], "audio_vae": ["4", 0], **node}},
        "6": {"class_type": "PreviewAny", "inputs": {"source": ["5", 0]}},
    }


def execution_error(server, names: dict, **widgets) -> dict:
    """Queue the prompt, wait for its /history entry; the execution_error ComfyUI recorded."""
    running, _ = server
    status, answer = request(f"{running.url}/prompt", {"prompt": prompt(names, **widgets),
                                                       "client_id": uuid.uuid4().hex})
    assert status == 200, answer
    prompt_id = answer["prompt_id"]
    deadline = time.monotonic() + PROMPT_TIMEOUT_S
    while True:
        status, history = request(f"{running.url}/history/{prompt_id}")
        if status == 200 and prompt_id in history and history[prompt_id].get("status", {}).get("completed") is not None:
            break
        assert time.monotonic() < deadline, f"prompt {widgets} did not end:\n{running.log_text()[-3000:]}"
        time.sleep(0.25)
    entry = history[prompt_id]["status"]
    errors = [body for kind, body in entry["messages"] if kind == "execution_error"]
    assert entry["status_str"] == "error" and errors, (entry, running.log_text()[-3000:])
    (error,) = errors
    assert error["node_type"] == "MultiNPUParallelConfig", error
    return error


def check(error: dict, names: tuple, fix: str, shown_type: str = "ValueError") -> str:
    # ComfyUI sends "{message}\n{tips}", the tips empty for these errors
    message = error["exception_message"].rstrip("\n")
    assert error["exception_type"] == shown_type, error["exception_type"]
    assert_user_facing(message, names, fix)
    return message


def test_npu_count_above_the_cards_of_this_server(server):
    error = execution_error(server, server[1], npu_count=8, device_kind="auto")
    check(error, ("npu_count is 8", "no NPU or CUDA card", "CUDA_VISIBLE_DEVICES"), "set device_kind to cpu")


def test_dit_weights_shard_with_one_card(server):
    error = execution_error(server, server[1], npu_count=1, device_kind="cpu", dit_weights="shard")
    check(error, ("dit_weights is shard", "npu_count 1"), "set npu_count to 4 or 8")


def test_a_memory_plan_that_does_not_fit(server, upstream):
    error = execution_error(server, server[1], npu_count=4, device_kind="cpu", dit_weights="replicate",
                            plan_tokens=10_000_000)
    if not upstream.has_attention_hook:  # v0.33.0: refused before the memory plan, and says why
        check(error, ("this ComfyUI is too old", "attention"), "update ComfyUI")
        return
    message = check(error, ("cpu cannot hold the DiT stage", "GiB free", "plan_tokens (now 10000000)"),
                    "set dit_weights to shard")
    assert "memory plan (" not in message  # the per-card table is in the server log instead
    assert "memory plan (dit_weights=replicate, 10000000 tokens from plan_tokens)" in server[0].log_text()


def test_an_unknown_backend_is_refused_by_the_servers_validation_naming_the_input(server):
    running, names = server
    status, answer = request(f"{running.url}/prompt", {"prompt": prompt(names, backend="mpi")})
    assert status == 400, answer
    (node_error,) = answer["node_errors"].values()
    text = json.dumps(node_error)
    assert "backend" in text and "mpi" in text, text  # ComfyUI's own option check, before the node runs
