"""Upstream's own dynamic-VRAM loader (`comfy.utils.load_safetensors`) builds the state dict,
and the shared base adopts its mapping of the file instead of mapping it again.

comfy-aimdo's C library does not initialise beside this CPU torch, so only
`comfy_aimdo.model_mmap.ModelMMAP` is replaced, by the STAND-IN of tests/weights/aimdo_standin.py
(a read-only Python mmap of the whole file with the same methods); everything else is
upstream's code. The node's DiT role on 2 CPU ranks samples like one card (fp32, 1e-5 of
max |reference|, as in test_h3_dit.py), for an fp32 file and one with fp8 block linears.
"""

from __future__ import annotations

import os

import pytest
import safetensors.torch
import torch

import comfy.multidevice.weights.checkpoint as sc
from comfy.multidevice.weights.aimdo_mapping import MMAP_REFS_ATTRIBUTE
from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, tiny_state_dict
from tests.upstream.test_sampling import node_dit, sample
from tests.weights.aimdo_standin import StandInModelMMAP, file_mappings


@pytest.fixture
def aimdo_loader(upstream, monkeypatch):
    """Upstream's load_safetensors with the stand-in ModelMMAP; skips where either is missing."""
    import comfy.utils
    if not hasattr(comfy.utils, "load_safetensors"):
        pytest.skip("this ComfyUI has no comfy.utils.load_safetensors (no comfy-aimdo loading)")
    try:
        import comfy_aimdo.model_mmap
    except Exception as exc:  # absent, or fails to import beside this torch
        pytest.skip(f"comfy_aimdo.model_mmap does not import here ({type(exc).__name__}: {exc})")
    monkeypatch.setattr(comfy_aimdo.model_mmap, "ModelMMAP", StandInModelMMAP)
    sc.clear_shared_checkpoints()
    yield comfy.utils.load_safetensors
    sc.clear_shared_checkpoints()


@pytest.fixture
def own_mappings(monkeypatch):
    calls = []
    real = sc._map_read_only
    monkeypatch.setattr(sc, "_map_read_only", lambda *args: calls.append(args[1]) or real(*args))
    return calls


@pytest.fixture(params=["fp32", "float8_e4m3fn"])
def h3_file(upstream, tmp_path, request):
    """A tiny H3 file: fp32, or with its block linears quantized (as test_quantized_files.py)."""
    from tests.upstream.test_quantized_files import quantized_state_dict
    state = tiny_state_dict(upstream) if request.param == "fp32" else quantized_state_dict(upstream, request.param)
    path = tmp_path / f"tiny_minimax_h3_{request.param}.safetensors"
    safetensors.torch.save_file(state, str(path))
    return path


def test_base_adopts_the_mapping_upstreams_loader_made(aimdo_loader, h3_file, own_mappings):
    made = StandInModelMMAP.made
    loaded, _metadata = aimdo_loader(str(h3_file))
    assert StandInModelMMAP.made == made + 1  # upstream's loader mapped the file through the stand-in
    owner = getattr(next(iter(loaded.values())).untyped_storage(), MMAP_REFS_ATTRIBUTE)[0]
    regions, before = file_mappings(h3_file), sc.total_bytes_read()
    base = sc.SharedCheckpoint.open(h3_file, loaded=loaded)
    assert base.mapped_by == "comfy-aimdo" and own_mappings == [] and file_mappings(h3_file) == regions
    assert sc.total_bytes_read() - before == base.bytes_read < os.path.getsize(h3_file) // 10  # the header
    start, size = owner.get(), os.path.getsize(h3_file)
    reference = safetensors.torch.load_file(str(h3_file))
    assert set(base) == set(reference)
    for name, t in reference.items():
        assert torch.equal(base[name], t) and base[name].dtype == t.dtype, name
        assert start <= base[name].data_ptr() < start + size and base[name].data_ptr() == loaded[name].data_ptr(), name


def test_node_dit_role_from_a_model_loaded_by_aimdo_samples_like_one_card(upstream, aimdo_loader, h3_file,
                                                                          own_mappings):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    import comfy.sd
    with torch.inference_mode():  # as ComfyUI runs a prompt's nodes, loaders included
        model = comfy.sd.load_diffusion_model(str(h3_file))   # records the file for the shared base
        loaded, _ = aimdo_loader(str(h3_file))
        # the dynamic-VRAM loader's step: upstream's load_model_weights with assign=True
        model.model.load_model_weights(loaded, "", assign=True)
    weight = model.model.diffusion_model.blocks[0].attn.qkv_proj.weight
    stored = weight._qdata if type(weight).__name__ == "QuantizedTensor" else weight
    assert (type(weight).__name__ == "QuantizedTensor") == ("float8" in h3_file.name)
    assert getattr(stored.untyped_storage(), MMAP_REFS_ATTRIBUTE, None) is not None, \
        "the MODEL's weights do not lie in the loader's mapping"
    reference = sample(model)
    coord, parallel = node_dit(model, 2)
    with coord:
        out = sample(parallel)
        replicas = parallel.multinpu_dit_replicas
    assert rel_diff(out, reference) <= FP32_TOL
    assert replicas.uses_base(), replicas.base_problem  # built from the shared base, not copied
    assert replicas.base_replicas.base.mapped_by == "comfy-aimdo" and own_mappings == []
