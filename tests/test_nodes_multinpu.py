"""The MultiNPUParallelConfig node: schema, the V3 node, errors that leave the inputs untouched,
the apply path end to end on 4 CPU ranks, and the official H3 workflows.

Parallel results are compared with the single-device result of the same objects:
DiT and text encoder in fp32 within 1e-5 of the output's scale (summation order differs),
the VAEs bit for bit (same ops, other threads).
"""

from __future__ import annotations

import asyncio
import glob
import inspect
import json
import sys
import uuid
from pathlib import Path

import pytest
import torch

from comfy.multidevice.roles import apply as roles_apply
from comfy.multidevice.cards import DeviceSelectionError, MixedDeviceKinds, TooFewDevices, UnsupportedCardCount
from comfy.multidevice.comm.errors import BackendUnavailable
from comfy.multidevice.roles.apply import apply_role_plan
from comfy.multidevice.roles.plan import RolePlanError
from comfy.multidevice.tp.layers import TensorParallelError
from comfy_extras import nodes_multinpu
from comfy_extras.nodes_multinpu import NODE_SCHEMA, configure_parallel, widget_defaults
from comfy.multidevice.roles.plan import plan_roles
from comfy.multidevice.sp.plan import shard_sizes
from tests.node_cases import (FakeModelPatcher, assert_same, inputs, inventory, make_fake_comfy_api, rank_threads,
                              run_dit, snapshot)
from tests.qwen_decoder import MiniatureDecoderConfig
from tests.small_vaes import TinyAudioVAE, TinyCausalVideoVAE, VAEWrapper
from tests.sp_cases import frobenius_rel, make_inputs, rel_diff, tiny_model
from tests.tp.tp_cases import LAYOUTS, WrappedWeight, mirror_clip

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("close_coordinators")]

FP32_TOL = 1e-5


# ----------------------------------------------------------------------------- schema

def test_schema_inputs_outputs_types_defaults():
    assert NODE_SCHEMA["node_id"] == "MultiNPUParallelConfig"
    assert NODE_SCHEMA["display_name"] == "Multi-NPU Parallel Config"
    assert NODE_SCHEMA["category"] == "advanced/multigpu"  # upstream's multi-GPU nodes' category
    ins = {s["name"]: s for s in NODE_SCHEMA["inputs"]}
    assert [s["name"] for s in NODE_SCHEMA["inputs"]] == [
        "model", "clip", "video_vae", "audio_vae", "npu_count", "backend", "device_kind", "devices",
        "dit_weights", "plan_tokens", "dit_ranks", "sp_mode", "exchange_precision", "split"]  # new widgets go last: saved workflows keep their positions
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
    assert ins["dit_ranks"]["options"] == ["auto", "threads", "processes"] and ins["dit_ranks"]["default"] == "auto"
    assert ins["dit_ranks"]["optional"] and ins["dit_ranks"]["advanced"]
    assert ins["sp_mode"]["options"] == ["auto", "allgather", "ulysses", "hybrid"] and ins["sp_mode"]["default"] == "auto"
    assert ins["sp_mode"]["optional"] and ins["sp_mode"]["advanced"]
    assert ins["exchange_precision"]["options"] == ["exact", "int8", "fp8"]
    assert ins["exchange_precision"]["default"] == "exact"
    assert ins["exchange_precision"]["optional"] and ins["exchange_precision"]["advanced"]
    assert ins["split"]["type"] == "STRING" and ins["split"]["default"] == "even"
    assert ins["split"]["optional"] and ins["split"]["advanced"]
    assert [o["type"] for o in NODE_SCHEMA["outputs"]] == ["MODEL", "CLIP", "VAE", "VAE"]
    assert [o["name"] for o in NODE_SCHEMA["outputs"]] == ["model", "clip", "video_vae", "audio_vae"]
    assert all(o["tooltip"] for o in NODE_SCHEMA["outputs"])  # every output says what it carries
    assert {"multi gpu", "multi npu", "sequence parallel"} <= set(NODE_SCHEMA["search_aliases"])
    assert widget_defaults() == [4, "default", "auto", "", "auto", 0, "auto", "auto", "exact", "even"]  # plan_tokens 0: auto
    json.dumps(NODE_SCHEMA)  # plain data, readable by tools without ComfyUI


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
                              "dit_weights": "auto", "plan_tokens": 0, "dit_ranks": "auto",
                              "prompt": None, "tell": seen["kwargs"]["tell"], "sp_mode": "auto",
                              "exchange_precision": "exact", "split": "even"}
    assert list(inspect.signature(node.execute).parameters)[:4] == ["model", "clip", "video_vae", "audio_vae"]


