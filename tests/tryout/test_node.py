"""The try-out node's files: imported as ComfyUI imports a custom node it shrinks the loaders and
logs the TRY-OUT line naming its remove command; its shrink.py stands alone; and nothing the
installer or the patch ships brings it."""

from __future__ import annotations

import ast
import importlib.util
import logging
import sys
from pathlib import Path

from comfy.multidevice.tryout import node, shrink

REPO = Path(__file__).resolve().parents[2]
REMOVE = "'/opt/a path/python' minimax_h3_parallel.py tryout --comfyui \"it's\" --remove"


def test_importing_the_node_shrinks_the_loaders_and_logs_the_try_out_line(tmp_path, caplog):
    folder = tmp_path / node.FOLDER
    folder.mkdir()
    for name, data in node.node_files(REMOVE).items():
        (folder / name).write_bytes(data)
    # a stand-in for shrink.py that records its call (the real one needs upstream's classes)
    (folder / "shrink.py").write_text("CALLS = []\ndef shrink_upstream():\n    CALLS.append(1)\n")
    spec = importlib.util.spec_from_file_location("tryout_node_under_test", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        with caplog.at_level(logging.WARNING):
            spec.loader.exec_module(module)
        assert sys.modules[f"{spec.name}.shrink"].CALLS == [1]
    finally:
        for name in [n for n in sys.modules if n.startswith(spec.name)]:
            del sys.modules[name]
    assert module.NODE_CLASS_MAPPINGS == {} and module.REMOVE_COMMAND == REMOVE
    assert f"TRY-OUT: tiny random weights, not the model; remove with {REMOVE}" in caplog.text


def test_the_node_carries_the_packages_shrink_py_which_imports_nothing_of_the_package_at_load():
    copied = node.node_files(REMOVE)["shrink.py"]
    assert copied == Path(shrink.__file__).read_bytes()
    tree = ast.parse(copied)
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    modules = [a.name for n in top_level if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module for n in top_level if isinstance(n, ast.ImportFrom)]
    assert not [m for m in modules if m.startswith("comfy")], modules  # the pack may not be loaded yet
    every = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in every if m.startswith("comfy.multidevice")], every


def test_neither_the_installer_nor_the_patch_brings_the_try_out():
    patch = (REPO / "comfy-ui-changes.patch").read_text()
    added = [line.split(" b/", 1)[1] for line in patch.splitlines() if line.startswith("diff --git ")]
    assert added and not [p for p in added if node.FOLDER in p or p.startswith("models/")]
    installer = (REPO / "install_deps_minimax_h3.sh").read_text()
    assert node.FOLDER not in installer and "tryout" not in installer
