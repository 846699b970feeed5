"""dit_weights="shard" on upstream's own MiniMax-H3: a tiny H3 file loaded by
`comfy.sd.load_diffusion_model`, sampled by `comfy.sample.sample` through the node's DiT role
with every card (card 0 included) holding 1/W of the block weights. Compared with the same
role and `replicate`, with and without a LoRA loaded before the node by upstream's
`comfy.sd.load_lora_for_models`: within fp32 rounding through the node's path on CPU ranks
(`like_replicate` says why not bit for bit), bit for bit where both modes compute on the same
operand layouts (`test_quantized_block_weights_travel_whole_and_stay_bit_identical`).
"""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.roles.plan import RolePlanError
from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL
from tests.upstream.test_lora import lora, with_lora  # noqa: F401  (fixture)
from tests.upstream.test_sampling import sample


def node_dit(model, world, dit_weights):
    from comfy.multidevice.roles.dit import sequence_parallel_dit
    coord = SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60)
    return coord, sequence_parallel_dit(model, coord.devices, coord, dit_weights=dit_weights)


@pytest.fixture(autouse=True)
def _needs_the_hook(upstream):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")


def identical(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def misaligned_block_tensors(module) -> list[str]:
    """The block tensors (inner tensors of a QuantizedTensor included) not on a 64-byte line."""
    from comfy.multidevice.tensor_bytes import tensor_leaves
    from comfy.multidevice.weights.block_shards import block_tensors
    return [f"{i}.{name}" for i, block in enumerate(module.blocks) for name, t in block_tensors(block).items()
            if any(leaf.numel() and leaf.data_ptr() % 64 for leaf in tensor_leaves(t))]


def like_replicate(out, reference) -> bool:
    """`shard` (or `replicate` set up another way) against `replicate` through the node's MODEL
    path on CPU ranks: within fp32 rounding (FP32_TOL of max |reference|, as SP against one
    card), not bit for bit. Why: the gathered tensors are the owners' bytes (checked byte for
    byte below and in tests/weights/test_block_shards.py), but the two modes compute on operands
    at other addresses. Under `replicate` card 0 computes with ComfyUI's own copy of each weight
    (an allocator block: 64-byte aligned) and cards 1..W-1 with views of the mapped file (where
    the file put each tensor: in the tiny file 56 bytes into a 64-byte line); under `shard`
    every card computes with views of the file and gathered copies (64-byte aligned). Some CPU
    kernels choose their summation order by operand alignment: MKL's one-row GEMV on AVX-512
    (the adaLN projection of the timestep, M = 1) sums differently when the weight is not
    16-byte aligned, so the same values can round differently in the last bits (measured on an
    AVX-512 EPYC: at most 2.5e-7 of max |reference|). On cards every operand is an allocator block in both
    modes."""
    return len(out) == len(reference) and rel_diff(out, reference) <= FP32_TOL


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("with_a_lora", [False, True])
def test_shard_samples_like_replicate(patcher, lora, world, with_a_lora):
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
    assert like_replicate(out, reference)
    blocks = sum(t.nbytes for n, t in patcher.model.diffusion_model.state_dict().items() if n.startswith("blocks."))
    assert sum(resident) == world * (full - blocks) + blocks  # every block tensor on exactly one rank
    assert all(g > 0 for g in gathered)
    # ComfyUI loads and counts card 0's shard, not the full DiT; the input MODEL is unchanged
    assert sharded.model_size() == sum(t.nbytes for t in sharded.model.state_dict().values()) < patcher.model_size()
    assert sharded.model.diffusion_model is shards.module(0)
    assert patcher.model.diffusion_model is not shards.module(0)
    assert all(t.numel() > 0 for t in patcher.model.diffusion_model.state_dict().values())


@pytest.mark.parametrize("world", [2, 3])
def test_a_lora_is_patched_in_comfyuis_lora_compute_dtype(patcher, lora, world, monkeypatch):
    """On Ascend NPUs and recent NVIDIA cards ComfyUI patches weights in float16
    (comfy.model_management.lora_compute_dtype), on the CPU in float32. Made float16 here: the
    shards and the replicas, patched from the base, still equal `replicate` with the LoRA after
    the node (every rank a copy of card 0's weights as ComfyUI patched them) bit for bit."""
    import comfy.model_management
    monkeypatch.setattr(comfy.model_management, "lora_compute_dtype", lambda device: torch.float16)
    coord, replicated = node_dit(patcher, world, "replicate")
    with coord:
        reference = sample(with_lora(replicated, lora))
        assert not replicated.multinpu_dit_replicas.uses_base()
    with torch.inference_mode():
        comfy.model_management.unload_all_models()
    coord, sharded = node_dit(with_lora(patcher, lora), world, "shard")
    with coord:
        out = sample(sharded)
        sharded.multinpu_dit_shards.family.close()
    assert like_replicate(out, reference)
    coord, replicated = node_dit(with_lora(patcher, lora), world, "replicate")  # cards 1..W-1 from the base
    with coord:
        assert like_replicate(sample(replicated), reference)
        assert replicated.multinpu_dit_replicas.uses_base()


def test_a_lora_added_after_the_node_is_refused(patcher, lora):
    coord, sharded = node_dit(patcher, 2, "shard")
    with coord, pytest.raises(RolePlanError, match="added after MultiNPUParallelConfig"):
        sample(with_lora(sharded, lora))


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
@pytest.mark.parametrize("world", [2, 4])
def test_quantized_block_weights_travel_whole_and_stay_bit_identical(upstream, tmp_path, fmt, world):
    """A file quantized by upstream's own layouts, loaded by comfy.sd: its block linears hold
    QuantizedTensors. Sharded, they are gathered as their inner tensors and rebuilt, and the
    forward equals `replicate` over the same loaded weights bit for bit. That is structural here:
    every rank's module is a copy (`replica_on`: allocator blocks) and the gathered tensors sit
    in 64-byte-aligned slots, so both modes run the same kernels on equally aligned operands
    (the precondition is asserted; `like_replicate` says what differs through the file base)."""
    from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
    from comfy.multidevice.weights.module_copies import replica_on
    from tests.upstream.test_h3_dit import inputs
    from tests.upstream.test_quantized_files import load, quantized_state_dict

    dit = load(upstream, quantized_state_dict(upstream, fmt), tmp_path, fmt).model.diffusion_model
    assert type(dit.blocks[0].attn.qkv_proj.weight).__name__ == "QuantizedTensor"
    x, t, ctx, kw = inputs("plain")
    outs = {}
    for mode in ("replicate", "shard"):
        models = [replica_on(dit, "cpu") for _ in range(world)]  # the node's copy path for such files
        assert all(misaligned_block_tensors(m) == [] for m in models)
        with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
            sp = enable_sequence_parallel(models, coord, dit_weights=mode)
            with torch.inference_mode():
                outs[mode] = [sp(x, t, ctx, **kw) for _ in range(2)]
            sp.close()
    assert all(identical(a, b) for a, b in zip(outs["replicate"], outs["shard"]))


def test_the_memory_plan_reads_upstreams_dit(patcher):
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
def test_shard_with_a_quantized_file_samples_like_replicate(upstream, tmp_path, fmt, world,
                                                                   node_in_inference_mode):
    """The node's MODEL path (comfy.sd's loader, comfy.sample.sample) with a DiT file made by
    upstream's own quantizers: every card's shard is built from the shared base with the
    quantized layers as QuantizedTensors, and the latents equal `replicate`'s within fp32
    rounding (`like_replicate`).
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
    assert like_replicate(out, reference)
    assert all(g > 0 for g in gathered)
    # the layer that owns blocks.0's qkv weight holds it quantized; on the others it is released
    assert "QuantizedTensor" in kept


def quantized_lora(model, seed=13):
    """A rank-2 LoRA on every block linear of a (quantized) DiT, sized from the layers
    (a QuantizedTensor reports its float shape), in the form test_lora.py's LoRA takes."""
    g = torch.Generator().manual_seed(seed)
    dit, out = model.model.diffusion_model, {}
    for i in range(len(dit.blocks)):
        for target in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2"):
            rows, cols = dit.blocks[i].get_submodule(target).weight.shape
            out[f"diffusion_model.blocks.{i}.{target}.lora_up.weight"] = torch.randn(rows, 2, generator=g) * 0.3
            out[f"diffusion_model.blocks.{i}.{target}.lora_down.weight"] = torch.randn(2, cols, generator=g) * 0.3
    return out


def layer_tensors(layer):
    """The plain tensors a (quantized) layer holds: a QuantizedTensor as its inner tensors."""
    from comfy.multidevice.tensor_bytes import tensor_leaves
    return [leaf for t in (*layer._parameters.values(), *layer._buffers.values()) if t is not None
            for leaf in tensor_leaves(t)]


QUANTIZED_FORMATS = ["float8_e4m3fn", "int8_tensorwise", "convrot_int8"]


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_with_a_lora_on_a_quantized_file_samples_like_replicate(upstream, tmp_path, fmt, world,
                                                                            monkeypatch):
    check_a_lora_on_a_quantized_file(upstream, tmp_path, fmt, world, monkeypatch)


@pytest.mark.parametrize("fmt", QUANTIZED_FORMATS)
def test_a_lora_on_a_quantized_file_in_a_float16_lora_compute_dtype(upstream, tmp_path, fmt, monkeypatch):
    """The same with ComfyUI's LoRA compute dtype float16, as on Ascend and recent NVIDIA cards."""
    import comfy.model_management
    monkeypatch.setattr(comfy.model_management, "lora_compute_dtype", lambda device: torch.float16)
    check_a_lora_on_a_quantized_file(upstream, tmp_path, fmt, 2, monkeypatch)


def check_a_lora_on_a_quantized_file(upstream, tmp_path, fmt, world, monkeypatch):
    """A LoRA (upstream's load_lora_for_models) before the node onto a DiT file made by
    upstream's own quantizers. Each quantized block tensor is patched once, by the rank that
    keeps it, with ComfyUI's patch_weight_to_device (dequantize, patch, requantize with the
    key's seeded rounding); the reference is `replicate` with the same LoRA after the node, where
    every rank runs a copy of card 0's weights as ComfyUI itself loaded and patched them. The
    latents agree within fp32 rounding (`like_replicate`), every kept quantized tensor equals
    ComfyUI's patched one byte for byte, and the base stays unpatched."""
    import comfy.model_management
    from tests.upstream.test_quantized_files import convrot_state_dict, load, quantized_state_dict
    state = convrot_state_dict("int8") if fmt == "convrot_int8" else quantized_state_dict(upstream, fmt)
    model = load(upstream, state, tmp_path, fmt)
    turbo = quantized_lora(model)
    coord, replicated = node_dit(model, world, "replicate")
    with coord:
        reference = sample(with_lora(replicated, turbo))  # ComfyUI patches card 0; the others copy it
        assert not replicated.multinpu_dit_replicas.uses_base()
    # card 0's weights as ComfyUI loaded and patched them (the MODEL stays loaded after sampling)
    loaded = {name: [t.clone() for t in layer_tensors(layer)]
              for name, layer in model.model.diffusion_model.blocks.named_modules()
              if type(getattr(layer, "weight", None)).__name__ == "QuantizedTensor"}
    with torch.inference_mode():  # as ComfyUI evicts, inside a prompt: card 0 back to the file's weights
        comfy.model_management.unload_all_models()
    assert len(loaded) == 4 * len(model.model.diffusion_model.blocks)
    import comfy.model_patcher
    patched_keys, real_patch = [], comfy.model_patcher.ModelPatcher.patch_weight_to_device

    def counting_patch(self, key, *args, **kwargs):
        patched_keys.append(key)
        return real_patch(self, key, *args, **kwargs)
    with monkeypatch.context() as counting:
        counting.setattr(comfy.model_patcher.ModelPatcher, "patch_weight_to_device", counting_patch)
        coord, sharded = node_dit(with_lora(model, turbo), world, "shard")
    # every quantized block weight patched exactly once over all the cards (by its owner)
    assert sorted(patched_keys) == sorted(f"diffusion_model.blocks.{n}.weight" for n in loaded)
    with coord:
        out = sample(sharded)
        shards = sharded.multinpu_dit_shards
        kept = {}
        for r in range(world):
            for name in loaded:
                layer = shards.module(r).blocks.get_submodule(name)
                if layer.weight.numel():  # the rank keeps this layer's weight
                    kept.setdefault(name, []).append(layer_tensors(layer))
        base = shards.replicas[0].base
        shards.family.close()
    assert like_replicate(out, reference)
    assert sorted(kept) == sorted(loaded) and all(len(v) == 1 for v in kept.values())  # one owner each
    for name, (tensors,) in kept.items():
        assert len(tensors) == len(loaded[name]) and all(torch.equal(a, b) for a, b in zip(tensors, loaded[name])), name
    # the base still holds the file's (unpatched) bytes
    for name in state:
        if name.startswith("blocks.") and not name.endswith("comfy_quant"):
            assert torch.equal(base[name], state[name]), name
    assert rel_diff(out, sample(model)) > 1e-3  # the LoRA acts (far beyond any rounding)
    # replicate with the LoRA before the node now builds cards 1..W-1 from the base the same way
    coord, replicated = node_dit(with_lora(model, turbo), world, "replicate")
    with coord:
        assert like_replicate(sample(replicated), reference)
        assert replicated.multinpu_dit_replicas.uses_base()
