"""The pins file (source_deps_info.json): its structure, the model files it names against the
official templates and our workflows' loaders, and the model folders the pack adds."""

from __future__ import annotations

import json
import re
import sys

from tests.packaging.packaging_cases import (LOADER_FOLDERS, PINS, REPO, WORKFLOW_NAMES, load_workflow,
                                             make_workflows, official_templates)


VERSION = re.compile(r"^\d+(\.\d+)+$")


def test_pins_file_structure():
    assert re.fullmatch(r"[0-9a-f]{40}", PINS["upstream"]["commit"])
    assert PINS["upstream"]["repository"] == "Comfy-Org/ComfyUI"
    for platform in ("cpu", "nvidia", "ascend"):
        assert VERSION.match(PINS["torch"][platform]["torch"])
    ascend = PINS["torch"]["ascend"]
    assert VERSION.match(ascend["torch_npu"]) and VERSION.match(ascend["cann"])
    # torch_npu is built for exactly one torch release: major.minor must agree.
    assert ascend["torch_npu"].split(".")[:2] == ascend["torch"].split(".")[:2]
    for group in ("runtime", "test"):
        assert PINS["python_dependencies"][group]
        for name, version in PINS["python_dependencies"][group].items():
            assert VERSION.match(version), (name, version)
    files = PINS["model_files"]["files"]
    assert len({f["role"] for f in files}) == len(files)
    for f in files:
        assert f["file"].endswith(".safetensors") and f["size_gib"] > 0
        assert f["folder"] in {"diffusion_models", "text_encoders", "vae", "loras"}
        assert set(f["used_by"]) <= set(WORKFLOW_NAMES)
    roles = {f["role"] for f in files}
    assert {"text_encoder", "video_vae", "audio_vae"} <= roles


def test_model_files_are_named_as_in_the_official_templates():
    text = "".join(json.dumps(t) for t in official_templates().values())
    for f in PINS["model_files"]["files"]:
        if f["used_by"]:
            assert f["file"] in text, f["file"]
    for task, rel in PINS["workflow_templates"]["templates"].items():
        assert (make_workflows.templates_dir() / rel).is_file(), (task, rel)


def test_model_files_match_the_workflows_loaders():
    by_file = {f["file"]: f for f in PINS["model_files"]["files"]}
    used = {}
    for name in WORKFLOW_NAMES:
        for node in load_workflow(name)["nodes"]:
            if node["type"] in LOADER_FOLDERS:
                widget, folder = LOADER_FOLDERS[node["type"]]
                file_name = node["widgets_values"][0]
                assert file_name in by_file, (name, file_name)
                assert by_file[file_name]["folder"] == folder
                used.setdefault(file_name, set()).add(name)
    for file_name, entry in by_file.items():
        assert set(entry["used_by"]) == used.get(file_name, set()), file_name


def _load_shim(monkeypatch, environ, input_dir):
    """The node pack's loader, imported with a stand-in for ComfyUI's folder_paths."""
    import importlib.util
    import types
    added = []
    fake = types.ModuleType("folder_paths")
    fake.add_model_folder_path = lambda folder, path, is_default=False: added.append((folder, path))
    fake.get_input_directory = lambda: str(input_dir)
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    for key in ("MINIMAX_H3_MODELS",):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location("multinpu_shim_under_test",
                                                  REPO / "__init__.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return added


def test_model_folders_from_the_variable_and_nothing_without_it(monkeypatch, tmp_path):
    folders = {f["folder"] for f in PINS["model_files"]["files"]}
    added = _load_shim(monkeypatch, {"MINIMAX_H3_MODELS": str(tmp_path / "models")}, tmp_path / "input")
    assert {folder for folder, _ in added} == folders  # every folder the H3 files use
    assert all(path == str(tmp_path / "models" / folder) for folder, path in added)
    assert _load_shim(monkeypatch, {}, tmp_path / "input") == []  # unset: ComfyUI's own models/<folder>/, no literal path
    assert _load_shim(monkeypatch, {"MINIMAX_H3_MODELS": ""}, tmp_path / "input") == []
    assert "MINIMAX_H3_MODELS" in (REPO / "additional_files/runtime/restart-v1.sh").read_text()
