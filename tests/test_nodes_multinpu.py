"""The MultiNPUParallelConfig node: schema, role plans, device validation, the apply path
end to end on 4 CPU ranks, the custom-node shim, and the official H3 workflows.

Parallel results are compared with the single-device result of the same objects:
DiT and text encoder in fp32 within 1e-5 of the output's scale (summation order differs),
the VAEs bit for bit (same ops, other threads).
"""

from __future__ import annotations

import asyncio
import glob
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import types
import uuid
from pathlib import Path

import pytest
import torch

from comfy.multidevice.roles import apply as roles_apply
from comfy.multidevice.cards import (DeviceInventory, DeviceSelectionError, InvalidDeviceList,
                                     MixedDeviceKinds, select_devices, TooFewDevices, UnsupportedCardCount)
from comfy.multidevice.comm.errors import BackendUnavailable
from comfy.multidevice.roles.apply import apply_role_plan
from comfy.multidevice.roles.plan import RolePlanError
from comfy.multidevice.tp.layers import TensorParallelError
from comfy.multidevice.miniature.qwen_decoder import MiniatureDecoderConfig
from comfy_extras import nodes_multinpu
from comfy_extras.nodes_multinpu import NODE_SCHEMA, configure_parallel, widget_defaults
from comfy.multidevice.roles.plan import plan_roles, roles_table
from tests.small_vaes import TinyAudioVAE, TinyCausalVideoVAE, VAEWrapper
from tests.sp_cases import make_inputs, rel_diff, tiny_model
from tests.sp.test_minimax_h3 import fake_patcher_extension  # noqa: F401  (fixture: comfy.patcher_extension stand-in)
from tests.tp.test_tensor_parallel import LAYOUTS, WrappedWeight, mirror_clip

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent
FP32_TOL = 1e-5


# ----------------------------------------------------------------------------- stand-ins

class FakeModelPatcher:
    """The slice of ComfyUI's ModelPatcher the node uses: clone() shares the model and copies
    the wrappers; wrappers are added/removed by key; `.model.diffusion_model` is the DiT."""

    def __init__(self, diffusion_model, load_device="cpu"):
        self.model = types.SimpleNamespace(diffusion_model=diffusion_model)
        self.load_device = torch.device(load_device)
        self.wrappers = {}
        self.patches_uuid = uuid.uuid4()

    def clone(self):
        n = FakeModelPatcher.__new__(FakeModelPatcher)
        n.model, n.load_device, n.patches_uuid = self.model, self.load_device, self.patches_uuid
        n.wrappers = {k: {kk: list(v) for kk, v in d.items()} for k, d in self.wrappers.items()}
        return n

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def forward(self, x, t, ctx, **kwargs):
        """What ComfyUI's sampling does: the patcher's wrappers go into transformer_options."""
        return self.model.diffusion_model(x, t, ctx, transformer_options={"wrappers": self.wrappers}, **kwargs)


@pytest.fixture(autouse=True)
def close_coordinators():
    yield
    roles_apply.close_shared_coordinators()


def inputs(seed=0, clip_cfg=None, clip_patches=None):
    return (FakeModelPatcher(tiny_model(seed=seed)),
            mirror_clip(clip_cfg or LAYOUTS["separate"], patches=clip_patches),
            VAEWrapper(TinyCausalVideoVAE(seed=seed)),
            VAEWrapper(TinyAudioVAE(seed=seed)))


def inventory(npu=0, cuda=0, **env):
    names = {"ASCEND_RT_VISIBLE_DEVICES": None, "CUDA_VISIBLE_DEVICES": None}
    names.update(env)
    return DeviceInventory(counts={"npu": npu, "cuda": cuda}, env=names)


# ----------------------------------------------------------------------------- schema

def test_schema_inputs_outputs_types_defaults():
    assert NODE_SCHEMA["node_id"] == "MultiNPUParallelConfig"
    assert NODE_SCHEMA["display_name"] == "Multi-NPU Parallel Config"
    assert NODE_SCHEMA["category"] == "advanced/multigpu"  # upstream's multi-GPU nodes' category
    ins = {s["name"]: s for s in NODE_SCHEMA["inputs"]}
    assert [s["name"] for s in NODE_SCHEMA["inputs"]] == [
        "model", "clip", "video_vae", "audio_vae", "npu_count", "backend", "device_kind", "devices",
        "dit_weights", "plan_tokens"]  # new widgets go last: saved workflows keep their positions
    assert [(n, ins[n]["type"]) for n in ("model", "clip", "video_vae", "audio_vae")] == [
        ("model", "MODEL"), ("clip", "CLIP"), ("video_vae", "VAE"), ("audio_vae", "VAE")]
    assert ins["npu_count"] == {**ins["npu_count"], "type": "COMBO", "options": [1, 2, 4, 8], "default": 4}
    assert "optional" not in ins["npu_count"]
    for name in ("backend", "device_kind", "devices"):
        assert ins[name]["optional"] and ins[name]["advanced"]
        assert ins[name]["default"] in ins[name].get("options", [ins[name]["default"]])
    assert ins["backend"]["options"] == ["default", "auto", "hccl", "nccl", "peer"]
    assert ins["device_kind"]["options"] == ["auto", "npu", "cuda", "cpu"]
    assert ins["devices"]["type"] == "STRING" and ins["devices"]["default"] == ""
    assert ins["dit_weights"]["options"] == ["auto", "replicate", "shard"] and ins["dit_weights"]["optional"]
    assert ins["plan_tokens"]["type"] == "INT" and ins["plan_tokens"]["advanced"]
    assert [o["type"] for o in NODE_SCHEMA["outputs"]] == ["MODEL", "CLIP", "VAE", "VAE"]
    assert [o["name"] for o in NODE_SCHEMA["outputs"]] == ["model", "clip", "video_vae", "audio_vae"]
    assert all(o["tooltip"] for o in NODE_SCHEMA["outputs"])  # every output says what it carries
    assert {"multi gpu", "multi npu", "sequence parallel"} <= set(NODE_SCHEMA["search_aliases"])
    assert widget_defaults() == [4, "default", "auto", "", "auto", 109952]
    json.dumps(NODE_SCHEMA)  # plain data, readable by tools without ComfyUI


