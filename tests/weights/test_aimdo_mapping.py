"""The shared base adopts comfy-aimdo's mapping of a file instead of mapping it a second time.

comfy-aimdo cannot initialise here (CPU torch), so the mapping is the STAND-IN of
tests/weights/aimdo_standin.py, which follows upstream's attribute contract; upstream's own
loader builds the state dict over it in tests/upstream/test_aimdo_mapping.py. Every tensor is
compared bit for bit with safetensors' own read of the file.
"""

import ctypes
import gc
import logging
import os
import shutil
import weakref

import pytest
import torch
from safetensors.torch import load_file

import comfy.multidevice.weights.checkpoint as sc
from comfy.multidevice.weights.aimdo_mapping import FILE_SLICE_ATTRIBUTE, MMAP_REFS_ATTRIBUTE, find_loader_mappings
from comfy.multidevice.weights.checkpoint import SharedCheckpoint, clear_shared_checkpoints, total_bytes_read
from comfy.multidevice.weights.read_only import ReadOnlyWeightError, is_read_only
from comfy.multidevice.weights.comfy_replicas import comfy_diffusion_model_replicas
from tests.weights.aimdo_standin import StandInModelMMAP, file_mappings, loader_state_dict
from tests.weights.weight_cases import bit_equal, fake_patcher, sample_tensors, tiny_reference, write

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps (Linux)")


@pytest.fixture
def own_mappings(monkeypatch):
    """Counts the base's own mappings of files (calls of checkpoint._map_read_only)."""
    calls = []
    real = sc._map_read_only

    def spy(handle, path, offset, nbytes):
        calls.append(path)
        return real(handle, path, offset, nbytes)

    monkeypatch.setattr(sc, "_map_read_only", spy)
    return calls


