"""The CLIP conversion (comfy/multidevice/tp/clip.py) on a module tree with upstream's layout.

The upstream ComfyUI conversion (apply_tensor_parallel_text_encoder) cannot run against
upstream here (ComfyUI is not installed); it is tested on a small module tree in
tests/tp/tp_cases.py that mirrors upstream's attribute layout (CLIP.cond_stage_model.<clip name>
.transformer.model / .visual, get_input_embeddings, patcher.patches), with the miniature
decoder as the language model.
"""

import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from comfy.multidevice.tp.layers import QuantizedWeightsError, TensorParallelError
from comfy.multidevice.tp.decoder import TensorParallelDecoder
from comfy.multidevice.tp.clip import (apply_tensor_parallel_text_encoder, remove_tensor_parallel_text_encoder, tensor_parallel_clip, check_tensor_parallel_clip)
from tests.qwen_decoder import build_miniature_decoder
from tests.tp.tp_cases import (FP32_REL_TOL, LAYOUTS, MirrorCLIP, MirrorSD1ClipModel, WrappedWeight,
                               coordinator, mirror_clip, rel_err)


def test_quantized_weights_are_refused_with_their_own_error():
    model = build_miniature_decoder(LAYOUTS["separate"])
    proj = model.layers[1].mlp.up_proj
    proj.weight = nn.Parameter(proj.weight.detach().as_subclass(WrappedWeight), requires_grad=False)
    clip = MirrorCLIP(MirrorSD1ClipModel(model), {})
    with pytest.raises(QuantizedWeightsError, match=r"layers\.1\.mlp\.up_proj\.weight.*one card|quantized"):
        check_tensor_parallel_clip(clip, 2)


def test_upstream_clip_conversion_matches_and_can_be_undone(backend, caplog):
    cfg = LAYOUTS["separate"]
    clip = mirror_clip(cfg)
    te = clip.cond_stage_model.qwen3vl_32b
    original = te.transformer.model
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(1))
    want = te.encode(ids)
    with coordinator(4, backend) as coord:
        with caplog.at_level(logging.INFO, logger="comfy.multidevice.tp"):
            assert apply_tensor_parallel_text_encoder(clip, coord) is clip
        wrapper = te.transformer.model
        assert isinstance(wrapper, TensorParallelDecoder) and wrapper.source_decoder is original
        assert te.transformer.get_input_embeddings() is original.embed_tokens
        assert "vision tower is not split" in caplog.text
        assert rel_err(te.encode(ids), want) <= FP32_REL_TOL
        # The wrapper's registered modules are only what the CLIP's own patcher should move.
        assert {n for n, _ in wrapper.named_children()} == {"embed_tokens"}
        assert apply_tensor_parallel_text_encoder(clip, coord) is clip
        assert te.transformer.model is wrapper  # same coordinator: no-op
        with coordinator(2, backend) as other:
            apply_tensor_parallel_text_encoder(clip, other)  # re-split from the kept original
            assert te.transformer.model.world_size == 2
            assert rel_err(te.encode(ids), want) <= FP32_REL_TOL
    remove_tensor_parallel_text_encoder(clip)
    assert te.transformer.model is original
    assert torch.equal(te.encode(ids), want)


def test_upstream_clip_from_checkpoint_weights():
    cfg = LAYOUTS["fused"]
    clip = mirror_clip(cfg)
    te = clip.cond_stage_model.qwen3vl_32b
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    want = te.encode(ids)
    file_tensors = te.transformer.state_dict()  # keys as in a text-encoder file: "model.layers..."
    assert "model.layers.0.self_attn.qkv_proj.weight" in file_tensors
    with coordinator(2) as coord:
        apply_tensor_parallel_text_encoder(clip, coord, weights=file_tensors)
        assert rel_err(te.encode(ids), want) <= FP32_REL_TOL


def test_upstream_clip_errors_leave_it_unchanged():
    lora = {"qwen3vl_32b.transformer.model.layers.0.self_attn.q_proj.weight": [("lora",)]}
    clip = mirror_clip(LAYOUTS["separate"], patches=lora)
    original = clip.cond_stage_model.qwen3vl_32b.transformer.model
    with coordinator(2) as coord:
        with pytest.raises(TensorParallelError, match="CLIP LoRA"):
            apply_tensor_parallel_text_encoder(clip, coord)
        assert clip.cond_stage_model.qwen3vl_32b.transformer.model is original
        clip = mirror_clip(LAYOUTS["separate"])
        with coordinator(3) as three, pytest.raises(TensorParallelError, match="8 query heads over W=3"):
            apply_tensor_parallel_text_encoder(clip, three)
        assert clip.cond_stage_model.qwen3vl_32b.transformer.model is not None
        assert isinstance(clip.cond_stage_model.qwen3vl_32b.transformer.model.layers[0].self_attn.q_proj,
                          nn.Linear)
        with pytest.raises(TensorParallelError, match="cond_stage_model"):
            apply_tensor_parallel_text_encoder(object(), coord)
        not_llama = SimpleNamespace(cond_stage_model=SimpleNamespace(clip="t5xxl", t5xxl=object()))
        with pytest.raises(TensorParallelError, match="t5xxl"):
            apply_tensor_parallel_text_encoder(not_llama, coord)


def test_tensor_parallel_clip_returns_a_new_clip_and_leaves_the_input_alone(backend):
    cfg = LAYOUTS["separate"]
    clip = mirror_clip(cfg)
    cond = clip.cond_stage_model
    original = cond.qwen3vl_32b.transformer.model
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    want = cond.qwen3vl_32b.encode(ids)
    with coordinator(4, backend) as coord:
        new = tensor_parallel_clip(clip, coord)
        assert new is not clip and new.cond_stage_model is not cond
        assert new.patcher.model is new.cond_stage_model and clip.patcher.model is cond
        new_te = new.cond_stage_model.qwen3vl_32b
        assert isinstance(new_te.transformer.model, TensorParallelDecoder)
        assert new_te.transformer.visual is cond.qwen3vl_32b.transformer.visual  # shared, not copied
        assert rel_err(new_te.encode(ids), want) <= FP32_REL_TOL
    # The input CLIP still runs its single-device encoder, unchanged.
    assert cond.qwen3vl_32b.transformer.model is original
    assert clip.cond_stage_model.qwen3vl_32b is not new_te
    assert torch.equal(cond.qwen3vl_32b.encode(ids), want)


def test_check_tensor_parallel_clip_alone():
    clip = mirror_clip(LAYOUTS["separate"])
    for world in (1, 2, 4, 8):
        check_tensor_parallel_clip(clip, world)
    with pytest.raises(TensorParallelError, match="8 query heads over W=3"):
        check_tensor_parallel_clip(clip, 3)
    assert isinstance(clip.cond_stage_model.qwen3vl_32b.transformer.model.layers[0].mlp.down_proj, nn.Linear)


def test_tensor_parallel_clip_fails_before_copying():
    lora = {"qwen3vl_32b.transformer.model.layers.1.mlp.down_proj.weight": [("lora",)]}
    with coordinator(2) as two, coordinator(3) as three:
        for clip, coord, match in [(mirror_clip(LAYOUTS["separate"], patches=lora), two, "CLIP LoRA"),
                                   (mirror_clip(LAYOUTS["separate"]), three, "W=3")]:
            clones = MirrorCLIP.clones
            with pytest.raises(TensorParallelError, match=match):
                tensor_parallel_clip(clip, coord)
            assert MirrorCLIP.clones == clones
