"""Ranks as processes through upstream's own sampling path: the tiny H3 file loaded by
`comfy.sd.load_diffusion_model`, sampled by `comfy.sample.sample` with the DiT forward on rank 0
(this process) and on worker processes that rebuild the DiT from the MODEL's loader and weight
patches (comfy/multidevice/workers/). Compared with the same sampling on one card (fp32,
1e-5 of max |reference|, as test_sampling.py)."""

from __future__ import annotations

import pytest

from comfy.multidevice.sp.plan import SequenceParallelError
from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL
from tests.upstream.test_lora import lora, with_lora  # noqa: F401 - lora is a fixture
from tests.upstream.test_sampling import sample

PRELUDE = (("tests.upstream.standins", "install"),)  # the workers need the test's stand-ins too
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def trusted_stand_ins(monkeypatch):
    """A worker calls the prelude only from a module its environment trusts (it inherits this)."""
    from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
    monkeypatch.setenv(TRUSTED_MODULES_ENV, PRELUDE[0][0])


def workers(model, world, **kwargs):
    from comfy.multidevice.workers.pool_runner import workers_on_patcher
    parallel = model.clone()
    return parallel, workers_on_patcher(parallel, ["cpu"] * world, prelude=PRELUDE, timeout_s=120, **kwargs)


@pytest.mark.parametrize("world", [2, 3])
def test_workers_sample_like_one_card(upstream, hook, patcher, world):
    import torch
    # text states of 24 KiB: above what workers/repeats.py holds, as a real prompt's are
    positive = [[torch.randn(1, 256, 24, generator=torch.Generator().manual_seed(1)), {}]]
    reference = sample(patcher, positive=positive)
    parallel, fan_out = workers(patcher, world)
    try:
        out = sample(parallel, positive=positive)
        assert rel_diff(out, reference) <= FP32_TOL
        assert fan_out.runner.pool is not None and fan_out.runner.pool.world_size == world
        sent = fan_out.runner.pool.bytes_sent_per_forward
        assert len(sent) >= 3  # one message per step at least
        # ComfyUI builds the step's conditioning anew each step; its digest is the same, so it
        # travels with the first step only
        assert max(sent[1:]) < sent[0], sent
    finally:
        fan_out.close()


def test_workers_carry_the_models_lora_and_a_new_patch_set_makes_a_new_pool(upstream, hook, patcher, lora):
    import torch
    reference = sample(with_lora(patcher, lora))
    parallel, fan_out = workers(with_lora(patcher, lora), 2)
    try:
        assert rel_diff(sample(parallel), reference) <= FP32_TOL  # the LoRA reached the worker
        first = fan_out.runner.pool
        key, weight = next((k, w) for k, w in parallel.model_state_dict().items() if w.dim() == 2)
        delta = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5)) * 0.05
        parallel.add_patches({key: (delta,)}, 1.0)  # a new patch set on the same MODEL
        one_card = with_lora(patcher, lora)
        one_card.add_patches({key: (delta,)}, 1.0)
        assert rel_diff(sample(parallel), sample(one_card)) <= FP32_TOL
        assert fan_out.runner.pool is not first  # rebuilt for the new patches, not stale
    finally:
        fan_out.close()


@pytest.mark.parametrize("with_a_lora", [False, True])
def test_sharded_workers_sample_like_one_card_with_the_models_lora(upstream, hook, patcher, lora, with_a_lora):
    """dit_weights="shard" with ranks as processes through the node's DiT role: rank 0's shard
    is the MODEL ComfyUI samples here, each worker rebuilds the MODEL (with the LoRA loaded
    before the node) and keeps its rank's block tensors only; the rest travel over gloo as
    each block runs."""
    from comfy.multidevice.roles.dit import workers_dit
    from comfy.multidevice.weights.block_shards import block_tensors
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    model = with_lora(patcher, lora) if with_a_lora else patcher
    reference = sample(model)
    parallel = workers_dit(model, ["cpu"] * 3, dit_weights="shard", prelude=PRELUDE)
    fan_out = parallel.multinpu_workers
    try:
        assert rel_diff(sample(parallel), reference) <= FP32_TOL
        pool = fan_out.runner.pool
        assert pool.world_size == 3 and pool.rank0_weights is not None
        plan = pool.rank0_weights.family.plan
        assert 0 < plan.owned_bytes(0) < sum(plan.block_bytes(i) for i in range(len(plan.owner))) / 2
        # between steps rank 0's DiT keeps only its own block tensors (the others are empty)
        dit = parallel.model.diffusion_model
        held = {f"{i}.{n}" for i, block in enumerate(dit.blocks) for n, t in block_tensors(block).items() if t.numel()}
        assert held == {f"{i}.{n}" for i in range(len(plan.owner)) for n in plan.names_of(i, 0)}
        assert sum(pool.rank0_weights.family.gathered_bytes) > 0
    finally:
        fan_out.close()