# ----------------------------------------------------------------------------- nothing half-done

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
    "bad sp_mode": (with_inputs(sp_mode="ring"), ValueError, "sp_mode='ring' is unknown"),
    "bad exchange_precision": (with_inputs(exchange_precision="int4"), ValueError,
                               "exchange_precision='int4' is unknown"),
    "ulysses, heads not divisible": (with_inputs(sp_mode="ulysses"), ValueError,
                                     "3 heads over 4 ranks, and 3 does not divide by 4: set sp_mode to allgather"),
    "bad split": (with_inputs(split="3,1"), ValueError, r"split='3,1' does not give 4 card\(s\) their shares: "
                                                        r"set split to even, auto, or one positive number per card"),
    "ulysses, uneven split": (with_inputs(sp_mode="hybrid", split="auto"), ValueError,
                              "sp_mode=hybrid splits the attention heads evenly .* set sp_mode to allgather or "
                              "auto, or split to even"),
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
            assert fan_out.runner.coordinator is coordinator
            assert model.wrappers == {}  # the input patcher got nothing
            # ranks 1..3 run replicas built from the shared base: on CPU, zero-copy views
            replicas = p_model.multinpu_dit_replicas
            assert replicas.base_problem is None and replicas.uses_base()
            rank_modules = [e.diffusion_model for e in fan_out.runner.models[1:]]
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


@pytest.mark.parametrize("npu_count, sp_mode, strategy, degree", [
    (4, "ulysses", "ulysses", 4), (8, "hybrid", "ulysses", 4), (4, "allgather", "allgather", 1),
    (4, "auto", "ulysses", 4),  # fewer bytes (sp/mode_choice.py's rule; no measurement kept)
])
def test_each_sp_mode_through_the_node_matches_one_card(npu_count, sp_mode, strategy, degree,
                                                        fake_patcher_extension, caplog):
    """The node's sp_mode reaches every rank: a 4-head DiT at 4 cards (plain Ulysses) and at 8
    (the hybrid, 2 groups of 4), its result one card's within the SP tolerance."""
    import dataclasses

    from comfy.multidevice.miniature.h3 import build_miniature
    from tests.sp_cases import TINY
    dit = build_miniature(dataclasses.replace(TINY, num_attention_heads=4), seed=3)
    objs = inputs()
    caplog.set_level("INFO")
    p_model = configure_parallel(FakeModelPatcher(dit), *objs[1:], npu_count=npu_count, device_kind="cpu",
                                 sp_mode=sp_mode)[0]
    fan_out = p_model.wrappers["diffusion_model"]["minimax_h3_sequence_parallel"][0]
    fan_out.runner.coordinator.reset_byte_counts()
    with torch.inference_mode():
        x, t, ctx, kw = make_inputs("cond_refs", seed=1)
        assert rel_diff(run_dit(p_model, x, t, ctx, kw), dit(x, t, ctx, **kw)) <= FP32_TOL
    used = [state.strategy for state in fan_out.runner.last_rank_states]
    assert len(used) == npu_count and {s.name for s in used} == {strategy}
    # Ulysses: at least two all-to-alls per block (q/k/v there, the output back); the all-gather
    # none (its K/V and the hidden state before the final layer go by exchange)
    all_to_all = [c["by_op"].get("all_to_all_v", {}).get("calls", 0) for c in fan_out.runner.coordinator.byte_counts()]
    blocks = len(dit.blocks)
    assert all(n >= 2 * blocks if strategy == "ulysses" else n < blocks for n in all_to_all), all_to_all
    name = "hybrid (2 groups of 4)" if npu_count == 8 and strategy == "ulysses" else strategy
    assert f"DiT sp_mode {name}: " in caplog.text


@pytest.mark.parametrize("sp_mode", ["allgather", "ulysses"])
def test_exchange_precision_int8_through_the_node_within_its_bound(sp_mode, fake_patcher_extension):
    """The node's exchange_precision reaches every rank (a CompressedKV around the mode's
    strategy): a 4-head DiT at 4 cards within the documented bound of one card, not equal to it."""
    import dataclasses

    from comfy.multidevice.comm.compression import STEP_REL_ERROR_BOUND
    from comfy.multidevice.miniature.h3 import build_miniature
    from comfy.multidevice.sp.strategies import CompressedKV
    from tests.sp_cases import TINY
    dit = build_miniature(dataclasses.replace(TINY, num_attention_heads=4), seed=3)
    objs = inputs()
    p_model = configure_parallel(FakeModelPatcher(dit), *objs[1:], npu_count=4, device_kind="cpu",
                                 sp_mode=sp_mode, exchange_precision="int8")[0]
    fan_out = p_model.wrappers["diffusion_model"]["minimax_h3_sequence_parallel"][0]
    with torch.inference_mode():
        x, t, ctx, kw = make_inputs("cond_refs", seed=1)
        out, ref = run_dit(p_model, x, t, ctx, kw), dit(x, t, ctx, **kw)
    used = [state.strategy for state in fan_out.runner.last_rank_states]
    assert all(isinstance(s, CompressedKV) and s.name == sp_mode and s.precision == "int8" for s in used)
    error = frobenius_rel(out, ref)
    assert 0 < error <= STEP_REL_ERROR_BOUND["int8"]


