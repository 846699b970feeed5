"""Our commands named by the paths they have in the user's install (comfy/multidevice/commands.py):
a clone in ComfyUI's custom_nodes/, a ComfyUI folder the patch went into, the project's own
checkout; and the messages that name them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from comfy.multidevice import cards, commands
from comfy.multidevice.commands import CLI_SCRIPT, INSTALLER, install_root, module_command, script_command
from comfy.multidevice.devices import resolve_device


def project(root: Path, *files: str) -> Path:
    root.mkdir(parents=True)
    for name in files:
        (root / name).write_text("")
    return root


def test_a_clone_in_custom_nodes_is_named_from_comfyuis_folder(tmp_path):
    clone = project(tmp_path / "ComfyUI" / "custom_nodes" / "ComfyUI-MultiNPU", CLI_SCRIPT, INSTALLER)
    assert install_root(clone) == tmp_path / "ComfyUI"
    assert script_command(CLI_SCRIPT, "doctor", project_dir=clone) == \
        "python custom_nodes/ComfyUI-MultiNPU/minimax_h3_parallel.py doctor"
    assert script_command(INSTALLER, "--platform", "ascend", project_dir=clone) == \
        "bash custom_nodes/ComfyUI-MultiNPU/install_deps_minimax_h3.sh --platform ascend"
    # ComfyUI's folder does not hold our package: python -m finds it through the clone's folder
    assert module_command("comfy.multidevice.workers.join", "--first-rank", "8", project_dir=clone) == \
        "PYTHONPATH=custom_nodes/ComfyUI-MultiNPU python -m comfy.multidevice.workers.join --first-rank 8"


@pytest.mark.parametrize("where", ["ComfyUI", "minimax-h3"])  # patched into ComfyUI, or the checkout
def test_a_patched_comfyui_or_the_checkout_names_the_command_from_its_own_folder(tmp_path, where):
    root = project(tmp_path / where, CLI_SCRIPT)
    assert script_command(CLI_SCRIPT, "doctor", project_dir=root) == "python minimax_h3_parallel.py doctor"
    assert module_command("comfy.multidevice.workers.join", project_dir=root) == \
        "python -m comfy.multidevice.workers.join"


def test_a_file_the_install_lacks_is_named_as_the_repositorys(tmp_path):
    patched = project(tmp_path / "ComfyUI", CLI_SCRIPT)  # the patch brings no installer
    assert script_command(INSTALLER, "--platform", "ascend", project_dir=patched) == \
        "bash install_deps_minimax_h3.sh --platform ascend (from a checkout of this project)"


def test_this_checkouts_commands_exist_where_they_are_named():
    command = script_command(CLI_SCRIPT, "doctor").split()
    assert command[0] == "python" and (install_root() / command[1]).is_file()


def test_the_refusal_without_cards_names_doctor_by_its_path_in_a_clone(tmp_path, monkeypatch):
    clone = project(tmp_path / "ComfyUI" / "custom_nodes" / "pack", CLI_SCRIPT)
    monkeypatch.setattr(commands, "PROJECT_DIR", clone)  # as a clone's own files would compute it
    empty = cards.DeviceInventory()
    with pytest.raises(cards.TooFewDevices) as info:
        cards.select_devices(4, "auto", inventory=empty)
    assert "(python custom_nodes/pack/minimax_h3_parallel.py doctor says which)" in str(info.value)


def test_a_missing_torch_npu_names_the_clones_installer_for_comfyuis_python(tmp_path, monkeypatch):
    clone = project(tmp_path / "ComfyUI" / "custom_nodes" / "pack", CLI_SCRIPT, INSTALLER)
    monkeypatch.setattr(commands, "PROJECT_DIR", clone)
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # not installed
    with pytest.raises(ValueError) as info:
        resolve_device("npu:1")
    assert (f"run bash custom_nodes/pack/install_deps_minimax_h3.sh --platform ascend --python {sys.executable} "
            "on the Ascend host") in str(info.value)