def test_after_a_killed_sharded_worker_the_next_pool_serves_rank0s_same_shard(upstream, hook, patcher):
    """Rank 0's shard is the MODEL ComfyUI holds: it outlives a pool that lost a rank, and the
    fresh pool's workers gather with it again (on that pool's own prefetch group)."""
    import os
    import signal
    from comfy.multidevice.roles.dit import workers_dit
    from comfy.multidevice.workers.pool import WorkerPoolError
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    reference = sample(patcher)
    parallel = workers_dit(patcher, ["cpu"] * 3, dit_weights="shard", prelude=PRELUDE)
    fan_out = parallel.multinpu_workers
    try:
        assert rel_diff(sample(parallel), reference) <= FP32_TOL
        first, weights = fan_out.runner.pool, fan_out.runner.pool.rank0_weights
        os.kill(first.workers[0].process.pid, signal.SIGKILL)
        first.workers[0].process.wait()
        with pytest.raises(WorkerPoolError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
            sample(parallel)
        assert rel_diff(sample(parallel), reference) <= FP32_TOL
        assert fan_out.runner.pool is not first and fan_out.runner.pool.rank0_weights is weights
    finally:
        fan_out.close()


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
@pytest.mark.parametrize("dit_weights", ["replicate", "shard"])
def test_workers_of_a_quantized_file_sample_like_the_rank_threads(upstream, hook, tmp_path, fmt, dit_weights):
    """A DiT file made by upstream's own quantizers: each worker loads it through comfy.sd
    again and holds its layers as QuantizedTensors (gathered whole under shard); the latents
    equal the rank threads' of the same mode within fp32 rounding (test_dit_shards.py
    `like_replicate` says why not bit for bit)."""
    from comfy.multidevice.roles.dit import workers_dit
    from tests.upstream.test_dit_shards import like_replicate, node_dit
    from tests.upstream.test_quantized_files import load, quantized_state_dict
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    model = load(upstream, quantized_state_dict(upstream, fmt), tmp_path, fmt)
    assert type(model.model.diffusion_model.blocks[0].attn.qkv_proj.weight).__name__ == "QuantizedTensor"
    coord, threads = node_dit(model, 3, dit_weights)
    with coord:
        reference = sample(threads)
        if dit_weights == "shard":
            threads.multinpu_dit_shards.family.close()
    parallel = workers_dit(model, ["cpu"] * 3, dit_weights=dit_weights, prelude=PRELUDE)
    fan_out = parallel.multinpu_workers
    try:
        assert like_replicate(sample(parallel), reference)
        if dit_weights == "shard":
            assert sum(fan_out.runner.pool.rank0_weights.family.gathered_bytes) > 0
    finally:
        fan_out.close()


def test_a_fun_controlnet_with_upstreams_tower_travels_to_the_workers(upstream, hook, patcher):
    """Upstream's own Fun ControlNet tower (MiniMaxH3FunControl, tiny and seeded, as
    test_fun_controlnet.py builds it) in block patches with upstream's semantics on one card
    (tests/sp/test_fun_controlnet.py's stand-in: this tree has no MiniMaxH3FunControlNetApply),
    placed on the MODEL as the apply node places them; sampled by comfy.sample.sample. With
    ranks as processes the tower goes to each worker with the first step of the pool and every
    rank drives the control stream: within 1e-5 of one card."""
    import types
    import torch
    from tests.sp.test_fun_controlnet import _FunBlockPatchStandIn
    from tests.upstream.test_fun_controlnet import control_model_patch, INJECTION_LAYERS
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    tower = control_model_patch(upstream).model
    latent = torch.randn(1, 24, 7, 2, 4, generator=torch.Generator().manual_seed(9))  # the video latent's shape
    control = types.SimpleNamespace(active=True, strength=0.8, control_latent=latent,
                                    model_patch=types.SimpleNamespace(model=tower))
    controlled = patcher.clone()
    for index in INJECTION_LAYERS:
        controlled.set_model_patch_replace(_FunBlockPatchStandIn(control, index), "dit", "double_block", index)
    reference = sample(controlled)
    assert rel_diff(reference, sample(patcher)) > 1e-3  # the control acts
    parallel, fan_out = workers(controlled, 3)
    try:
        assert rel_diff(sample(parallel), reference) <= FP32_TOL
        sent = fan_out.runner.pool.bytes_sent_per_forward
        tower_bytes = sum(t.nbytes for t in tower.state_dict().values())
        assert sent[0] > tower_bytes > max(sent[1:])  # the tower with the first step only
    finally:
        fan_out.close()


def test_a_lora_after_the_node_reaches_the_workers_and_leaving_it_out_again_too(upstream, hook, patcher, lora):
    """A LoRA loader placed after the node: ComfyUI samples a clone of the node's MODEL with
    more patches (BaseModel.current_patcher says which); the workers are started with that
    clone's patches, and the node's MODEL sampled again gets a pool without them."""
    parallel, fan_out = workers(patcher, 2)
    try:
        assert rel_diff(sample(with_lora(parallel, lora)), sample(with_lora(patcher, lora))) <= FP32_TOL
        with_it = fan_out.runner.pool
        assert rel_diff(sample(parallel), sample(patcher)) <= FP32_TOL
        assert fan_out.runner.pool is not with_it
    finally:
        fan_out.close()


def test_a_lora_after_a_sharded_node_is_refused_naming_the_fix(upstream, hook, patcher, lora):
    from comfy.multidevice.roles.dit import workers_dit
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    parallel = workers_dit(patcher, ["cpu"] * 2, dit_weights="shard", prelude=PRELUDE)
    try:
        with pytest.raises(SequenceParallelError, match="patches added after the MultiNPUParallelConfig node .* "
                                                        "reach card 0's shard only: place the LoRA loader before"):
            sample(with_lora(parallel, lora))
    finally:
        parallel.multinpu_workers.close()


def test_a_forward_with_patch_functions_is_refused_before_any_worker_is_asked(upstream, hook, patcher):
    parallel, fan_out = workers(patcher, 2)
    parallel.set_model_attn1_patch(lambda q, k, v, extra_options: (q, k, v))
    try:
        with pytest.raises(SequenceParallelError, match="cannot carry the transformer_options 'patches'"):
            sample(parallel)
        assert fan_out.runner.pool is None
    finally:
        fan_out.close()


@pytest.mark.parametrize("operations", ["disable_weight_init", "manual_cast"])
def test_upstreams_tower_travels_as_its_class_arguments_and_weights(upstream, hook, operations):
    """MiniMaxH3FunControl described by workers/towers.py, rebuilt from the wire bytes: the same
    class, arguments and structure, its weights views of the message and equal to rank 0's."""
    import torch
    import comfy.ops
    from comfy.ldm.minimax.controlnet import MiniMaxH3FunControl
    from comfy.multidevice.workers.towers import tower_data
    from comfy.multidevice.workers.wire import decode, encode
    from tests.upstream.test_fun_controlnet import control_model_patch
    tower = control_model_patch(upstream).model
    if operations == "manual_cast":
        state = tower.state_dict()
        with torch.device("meta"):
            tower = MiniMaxH3FunControl(**{**tower_data(tower).arguments, "operations": comfy.ops.manual_cast})
        tower.load_state_dict(state, assign=True)
    data = tower_data(tower)
    assert data.arguments["operations"] == operations and data.arguments["injection_layers"] == (0, 2)
    buffer = torch.frombuffer(encode(data), dtype=torch.uint8).clone()
    built = decode(buffer.numpy(), max_bytes=buffer.numel(), what="the tower").build()
    assert type(built) is MiniMaxH3FunControl and type(built.control_proj_in) is getattr(comfy.ops, operations).Linear
    weight = built.control_blocks[0].attn.qkv_proj.weight
    assert buffer.data_ptr() <= weight.data_ptr() < buffer.data_ptr() + buffer.numel()
    for name, t in tower.state_dict().items():
        assert torch.equal(built.state_dict()[name], t), name


def test_a_dit_file_replaced_after_the_node_ran_is_refused_naming_it(upstream, hook, tmp_path):
    """The audit replaced the DiT file after ComfyUI had loaded it: the workers loaded the new
    bytes and the result was wrong without an error. The node takes the file's identity when
    it runs; every worker checks its own file against it before it loads."""
    import os

    import comfy.sd
    import safetensors.torch

    from tests.upstream.test_h3_dit import tiny_state_dict
    path = tmp_path / "dit.safetensors"
    weights = tiny_state_dict(upstream)
    safetensors.torch.save_file(weights, str(path))
    patcher = comfy.sd.load_diffusion_model(str(path))
    parallel, fan_out = workers(patcher, 2)
    try:
        safetensors.torch.save_file({k: v * 1.05 for k, v in weights.items()}, str(tmp_path / "other.safetensors"))
        os.replace(tmp_path / "other.safetensors", path)  # same path, same size, other weights
        with pytest.raises(Exception, match=rf"the DiT file at {path} on rank 1 on .* differs from rank 0's"):
            sample(parallel)
    finally:
        fan_out.close()


def test_remote_ranks_without_the_cluster_secret_are_refused_before_the_model_changes(upstream, hook, patcher,
                                                                                       monkeypatch):
    from comfy.multidevice.workers.admission import SecretError
    from comfy.multidevice.workers.pool_runner import workers_on_patcher
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_SECRET_FILE", raising=False)
    monkeypatch.delenv("COMFYUI_MULTI_DEVICE_SECRET", raising=False)
    parallel = patcher.clone()
    with pytest.raises(SecretError, match="COMFYUI_MULTI_DEVICE_SECRET_FILE .*secrets.token_hex"):
        workers_on_patcher(parallel, ["cpu"] * 2, remote=2, address="127.0.0.1", port=29600)
    assert not parallel.wrappers.get("diffusion_model")
