"""The memory plan follows the prompt (roles/prompt_size.py): plan_tokens auto plans for the
workflow's latents, and each step's real sequence is checked before any rank runs it."""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.roles.memory_plan import dit_shape_of, MemoryPlanError
from comfy.multidevice.roles.prompt_size import (latent_tokens, step_tokens, WRAPPER_KEY, workflow_tokens)
from comfy.multidevice.sp.cost_model import activation_bytes
from comfy_extras.nodes_multinpu import configure_parallel
from tests.node_cases import inputs, run_dit
from tests.sp_cases import make_inputs

pytestmark = pytest.mark.usefixtures("close_coordinators")

CPU = "cpu"
FP32_SP_TOL = 1e-5  # sequence parallel against one card on CPU ranks: fp32 summation order only


def _latent(node_type: str, width, height, length) -> dict:
    return {"class_type": node_type, "inputs": {"width": width, "height": height, "length": length}}


def test_latent_tokens_follow_the_h3_layout():
    # UPSTREAM_H3.md: 768p 5 s = 37,296 video + 414 audio rows, 38,592 tokens with its 882 text rows
    assert latent_tokens(1344, 768, 124, text_rows=882) == 38_592
    # 15 s: 107 latent frames -> 107,856 video rows, ~1,206 audio rows (109,952 tokens in all)
    assert abs(latent_tokens(1344, 768, 362, text_rows=0) - (107_856 + 1_206)) <= 4
    assert latent_tokens(1344, 768, 120) == latent_tokens(1344, 768, 124) - 2 * 7  # snapped up to 5k + 2 frames


def test_workflow_tokens_take_the_largest_readable_latent():
    prompt = {"3": _latent("EmptyMiniMaxH3LatentAV", 640, 384, 124),
              "7": _latent("MiniMaxH3ImageToVideo", 1344, 768, 124),
              "9": _latent("MiniMaxH3ReferenceToVideo", ["12", 0], 768, 362),  # a wired size: not known here
              "11": {"class_type": "KSampler", "inputs": {"width": 99999, "height": 99999, "length": 99999}}}
    assert workflow_tokens(prompt) == latent_tokens(1344, 768, 124)
    assert workflow_tokens({"9": prompt["9"], "11": prompt["11"]}) is None
    assert workflow_tokens(None) is None and workflow_tokens("not a prompt") is None


def test_step_tokens_count_video_audio_and_text_rows():
    x, t, ctx, kw = make_inputs("plain")  # text 7 | audio 10 | video 18 rows
    assert step_tokens((x, t, ctx), kw) == 35
    assert step_tokens((), {"x": x, "context": ctx}) == 35
    assert step_tokens((torch.zeros(1, 4, 8, 8), t, ctx), {}) is None  # not an H3 step: not checked


def _host_that_fits(model, tokens: int) -> int:
    """The host memory at which 4 CPU ranks' DiT stage fits `tokens` and little more: the weights
    once, activations per rank, and the attention's quarter of what is available."""
    dit = model.model.diffusion_model
    weights = sum(t.nbytes for t in dit.state_dict().values())
    return (weights + 4 * activation_bytes(dit_shape_of(dit), tokens, 4)) * 4 // 3 + 4096


def test_a_small_prompt_runs_on_cards_that_cannot_hold_768p_15s(fake_patcher_extension):  # noqa: F811
    model, clip, video, audio = inputs()
    x, t, ctx, kw = make_inputs("plain")
    reference = run_dit(model, x, t, ctx, kw)
    free = {"host": _host_that_fits(model, 2_000)}
    run = dict(npu_count=4, device_kind=CPU, dit_weights="replicate", free_memory=free)

    with pytest.raises(MemoryPlanError, match=r"plan_tokens \(now 109952\)"):  # the old default refuses it
        configure_parallel(model, clip, video, audio, plan_tokens=109_952, **run)
    with pytest.raises(MemoryPlanError, match=r"tokens from the workflow's latents"):
        configure_parallel(model, clip, video, audio,
                           prompt={"5": _latent("EmptyMiniMaxH3LatentAV", 1344, 768, 362)}, **run)

    small = {"5": _latent("EmptyMiniMaxH3LatentAV", 128, 64, 5)}
    assert workflow_tokens(small) < 2_000
    out_model = configure_parallel(model, clip, video, audio, prompt=small, **run)[0]
    assert next(iter(out_model.wrappers["diffusion_model"])) == WRAPPER_KEY  # before the fan-out
    out = run_dit(out_model, x, t, ctx, kw)
    assert all((a - b).abs().max() / b.abs().max() <= FP32_SP_TOL for a, b in zip(out, reference))


def test_a_step_longer_than_the_cards_hold_is_refused_before_any_rank_runs(fake_patcher_extension):  # noqa: F811
    model, clip, video, audio = inputs()
    out_model = configure_parallel(model, clip, video, audio, npu_count=4, device_kind=CPU,
                                   dit_weights="replicate", free_memory={"host": _host_that_fits(model, 2_000)})[0]
    fan_out = out_model.wrappers["diffusion_model"]
    calls = []
    for key, wrappers in fan_out.items():
        if key != WRAPPER_KEY:  # count what runs after the check
            fan_out[key] = [lambda executor, *a, _w=w, **k: calls.append(1) or _w(executor, *a, **k) for w in wrappers]
    x, t, ctx, kw = make_inputs("plain")
    long_video = torch.zeros(1, 24, 10, 40, 40)  # 4,000 video rows
    with pytest.raises(MemoryPlanError, match=r"\d+ tokens from this prompt") as err:
        run_dit(out_model, [long_video, x[1]], t, ctx, kw)
    assert "sample fewer frames / a lower resolution" in str(err.value) and "plan_tokens" not in str(err.value)
    assert calls == []
    run_dit(out_model, x, t, ctx, kw)  # a step that fits still runs
    assert calls == [1]