def make_fake_comfy_api(with_advanced=True):
    """A stand-in for comfy_api.latest that records how the node declares itself."""
    def input_class(io_type):
        def __init__(self, id, display_name=None, optional=False, tooltip=None, default=None,
                     options=None, advanced=None, min=None, max=None):
            self.io_type, self.id, self.optional, self.tooltip = io_type, id, optional, tooltip
            self.default, self.options, self.advanced = default, options, advanced
        if not with_advanced:
            def __init__(self, id, display_name=None, optional=False, tooltip=None, default=None,  # noqa: F811
                         options=None, min=None, max=None):
                self.io_type, self.id, self.optional, self.default, self.options = io_type, id, optional, default, options
                self.advanced = "absent"
        return type(f"{io_type}Input", (), {"__init__": __init__})

    def output_class(io_type):
        def __init__(self, id=None, display_name=None, tooltip=None):
            self.io_type, self.display_name, self.tooltip = io_type, display_name, tooltip
        return type(f"{io_type}Output", (), {"__init__": __init__})

    def comfy_type(io_type):
        return types.SimpleNamespace(Input=input_class(io_type), Output=output_class(io_type))

    io = types.SimpleNamespace(
        ComfyNode=type("ComfyNode", (), {}),
        Schema=lambda **kw: types.SimpleNamespace(**kw),
        NodeOutput=lambda *values: ("NodeOutput", values),
        Model=comfy_type("MODEL"), Clip=comfy_type("CLIP"), Vae=comfy_type("VAE"),
        Combo=comfy_type("COMBO"), String=comfy_type("STRING"), Int=comfy_type("INT"))
    latest = types.ModuleType("comfy_api.latest")
    latest.io = io
    latest.ComfyExtension = type("ComfyExtension", (), {})
    package = types.ModuleType("comfy_api")
    package.latest = latest
    return package, latest


