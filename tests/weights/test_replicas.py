"""Per-rank replicas from the shared base (weights/replicas.py): hot caches, patches, offload,
and the ComfyUI MODEL helper.

Replicas are compared with the tensors written to the file (bit-exact: building a replica
copies or casts, it computes nothing) and with a reference module loaded the ordinary way.
"""

import os
import sys
import types

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.weights.replicas import RankReplica, RankReplicas
from comfy.multidevice.weights.comfy_replicas import comfy_diffusion_model_replicas
from comfy.multidevice.weights.offload import offload_components, release_cached_device_memory
from comfy.multidevice.weights.read_only import is_read_only
from comfy.multidevice.weights.checkpoint import (SharedCheckpoint, total_bytes_read)
from tests.weights.weight_cases import (THREAD_LIMIT_S, TinyNet, bit_equal, fake_patcher, sample_tensors, tiny_reference, write)


# ----------------------------------------------------------------------------- hot caches

def test_four_rank_replicas_and_three_reload_cycles_read_the_file_once(tmp_path):
    ref = tiny_reference()
    path = write(tmp_path / "tiny.safetensors", ref.state_dict())
    file_size = os.path.getsize(path)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    want = ref.double()(x.double())   # replicas are built in float64: real copies, not views
    with torch.device("meta"):
        template = TinyNet()
    template.offset = torch.arange(8.0)  # non-persistent buffers carry no checkpoint values

    before = total_bytes_read()

    def build(rank, comm):
        base = SharedCheckpoint.open(path)   # every rank opens concurrently: one read
        return RankReplica(base, comm.device, rank=rank, template=template, dtype=torch.float64).load()

    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=THREAD_LIMIT_S) as coord:
        replicas = coord.run(build)
        assert len({id(r.base) for r in replicas}) == 1
        for cycle in range(4):
            for r in replicas:
                assert r.resident and r.resident_bytes > 0
                out = r.module(x.double())
                assert torch.equal(out, want), f"cycle {cycle} rank {r.rank}"
                for name, t in ref.state_dict().items():
                    assert torch.equal(r.state_dict()[name], t.double()), name
            if cycle == 3:
                break
            assert sum(r.unload() for r in replicas) > 0
            for r in replicas:
                assert not r.resident and r.resident_bytes == 0
                assert is_read_only(r.module.embed.weight)      # back on the shared base
            coord.run(lambda rank, comm: replicas[rank].load() and None)
    assert total_bytes_read() - before == file_size


def test_cpu_replicas_in_the_stored_dtype_are_zero_copy_views(tmp_path):
    tensors = sample_tensors()
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", tensors))
    family = RankReplicas(ckpt, ["cpu"] * 4)
    for replica in family:
        assert replica.resident_bytes == 0
        for name, want in tensors.items():
            t = replica.state_dict()[name]
            assert is_read_only(t) and bit_equal(t, want)
            assert t.data_ptr() == ckpt[name].data_ptr()
    assert offload_components(family) == 0


def test_replica_with_prefix_and_tied_weights(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4, bias=False)
            self.b = torch.nn.Linear(4, 4, bias=False)
            self.b.weight = self.a.weight

    torch.manual_seed(1)
    model = Tied()
    path = write(tmp_path / "full.safetensors", {"model.diffusion_model.a.weight": model.a.weight.detach(),
                                                  "text.weight": torch.ones(2)})
    ckpt = SharedCheckpoint.open(path)
    replica = RankReplica(ckpt, "cpu", template=model, prefix="model.diffusion_model.",
                          dtype=torch.float64).load()
    assert replica.module.a.weight is replica.module.b.weight
    assert torch.equal(replica.module.b.weight, model.a.weight.double())


