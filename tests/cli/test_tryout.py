"""`minimax_h3_parallel.py tryout` without ComfyUI: fake ComfyUI folders, and fake bytes where
upstream's classes would build the tiny files. It refuses (writing nothing) where a released
file is, installs under the released names and removes back to the same bytes.
tests/e2e/test_tryout.py runs it on a real tree with a real server."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from comfy.multidevice.cli import tryout
from comfy.multidevice.tryout import models, node
from tests.helpers import file_hashes

REPO = Path(__file__).resolve().parents[2]
ROLES = ("diffusion_model_ref2va", "diffusion_model_fl2va", "text_encoder", "video_vae", "audio_vae",
         "turbo_lora_ref2va", "turbo_lora_fl2va")


@pytest.fixture
def comfyui(tmp_path, monkeypatch):
    """A fake ComfyUI folder; upstream's classes stood in by fixed bytes per role."""
    root = tmp_path / "ComfyUI"
    for folder in ("comfy", "custom_nodes", "models/vae", "models/loras"):
        (root / folder).mkdir(parents=True)
    (root / "main.py").write_text("# ComfyUI\n")
    (root / "models" / "loras" / "their_lora.safetensors").write_bytes(b"the user's")
    monkeypatch.setattr(tryout, "import_upstream", lambda root: None)
    monkeypatch.setattr(models, "tiny_files", lambda: {role: f"tiny {role}".encode() for role in ROLES})
    monkeypatch.delenv(tryout.MODELS_ENV, raising=False)
    return root


def run(root: Path, remove: bool = False) -> int:
    return tryout.main(argparse.Namespace(comfyui=root, remove=remove))


def test_installs_under_the_released_names_and_removes_back_to_the_same_bytes(comfyui, capsys):
    before = file_hashes(comfyui)
    assert run(comfyui) == 0
    out = capsys.readouterr().out
    names = models.released_names()
    for role in ROLES:
        folder, name = names[role]
        assert (comfyui / "models" / folder / name).read_bytes() == f"tiny {role}".encode()
    init = (comfyui / tryout.NODE_DIR / "__init__.py").read_text()
    assert tryout.remove_command(comfyui) in init and tryout.remove_command(comfyui) in out
    assert "TRY-OUT" in out and "npu_count 4" in out

    assert run(comfyui) == 0 and "already in" in capsys.readouterr().out  # a second run changes nothing
    assert run(comfyui, remove=True) == 0
    assert "9 file(s) deleted" in capsys.readouterr().out  # seven models, the node's two files
    assert file_hashes(comfyui) == before


@pytest.mark.parametrize("role", ["video_vae", "diffusion_model_fl2va_bf16"])
def test_refuses_where_a_released_file_is_and_writes_nothing(comfyui, capsys, role):
    folder, name = models.released_names()[role]
    (comfyui / "models" / folder).mkdir(parents=True, exist_ok=True)
    (comfyui / "models" / folder / name).write_bytes(b"real weights")
    before = file_hashes(comfyui)
    assert run(comfyui) == 1
    assert f"models/{folder}/{name}" in capsys.readouterr().err
    assert file_hashes(comfyui) == before


def test_refuses_where_the_packs_model_folder_holds_a_released_file(comfyui, tmp_path, monkeypatch, capsys):
    folder, name = models.released_names()["text_encoder"]
    (tmp_path / "weights" / folder).mkdir(parents=True)
    (tmp_path / "weights" / folder / name).write_bytes(b"real weights")
    monkeypatch.setenv(tryout.MODELS_ENV, str(tmp_path / "weights"))
    before = file_hashes(comfyui)
    assert run(comfyui) == 1
    assert name in capsys.readouterr().err and file_hashes(comfyui) == before


def test_the_variable_is_the_one_the_pack_reads():
    assert f'MODELS_ENV = "{tryout.MODELS_ENV}"' in (REPO / "__init__.py").read_text()


def test_a_changed_file_is_left_and_named_with_exit_1(comfyui, capsys):
    assert run(comfyui) == 0
    folder, name = models.released_names()["audio_vae"]
    (comfyui / "models" / folder / name).write_bytes(b"changed")
    assert run(comfyui) == 1 and name in capsys.readouterr().out
    assert run(comfyui, remove=True) == 1
    assert name in capsys.readouterr().err and (comfyui / "models" / folder / name).read_bytes() == b"changed"


def test_remove_without_a_try_out_says_so(comfyui, capsys):
    assert run(comfyui, remove=True) == 0
    assert "nothing to remove" in capsys.readouterr().out


def test_the_node_folder_of_someone_else_is_refused(comfyui, capsys):
    (comfyui / "custom_nodes" / node.FOLDER).mkdir()
    assert run(comfyui) == 1 and node.FOLDER in capsys.readouterr().err


def test_without_the_pins_file_it_names_where_to_run_it(comfyui, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "PINS", tmp_path / "source_deps_info.json")
    assert run(comfyui) == 2 and "checkout or clone" in capsys.readouterr().err


def test_the_script_refuses_a_folder_that_is_not_comfyui(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "minimax_h3_parallel.py"), "tryout", "--comfyui", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "is not a ComfyUI folder" in proc.stderr, proc.stderr
