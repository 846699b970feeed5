"""The miniature follows upstream H3's contract: keys, shapes, block/attention hooks, layout."""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.miniature.h3 import MiniatureConfig, build_miniature, save_miniature
from comfy.multidevice.workers.recipe import miniature_from_shared_checkpoint
from tests.sp_cases import TINY, make_inputs, rel_diff, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_state_dict_keys_and_shapes_follow_upstream(model):
    c = TINY
    sd = model.state_dict()
    width = c.num_attention_heads * c.attention_head_dim
    assert width != c.hidden_size  # attention width differs from hidden, as in H3 (7168 vs 5376)
    expected = {
        "video_patch_proj.weight": (c.hidden_size, 96), "audio_patch_proj.weight": (c.hidden_size, 32),
        "condition_proj.weight": (c.hidden_size, c.text_dim),
        "time_embedder.proj_in.weight": (c.time_embed_hidden_size, c.timestep_input_dim),
        "time_embedder.proj_out.weight": (c.time_embed_dim, c.time_embed_hidden_size),
        "rope.inv_freq": (c.rope_inv_freq_len,),
        "token_refiner.blocks.0.attn.qkv_proj.weight": (3 * width, c.hidden_size),
        "token_refiner.final_norm.weight": (c.hidden_size,),
        "blocks.0.norm1.weight": (c.hidden_size,), "blocks.0.norm2.weight": (c.hidden_size,),
        "blocks.0.attn.qkv_proj.weight": (3 * width, c.hidden_size),
        "blocks.0.attn.q_norm.weight": (c.attention_head_dim,),
        "blocks.0.attn.k_norm.weight": (c.attention_head_dim,),
        "blocks.0.attn.out_proj.weight": (c.hidden_size, width),
        "blocks.0.mlp.fc1.weight": (2 * c.ffn_hidden_size, c.hidden_size),
        "blocks.0.mlp.fc2.weight": (c.hidden_size, c.ffn_hidden_size),
        "blocks.0.adaln_proj.linear.weight": (6 * c.hidden_size * 3, c.time_embed_dim),
        "final_layer.norm.weight": (c.hidden_size,),
        "final_layer.adaln_proj.linear.weight": (2 * c.hidden_size, c.time_embed_dim),
        "final_layer.video_out.weight": (96, c.hidden_size),
        "final_layer.audio_out.weight": (32, c.hidden_size),
    }
    for key, shape in expected.items():
        assert tuple(sd[key].shape) == shape, key
    assert "blocks.0.attn.qkv_proj.bias" not in sd and "blocks.0.mlp.fc1.bias" not in sd


def test_bf16_keeps_the_fp32_islands():
    sd = tiny_model(torch.bfloat16).state_dict()
    for key in ("video_patch_proj.weight", "audio_patch_proj.weight", "final_layer.video_out.weight",
                "final_layer.audio_out.weight", "time_embedder.proj_in.weight"):
        assert sd[key].dtype == torch.float32, key
    assert sd["blocks.0.attn.qkv_proj.weight"].dtype == torch.bfloat16


def test_attention_override_sees_heads_seq_headdim(model):
    shapes = []

    def override(func, q, k, v, heads, **kwargs):
        shapes.append((tuple(q.shape), heads, kwargs["skip_reshape"], kwargs["mask"]))
        return func(q, k, v, heads, **kwargs)

    x, t, ctx, kw = make_inputs("plain")
    with torch.inference_mode():
        ref = model(x, t, ctx, **kw)
        out = model(x, t, ctx, transformer_options={"optimized_attention_override": override}, **kw)
    assert torch.equal(out[0], ref[0])
    s_text, s_all, heads = 7, 35, TINY.num_attention_heads
    assert shapes == ([((1, heads, s_text, 16), heads, True, None)] * TINY.token_refiner_num_layers
                      + [((1, heads, s_all, 16), heads, True, None)] * TINY.num_layers)


def test_block_replacement_contract(model):
    seen = []

    def replace(args, extra):
        seen.append(sorted(args))
        calls = []

        def my_attention(h, rope_freqs=None, transformer_options=None):
            calls.append(h.shape[0])
            return block_attn(h, rope_freqs=rope_freqs, transformer_options=transformer_options)

        block_attn = model.blocks[args["transformer_options"]["block_index"]].attn
        out = extra["original_block"]({**args, "attention": my_attention})
        assert calls == [args["img"].shape[0]]  # original_block honoured args["attention"]
        return out

    x, t, ctx, kw = make_inputs("cond_refs")
    patches = {"patches_replace": {"dit": {("double_block", i): replace for i in range(TINY.num_layers)}}}
    with torch.inference_mode():
        ref = model(x, t, ctx, **kw)
        out = model(x, t, ctx, transformer_options=patches, **kw)
    assert rel_diff(out, ref) == 0.0
    assert seen == [["img", "layout", "mod_segments", "rope_freqs", "t_emb", "transformer_options"]] * TINY.num_layers


def test_diffusion_model_wrapper_is_called_with_the_model(model):
    seen = []

    def wrapper(executor, *args, **kwargs):
        seen.append(executor.class_obj)
        return executor(*args, **kwargs)

    x, t, ctx, _ = make_inputs("plain")
    with torch.inference_mode():
        model(x, t, ctx, transformer_options={"wrappers": {"diffusion_model": {"k": [wrapper]}}})
    assert seen == [model]


def test_save_load_round_trip(model, tmp_path):
    path = tmp_path / "mini.safetensors"
    save_miniature(model, path)
    loaded = miniature_from_shared_checkpoint(path)  # how the workers load it
    assert loaded.config == model.config
    x, t, ctx, kw = make_inputs("masked")
    with torch.inference_mode():
        assert rel_diff(loaded(x, t, ctx, **kw), model(x, t, ctx, **kw)) == 0.0


def test_seeded_weights_are_reproducible():
    a, b = build_miniature(TINY, seed=3), build_miniature(TINY, seed=3)
    c = build_miniature(TINY, seed=4)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(a.state_dict()["blocks.0.attn.qkv_proj.weight"],
                           c.state_dict()["blocks.0.attn.qkv_proj.weight"])


def test_bad_inputs_raise_clear_errors(model):
    x, t, ctx, _ = make_inputs("plain")
    with pytest.raises(ValueError, match="video latent must be"):
        model([x[0][:, :3], x[1]], t, ctx)
    with pytest.raises(ValueError, match="multiples of the patch size"):
        model([x[0][..., :5], x[1]], t, ctx)
    with pytest.raises(ValueError, match="context must be"):
        model(x, t, ctx[..., :5])
    with pytest.raises(ValueError, match="rope_inv_freq_len=3 rotates 18"):
        MiniatureConfig(attention_head_dim=16, rope_inv_freq_len=3)
