"""Sampling through upstream's own code path: a tiny H3 file loaded by
`comfy.sd.load_diffusion_model`, wrapped in upstream's ModelPatcher, sampled by
`comfy.sample.sample`, with the DiT set up the way the MultiNPUParallelConfig node sets it up
(replicas from the shared checkpoint base of that file). Compared with the same sampling on one
card; tolerance as in test_h3_dit.py (fp32, 1e-5 of max |reference|).
"""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.plan import SequenceParallelError
from tests.helpers import recording_progress_bar
from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL

STEPS = 3


def latent_and_conditioning(seed=0):
    from comfy_extras import nodes_minimax_h3
    latent = nodes_minimax_h3._empty_av_latent(64, 32, 22)[0]["samples"]  # 7 latent frames + audio
    text = torch.randn(1, 7, 24, generator=torch.Generator().manual_seed(seed))
    return latent, [[text, {}]]


def sample(model, seed=0, steps=STEPS, positive=None):
    """Euler sampling through comfy.sample; `positive` replaces the default text conditioning."""
    import comfy.sample
    latent, default_positive = latent_and_conditioning(seed)
    positive = default_positive if positive is None else positive
    noise = comfy.sample.prepare_noise(latent, seed)
    with torch.inference_mode():
        out = comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", positive, positive, latent,
                                  seed=seed, disable_pbar=True)
    return list(out.unbind()) if getattr(out, "is_nested", False) else [out]


def node_dit(model, world):
    """The DiT as the node's role plan sets it up (roles/dit.py), on `world` CPU ranks."""
    from comfy.multidevice.roles.dit import sequence_parallel_dit
    coord = SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60)
    return coord, sequence_parallel_dit(model, coord.devices, coord)


@pytest.mark.parametrize("world", [2, 4])
def test_node_dit_role_samples_like_one_card(upstream, patcher, world):
    if not upstream.has_attention_hook:
        coord = SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60)
        with coord, pytest.raises(SequenceParallelError, match="takes no `attention` argument"):
            node_dit(patcher, world)[1]
        return
    reference = sample(patcher)
    coord, parallel = node_dit(patcher, world)
    with coord:
        out = sample(parallel)
        replicas = parallel.multinpu_dit_replicas
    assert rel_diff(out, reference) <= FP32_TOL
    assert replicas.base_replicas is not None, "replicas were not built from the shared checkpoint base"


@pytest.mark.parametrize("sp_mode", ["ulysses", "auto"])
def test_patcher_entry_point_in_every_mode(upstream, patcher, sp_mode):
    if not upstream.has_attention_hook:
        pytest.skip("refused on this ComfyUI (test_node_dit_role_samples_like_one_card checks that)")
    import copy
    from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel_on_patcher
    reference = sample(patcher)
    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=60) as coord:
        parallel = patcher.clone()
        replicas = [None] + [copy.deepcopy(patcher.model.diffusion_model) for _ in range(3)]
        enable_sequence_parallel_on_patcher(parallel, coord, replicas, sp_mode=sp_mode)
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL


def test_first_prompt_shows_replica_progress_and_logs_each_card(upstream, patcher, monkeypatch, caplog):
    """The first sampling builds the W-1 replicas: one line on the running node (not the
    sampler's progress bar) and one log line (card, GiB, seconds) per card; the second
    sampling builds nothing."""
    if not upstream.has_attention_hook:
        pytest.skip("refused on this ComfyUI (test_node_dit_role_samples_like_one_card checks that)")
    import comfy.utils
    from comfy.multidevice import progress
    steps, shown = [], []
    monkeypatch.setattr(comfy.utils, "ProgressBar", recording_progress_bar(steps))
    monkeypatch.setattr(progress, "executing_node_text", lambda: shown.append)
    world = 4
    coord, parallel = node_dit(patcher, world)
    with coord, caplog.at_level("INFO", logger="comfy.multidevice.roles"):
        sample(parallel)
        first = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DiT replica for")]
        caplog.clear()
        sample(parallel)
        second = [r.getMessage() for r in caplog.records if r.getMessage().startswith("DiT replica for")]
    assert len(first) == world - 1 and all("GiB" in m and " s" in m for m in first), first
    assert second == []
    assert shown == [f"DiT replica: {k}/{world - 1} cards ready" for k in range(1, world)]
    assert ("new", world - 1) not in steps  # the sampler's bar is the sampler's alone


class _PlanStub:
    """A memory plan that records the sequence it is asked about, and refuses beyond `limit`."""

    tokens = None
    dit_shape = "known"

    def __init__(self, limit: int):
        self.limit, self.asked = limit, []

    def for_tokens(self, tokens):
        from comfy.multidevice.roles.memory_plan import MemoryPlanError
        self.asked.append(tokens)
        refuse = tokens > self.limit

        class Checked:
            def table(self):
                return "stub plan"

            def check(self):
                if refuse:
                    raise MemoryPlanError(f"stub: {tokens} tokens do not fit")
        return Checked()


def test_the_step_check_counts_the_real_sequence_before_the_fan_out(upstream, patcher):
    """plan_tokens auto's check (roles/prompt_size.py) under ComfyUI's own sampling: it reads
    the sequence upstream's DiT packs (the rows block 0 receives), once per longer sequence, and
    a refusal comes before the fan-out runs any rank."""
    if not upstream.has_attention_hook:
        pytest.skip("refused on this ComfyUI (test_node_dit_role_samples_like_one_card checks that)")
    from comfy.multidevice.roles.memory_plan import MemoryPlanError
    from comfy.multidevice.roles.prompt_size import install_prompt_size_check
    rows = []

    def block_zero(args, extra):
        rows.append(args["img"].reshape(-1, args["img"].shape[-1]).shape[0])
        return extra["original_block"](args)

    one = patcher.clone()
    one.set_model_patch_replace(block_zero, "dit", "double_block", 0)
    fits = _PlanStub(limit=10 ** 9)
    install_prompt_size_check(one, fits)
    sample(one)
    assert len(rows) >= STEPS and set(rows) == {rows[0]} and fits.asked == [rows[0]]

    coord, parallel = node_dit(patcher, 2)
    fan_outs = parallel.wrappers["diffusion_model"]
    assert fan_outs
    calls = []
    for key, wrappers in fan_outs.items():  # count what runs after the check
        fan_outs[key] = [lambda executor, *a, _w=w, **k: calls.append(1) or _w(executor, *a, **k) for w in wrappers]
    refusing = _PlanStub(limit=rows[0] - 1)
    install_prompt_size_check(parallel, refusing)
    with coord, pytest.raises(MemoryPlanError, match=f"stub: {rows[0]} tokens do not fit"):
        sample(parallel)
    assert refusing.asked == [rows[0]] and calls == []  # the fan-out never ran