def test_replica_errors_name_the_tensor(tmp_path):
    ref = tiny_reference()
    sd = ref.state_dict()
    missing = dict(sd)
    del missing["norm.bias"]
    with pytest.raises(ValueError, match="norm.bias"):
        RankReplica(SharedCheckpoint.open(write(tmp_path / "a.safetensors", missing)), "cpu", template=ref)
    wrong = dict(sd, **{"out.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"'out.weight' has shape \(3, 3\) but the model expects \(8, 16\)"):
        RankReplica(SharedCheckpoint.open(write(tmp_path / "b.safetensors", wrong)), "cpu", template=ref)


def test_patches_reach_every_replica_and_survive_reload(tmp_path):
    ref = tiny_reference()
    path = write(tmp_path / "m.safetensors", {k: v.bfloat16() if v.dim() == 2 else v
                                              for k, v in ref.state_dict().items()})
    ckpt = SharedCheckpoint.open(path)
    written = {k: ckpt[k].clone() for k in ckpt}
    family = RankReplicas(ckpt, ["cpu"] * 4, ref)
    gen = torch.Generator().manual_seed(3)
    deltas = {"embed.weight": torch.randn(16, 8, generator=gen) * 0.01,
              "norm.bias": torch.randn(16, generator=gen)}
    strength = 0.75
    before = total_bytes_read()
    with pytest.raises(ValueError, match="unknown weight"):
        family.add_patches({"nope.weight": torch.zeros(1), **deltas})
    with pytest.raises(ValueError, match="shape"):
        family.add_patches({"embed.weight": torch.zeros(8, 16)})
    assert family.patches.names() == []        # a refused patch changes nothing
    assert sorted(family.add_patches(deltas, strength)) == sorted(deltas)
    expected = {k: (written[k].float() + strength * d).to(written[k].dtype) for k, d in deltas.items()}
    x = torch.randn(2, 8, generator=gen)
    for cycle in range(3):
        outs = []
        for replica in family:
            sd = replica.state_dict()
            for name, want in expected.items():
                assert bit_equal(sd[name], want), (cycle, replica.rank, name)
            assert is_read_only(sd["out.weight"])        # unpatched CPU weights stay zero-copy
            outs.append(_forward_float(replica.module, x))
        assert all(torch.equal(o, outs[0]) for o in outs)   # identical on every rank
        offload_components(family)
        family.load()
    for name, t in written.items():
        assert bit_equal(ckpt[name], t), name             # the base never changes
    assert total_bytes_read() == before                   # patches and reloads read nothing


def _forward_float(module, x):
    # bf16 weights: run a float copy of the replica's weights through the reference module.
    ref = TinyNet()
    ref.load_state_dict({k: v.float() for k, v in module.state_dict().items()})
    return ref(x)


def test_patches_added_while_unloaded_apply_on_next_load(tmp_path):
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", {"w": torch.ones(3)}))
    family = RankReplicas(ckpt, ["cpu", "cpu"], load=False)
    family.add_patches({"w": torch.full((3,), 2.0)})
    assert all(torch.equal(r.state_dict()["w"], torch.ones(3)) for r in family)  # not resident yet
    family.load()
    assert all(torch.equal(r.state_dict()["w"], torch.full((3,), 3.0)) for r in family)


def test_release_cached_device_memory_uses_the_allocators_present(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(empty_cache=lambda: calls.append("npu")),
                        raising=False)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))  # what registers torch.npu
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("cuda"))
    assert release_cached_device_memory(["npu", "cpu", "cuda", "npu"]) == ["cuda", "npu"]
    assert calls == ["cuda", "npu"]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert release_cached_device_memory(["cuda"]) == []    # never initialize CUDA just to empty it


def test_offload_components_unloads_every_family(tmp_path):
    ckpt = SharedCheckpoint.open(write(tmp_path / "m.safetensors", {"a": torch.ones(4), "b": torch.ones(2)}))
    dit = RankReplicas(ckpt, ["cpu"] * 2, dtype=torch.float64)
    text = RankReplicas(ckpt, ["cpu"] * 2, names=["b"], dtype=torch.float16)
    resident = sum(r.resident_bytes for r in (*dit, *text))
    assert resident == 2 * (4 * 8 + 2 * 8) + 2 * 2 * 2
    assert offload_components(dit, text) == resident
    assert not any(r.resident for r in (*dit, *text))
    with pytest.raises(ValueError, match="RankReplica"):
        offload_components(torch.nn.Linear(2, 2))


# ----------------------------------------------------------------------------- ComfyUI helper

def _fake_comfy_lora(monkeypatch):
    """Stand-in for comfy.lora with ComfyUI's calculate_weight contract for 'diff' patches."""
    def calculate_weight(patches, weight, key):
        for strength, value, strength_model, *_ in patches:
            kind, (delta,) = value
            assert kind == "diff"
            weight = weight * strength_model + strength * delta.to(weight)
        return weight

    fake = types.ModuleType("comfy.lora")
    fake.calculate_weight = calculate_weight
    import comfy
    monkeypatch.setitem(sys.modules, "comfy.lora", fake)
    monkeypatch.setattr(comfy, "lora", fake, raising=False)


def test_comfy_replicas_share_the_base_and_apply_model_patches(tmp_path, monkeypatch):
    _fake_comfy_lora(monkeypatch)
    ref = tiny_reference()
    path = write(tmp_path / "dit.safetensors", {"model.diffusion_model." + k: v
                                                for k, v in ref.state_dict().items()})
    delta = torch.randn(16, 8, generator=torch.Generator().manual_seed(9))
    patcher = fake_patcher(ref, path, {"diffusion_model.embed.weight": [(0.5, ("diff", (delta,)), 1.0, None, None)],
                                        "text_encoder.unrelated": [(1.0, ("diff", (delta,)), 1.0, None, None)]})
    before = total_bytes_read()
    first = comfy_diffusion_model_replicas(patcher, ["cpu"] * 3, load=True)
    second = comfy_diffusion_model_replicas(patcher, ["cpu"], load=True)   # reuses the base
    assert total_bytes_read() - before == os.path.getsize(path)
    want = ref.embed.weight.detach() + 0.5 * delta
    for replica in (*first, *second):
        assert replica.module is not ref and isinstance(replica.module, TinyNet)
        assert torch.equal(replica.module.embed.weight, want)
        assert torch.equal(replica.module.out.weight, ref.out.weight) and is_read_only(replica.module.out.weight)
    assert torch.equal(ref.embed.weight, SharedCheckpoint.open(path)["model.diffusion_model.embed.weight"])


def test_comfy_replicas_from_loaded_weights_read_nothing(monkeypatch):
    ref = tiny_reference()
    before = total_bytes_read()
    family = comfy_diffusion_model_replicas(fake_patcher(ref), ["cpu", "cpu"], load=True)
    assert total_bytes_read() == before
    x = torch.randn(2, 8)
    for replica in family:
        assert torch.equal(replica.module(x), ref(x))
        assert replica.module.embed.weight.data_ptr() == ref.embed.weight.data_ptr()   # zero-copy
    with pytest.raises(ValueError, match="ModelPatcher"):
        comfy_diffusion_model_replicas(object(), ["cpu"])