@pytest.mark.parametrize("split", ["3,1,2,1.5", "auto"])
def test_an_uneven_split_through_the_node_matches_one_card(split, fake_patcher_extension, caplog):
    """Mixed cards: the node's split reaches every rank thread, auto picks the all-gather (Ulysses
    needs even rows) and every card's share is logged with its reason."""
    import dataclasses

    from comfy.multidevice.miniature.h3 import build_miniature
    from tests.sp_cases import TINY
    dit = build_miniature(dataclasses.replace(TINY, num_attention_heads=4), seed=3)
    objs = inputs()
    caplog.set_level("INFO")
    p_model = configure_parallel(FakeModelPatcher(dit), *objs[1:], npu_count=4, device_kind="cpu",
                                 sp_mode="auto", split=split)[0]
    fan_out = p_model.wrappers["diffusion_model"]["minimax_h3_sequence_parallel"][0]
    with torch.inference_mode():
        x, t, ctx, kw = make_inputs("cond_refs", seed=1)
        assert rel_diff(run_dit(p_model, x, t, ctx, kw), dit(x, t, ctx, **kw)) <= FP32_TOL
    states = fan_out.runner.last_rank_states
    assert {s.strategy.name for s in states} == {"allgather"}
    assert "DiT sp_mode allgather: " in caplog.text
    if split == "auto":
        assert caplog.text.count("split auto: rank") == 4 and caplog.text.count("capped at") == 4
    else:
        assert states[0].plan.sizes == shard_sizes(states[0].plan.seq_len, 4, (3, 1, 2, 1.5))
        assert "split 3,1,2,1.5: cpu takes 40.0% of the rows (asked)" in caplog.text


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



def test_the_node_running_again_stops_an_earlier_worker_pool_saying_why(fake_patcher_extension, monkeypatch, caplog):
    """A processes run's workers each hold a DiT: when the node runs again (here: one card, then
    threads on four) they are stopped before the new run loads anything, with one log line
    (the real pool's stop: tests/workers/test_hardening.py)."""
    import logging
    from comfy.multidevice.workers import pool as pool_module

    class RunningPool:
        world_size, running, closed = 3, True, 0

        def close(self):
            self.closed += 1
            self.running = False

    for plan, devices in ((plan_roles(1), [torch.device("cpu")]), (plan_roles(4), [torch.device("cpu")] * 4)):
        earlier = RunningPool()
        monkeypatch.setitem(pool_module._live, "pool", earlier)
        with caplog.at_level(logging.INFO, logger=pool_module.__name__):
            apply_role_plan(plan, devices, *inputs())
        assert earlier.closed == 1 and "pool" not in pool_module._live
        assert f"stopped the worker pool's 2 rank(s) in other processes: the MultiNPUParallelConfig node ran again (the DiT on " \
               f"{len(devices)} card(s)" in caplog.text

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
    from tests.sp_cases import BlockWithoutAttentionArgument
    objs = inputs()
    for block in objs[0].model.diffusion_model.blocks:
        block.__class__ = BlockWithoutAttentionArgument
    before, threads = snapshot(*objs), rank_threads()
    with pytest.raises(RolePlanError, match=r"attention hook.*update ComfyUI.*npu_count to 1 or 2"):
        configure_parallel(*objs, npu_count=4, device_kind="cpu")
    assert_same(before, snapshot(*objs))
    assert rank_threads() == threads and roles_apply._COORDINATORS == {}


def test_a_control_patch_it_cannot_drive_is_refused_by_the_node_before_anything_changes(fake_patcher_extension):
    from tests.sp_cases import FunControlBlockPatchStandIn
    objs = inputs()
    objs[0].model_options = {"transformer_options": {"patches_replace": {"dit": {
        ("double_block", 0): FunControlBlockPatchStandIn(0)}}}}
    before, threads = snapshot(*objs), rank_threads()
    with pytest.raises(RolePlanError, match=r"ControlNet-style.*FunControlBlockPatchStandIn \(0\).*npu_count to 1 or 2"):
        configure_parallel(*objs, npu_count=4, device_kind="cpu")
    assert_same(before, snapshot(*objs))
    assert rank_threads() == threads and roles_apply._COORDINATORS == {}
