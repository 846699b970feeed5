"""What a ComfyUI user reads when MultiNPUParallelConfig refuses: for every refusal the node's
inputs or the server's environment can cause, one sentence that names the node input (or the
variable) to change and the fix, with none of this package's class names and no reprs.

ComfyUI's execution_error shows str(error) and the error's qualified class name, so the node
raises a plain ValueError / RuntimeError with that sentence (its internal cause logged).
tests/upstream/test_node_errors.py reads the same texts from a real server's /history.
"""

from __future__ import annotations

import inspect
import re
import sys

import pytest
import torch

import comfy.multidevice
from comfy.multidevice.comm.settings import BACKEND_ENV, RUN_TIMEOUT_ENV, TIMEOUT_ENV, WEIGHT_BASE_ENV
from comfy.multidevice.roles import apply as roles_apply
from comfy_extras import nodes_multinpu
from comfy_extras.nodes_multinpu import configure_parallel, shown_error
from tests.node_cases import FakeModelPatcher, inputs, inventory, make_fake_comfy_api
from tests.qwen_decoder import MiniatureDecoderConfig
from tests.tp.tp_cases import LAYOUTS

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("close_coordinators")]


def package_error_names() -> set[str]:
    """Every exception class this package defines (in the modules the node has imported)."""
    names = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name.startswith("comfy.multidevice") or name == nodes_multinpu.__name__):
            continue
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and \
                    value.__module__.startswith(("comfy.multidevice", nodes_multinpu.__name__)):
                names.add(value.__name__)
    return names


def assert_user_facing(message: str, names: tuple, fix: str) -> None:
    """One sentence (ending in a period, no line break, no second sentence), naming `names`
    and `fix`, without internal class names, chains or object reprs."""
    assert "\n" not in message and message.endswith("."), message
    sentences = re.split(r"(?<!e\.g)(?<!\d)\.\s+(?=[A-Z])", message)
    assert len(sentences) == 1, sentences
    for name in names:
        assert name in message, (name, message)
    assert fix in message, (fix, message)
    leaked = sorted(n for n in package_error_names() if n in message)
    assert not leaked, (leaked, message)
    for internal in ("Traceback", "caused by", "object at 0x", "<class", "comfy.multidevice", "Coordinator"):
        assert internal not in message, (internal, message)


def refusal(**kwargs):
    """The error configure_parallel raises for these inputs, and what ComfyUI would show."""
    objs = kwargs.pop("objs", None) or inputs()
    with pytest.raises(Exception) as info:
        configure_parallel(*objs, **kwargs)
    shown = shown_error(info.value) or info.value  # None: raised as is (a builtin type already)
    assert type(shown) in (ValueError, RuntimeError), type(info.value)
    assert str(shown) == str(info.value)
    return str(shown)


def ascend(n):
    return inventory(npu=n, ASCEND_RT_VISIBLE_DEVICES=",".join(map(str, range(n))))