@pytest.mark.parametrize("with_advanced", [True, False])
def test_v3_node_is_built_from_the_plain_schema(monkeypatch, with_advanced):
    package, latest = make_fake_comfy_api(with_advanced)
    monkeypatch.setitem(sys.modules, "comfy_api", package)
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    monkeypatch.setattr(nodes_multinpu, "_NODE_CLASS", None)

    extension = asyncio.run(nodes_multinpu.comfy_entrypoint())
    (node,) = asyncio.run(extension.get_node_list())
    schema = node.define_schema()
    assert (schema.node_id, schema.display_name, schema.category) == (
        "MultiNPUParallelConfig", "Multi-NPU Parallel Config", "advanced/multigpu")
    assert [(i.id, i.io_type) for i in schema.inputs] == [(s["name"], s["type"]) for s in NODE_SCHEMA["inputs"]]
    by_id = {i.id: i for i in schema.inputs}
    assert by_id["npu_count"].options == [1, 2, 4, 8] and by_id["npu_count"].default == 4
    assert by_id["backend"].optional is True
    assert by_id["backend"].advanced == (True if with_advanced else "absent")
    assert [(o.io_type, o.display_name) for o in schema.outputs] == [
        ("MODEL", "model"), ("CLIP", "clip"), ("VAE", "video_vae"), ("VAE", "audio_vae")]
    assert [o.tooltip for o in schema.outputs] == [o["tooltip"] for o in NODE_SCHEMA["outputs"]]
    assert schema.search_aliases == NODE_SCHEMA["search_aliases"]

    seen = {}

    def fake_configure(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        return ("m", "c", "v", "a")

    monkeypatch.setattr(nodes_multinpu, "configure_parallel", fake_configure)
    out = node.execute("M", "C", "V", "A", npu_count=2, backend="peer")
    assert out == ("NodeOutput", ("m", "c", "v", "a"))
    assert seen["args"] == ("M", "C", "V", "A")
    assert seen["kwargs"] == {"npu_count": 2, "backend": "peer", "device_kind": "auto", "devices": "",
                              "dit_weights": "auto", "plan_tokens": 109952}
    assert list(inspect.signature(node.execute).parameters)[:4] == ["model", "clip", "video_vae", "audio_vae"]


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
    ours = {"inventory_file": "comfy.multidevice.cards", "node_file": "comfy_extras.nodes_multinpu"}
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


# ----------------------------------------------------------------------------- role plans

def test_plan_roles_for_1_2_4_8_cards():
    assert plan_roles(1).as_dict() == {
        "n_cards": 1,
        "dit": {"cards": [0], "mode": "single"},
        "text_encoder": {"cards": [0], "mode": "single"},
        "video_vae": {"cards": [0], "mode": "single"},
        "audio_vae": {"cards": [0], "mode": "single"},
    }
    assert plan_roles(2).as_dict() == {
        "n_cards": 2,
        "dit": {"cards": [0], "mode": "single"},
        "text_encoder": {"cards": [0], "mode": "single"},
        "video_vae": {"cards": [0], "mode": "single"},
        "audio_vae": {"cards": [1], "mode": "single"},
    }
    assert plan_roles(4).as_dict() == {
        "n_cards": 4,
        "dit": {"cards": [0, 1, 2, 3], "mode": "sequence_parallel"},
        "text_encoder": {"cards": [0, 1, 2, 3], "mode": "tensor_parallel"},
        "video_vae": {"cards": [0, 1, 2, 3], "mode": "temporal_chunks", "merge_card": 0},
        "audio_vae": {"cards": [3], "mode": "single"},
    }
    eight = list(range(8))
    assert plan_roles(8).as_dict() == {
        "n_cards": 8,
        "dit": {"cards": eight, "mode": "sequence_parallel"},
        "text_encoder": {"cards": eight, "mode": "tensor_parallel"},
        "video_vae": {"cards": eight, "mode": "temporal_chunks", "merge_card": 0},
        "audio_vae": {"cards": [7], "mode": "single"},
    }
    assert [row["n_cards"] for row in roles_table()] == [1, 2, 4, 8]


@pytest.mark.parametrize("bad", [0, 3, 5, 6, 16, -4, "4", 4.0, True, None])
def test_unsupported_counts(bad):
    with pytest.raises(UnsupportedCardCount) as info:
        plan_roles(bad)
    assert repr(bad) in str(info.value) and "1, 2, 4, 8" in str(info.value)


# ----------------------------------------------------------------------------- device checks

def test_unsupported_count_names_the_visible_cards():
    with pytest.raises(UnsupportedCardCount) as info:
        select_devices(3, inventory=inventory(npu=3, ASCEND_RT_VISIBLE_DEVICES="0,1,2"))
    msg = str(info.value)
    assert "npu_count=3" in msg and "npu: 3 (ASCEND_RT_VISIBLE_DEVICES=0,1,2)" in msg and "set npu_count to 2" in msg


def test_too_few_devices_says_asked_found_variable_and_fix():
    inv = inventory(npu=2, ASCEND_RT_VISIBLE_DEVICES="0,1")
    with pytest.raises(TooFewDevices) as info:
        select_devices(4, inventory=inv)
    msg = str(info.value)
    for part in ("npu_count is 4", "2 npu card(s) are visible", "ASCEND_RT_VISIBLE_DEVICES=0,1", "set npu_count to 2",
                 "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3"):
        assert part in msg, msg
    with pytest.raises(TooFewDevices, match=r"npu_count is 8 but 3 cuda card\(s\) are visible \(CUDA_VISIBLE_DEVICES unset\)"):
        select_devices(8, kind="cuda", inventory=inventory(cuda=3))


def test_no_accelerator_at_all():
    with pytest.raises(TooFewDevices) as info:
        select_devices(4, inventory=inventory())
    msg = str(info.value)
    assert "npu_count is 4 but this server sees no NPU or CUDA card" in msg and "device_kind to cpu" in msg and "doctor" in msg


def test_mixed_kinds_visible_or_listed():
    with pytest.raises(MixedDeviceKinds) as info:
        select_devices(4, inventory=inventory(npu=4, cuda=2, CUDA_VISIBLE_DEVICES="0,1"))
    msg = str(info.value)
    assert "npu: 4" in msg and "cuda: 2 (CUDA_VISIBLE_DEVICES=0,1)" in msg and "device_kind" in msg
    with pytest.raises(MixedDeviceKinds, match="mixes kinds"):
        select_devices(2, devices="npu:0,cuda:0", inventory=inventory(npu=2, cuda=2))
    with pytest.raises(MixedDeviceKinds, match="device_kind is cuda but devices lists npu"):
        select_devices(2, kind="cuda", devices="npu:0,npu:1", inventory=inventory(npu=2, cuda=2))


def test_device_list_errors_and_success():
    inv = inventory(npu=8, ASCEND_RT_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    assert select_devices(4, devices="npu:0, npu:2,npu:4,npu:6", inventory=inv) == [
        "npu:0", "npu:2", "npu:4", "npu:6"]
    with pytest.raises(InvalidDeviceList, match="lists 2 card"):
        select_devices(4, devices="npu:0,npu:1", inventory=inv)
    with pytest.raises(InvalidDeviceList, match="more than once"):
        select_devices(2, devices="npu:1,npu:1", inventory=inv)
    with pytest.raises(InvalidDeviceList, match="'3' is not a device"):
        select_devices(2, devices="npu:0,3", inventory=inv)
    with pytest.raises(TooFewDevices, match="npu:9.*only 8 npu"):
        select_devices(2, devices="npu:0,npu:9", inventory=inv)
    with pytest.raises(DeviceSelectionError, match="device_kind='tpu'"):
        select_devices(2, kind="tpu", inventory=inv)


def test_successful_selection():
    assert select_devices(4, inventory=inventory(npu=8)) == ["npu:0", "npu:1", "npu:2", "npu:3"]
    assert select_devices(2, inventory=inventory(cuda=2)) == ["cuda:0", "cuda:1"]
    assert select_devices(2, kind="cuda", inventory=inventory(npu=4, cuda=2)) == ["cuda:0", "cuda:1"]
    assert select_devices(8, kind="cpu") == ["cpu"] * 8
    assert select_devices(2, devices="cpu,cpu") == ["cpu", "cpu"]


def fake_torch_npu(tmp_path, monkeypatch, body):
    """A torch_npu module on the path (its import runs `body`); the real one never exists here."""
    folder = tmp_path / "fake_npu"
    folder.mkdir()
    (folder / "torch_npu.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)


def test_probe_counts_npus_through_torch_npu_and_reads_the_variable(tmp_path, monkeypatch):
    from comfy.multidevice.cards import probe_devices
    fake_torch_npu(tmp_path, monkeypatch, "")  # importing it registers torch.npu (below)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(device_count=lambda: 4), raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    inv = probe_devices()
    assert (inv.count("npu"), inv.count("cuda"), inv.notes) == (4, 0, ())
    assert inv.env_text("npu") == "ASCEND_RT_VISIBLE_DEVICES=4,5,6,7"
    assert select_devices(4) == ["npu:0", "npu:1", "npu:2", "npu:3"]  # probed, not given
    with pytest.raises(TooFewDevices, match=r"npu_count is 8 but 4 npu card\(s\) are visible \(ASCEND_RT_VISIBLE_DEVICES=4,5,6,7\)"):
        select_devices(8)


def test_probe_survives_a_broken_npu_stack_and_says_why(tmp_path, monkeypatch):
    from comfy.multidevice.cards import probe_devices
    fake_torch_npu(tmp_path, monkeypatch, "raise RuntimeError('libascendcl.so: cannot open shared object file')")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    inv = probe_devices()
    assert (inv.count("npu"), inv.count("cuda")) == (0, 2)
    assert inv.notes == ("npu probe failed: RuntimeError: libascendcl.so: cannot open shared object file",)
    assert "npu probe failed" in inv.describe()
    assert select_devices(2) == ["cuda:0", "cuda:1"]  # auto: the one kind that is visible
    with pytest.raises(TooFewDevices, match=r"npu_count is 4 but 0 npu card.*npu probe failed: RuntimeError: libascendcl"):
        select_devices(4, kind="npu")  # the cause of "0 NPUs" reaches the user


# ----------------------------------------------------------------------------- nothing half-done

def snapshot(model, clip, video_vae, audio_vae):
    """Identity and contents of everything the node could touch."""
    te = clip.cond_stage_model.qwen3vl_32b
    return {
        "model": (dict(vars(model)), {k: {kk: list(v) for kk, v in d.items()} for k, d in model.wrappers.items()},
                  {k: v.clone() for k, v in model.model.diffusion_model.state_dict().items()}),
        "clip": (dict(vars(clip)), dict(vars(clip.patcher)), te.transformer.model,
                 dict(te.transformer._modules), dict(clip.cond_stage_model._modules)),
        "video_vae": (dict(vars(video_vae)), dict(vars(video_vae.first_stage_model))),
        "audio_vae": (dict(vars(audio_vae)), dict(vars(audio_vae.first_stage_model))),
    }


def assert_same(before, after):
    for key in before:
        b, a = before[key], after[key]
        assert len(b) == len(a)
        for x, y in zip(b, a):
            if isinstance(x, dict) and x and all(torch.is_tensor(v) for v in x.values()):
                assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), key
            else:
                assert x == y, key


def rank_threads():
    return sum(1 for t in threading.enumerate() if t.name.startswith("sp-rank-"))


def with_inputs(**change):
    def build(objs):
        model, clip, vv, av = objs
        kw = {"npu_count": 4, "device_kind": "cpu"}
        kw.update(change)
        return (model, clip, vv, av), kw
    return build


ERROR_CASES = {
    "unsupported count": (with_inputs(npu_count=3), UnsupportedCardCount, "npu_count=3"),
    "too few": (with_inputs(device_kind="npu", inventory=inventory(npu=2, ASCEND_RT_VISIBLE_DEVICES="0,1")),
                TooFewDevices, "npu_count is 4 but 2 npu"),
    "mixed visible": (with_inputs(device_kind="auto", inventory=inventory(npu=4, cuda=4)),
                      MixedDeviceKinds, "more than one kind of card"),
    "mixed list": (with_inputs(device_kind="auto", devices="npu:0,npu:1,cuda:0,npu:2",
                               inventory=inventory(npu=4, cuda=4)), MixedDeviceKinds, "mixes kinds"),
    "bad backend": (with_inputs(backend="mpi"), ValueError, "backend='mpi'"),
    "bad kind": (with_inputs(device_kind="tpu"), DeviceSelectionError, "tpu"),
    "forced backend missing": (with_inputs(backend="nccl"), BackendUnavailable, "nccl"),
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_validation_errors_leave_everything_untouched(case, fake_patcher_extension):
    build, error, text = ERROR_CASES[case]
    objs = inputs()
    (model, clip, vv, av), kw = build(objs)
    before, threads, coords = snapshot(*objs), rank_threads(), dict(roles_apply._COORDINATORS)
    with pytest.raises(error, match=text):
        configure_parallel(model, clip, vv, av, **kw)
    assert_same(before, snapshot(*objs))
    assert rank_threads() == threads and roles_apply._COORDINATORS == coords  # nothing started


def test_role_errors_leave_everything_untouched(fake_patcher_extension):
    objs = inputs()
    model, clip, vv, av = objs
    before = snapshot(*objs)
    cases = [
        ((FakeModelPatcher(torch.nn.Linear(2, 2)), clip, vv, av), RolePlanError, "is not a MiniMax-H3 DiT"),
        ((model, clip, vv, vv), RolePlanError, "same VAE"),
        ((model, clip, None, av), RolePlanError, "video_vae input is not connected"),
        ((model, clip, vv, object()), RolePlanError, "not a VAE"),
    ]
    for args, error, text in cases:
        with pytest.raises(error, match=text):
            configure_parallel(*args, npu_count=4, device_kind="cpu")
    assert_same(before, snapshot(*objs))
    # a text encoder whose heads cannot be split over 4 cards; one with a CLIP LoRA
    for clip_cfg, patches, text in (
            (MiniatureDecoderConfig(num_attention_heads=6, num_key_value_heads=2), None, "6 query heads over W=4"),
            (None, {"qwen3vl_32b.transformer.model.layers.0.mlp.up_proj.weight": [("lora",)]}, "CLIP LoRA")):
        objs = inputs(clip_cfg=clip_cfg, clip_patches=patches)
        before = snapshot(*objs)
        with pytest.raises(TensorParallelError, match=text):
            configure_parallel(*objs, npu_count=4, device_kind="cpu")
        assert_same(before, snapshot(*objs))
        assert roles_apply._COORDINATORS == {}  # failed before any rank thread started


# ----------------------------------------------------------------------------- end to end

def run_dit(model, x, t, ctx, kw):
    if isinstance(model, FakeModelPatcher):
        return model.forward(x, t, ctx, **kw)
    return model(x, t, ctx, **kw)


def euler(model, x, ctx, kw, steps=3):
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        v = run_dit(model, x, torch.tensor([float(s) * 1000]), ctx, kw)
        x = [xi + (s_next - s) * vi for xi, vi in zip(x, v)]
    return x


@pytest.mark.parametrize("as_patcher", [True, False], ids=["model_patcher", "dit_module"])
def test_end_to_end_on_4_cpu_ranks_matches_single_device(as_patcher, fake_patcher_extension):
    dit = tiny_model(seed=3)
    model = FakeModelPatcher(dit) if as_patcher else dit
    clip = mirror_clip(LAYOUTS["separate"], seed=5)
    video_vae, audio_vae = VAEWrapper(TinyCausalVideoVAE(seed=2)), VAEWrapper(TinyAudioVAE(seed=2))
    original_lm = clip.cond_stage_model.qwen3vl_32b.transformer.model

    p_model, p_clip, p_video, p_audio = configure_parallel(model, clip, video_vae, audio_vae,
                                                           npu_count=4, device_kind="cpu")
    assert p_model is not model and p_clip is not clip and p_video is not video_vae and p_audio is not audio_vae
    coordinator = roles_apply.shared_coordinator([torch.device("cpu")] * 4)
    assert coordinator.world_size == 4 and len(roles_apply._COORDINATORS) == 1

    with torch.inference_mode():
        # DiT: one forward and a 3-step Euler sampling, 4 ranks against 1
        x, t, ctx, kw = make_inputs("cond_refs", seed=1)
        assert rel_diff(run_dit(p_model, x, t, ctx, kw), dit(x, t, ctx, **kw)) <= FP32_TOL
        assert rel_diff(euler(p_model, x, ctx, kw), euler(dit, x, ctx, kw)) <= FP32_TOL
        if as_patcher:
            fan_out = p_model.wrappers["diffusion_model"]["minimax_h3_sequence_parallel"][0]
            assert fan_out.coordinator is coordinator
            assert model.wrappers == {}  # the input patcher got nothing
            # ranks 1..3 run replicas built from the shared base: on CPU, zero-copy views
            replicas = p_model.multinpu_dit_replicas
            assert replicas.base_problem is None and replicas.uses_base()
            rank_modules = [e.diffusion_model for e in fan_out.models[1:]]
            assert all(m is not dit for m in rank_modules)
            name, weight = next(iter(dit.state_dict().items()))
            assert all(m.state_dict()[name].data_ptr() == weight.data_ptr() for m in rank_modules)

        # text encoder: tensor parallel over the 4 ranks; the input CLIP keeps its encoder
        ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(4))
        want = clip.cond_stage_model.qwen3vl_32b.encode(ids)
        got = p_clip.cond_stage_model.qwen3vl_32b.encode(ids)
        assert float((got - want).abs().max()) <= FP32_TOL * float(want.abs().max())
        assert clip.cond_stage_model.qwen3vl_32b.transformer.model is original_lm
        assert p_clip.cond_stage_model.qwen3vl_32b.transformer.model.world_size == 4

        # video VAE: chunks on the 4 ranks, bit-identical; audio VAE on the last card
        z = torch.randn(1, 4, 12, 3, 5, generator=torch.Generator().manual_seed(6))
        assert torch.equal(p_video.decode(z), video_vae.decode(z))
        assert p_video.first_stage_model.parallel_decode.devices == [torch.device("cpu")] * 4
        assert "decode" not in vars(video_vae.first_stage_model)
        za = torch.randn(1, 32, 2, 7, generator=torch.Generator().manual_seed(7))
        assert torch.equal(p_audio.decode(za), audio_vae.decode(za))

    # the node again with the same cards reuses the rank threads
    configure_parallel(model, clip, video_vae, audio_vae, npu_count=4, device_kind="cpu")
    assert len(roles_apply._COORDINATORS) == 1


def test_a_patch_added_after_the_node_reaches_every_rank(fake_patcher_extension):
    # A LoRA loader placed after the node: ComfyUI patches the shared weights for a patcher
    # with another patch set; replicas from the base would miss it, so the loaded weights
    # are copied to the other ranks instead.
    dit = tiny_model(seed=8)
    model, clip, video_vae, audio_vae = inputs()
    model = FakeModelPatcher(dit)
    p_model, *_ = configure_parallel(model, clip, video_vae, audio_vae, npu_count=4, device_kind="cpu")
    replicas = p_model.multinpu_dit_replicas
    x, t, ctx, kw = make_inputs("plain", seed=2)
    with torch.no_grad():
        before = dit(x, t, ctx, **kw)
        for p in dit.blocks[0].parameters():  # what loading the LoRA'd patcher does to the weights
            p.add_(0.05)
        dit.current_weight_patches_uuid = uuid.uuid4()
        p_model.model.current_weight_patches_uuid = dit.current_weight_patches_uuid
        want = dit(x, t, ctx, **kw)
        assert rel_diff(want, before) > 1e-3  # the patch matters
        assert not replicas.uses_base()
        assert rel_diff(p_model.forward(x, t, ctx, **kw), want) <= FP32_TOL
    assert replicas.unload() == 0  # CPU ranks: the base replicas held nothing beyond the base


def test_a_quantized_text_encoder_stays_on_the_first_card(fake_patcher_extension, caplog):
    # The official templates load the NVFP4 encoder file: its weights cannot be sliced, and it
    # fits on one card, so the plan keeps it on card 0 (and says so) instead of failing.
    model, clip, video_vae, audio_vae = inputs()
    lm = clip.cond_stage_model.qwen3vl_32b.transformer.model
    proj = lm.layers[0].mlp.up_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().as_subclass(WrappedWeight), requires_grad=False)
    with caplog.at_level("WARNING", logger="comfy.multidevice.roles"):
        _, p_clip, *_ = configure_parallel(model, clip, video_vae, audio_vae, npu_count=4, device_kind="cpu")
    assert "not tensor parallel" in caplog.text and "cannot be sliced" in caplog.text
    assert p_clip is not clip and p_clip.cond_stage_model.qwen3vl_32b.transformer.model is lm


def test_one_and_two_card_plans_place_each_component(fake_patcher_extension):
    model, clip, video_vae, audio_vae = inputs()
    cpu, other = torch.device("cpu"), torch.device("meta")  # meta: a second "card" nothing runs on
    m, c, v, a = apply_role_plan(plan_roles(2), [cpu, other], model, clip, video_vae, audio_vae)
    assert roles_apply._COORDINATORS == {}  # no parallel role: no rank threads
    assert a.device == other and audio_vae.device == cpu  # the audio VAE moved, its input did not
    assert v.device == cpu and v.first_stage_model is video_vae.first_stage_model
    assert m.load_device == cpu and m.model is model.model and m is not model
    assert c.cond_stage_model is clip.cond_stage_model and c is not clip
    m, c, v, a = apply_role_plan(plan_roles(1), [cpu], model, clip, video_vae, audio_vae)
    assert a.device == cpu and v.device == cpu and m.wrappers == {}
    m, *_ = apply_role_plan(plan_roles(1), [other], model, clip, video_vae, audio_vae)
    assert m.load_device == other and model.load_device == cpu


# ----------------------------------------------------------------------------- official workflows

TEMPLATES_PACKAGE = "comfyui_workflow_templates_json"
LOADERS = ("UNETLoader", "CLIPLoader", "VAELoader")


def h3_templates():
    import importlib
    package = importlib.import_module(TEMPLATES_PACKAGE)
    folder = Path(package.__file__).parent / "templates"
    return sorted(glob.glob(str(folder / "video_minimax_h3_*.json")))


class Graph:
    """A UI-format graph (the workflow itself or one of its subgraphs) with link helpers."""

    def __init__(self, data, link_as_list):
        self.data = data
        self.as_list = link_as_list
        self.nodes = {n["id"]: n for n in data["nodes"]}

    def links(self):
        for link in self.data["links"]:
            if self.as_list:
                lid, oid, oslot, tid, tslot, ltype = link[:6]
                yield {"id": lid, "origin_id": oid, "origin_slot": oslot, "target_id": tid,
                       "target_slot": tslot, "type": ltype}
            else:
                yield link

    def set_origin(self, link_id, origin_id, origin_slot):
        for link in self.data["links"]:
            if (link[0] if self.as_list else link["id"]) == link_id:
                if self.as_list:
                    link[1], link[2] = origin_id, origin_slot
                else:
                    link["origin_id"], link["origin_slot"] = origin_id, origin_slot

    def add_link(self, link_id, origin_id, origin_slot, target_id, target_slot, ltype):
        entry = [link_id, origin_id, origin_slot, target_id, target_slot, ltype] if self.as_list else {
            "id": link_id, "origin_id": origin_id, "origin_slot": origin_slot, "target_id": target_id,
            "target_slot": target_slot, "type": ltype}
        self.data["links"].append(entry)

    def consumers(self, node_id, slot=0):
        return [(self.nodes.get(l["target_id"]), l) for l in self.links()
                if l["origin_id"] == node_id and l["origin_slot"] == slot]


def h3_graph(workflow):
    """The graph (top level or subgraph) holding H3's UNET, CLIP and two VAE loaders."""
    candidates = [Graph(workflow, True)] + [Graph(s, False) for s in
                                            workflow.get("definitions", {}).get("subgraphs", [])]
    for graph in candidates:
        kinds = [n["type"] for n in graph.data["nodes"]]
        if kinds.count("VAELoader") == 2 and "CLIPLoader" in kinds and "UNETLoader" in kinds:
            return graph
    return None


def pick_loaders(graph):
    """{input name of our node: loader node} - the audio VAE is the one audio nodes consume."""
    by_type = {}
    for node in graph.data["nodes"]:
        by_type.setdefault(node["type"], []).append(node)
    (unet,), (clip,) = by_type["UNETLoader"], by_type["CLIPLoader"]
    audio, video = [], []
    for vae in by_type["VAELoader"]:
        uses = [(n["type"], n["inputs"][l["target_slot"]]["name"]) for n, l in graph.consumers(vae["id"]) if n]
        is_audio = any(t == "VAEDecodeAudio" or name == "audio_vae" for t, name in uses)
        (audio if is_audio else video).append(vae)
    assert len(audio) == 1 and len(video) == 1, "cannot tell the video VAE loader from the audio one"
    return {"model": unet, "clip": clip, "video_vae": video[0], "audio_vae": audio[0]}


def insert_parallel_config(workflow, graph):
    """Put MultiNPUParallelConfig between H3's loaders and every consumer of what they load."""
    is_sub = graph.data is not workflow
    state = graph.data["state"] if is_sub else workflow
    node_key, link_key = ("lastNodeId", "lastLinkId") if is_sub else ("last_node_id", "last_link_id")
    node_id = state[node_key] + 1
    state[node_key] = node_id
    loaders = pick_loaders(graph)
    sockets = [s for s in NODE_SCHEMA["inputs"] if s["name"] in loaders]
    anchor = loaders["model"]["pos"]
    node = {
        "id": node_id, "type": NODE_SCHEMA["node_id"], "pos": [anchor[0] + 700, anchor[1]],
        "size": [360, 200], "flags": {}, "order": 0, "mode": 0,
        "inputs": [{"name": s["name"], "type": s["type"], "link": None} for s in sockets],
        "outputs": [{"name": o["name"], "type": o["type"], "links": [], "slot_index": i}
                    for i, o in enumerate(NODE_SCHEMA["outputs"])],
        "properties": {"Node name for S&R": NODE_SCHEMA["node_id"]},
        "widgets_values": widget_defaults(),
    }
    for slot, spec in enumerate(sockets):
        loader = loaders[spec["name"]]
        out = loader["outputs"][0]
        moved = [l["id"] for _, l in graph.consumers(loader["id"])]
        for link_id in moved:  # every consumer now reads our output of the same slot
            graph.set_origin(link_id, node_id, slot)
        node["outputs"][slot]["links"] = moved
        link_id = state[link_key] + 1
        state[link_key] = link_id
        graph.add_link(link_id, loader["id"], 0, node_id, slot, spec["type"])
        out["links"] = [link_id]
        node["inputs"][slot]["link"] = link_id
    graph.data["nodes"].append(node)
    graph.nodes[node_id] = node
    return node


def type_accepts(declared, link_type):
    return declared == "*" or link_type in str(declared).split(",")


def check_links(graph):
    """Every link: origin output type == link type accepted by the target input, both ends agree."""
    problems = []
    for link in graph.links():
        origin, target = graph.nodes.get(link["origin_id"]), graph.nodes.get(link["target_id"])
        if origin is not None:
            out = origin["outputs"][link["origin_slot"]]
            if out["type"] != link["type"] or link["id"] not in (out.get("links") or []):
                problems.append(f"link {link['id']}: origin {origin['type']}.{out['name']} is {out['type']}")
        if target is not None:
            inp = target["inputs"][link["target_slot"]]
            if not type_accepts(inp["type"], link["type"]) or inp.get("link") != link["id"]:
                problems.append(f"link {link['id']} ({link['type']}): target {target['type']}.{inp['name']} "
                                f"takes {inp['type']}")
    return problems


def test_official_templates_take_the_node_between_loaders_and_consumers():
    files = h3_templates()
    names = {Path(f).name for f in files}
    assert {"video_minimax_h3_t2v.json", "video_minimax_h3_i2v.json", "video_minimax_h3_r2v.json"} <= names
    done = 0
    for path in files:
        workflow = json.loads(Path(path).read_text())
        graph = h3_graph(workflow)
        if graph is None:
            continue
        assert check_links(graph) == [], f"{path}: the template itself is inconsistent"
        loaders = pick_loaders(graph)
        before = {name: sorted((l["target_id"], l["target_slot"]) for _, l in graph.consumers(node["id"]))
                  for name, node in loaders.items()}
        node = insert_parallel_config(workflow, graph)
        graph = Graph(graph.data, graph.as_list)  # re-read after the edit
        assert check_links(graph) == [], path

        # our node's sockets carry exactly the schema's types, in order
        schema_in = {s["name"]: s["type"] for s in NODE_SCHEMA["inputs"]}
        assert [(i["name"], i["type"]) for i in node["inputs"]] == [
            (n, schema_in[n]) for n in ("model", "clip", "video_vae", "audio_vae")]
        assert [o["type"] for o in node["outputs"]] == [o["type"] for o in NODE_SCHEMA["outputs"]]
        for slot, (name, loader) in enumerate(loaders.items()):
            # the loader feeds only our node; its former consumers read our matching output
            assert [(n["id"], l["target_slot"]) for n, l in graph.consumers(loader["id"])] == [(node["id"], slot)]
            after = sorted((l["target_id"], l["target_slot"]) for _, l in graph.consumers(node["id"], slot))
            assert after == before[name] and after, (path, name)
        json.dumps(workflow)
        done += 1
    assert done >= 3


def test_a_comfyui_without_the_attention_hook_is_refused_by_the_node_before_anything_changes(
        fake_patcher_extension):
    """ComfyUI v0.33.0's H3 blocks have no `attention` parameter: the node says so and what to do,
    before any clone, copy or rank thread (feature detection, not a commit check)."""
    from tests.sp.test_minimax_h3 import _BlockWithoutAttentionArgument
    objs = inputs()
    for block in objs[0].model.diffusion_model.blocks:
        block.__class__ = _BlockWithoutAttentionArgument
    before, threads = snapshot(*objs), rank_threads()
    with pytest.raises(RolePlanError, match=r"attention hook.*update ComfyUI.*npu_count to 1 or 2"):
        configure_parallel(*objs, npu_count=4, device_kind="cpu")
    assert_same(before, snapshot(*objs))
    assert rank_threads() == threads and roles_apply._COORDINATORS == {}


def test_a_control_patch_it_cannot_drive_is_refused_by_the_node_before_anything_changes(fake_patcher_extension):
    from tests.sp.test_minimax_h3 import FunControlBlockPatchStandIn
    objs = inputs()
    objs[0].model_options = {"transformer_options": {"patches_replace": {"dit": {
        ("double_block", 0): FunControlBlockPatchStandIn(0)}}}}
    before, threads = snapshot(*objs), rank_threads()
    with pytest.raises(RolePlanError, match=r"ControlNet-style.*FunControlBlockPatchStandIn \(0\).*npu_count to 1 or 2"):
        configure_parallel(*objs, npu_count=4, device_kind="cpu")
    assert_same(before, snapshot(*objs))
    assert rank_threads() == threads and roles_apply._COORDINATORS == {}
