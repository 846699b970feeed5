"""A LoRA through upstream's own `comfy.sd.load_lora_for_models`, applied before the node's DiT
role and after it, under sequence parallel against the same LoRA on one card (fp32, 1e-5 of
max |reference|). After the node, the patches reach the replicas (roles/dit.py)."""

from __future__ import annotations

import pytest
import torch

from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, TINY
from tests.upstream.test_sampling import node_dit, sample

RANK = 2
TARGETS = [f"blocks.{i}.{name}" for i in range(TINY["num_layers"])
           for name in ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")]


@pytest.fixture(scope="module")
def lora(patcher):
    """A rank-2 LoRA on every block's linears, in the generic `<key>.lora_up/down.weight` form."""
    g = torch.Generator().manual_seed(11)
    weights = dict(patcher.model.diffusion_model.state_dict())
    out = {}
    for target in TARGETS:
        rows, cols = weights[f"{target}.weight"].shape
        out[f"diffusion_model.{target}.lora_up.weight"] = torch.randn(rows, RANK, generator=g) * 0.3
        out[f"diffusion_model.{target}.lora_down.weight"] = torch.randn(RANK, cols, generator=g) * 0.3
    return out


def with_lora(model, lora):
    import comfy.sd
    patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
    return patched


@pytest.fixture(scope="module")
def reference(upstream, patcher, lora):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    out = sample(with_lora(patcher, lora))
    assert rel_diff(out, sample(patcher)) > 1e-3  # the LoRA acts
    return out


def test_lora_before_the_node(reference, patcher, lora):
    coord, parallel = node_dit(with_lora(patcher, lora), 4)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL


def test_lora_after_the_node(reference, patcher, lora):
    coord, parallel = node_dit(patcher, 4)
    with coord:
        out = sample(with_lora(parallel, lora))
    assert rel_diff(out, reference) <= FP32_TOL
