"""The upstream conformance suite: our package against real ComfyUI code.

Runs when COMFYUI_DIR names a ComfyUI checkout (README, "Supported ComfyUI"), with a Python
that has that checkout's requirements; otherwise every case is reported skipped with the reason.
The checkout goes on sys.path after this repository, so `comfy.multidevice` is ours and every
other `comfy.*` module is upstream's own.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

HERE = Path(__file__).resolve().parent
COMFYUI_ENV = "COMFYUI_DIR"


def comfyui_dir() -> Path | None:
    value = os.environ.get(COMFYUI_ENV)
    return Path(value).resolve() if value else None


def pytest_collection_modifyitems(config, items):
    if comfyui_dir() is not None:
        return
    skip = pytest.mark.skip(reason=f"{COMFYUI_ENV} is not set: the upstream suite needs a ComfyUI "
                                   "checkout (see the README, 'Supported ComfyUI')")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def pytest_report_header(config):
    tree = comfyui_dir()
    return f"upstream suite: {COMFYUI_ENV}={tree}" if tree else f"upstream suite: skipped ({COMFYUI_ENV} unset)"


@pytest.fixture(scope="session")
def upstream():
    """Upstream ComfyUI imported from COMFYUI_DIR, on the CPU; what it offers, as flags."""
    tree = comfyui_dir()
    if not (tree / "comfy" / "ldm" / "minimax" / "model.py").is_file():
        pytest.fail(f"{COMFYUI_ENV}={tree} is not a ComfyUI checkout with MiniMax-H3 "
                    "(comfy/ldm/minimax/model.py is missing)")
    if str(tree) not in sys.path:
        sys.path.append(str(tree))  # after this repository: comfy.multidevice stays ours
    from tests.upstream import standins
    stood_in = standins.install()
    import comfy.cli_args
    comfy.cli_args.args.cpu = True  # before model_management picks a device
    import comfy.model_management  # noqa: F401
    import comfy.ldm.minimax.model as h3
    if Path(h3.__file__).resolve().parents[3] != tree:
        pytest.fail(f"comfy.ldm.minimax.model came from {h3.__file__}, not from {tree}")
    from comfy.multidevice.sp.minimax_h3 import takes_attention_argument
    return SimpleNamespace(tree=tree, h3=h3, stood_in=stood_in,
                           has_attention_hook=takes_attention_argument(SimpleNamespace(forward=h3.DiTBlock.forward)))


@pytest.fixture
def hook(upstream):
    """Skips a test that needs the attention hook on a ComfyUI without it."""
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")


# A tiny H3 file and upstream's ModelPatcher of it (comfy.sd.load_diffusion_model): the sampling
# path of test_sampling.py and of the files that build on it.
@pytest.fixture(scope="module")
def tiny_file(upstream, tmp_path_factory):
    import safetensors.torch

    from tests.upstream.test_h3_dit import tiny_state_dict
    path = tmp_path_factory.mktemp("models") / "tiny_minimax_h3.safetensors"
    safetensors.torch.save_file(tiny_state_dict(upstream), str(path))
    return path


@pytest.fixture(scope="module")
def patcher(upstream, tiny_file):
    import comfy.sd
    model = comfy.sd.load_diffusion_model(str(tiny_file))
    assert type(model.model).__name__ == "MiniMaxH3"  # upstream's detection took the file as H3
    return model


def pytest_terminal_summary(terminalreporter):
    from tests.upstream import standins
    if standins.STOOD_IN:
        terminalreporter.write_line(f"upstream suite: stood in for {', '.join(standins.STOOD_IN)} "
                                    "(not importable beside this torch; the cases never call them)")