def header_bytes(path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_base_points_into_the_loaders_mapping_and_maps_nothing_itself(tmp_path, own_mappings):
    written = sample_tensors()
    path = write(tmp_path / "m.safetensors", written)
    model_mmap = StandInModelMMAP(path)
    loaded = loader_state_dict(path, model_mmap)
    start, size = model_mmap.get(), os.path.getsize(path)
    regions, before = file_mappings(path), total_bytes_read()

    base = SharedCheckpoint.open(path, loaded=loaded)

    assert base.mapped_by == "comfy-aimdo" and base.mode == "map"
    assert own_mappings == [] and file_mappings(path) == regions   # no second mapping of the file
    assert base.bytes_read == header_bytes(path) == total_bytes_read() - before  # the header only
    reference = load_file(str(path))
    assert set(base) == set(reference)
    for name, t in reference.items():
        assert bit_equal(base[name], t), name
        if t.nbytes:
            assert start <= base[name].data_ptr() < start + size, name        # in the loader's memory
            assert base[name].data_ptr() == loaded[name].data_ptr(), name     # at the loader's address
    with pytest.raises(ReadOnlyWeightError):
        base["f32"].add_(1)
    with pytest.raises(ReadOnlyWeightError):
        base["bf16"][0] = 0
    assert bit_equal(base["f32"], reference["f32"])
    assert not is_read_only(loaded["f32"])   # upstream's own tensors are left as they are
    assert SharedCheckpoint.open(path) is base  # one base per file


def test_base_keeps_the_loaders_mapping_alive_and_then_lets_it_go(tmp_path):
    path = write(tmp_path / "m.safetensors", sample_tensors())
    model_mmap = StandInModelMMAP(path)
    loaded = loader_state_dict(path, model_mmap)
    owner = weakref.ref(model_mmap)
    base = SharedCheckpoint.open(path, loaded=loaded)
    del model_mmap, loaded  # the MODEL drops its weights
    gc.collect()
    assert owner() is not None and base.mapped_by == "comfy-aimdo"
    view = base["f32"]
    del base
    clear_shared_checkpoints()
    gc.collect()
    assert owner() is not None                      # a view alone keeps the mapping
    assert bit_equal(view, load_file(str(path))["f32"])
    del view
    gc.collect()
    assert owner() is None                          # and nothing holds it after the last one


def _shift_offset(path, loaded, model_mmap):
    storage = loaded["f32"].untyped_storage()
    slice_ = getattr(storage, FILE_SLICE_ATTRIBUTE)
    setattr(storage, FILE_SLICE_ATTRIBUTE, slice_._replace(offset=slice_.offset + 4))
    return "records file offset"


def _whole_file_as_data(path, loaded, model_mmap):
    # a loader that took the data section for the whole file: the sizes disagree
    whole = memoryview((ctypes.c_uint8 * os.path.getsize(path)).from_address(model_mmap.get()))
    for t in loaded.values():
        if t.nbytes:
            setattr(t.untyped_storage(), MMAP_REFS_ATTRIBUTE, (model_mmap, whole))
    return "data section has"


def _another_file(path, loaded, model_mmap):
    # the same bytes in another file (a copy): the mapping is not of the file being opened
    return "maps another file"


MISMATCHES = {"offset": _shift_offset, "size": _whole_file_as_data, "other_file": _another_file}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_mapping_that_does_not_match_is_logged_and_the_file_mapped_here(tmp_path, caplog, own_mappings, case):
    path = write(tmp_path / "m.safetensors", sample_tensors())
    mapped = path
    if case == "other_file":
        mapped = tmp_path / "copy.safetensors"
        shutil.copyfile(path, mapped)
    model_mmap = StandInModelMMAP(mapped)
    loaded = loader_state_dict(mapped, model_mmap)
    reason = MISMATCHES[case](path, loaded, model_mmap)
    before = total_bytes_read()
    with caplog.at_level(logging.WARNING, logger=sc.__name__):
        base = SharedCheckpoint.open(path, loaded=loaded)
    assert base.mapped_by is None and own_mappings == [os.path.realpath(path)]
    assert "not adopting comfy-aimdo's mapping" in caplog.text and reason in caplog.text
    assert total_bytes_read() - before == os.path.getsize(path)
    start = model_mmap.get()
    for name, t in load_file(str(path)).items():
        assert bit_equal(base[name], t), name
        assert not start <= base[name].data_ptr() < start + os.path.getsize(mapped), name


def test_pin_mode_and_plain_loaded_tensors_do_not_adopt(tmp_path, own_mappings):
    path = write(tmp_path / "m.safetensors", sample_tensors())
    model_mmap = StandInModelMMAP(path)
    pinned = SharedCheckpoint.open(path, mode="pin", loaded=loader_state_dict(path, model_mmap))
    assert pinned.mapped_by is None and pinned.bytes_read == os.path.getsize(path)  # pin: a private copy
    del pinned
    clear_shared_checkpoints()
    mapped = SharedCheckpoint.open(path, loaded=load_file(str(path)))  # safetensors' own tensors: no aimdo
    assert mapped.mapped_by is None and len(own_mappings) == 1


def test_model_replicas_adopt_the_mapping_the_model_was_loaded_from(tmp_path, own_mappings):
    ref = tiny_reference()
    path = write(tmp_path / "dit.safetensors", ref.state_dict())
    model_mmap = StandInModelMMAP(path)
    model = tiny_reference(seed=1)
    model.load_state_dict(loader_state_dict(path, model_mmap), assign=True)  # as upstream's dynamic loader
    before = total_bytes_read()
    family = comfy_diffusion_model_replicas(fake_patcher(model, path), ["cpu", "cpu"], load=True)
    assert family.base.mapped_by == "comfy-aimdo" and own_mappings == []
    assert total_bytes_read() - before == header_bytes(path)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    for replica in family:
        assert torch.equal(replica.module(x), ref(x))
        assert replica.module.embed.weight.data_ptr() == model.embed.weight.data_ptr()  # zero-copy


def test_a_wrapper_subclass_is_followed_to_its_inner_tensors(tmp_path):
    # upstream's QuantizedTensor keeps its bytes in inner tensors (torch's __tensor_flatten__);
    # torch's own two-tensor test subclass has the same protocol
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    path = write(tmp_path / "m.safetensors", sample_tensors())
    model_mmap = StandInModelMMAP(path)
    loaded = loader_state_dict(path, model_mmap)
    wrapped = two_tensor.TwoTensor(loaded["f32"], loaded["f32"].clone())  # one inner tensor in the mapping
    (mapping,) = find_loader_mappings([wrapped, torch.ones(3)])
    assert mapping.owner is model_mmap and [s.address for s in mapping.slices] == [loaded["f32"].data_ptr()]
    assert SharedCheckpoint.open(path, loaded={"w": wrapped}).mapped_by == "comfy-aimdo"
