"""Upstream's MiniMax-H3 text encoder (`comfy.sd.CLIP` with `comfy.text_encoders.minimax`'s
MiniMaxH3TEModel / MiniMaxH3Tokenizer, Qwen3-VL classes with a tiny config, seeded weights)
tensor parallel as the node sets it up, against its own single-device encode of the same
prompt. Tolerance: 1e-5 of max |reference| (fp32): each rank computes 1/W of every layer's heads
and MLP columns, and the all-reduce adds the W partial sums in a different order than one
matmul does, nothing else.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator

TOL = 1e-5
PROMPT = "a red fox runs through fresh snow at dawn, soft wind, birds in the distance"


@pytest.fixture(scope="module")
def tiny_clip(upstream):
    import comfy.sd
    from comfy.text_encoders import minimax, qwen3vl
    base = qwen3vl.QWEN3VL_CONFIGS["qwen3vl_32b"]
    tiny = dataclasses.make_dataclass("TinyQwen3VL32B", [
        ("hidden_size", int, 64), ("intermediate_size", int, 96), ("num_hidden_layers", int, 2),
        ("num_attention_heads", int, 8), ("num_key_value_heads", int, 4), ("head_dim", int, 8)], bases=(base,))
    mp = pytest.MonkeyPatch()
    mp.setitem(qwen3vl.QWEN3VL_CONFIGS, "qwen3vl_32b", tiny)
    mp.setitem(qwen3vl.QWEN3VL_VISION, "qwen3vl_32b",
               dict(hidden_size=32, intermediate_size=64, depth=1, deepstack_visual_indexes=[0]))
    try:
        target = types.SimpleNamespace(clip=minimax.MiniMaxH3TEModel, tokenizer=minimax.MiniMaxH3Tokenizer, params={})
        clip = comfy.sd.CLIP(target=target, model_options={"dtype": torch.float32})
    finally:
        mp.undo()
    g = torch.Generator().manual_seed(8)
    state = {name: torch.randn(t.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0)
             for name, t in clip.cond_stage_model.state_dict().items() if t.is_floating_point()}
    clip.cond_stage_model.load_state_dict(state, strict=False)
    language_model = clip.cond_stage_model.qwen3vl_32b.transformer.model
    assert language_model.config.num_hidden_layers == 2 and language_model.config.hidden_size == 64
    return clip


def encode(clip):
    with torch.inference_mode():
        cond, pooled = clip.encode_from_tokens(clip.tokenize(PROMPT), return_pooled=True)
    return cond


@pytest.mark.parametrize("world", [2, 4])
def test_text_encoder_tensor_parallel_matches_one_card(upstream, tiny_clip, world):
    from comfy.multidevice.roles.apply import tensor_parallel_text_encoder
    reference = encode(tiny_clip)
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
        parallel = tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        assert parallel is not tiny_clip
        split = parallel.cond_stage_model.qwen3vl_32b.transformer.model
        assert type(split).__name__ == "TensorParallelDecoder", type(split)  # really split, not kept on one card
        out = encode(parallel)
    assert out.shape == reference.shape
    scale = float(reference.abs().max())
    assert float((out - reference).abs().max()) <= TOL * scale
    assert torch.equal(encode(tiny_clip), reference)  # the input CLIP still encodes on one card


@pytest.mark.parametrize("world", [2, 4])
def test_text_encoder_shards_hold_no_embedding_table(upstream, tiny_clip, world):
    """Upstream's SDClipModel embeds the tokens itself (get_input_embeddings) and passes `embeds`,
    so no shard copies the vocabulary table, before or after an encode; the embedding stays the
    CLIP's own. Bytes per card: exactly what planned_shard_bytes computed before the split."""
    from comfy.multidevice.roles.apply import tensor_parallel_text_encoder
    from comfy.multidevice.tensor_bytes import storage_bytes
    from comfy.multidevice.tp.shard import planned_shard_bytes

    language_model = tiny_clip.cond_stage_model.qwen3vl_32b.transformer.model
    table = language_model.embed_tokens.weight
    vocab, hidden = language_model.config.vocab_size, language_model.config.hidden_size
    assert tuple(table.shape) == (vocab, hidden) == (151936, 64)  # H3's real vocabulary, tiny width
    planned = planned_shard_bytes(language_model, world)
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
        parallel = tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        split = parallel.cond_stage_model.qwen3vl_32b.transformer.model
        for when in ("built", "after an encode"):
            for shard in split.shards:
                sizes = [tuple(t.shape) for t in (*shard.parameters(), *shard.buffers())]
                assert not any(vocab in shape for shape in sizes), (when, sizes)
            if when == "built":
                encode(parallel)
        per_card = [storage_bytes(s) for s in split.shards]
        assert split.embed_tokens is language_model.embed_tokens  # the CLIP's own, on its card
    assert per_card == planned == split.shard_bytes
    # a shard that copied the table would hold table.nbytes more (39 MB here in fp32, against
    # 124 kB (W=2) / 63 kB (W=4) of the tiny layers; for H3 in BF16, 1.56 GB per card)


def test_memory_plan_counts_what_upstreams_clip_and_the_shards_hold(upstream, tiny_clip):
    """The plan's text-encoder bytes per card, computed before the split, against the split:
    rank r's shard, and on rank 0's card what upstream's CLIP patcher counts for the new CLIP
    (ModelPatcher.model_size: the embedding, the vision tower, no language-model layers; its
    clone() would hand over the whole encoder's cached size, so the split resets it)."""
    from comfy.multidevice.roles.apply import tensor_parallel_text_encoder
    from comfy.multidevice.roles.memory_plan import text_encoder_shares
    from comfy.multidevice.tp.clip import remove_tensor_parallel_text_encoder
    from comfy.multidevice.tensor_bytes import storage_bytes

    world = 4
    planned = text_encoder_shares(tiny_clip, world)
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
        parallel = tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        split = parallel.cond_stage_model.qwen3vl_32b.transformer.model
        built = [storage_bytes(s) for s in split.shards]
        counted_by_comfyui = parallel.patcher.model_size()
        remove_tensor_parallel_text_encoder(parallel)
        assert parallel.patcher.model_size() == tiny_clip.patcher.model_size()  # whole again
    assert [p["shard"] for p in planned] == built
    assert planned[0]["CLIP module"] == counted_by_comfyui < tiny_clip.patcher.model_size()
