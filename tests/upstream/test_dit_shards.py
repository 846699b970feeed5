"""dit_weights="shard" on upstream's own MiniMax-H3: a tiny H3 file loaded by
`comfy.sd.load_diffusion_model`, sampled by `comfy.sample.sample` through the node's DiT role
with every card (card 0 included) holding 1/W of the block weights. Compared with the same
role and `replicate`: bit-identical (torch.equal), with and without a LoRA loaded before the
node by upstream's `comfy.sd.load_lora_for_models`.
"""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.roles.plan import RolePlanError
from tests.upstream.test_lora import lora, with_lora  # noqa: F401  (fixture)
from tests.upstream.test_sampling import patcher, sample, tiny_file  # noqa: F401  (fixtures)


def node_dit(model, world, dit_weights):
    from comfy.multidevice.roles.dit import _sequence_parallel_dit
    coord = SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60)
    return coord, _sequence_parallel_dit(model, coord.devices, coord, dit_weights=dit_weights)


@pytest.fixture(autouse=True)
def _needs_the_hook(upstream):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")


def identical(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("with_a_lora", [False, True])
def test_shard_samples_exactly_like_replicate(patcher, lora, world, with_a_lora):  # noqa: F811
    model = with_lora(patcher, lora) if with_a_lora else patcher
    coord, replicated = node_dit(model, world, "replicate")
    with coord:
        reference = sample(replicated)
    coord, sharded = node_dit(model, world, "shard")
    with coord:
        out = sample(sharded)
        shards = sharded.multinpu_dit_shards
        full = sum(t.nbytes for t in patcher.model.diffusion_model.state_dict().values())
        # bytes bound to each rank's DiT between blocks (on CPU they are views of the base)
        resident = [sum(t.nbytes for t in shards.module(r).state_dict().values()) for r in range(world)]
        gathered = shards.family.gathered_bytes
        shards.family.close()
    assert identical(out, reference)
    blocks = sum(t.nbytes for n, t in patcher.model.diffusion_model.state_dict().items() if n.startswith("blocks."))
    assert sum(resident) == world * (full - blocks) + blocks  # every block tensor on exactly one rank
    assert all(g > 0 for g in gathered)
    # ComfyUI loads and counts card 0's shard, not the full DiT; the input MODEL is unchanged
    assert sharded.model_size() == sum(t.nbytes for t in sharded.model.state_dict().values()) < patcher.model_size()
    assert sharded.model.diffusion_model is shards.module(0)
    assert patcher.model.diffusion_model is not shards.module(0)
    assert all(t.numel() > 0 for t in patcher.model.diffusion_model.state_dict().values())


def test_a_lora_added_after_the_node_is_refused(patcher, lora):  # noqa: F811
    coord, sharded = node_dit(patcher, 2, "shard")
    with coord, pytest.raises(RolePlanError, match="added after MultiNPUParallelConfig"):
        sample(with_lora(sharded, lora))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
@pytest.mark.parametrize("world", [2, 4])
def test_quantized_block_weights_travel_whole_and_stay_bit_identical(upstream, tmp_path, fmt, world):
    """A file quantized by upstream's own layouts, loaded by comfy.sd: its block linears hold
    QuantizedTensors. Sharded, they are gathered as their inner tensors and rebuilt, and the
    forward equals `replicate` over the same loaded weights bit for bit."""
    from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
    from comfy.multidevice.weights.replicas import replica_on
    from tests.upstream.test_h3_dit import inputs
    from tests.upstream.test_quantized_files import load, quantized_state_dict

    dit = load(upstream, quantized_state_dict(upstream, fmt), tmp_path, fmt).model.diffusion_model
    assert type(dit.blocks[0].attn.qkv_proj.weight).__name__ == "QuantizedTensor"
    x, t, ctx, kw = inputs("plain")
    outs = {}
    for mode in ("replicate", "shard"):
        models = [replica_on(dit, "cpu") for _ in range(world)]  # the node's copy path for such files
        with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
            sp = enable_sequence_parallel(models, coord, dit_weights=mode)
            with torch.inference_mode():
                outs[mode] = [sp(x, t, ctx, **kw) for _ in range(2)]
            sp.close()
    assert all(identical(a, b) for a, b in zip(outs["replicate"], outs["shard"]))


def test_the_memory_plan_reads_upstreams_dit(patcher):  # noqa: F811
    """The activation estimate's sizes come from upstream's own block layout, and `auto` on a
    card too small for a replica picks shard."""
    from comfy.multidevice.roles.memory_plan import dit_shape_of, plan_memory
    from comfy.multidevice.roles.plan import plan_roles
    from comfy.multidevice.sp.cost_model import DiTShape
    from tests.upstream.test_h3_dit import TINY

    shape = dit_shape_of(patcher.model.diffusion_model)
    assert shape == DiTShape(hidden=TINY["hidden_size"], blocks=TINY["num_layers"], heads=TINY["num_attention_heads"],
                             head_dim=TINY["attention_head_dim"], ffn=TINY["ffn_hidden_size"])
    vae = SimpleVAE()
    full = sum(t.nbytes for t in patcher.model.diffusion_model.state_dict().values())
    plan = plan_memory(plan_roles(4), [torch.device("cpu")] * 4, patcher, None, vae, SimpleVAE(),
                       tokens=100, free={"cpu": int(1.2 * full)})  # too small for a replica + activations
    assert plan.dit_weights == "shard" and not plan.problems()


class SimpleVAE:
    first_stage_model = torch.nn.Linear(2, 2)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise", "convrot_int8"])
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("node_in_inference_mode", [True, False])
def test_shard_with_a_quantized_file_samples_exactly_like_replicate(upstream, tmp_path, fmt, world,
                                                                   node_in_inference_mode):
    """The node's MODEL path (comfy.sd's loader, comfy.sample.sample) with a DiT file made by
    upstream's own quantizers: every card's shard is built from the shared base with the
    quantized layers as QuantizedTensors, and the latents equal `replicate`'s bit for bit.
    The file is loaded in inference mode, as ComfyUI runs its loaders; the node is set up in it
    too (a prompt) or outside it (a script): the shards follow the loaded weights' mode, which
    ComfyUI's move of card 0's shard needs for quantized layers."""
    from tests.upstream.test_quantized_files import convrot_state_dict, load, quantized_state_dict
    state = convrot_state_dict("int8") if fmt == "convrot_int8" else quantized_state_dict(upstream, fmt)
    model = load(upstream, state, tmp_path, fmt)
    coord, replicated = node_dit(model, world, "replicate")
    with coord:
        reference = sample(replicated)
    assert replicated.multinpu_dit_replicas.uses_base()
    with torch.inference_mode(node_in_inference_mode):
        coord, sharded = node_dit(model, world, "shard")
    with coord:
        out = sample(sharded)
        shards = sharded.multinpu_dit_shards
        kept = [type(shards.module(r).blocks[0].attn.qkv_proj.weight).__name__ for r in range(world)]
        gathered = shards.family.gathered_bytes
        shards.family.close()
    assert identical(out, reference)
    assert all(g > 0 for g in gathered)
    # the layer that owns blocks.0's qkv weight holds it quantized; on the others it is released
    assert "QuantizedTensor" in kept


def test_a_lora_on_a_quantized_file_is_refused_with_the_reason_and_the_fix(upstream, tmp_path):
    """A LoRA loaded before the node onto a quantized DiT: the shards are built from the base,
    which cannot patch quantized weights, so shard is refused (naming the patched layer and the
    fixes), before the input MODEL is changed; replicate serves the same MODEL."""
    from tests.upstream.test_quantized_files import load, quantized_state_dict
    model = load(upstream, quantized_state_dict(upstream, "int8_tensorwise"), tmp_path, "int8")
    patched = model.clone()
    key = "diffusion_model.blocks.0.attn.qkv_proj.weight"
    patched.add_patches({key: (torch.zeros(patched.model.diffusion_model.blocks[0].attn.qkv_proj.weight.shape),)}, 1.0)
    before = dict(patched.patches)
    with pytest.raises(RolePlanError, match=r"quantized layers \(first 'blocks\.0\.attn\.qkv_proj\.weight'\).*"
                                            r"dit_weights=replicate.*BF16 DiT file"), \
            SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=60) as coord:
        from comfy.multidevice.roles.dit import _sequence_parallel_dit
        _sequence_parallel_dit(patched, coord.devices, coord, dit_weights="shard")
    assert patched.patches == before and patched.model.diffusion_model is model.model.diffusion_model
    coord, replicated = node_dit(patched, 2, "replicate")
    with coord:
        sample(replicated)
