"""The try-out's install record on fake ComfyUI folders: it writes only new files, removes exactly
what it wrote (while unchanged), and never touches a file or folder it did not make."""

from __future__ import annotations

import hashlib
import json

import pytest

from comfy.multidevice.tryout.record import Record, remove, TryoutError, write_all
from tests.helpers import file_hashes

RECORD = "custom_nodes/tryout/record.json"
FILES = {"models/vae/tiny_vae.safetensors": b"vae bytes", "models/new_folder/deeper/tiny.safetensors": b"tiny",
         "custom_nodes/tryout/__init__.py": b"X = 1\n"}


@pytest.fixture
def comfyui(tmp_path):
    """A folder shaped like ComfyUI's, with a user's own model and node."""
    root = tmp_path / "ComfyUI"
    (root / "models" / "vae").mkdir(parents=True)
    (root / "models" / "vae" / "their_vae.safetensors").write_bytes(b"the user's")
    (root / "custom_nodes" / "their_node").mkdir(parents=True)
    (root / "custom_nodes" / "their_node" / "__init__.py").write_text("Y = 2\n")
    return root


def test_writes_the_files_and_records_each_with_its_sha256_and_every_folder_it_made(comfyui):
    record = write_all(comfyui, RECORD, FILES)
    for rel, data in FILES.items():
        assert (comfyui / rel).read_bytes() == data
        assert record.files[rel] == hashlib.sha256(data).hexdigest()
    assert record.folders == ["custom_nodes/tryout", "models/new_folder", "models/new_folder/deeper"]
    on_disk = json.loads((comfyui / RECORD).read_text())
    assert on_disk["files"] == record.files and on_disk["folders"] == record.folders
    assert Record.load(comfyui, RECORD).files == record.files


def test_remove_takes_exactly_what_it_wrote_and_leaves_the_users_files(comfyui):
    before = file_hashes(comfyui)
    write_all(comfyui, RECORD, FILES)
    (comfyui / "custom_nodes" / "tryout" / "__pycache__").mkdir()  # what ComfyUI's import makes
    (comfyui / "custom_nodes" / "tryout" / "__pycache__" / "__init__.cpython-312.pyc").write_bytes(b"\0")
    result = remove(comfyui, RECORD)
    assert result.complete and sorted(result.removed) == sorted(FILES)
    assert file_hashes(comfyui) == before


def test_refuses_when_a_file_is_already_there_and_writes_nothing(comfyui):
    (comfyui / "models" / "vae" / "tiny_vae.safetensors").write_bytes(b"real weights")
    before = file_hashes(comfyui)
    with pytest.raises(TryoutError, match="models/vae/tiny_vae.safetensors"):
        write_all(comfyui, RECORD, FILES)
    assert file_hashes(comfyui) == before


def test_a_failure_part_way_removes_what_was_written(comfyui):
    before = file_hashes(comfyui)
    (comfyui / "blocker").write_text("a file where a folder must go")
    files = {"models/vae/tiny_vae.safetensors": b"vae", "blocker/inside/x.bin": b"x"}
    with pytest.raises(OSError):
        write_all(comfyui, RECORD, files)
    (comfyui / "blocker").unlink()
    assert file_hashes(comfyui) == before


def test_a_changed_file_stays_named_and_recorded_until_it_is_gone(comfyui):
    write_all(comfyui, RECORD, FILES)
    changed = comfyui / "models" / "vae" / "tiny_vae.safetensors"
    changed.write_bytes(b"the user put real weights here")
    first = remove(comfyui, RECORD)
    assert not first.complete and first.changed == ["models/vae/tiny_vae.safetensors"]
    assert changed.read_bytes() == b"the user put real weights here"
    assert not (comfyui / "models" / "new_folder").exists()  # the rest went
    assert list(Record.load(comfyui, RECORD).files) == ["models/vae/tiny_vae.safetensors"]
    changed.unlink()  # the user decides
    second = remove(comfyui, RECORD)
    assert second.complete and second.gone == ["models/vae/tiny_vae.safetensors"]
    assert not (comfyui / "custom_nodes" / "tryout").exists()


def test_a_file_replaced_by_a_link_to_the_same_bytes_is_left(comfyui, tmp_path):
    write_all(comfyui, RECORD, FILES)
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"vae bytes")
    mine = comfyui / "models" / "vae" / "tiny_vae.safetensors"
    mine.unlink()
    mine.symlink_to(outside)
    assert remove(comfyui, RECORD).changed == ["models/vae/tiny_vae.safetensors"]
    assert mine.is_symlink() and outside.read_bytes() == b"vae bytes"


def test_a_folder_it_made_that_holds_someone_elses_file_stays(comfyui):
    write_all(comfyui, RECORD, FILES)
    (comfyui / "models" / "new_folder" / "theirs.txt").write_text("added later")
    result = remove(comfyui, RECORD)
    assert result.folders_left == ["models/new_folder"]
    assert (comfyui / "models" / "new_folder" / "theirs.txt").read_text() == "added later"
    assert not (comfyui / "models" / "new_folder" / "deeper").exists()


def test_without_a_record_there_is_nothing_to_remove(comfyui):
    before = file_hashes(comfyui)
    assert remove(comfyui, RECORD) is None
    assert file_hashes(comfyui) == before


@pytest.mark.parametrize("bad", ["../outside.bin", "/etc/hostname", "models/../../outside.bin"])
def test_a_record_that_names_a_path_outside_the_folder_is_refused(comfyui, tmp_path, bad):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep")
    write_all(comfyui, RECORD, FILES)
    data = json.loads((comfyui / RECORD).read_text())
    data["files"] = {bad: hashlib.sha256(b"keep").hexdigest(), **data["files"]}
    (comfyui / RECORD).write_text(json.dumps(data))
    with pytest.raises(TryoutError, match="not a path inside"):
        remove(comfyui, RECORD)
    assert outside.read_bytes() == b"keep"


def test_a_record_of_another_kind_is_refused(comfyui):
    (comfyui / "custom_nodes" / "tryout").mkdir()
    (comfyui / RECORD).write_text(json.dumps({"files": {"models/vae/their_vae.safetensors": "x"}}))
    with pytest.raises(TryoutError, match="not a try-out record"):
        remove(comfyui, RECORD)
    assert (comfyui / "models" / "vae" / "their_vae.safetensors").is_file()


def test_a_folder_linked_outside_the_comfyui_folder_is_never_written_into(comfyui, tmp_path):
    shared = tmp_path / "shared_models"
    shared.mkdir()
    (comfyui / "models" / "loras").symlink_to(shared, target_is_directory=True)
    with pytest.raises(TryoutError, match="leads outside"):
        write_all(comfyui, RECORD, {"models/loras/tiny_lora.safetensors": b"lora"})
    assert list(shared.iterdir()) == [] and not (comfyui / RECORD).exists()
