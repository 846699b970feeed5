"""The node pack (the repository root's __init__.py): loaded by a ComfyUI-shaped folder the way
ComfyUI loads custom nodes, from a clone in custom_nodes/, from the patch alone, and from both.
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

REPO = Path(__file__).resolve().parents[2]


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
    assert len(unused) == 1 and str(REPO) in unused[0] and "--uninstall" in unused[0]
    assert out["inputs"] == ["minimax_h3_first_frame.png"]  # the unused clone copied nothing


def test_the_patchs_pack_folder_without_the_package_says_what_to_do(tmp_path):
    root = fake_comfyui(tmp_path)
    (root / "custom_nodes" / "ComfyUI-MultiNPU").mkdir()
    shutil.copy(REPO / "__init__.py", root / "custom_nodes" / "ComfyUI-MultiNPU")
    out, _ = run_loader(root, "ComfyUI-MultiNPU")
    error = out["folders"]["ComfyUI-MultiNPU"]["error"]
    assert "Clone the whole repository into ComfyUI/custom_nodes/" in error and "--comfyui" in error
    assert out["node_file"] is None and out["inventory_file"] is None
