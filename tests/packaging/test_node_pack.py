"""The node pack (the repository root): its __init__.py loaded by a ComfyUI-shaped folder the way
ComfyUI loads custom nodes (from a clone in custom_nodes/, from the patch alone, from both), and
its metadata: pyproject.toml by the registry's rules, the license, the help page, the workflows'
pack name.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.packaging.packaging_cases import REPO, WORKFLOW_NAMES, committed_overlay, load_workflow, one_node


# ----------------------------------------------------------------------------- the pack's loader

LOADER_SCRIPT = textwrap.dedent("""
    import asyncio, importlib.util, json, logging, os, sys
    root, folders = sys.argv[1], sys.argv[2:]
    sys.path.insert(0, root)  # ComfyUI puts its own folder first
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    import folder_paths  # imported by ComfyUI before any custom node
    out = {"folders": {}}
    for folder in folders:  # the way ComfyUI loads custom node folders, in this order
        path = os.path.join(root, "custom_nodes", folder)
        spec = importlib.util.spec_from_file_location(path.replace(".", "_x_"), os.path.join(path, "__init__.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        try:
            spec.loader.exec_module(module)
        except ImportError as exc:
            out["folders"][folder] = {"error": str(exc)}
            continue
        if module.NODE_CLASS_MAPPINGS is not None:  # ComfyUI's V1 branch: registers these
            out["folders"][folder] = {"registers": sorted(module.NODE_CLASS_MAPPINGS)}
            continue
        ext = asyncio.run(module.comfy_entrypoint())
        out["folders"][folder] = {"registers": [n.define_schema().node_id for n in asyncio.run(ext.get_node_list())]}
    import comfy.model_management
    out.update(upstream_module=comfy.model_management.MARK, inputs=sorted(os.listdir(os.path.join(root, "input"))))
    ours = {"inventory_file": "comfy.multidevice.devices", "node_file": "comfy_extras.nodes_multinpu"}
    for key, name in ours.items():  # where each module came from, if loaded
        out[key] = sys.modules[name].__file__ if name in sys.modules else None
    print("RESULT " + json.dumps(out))
""")


def fake_comfyui(tmp_path, patched=False):
    """A ComfyUI-shaped folder: its own comfy/ and comfy_extras/ modules, folder_paths and a
    comfy_api stand-in; with `patched`, our package and node in its tree as the patch puts them."""
    root = tmp_path / "ComfyUI"
    (root / "comfy").mkdir(parents=True)
    (root / "comfy" / "model_management.py").write_text("MARK = 'upstream'\n")
    (root / "comfy_extras").mkdir()
    (root / "comfy_extras" / "nodes_upstream.py").write_text("")
    (root / "input").mkdir()
    (root / "input" / "minimax_h3_first_frame.png").write_bytes(b"the user's own picture")
    (root / "folder_paths.py").write_text(textwrap.dedent(f"""
        import os
        def get_input_directory():
            return {str(root / "input")!r}
        def add_model_folder_path(folder, path, is_default=False):
            pass
    """))
    api = root / "comfy_api" / "latest"
    api.mkdir(parents=True)
    (root / "comfy_api" / "__init__.py").write_text("")
    (api / "__init__.py").write_text(textwrap.dedent("""
        import types
        class ComfyExtension: pass
        class _Socket:
            def __init__(self, *args, **kwargs): pass
        def _kind():
            return types.SimpleNamespace(Input=_Socket, Output=_Socket)
        io = types.SimpleNamespace(ComfyNode=object, Schema=lambda **kw: types.SimpleNamespace(**kw),
                                   NodeOutput=tuple, Model=_kind(), Clip=_kind(), Vae=_kind(),
                                   Combo=_kind(), String=_kind(), Int=_kind())
    """))
    (root / "custom_nodes").mkdir()
    if patched:
        shutil.copytree(REPO / "comfy" / "multidevice", root / "comfy" / "multidevice",
                        ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(REPO / "comfy_extras" / "nodes_multinpu.py", root / "comfy_extras")
        (root / "custom_nodes" / "ComfyUI-MultiNPU").mkdir()
        shutil.copy(REPO / "__init__.py", root / "custom_nodes" / "ComfyUI-MultiNPU")
    return root


def clone_into(root, name="minimax-h3-multinpu"):
    """The repository "cloned" into custom_nodes/ (a link to this checkout)."""
    (root / "custom_nodes" / name).symlink_to(REPO, target_is_directory=True)
    return name


def run_loader(root, *folders):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", LOADER_SCRIPT, str(root), *folders], capture_output=True,
                          text=True, cwd=str(root), env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    log = [line for line in lines if line.startswith("MiniMax-H3 pack")]
    return json.loads(next(line for line in lines if line.startswith("RESULT "))[7:]), log


def test_a_clone_in_custom_nodes_registers_the_node_from_its_own_files(tmp_path):
    root = fake_comfyui(tmp_path)
    name = clone_into(root)
    out, log = run_loader(root, name)
    assert out["folders"] == {name: {"registers": ["MultiNPUParallelConfig"]}}
    assert out["upstream_module"] == "upstream"  # ComfyUI's own comfy modules still win
    assert Path(out["inventory_file"]).resolve().parent == REPO / "comfy" / "multidevice"
    assert Path(out["node_file"]).resolve().parent == REPO / "comfy_extras"
    samples = sorted(p.name for p in (REPO / "additional_files" / "input").iterdir())
    assert out["inputs"] == samples  # first use: the sample images the workflows name
    assert (root / "input" / "minimax_h3_first_frame.png").read_bytes() == b"the user's own picture"
    assert [line for line in log if "MultiNPUParallelConfig from" in line] == [
        f"MiniMax-H3 pack: MultiNPUParallelConfig from {REPO}"]


def test_the_patch_alone_registers_the_node_from_comfyuis_tree(tmp_path):
    root = fake_comfyui(tmp_path, patched=True)
    out, log = run_loader(root, "ComfyUI-MultiNPU")
    assert out["folders"] == {"ComfyUI-MultiNPU": {"registers": ["MultiNPUParallelConfig"]}}
    assert Path(out["node_file"]).parent == root / "comfy_extras"
    assert Path(out["inventory_file"]).parent == root / "comfy" / "multidevice"
    assert log == [f"MiniMax-H3 pack: MultiNPUParallelConfig from {root}"]


@pytest.mark.parametrize("order", ["patch first", "clone first"])
def test_with_the_patch_and_a_clone_the_patched_copy_is_the_one_used(tmp_path, order):
    root = fake_comfyui(tmp_path, patched=True)
    name = clone_into(root)
    folders = ["ComfyUI-MultiNPU", name] if order == "patch first" else [name, "ComfyUI-MultiNPU"]
    out, log = run_loader(root, *folders)
    assert out["folders"] == {"ComfyUI-MultiNPU": {"registers": ["MultiNPUParallelConfig"]}, name: {"registers": []}}
    assert Path(out["node_file"]).parent == root / "comfy_extras"  # no module from the clone
    assert Path(out["inventory_file"]).parent == root / "comfy" / "multidevice"
    unused = [line for line in log if "not used" in line]
    assert len(unused) == 1 and str(REPO) in unused[0]
    # the clone's own installer, by a path that exists (the patched tree has none)
    assert f"bash {REPO / 'install_deps_minimax_h3.sh'} --comfyui <ComfyUI dir> --uninstall" in unused[0]
    assert out["inputs"] == ["minimax_h3_first_frame.png"]  # the unused clone copied nothing


def test_the_patchs_pack_folder_without_the_package_says_what_to_do(tmp_path):
    root = fake_comfyui(tmp_path)
    (root / "custom_nodes" / "ComfyUI-MultiNPU").mkdir()
    shutil.copy(REPO / "__init__.py", root / "custom_nodes" / "ComfyUI-MultiNPU")
    out, _ = run_loader(root, "ComfyUI-MultiNPU")
    error = out["folders"]["ComfyUI-MultiNPU"]["error"]
    assert "Clone the whole repository into ComfyUI/custom_nodes/" in error and "--comfyui" in error
    assert out["node_file"] is None and out["inventory_file"] is None


# ----------------------------------------------------------------------------- the pack's metadata

PACK_DIR = REPO  # the repository root is the node pack (the patch puts it in custom_nodes/ComfyUI-MultiNPU/)


def pack_project() -> dict:
    import tomllib
    return tomllib.loads((PACK_DIR / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_packs_pyproject_follows_the_registrys_rules():
    # The registry's published rules for [project] name/version and [tool.comfy].
    import re
    data = pack_project()
    name, version = data["project"]["name"], data["project"]["version"]
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(?:[-_.][A-Za-z0-9]+)*", name), name
    assert "comfyui" not in name.lower()  # the registry asks names not to repeat "ComfyUI"
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert data["project"]["license"] == {"file": "LICENSE"}
    comfy = data["tool"]["comfy"]
    assert re.fullmatch(r"[a-z][a-z0-9-]*", comfy["PublisherId"]) and comfy["DisplayName"].strip()


def test_the_whole_project_and_the_pack_carry_the_same_gpl3_license():
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("GNU GENERAL PUBLIC LICENSE") and "Version 3, 29 June 2007" in text
    overlay = committed_overlay(REPO)  # the patch's copy of the pack carries it too
    assert overlay["custom_nodes/ComfyUI-MultiNPU/LICENSE"][0] == (REPO / "LICENSE").read_bytes()


def test_the_help_page_is_where_web_directory_serves_it_and_names_every_input_and_output():
    from comfy_extras.nodes_multinpu import NODE_SCHEMA
    shim = (PACK_DIR / "__init__.py").read_text(encoding="utf-8")
    assert 'WEB_DIRECTORY = "./web"' in shim
    page = (PACK_DIR / "web" / "docs" / f"{NODE_SCHEMA['node_id']}.md").read_text(encoding="utf-8")
    for spec in NODE_SCHEMA["inputs"] + NODE_SCHEMA["outputs"]:
        assert f"**{spec['name']}**" in page, spec["name"]
    for spec in NODE_SCHEMA["inputs"]:
        for option in spec.get("options", []):
            assert str(option) in page, (spec["name"], option)


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_workflows_name_the_pack_for_comfyui_manager(name):
    project = pack_project()["project"]
    node = one_node(load_workflow(name), "MultiNPUParallelConfig")
    assert node["properties"]["cnr_id"] == project["name"]
    assert node["properties"]["ver"] == project["version"]