# (inputs of configure_parallel, the names the message must carry, the fix it must give)
CASES = {
    "npu_count above the visible cards": (
        dict(npu_count=8, inventory=ascend(4)),
        ("npu_count is 8", "4 npu card(s) are visible", "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3"), "set npu_count to 4"),
    "no card at all": (
        dict(npu_count=8, inventory=inventory()),
        ("npu_count is 8", "no NPU or CUDA card"), "set device_kind to cpu"),
    "npu_count not in the table": (
        dict(npu_count=3, inventory=ascend(3)), ("npu_count=3",), "set npu_count to 2"),
    "device_kind unknown": (
        dict(npu_count=4, device_kind="tpu", inventory=ascend(4)), ("device_kind='tpu'",), "set device_kind to one of auto"),
    "device_kind auto with two kinds": (
        dict(npu_count=4, inventory=inventory(npu=4, cuda=4)), ("device_kind is auto",), "set device_kind to npu or cuda"),
    "device_kind against devices": (
        dict(npu_count=2, device_kind="cuda", devices="npu:0,npu:1", inventory=inventory(npu=2, cuda=2)),
        ("device_kind is cuda", "devices lists npu"), "make them agree"),
    "devices not a device": (
        dict(npu_count=2, devices="npu:0,3", inventory=ascend(2)), ("devices entry '3'",), "leave devices empty"),
    "devices beyond the visible": (
        dict(npu_count=2, devices="npu:0,npu:9", inventory=ascend(8)), ("devices asks for npu:9",),
        "list cards below npu:8"),
    "devices count against npu_count": (
        dict(npu_count=4, devices="npu:0,npu:1", inventory=ascend(8)), ("devices lists 2", "npu_count is 4"),
        "list exactly 4 cards"),
    "backend unknown": (
        dict(npu_count=4, device_kind="cpu", backend="mpi"), ("backend='mpi'",), "set backend to one of"),
    "backend forced and missing": (
        dict(npu_count=4, device_kind="cpu", backend="nccl"), ("backend is nccl",), "set backend to auto"),
    "dit_weights shard on one card": (
        dict(npu_count=1, device_kind="cpu", dit_weights="shard"), ("dit_weights is shard", "npu_count 1"),
        "set npu_count to 4 or 8"),
    "exchange_precision unknown": (
        dict(npu_count=4, device_kind="cpu", exchange_precision="int4"), ("exchange_precision='int4'",),
        "set exchange_precision to one of exact, int8, fp8"),
    "dit_weights unknown": (
        dict(npu_count=4, device_kind="cpu", dit_weights="halves"), ("dit_weights='halves'",),
        "set dit_weights to one of"),
    "a plan that does not fit": (
        dict(npu_count=4, device_kind="cpu", dit_weights="replicate", free_memory={"cpu": 1024}),
        ("cpu cannot hold the", "GiB free"), "raise npu_count"),
    "the DiT does not fit even sharded": (
        dict(npu_count=8, device_kind="cpu", free_memory={"cpu": 1024}),
        ("cpu cannot hold the", "GiB free"), "load the INT8 DiT file"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_refusal_is_one_sentence_naming_the_input_and_the_fix(case, fake_patcher_extension):  # noqa: F811
    kwargs, names, fix = CASES[case]
    assert_user_facing(refusal(**kwargs), names, fix)


def test_fp8_without_the_dtype_names_int8(fake_patcher_extension, monkeypatch):  # noqa: F811
    from comfy.multidevice.comm import compression
    monkeypatch.setattr(compression, "fp8_dtype", lambda: None)
    assert_user_facing(refusal(npu_count=4, device_kind="cpu", exchange_precision="fp8"),
                       ("exchange_precision is fp8",), "set exchange_precision to int8")


def test_model_refusals_name_the_model_input(fake_patcher_extension):  # noqa: F811
    model, clip, vv, av = inputs()
    assert_user_facing(refusal(objs=(FakeModelPatcher(torch.nn.Linear(2, 2)), clip, vv, av), npu_count=4,
                               device_kind="cpu"),
                       ("the model input is not a MiniMax-H3 DiT",), "set npu_count to 1 or 2")
    assert_user_facing(refusal(objs=(model, clip, vv, vv), npu_count=4, device_kind="cpu"),
                       ("video_vae", "audio_vae"), "connect the video VAE loader to video_vae")
    assert_user_facing(refusal(objs=(model, clip, vv, object()), npu_count=4, device_kind="cpu"),
                       ("the audio_vae input is not a VAE",), "connect the output of a Load VAE node")
    assert_user_facing(refusal(objs=(model, clip, None, av), npu_count=4, device_kind="cpu"),
                       ("the video_vae input is not connected",), "connect the loader's output")


def test_an_older_comfyui_is_named_with_the_update_fix(fake_patcher_extension):  # noqa: F811
    from tests.sp_cases import BlockWithoutAttentionArgument  # v0.33.0's block signature
    objs = inputs()
    for block in objs[0].model.diffusion_model.blocks:
        block.__class__ = BlockWithoutAttentionArgument
    message = refusal(objs=objs, npu_count=4, device_kind="cpu")
    assert_user_facing(message, ("model input", "this ComfyUI is too old", "attention"), "update ComfyUI")
    assert "set npu_count to 1 or 2" in message and "forward()" not in message


def test_a_control_patch_is_named_with_the_fix(fake_patcher_extension):  # noqa: F811
    from tests.sp_cases import FunControlBlockPatchStandIn
    objs = inputs()
    objs[0].model_options = {"transformer_options": {"patches_replace": {"dit": {
        ("double_block", 0): FunControlBlockPatchStandIn(0)}}}}
    assert_user_facing(refusal(objs=objs, npu_count=4, device_kind="cpu"),
                       ("the model input carries a ControlNet-style patch",), "set npu_count to 1 or 2")


def test_text_encoder_refusals_name_the_clip_input(fake_patcher_extension):  # noqa: F811
    lora = {"qwen3vl_32b.transformer.model.layers.0.mlp.up_proj.weight": [("lora",)]}
    assert_user_facing(refusal(objs=inputs(clip_patches=lora), npu_count=4, device_kind="cpu"),
                       ("the clip input carries a CLIP LoRA",), "remove the CLIP LoRA")
    heads = MiniatureDecoderConfig(num_attention_heads=6, num_key_value_heads=2)
    assert_user_facing(refusal(objs=inputs(clip_cfg=heads), npu_count=4, device_kind="cpu"),
                       ("the clip input's text encoder cannot be split over 4 cards",), "set npu_count to 1 or 2")
    assert LAYOUTS  # the separate-projection layout the other cases use is still there


@pytest.mark.parametrize("variable, value, fix", [
    (BACKEND_ENV, "gloo", "set this node's backend input to auto"),
    (TIMEOUT_ENV, "ten", "then restart ComfyUI"),
    (RUN_TIMEOUT_ENV, "ten", "then restart ComfyUI"),
    (WEIGHT_BASE_ENV, "bogus", "then restart ComfyUI"),
])
def test_bad_environment_variables_are_refused_before_anything_starts(monkeypatch, fake_patcher_extension,  # noqa: F811
                                                                      variable, value, fix):
    monkeypatch.setenv(variable, value)
    message = refusal(npu_count=4, device_kind="cpu")
    assert_user_facing(message, (f"{variable}={value!r}",), fix)
    assert roles_apply._COORDINATORS == {}  # refused before a rank thread started
    # one card starts no coordinator, so the variables are not read there
    assert len(configure_parallel(*inputs(), npu_count=1, device_kind="cpu")) == 4
    # an explicit backend input makes the backend variable irrelevant; the timeout still counts
    if variable == BACKEND_ENV:
        assert len(configure_parallel(*inputs(), npu_count=4, device_kind="cpu", backend="peer")) == 4


def test_errors_not_of_this_package_are_not_rewrapped():
    assert shown_error(torch.cuda.OutOfMemoryError("CUDA out of memory")) is None  # ComfyUI's OOM tips
    assert shown_error(KeyError("x")) is None
    from comfy.multidevice.cards import TooFewDevices
    assert type(shown_error(TooFewDevices("npu_count is 8 ..."))) is ValueError
    assert type(shown_error(comfy.multidevice.BackendUnavailable("backend is nccl ..."))) is RuntimeError


def test_the_node_raises_a_plain_error_with_the_cause_kept(monkeypatch, fake_patcher_extension, caplog):  # noqa: F811
    from comfy.multidevice.cards import TooFewDevices
    package, latest = make_fake_comfy_api(True)
    monkeypatch.setitem(sys.modules, "comfy_api", package)
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    monkeypatch.setattr(nodes_multinpu, "_NODE_CLASS", None)
    monkeypatch.setattr(nodes_multinpu, "configure_parallel",
                        lambda *a, **k: configure_parallel(*a, inventory=ascend(2), **k))
    node = nodes_multinpu.node_class()
    caplog.set_level("INFO", logger=nodes_multinpu.__name__)
    with pytest.raises(ValueError) as info:
        node.execute(*inputs(), npu_count=4)
    assert type(info.value) is ValueError  # ComfyUI shows exception_type "ValueError"
    assert_user_facing(str(info.value), ("npu_count is 4",), "set npu_count to 2")
    assert isinstance(info.value.__cause__, TooFewDevices)  # in the server log, not in the message
    assert "comfy.multidevice.cards.TooFewDevices" in caplog.text


def _node(monkeypatch):
    package, latest = make_fake_comfy_api(True)
    monkeypatch.setitem(sys.modules, "comfy_api", package)
    monkeypatch.setitem(sys.modules, "comfy_api.latest", latest)
    monkeypatch.setattr(nodes_multinpu, "_NODE_CLASS", None)
    return nodes_multinpu.node_class()


@pytest.mark.parametrize("value", [4.5, 4.0, "4", "\u0664", None, True, [4]])
def test_the_node_refuses_a_card_count_that_is_not_an_int(monkeypatch, fake_patcher_extension, value):  # noqa: F811
    with pytest.raises(ValueError) as info:
        _node(monkeypatch).execute(*inputs(), npu_count=value, device_kind="cpu")
    assert type(info.value) is ValueError
    assert_user_facing(str(info.value), (f"npu_count={value!r} is not supported",),
                       "set npu_count to one of 1, 2, 4, 8")


@pytest.mark.parametrize("value", [4.5, "109952", "\u0664", None, True, -1, 10_000_001])
def test_the_node_refuses_plan_tokens_that_are_not_an_int_in_range(monkeypatch, fake_patcher_extension,  # noqa: F811
                                                                   value):
    from comfy.multidevice.roles.memory_plan import MAX_PLAN_TOKENS
    with pytest.raises(ValueError) as info:
        _node(monkeypatch).execute(*inputs(), npu_count=1, device_kind="cpu", plan_tokens=value)
    assert type(info.value) is ValueError
    assert_user_facing(str(info.value), (f"plan_tokens={value!r} is not a whole number from 1 to 10000000", "or to 0 (auto)"),
                       "set it to the longest packed sequence")
    spec = next(s for s in nodes_multinpu.NODE_SCHEMA["inputs"] if s["name"] == "plan_tokens")
    assert spec["max"] == MAX_PLAN_TOKENS
