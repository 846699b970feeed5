"""Our per-card DiT replicas under upstream's model management (roles/model_management.py):
two prompts in a row through `comfy.sample.sample` with an eviction between them.

ComfyUI loads the replicas with the MODEL (they are among its additional models, as upstream's
multi-GPU clones are), so they appear in `current_loaded_models` on their cards;
`unload_all_models` and `free_memory` (what `load_models_gpu` calls when another model needs a
card) evict them, dropping only the device copy while the base stays in RAM; the next prompt
loads them again reading 0 bytes from disk and gives the same result bit for bit. Ranks are CPU
devices here, so a replica's "device copy" is the base view itself: what is measured is the
bookkeeping (registered, evicted, restored, bytes read), not freed card memory.
"""

from __future__ import annotations

import pytest
import torch

from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, tiny_state_dict
from tests.upstream.test_sampling import node_dit, sample
from tests.upstream import test_text_encoder
from tests.upstream.test_text_encoder import encode

tiny_clip = test_text_encoder.tiny_clip  # the text encoder cases' fixture, used here too


@pytest.fixture(scope="module")
def h3_file(upstream, tmp_path_factory):
    import safetensors.torch
    path = tmp_path_factory.mktemp("models") / "tiny_minimax_h3.safetensors"
    safetensors.torch.save_file(tiny_state_dict(upstream), str(path))
    return path


@pytest.fixture
def hook(upstream):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")


def _registered(patchers):
    import comfy.model_management as mm
    loaded = [lm.model for lm in mm.current_loaded_models]
    return [any(p is m for m in loaded) for p in patchers]


@pytest.mark.parametrize("world", [2, 3])
def test_two_prompts_with_an_eviction_between_read_nothing_from_disk(upstream, hook, h3_file, world):
    import comfy.model_management as mm
    import comfy.sd
    from comfy.multidevice.roles.model_management import ADDITIONAL_MODELS_KEY
    from comfy.multidevice.weights.checkpoint import shared_checkpoint_sources, total_bytes_read

    model = comfy.sd.load_diffusion_model(str(h3_file))
    reference = sample(model)
    coord, parallel = node_dit(model, world)
    replicas = parallel.multinpu_dit_replicas
    ours = parallel.get_additional_models_with_key(ADDITIONAL_MODELS_KEY)
    assert len(ours) == world - 1 and replicas.uses_base()
    assert [p.load_device for p in ours] == coord.devices[1:]
    with coord:
        first = sample(parallel)
        assert _registered(ours) == [True] * (world - 1)       # loaded by ComfyUI with the MODEL
        assert all(replicas.resident(i) for i in range(world - 1))
        assert all(p.loaded_size() == p.model_size() > 0 for p in ours)

        mm.unload_all_models()                                 # e.g. the UI's "unload models"
        assert _registered(ours) == [False] * (world - 1)
        assert not any(replicas.resident(i) for i in range(world - 1))
        assert any(key[0] == str(h3_file.resolve()) for key in shared_checkpoint_sources())  # base stays

        before = total_bytes_read()
        second = sample(parallel)
        assert total_bytes_read() == before                    # restored from RAM
        assert _registered(ours) == [True] * (world - 1)
        assert all(torch.equal(a, b) for a, b in zip(first, second))

        # another model needing the card: load_models_gpu frees memory on it like this
        mm.free_memory(1e30, coord.devices[1])
        assert not replicas.resident(0) and _registered(ours)[0] is False
        third = sample(parallel)
        assert total_bytes_read() == before
        assert all(torch.equal(a, b) for a, b in zip(first, third))
    assert rel_diff(first, reference) <= FP32_TOL


def test_a_clone_of_the_model_shares_the_registered_replicas(upstream, hook, h3_file):
    """A later node cloning the MODEL (LoRA loader, sampler set-up) gets the same patchers, so
    ComfyUI sees one loaded copy per card, not clones it would unload and reload in turn."""
    import comfy.sd
    from comfy.multidevice.roles.model_management import ADDITIONAL_MODELS_KEY
    model = comfy.sd.load_diffusion_model(str(h3_file))
    coord, parallel = node_dit(model, 2)
    with coord:
        clone = parallel.clone()
        assert clone.get_additional_models_with_key(ADDITIONAL_MODELS_KEY)[0] is \
            parallel.get_additional_models_with_key(ADDITIONAL_MODELS_KEY)[0]


def test_a_cached_decoder_copy_is_loaded_and_evicted_whole_by_its_patcher(upstream):
    """The patcher of a per-card decoder copy (what the node registers for the video VAE's
    chunked decode): ComfyUI's load/evict calls build and drop the copy, and its sizes follow.
    The card is the meta device here (the copy allocates nothing), so this checks our patcher's
    answers to ComfyUI, not a real card's memory."""
    from comfy.multidevice.roles.model_management import CachedCopy, card_patcher
    from comfy.multidevice.weights.replicas import ReplicaCache
    decoder = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    cache = ReplicaCache(decoder, "decoder")
    patcher = card_patcher(CachedCopy(cache, "meta", "video VAE decoder copy"))
    size = sum(p.nbytes for p in decoder.parameters())
    assert patcher.model_size() == size and patcher.loaded_size() == 0
    assert patcher.current_loaded_device() == torch.device("cpu")
    assert patcher.partially_load(torch.device("meta"), 1e32) == size
    assert cache.holds("meta") and patcher.loaded_size() == size
    assert patcher.current_loaded_device() == torch.device("meta")
    assert patcher.clone() is patcher
    patcher.detach()
    assert not cache.holds("meta") and patcher.loaded_size() == 0
    patcher.partially_load(torch.device("meta"), 1e32)
    assert patcher.partially_unload(torch.device("cpu"), size) == size and not cache.holds("meta")


def test_the_chunked_video_vae_loads_its_copies_through_comfyui_before_decoding(upstream, monkeypatch):
    """The node's chunked video VAE calls load_models_gpu with its copies' patchers before the
    ranks decode; on CPU ranks every card is the merge device, so there are none to load."""
    import comfy.model_management as mm
    from comfy.multidevice.roles.model_management import manage_decoder_copies
    from comfy.multidevice.vae.chunked import ChunkedDecode

    class Decoder(torch.nn.Module):  # only what ChunkedDecode's constructor looks at
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
    monkeypatch.setattr("comfy.multidevice.vae.chunked.H3ChunkInterface", lambda module: None)
    chunked = ChunkedDecode(Decoder(), ["cpu", "meta"], merge_device="cpu")
    patchers = manage_decoder_copies(chunked)
    assert [p.load_device for p in patchers] == [torch.device("meta")]
    loaded = []
    monkeypatch.setattr(mm, "load_models_gpu", lambda models, *a, **k: loaded.append(list(models)))
    chunked.before_decode()
    assert loaded == [patchers]


def test_text_encoder_shards_are_loaded_evicted_and_rebuilt_from_ram(upstream, tiny_clip):
    """The tensor-parallel text encoder's shards on ranks 1..W-1 are loaded through ComfyUI
    before each encode (counted in current_loaded_models), evicted by unload_all_models (their
    memory freed: the shard object is gone) and rebuilt from the kept decoder at the next
    encode, reading nothing from disk; the encodes agree bit for bit."""
    import comfy.model_management as mm
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.roles.apply import _tensor_parallel_text_encoder
    from comfy.multidevice.tp.clip import language_model_of
    from comfy.multidevice.weights.checkpoint import total_bytes_read
    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=60) as coord:
        parallel = _tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        decoder = language_model_of(parallel)
        first = encode(parallel)
        loaded = [lm.model for lm in mm.current_loaded_models]
        ours = [m for m in loaded if getattr(getattr(m, "card_copy", None), "decoder", None) is decoder]
        assert sorted(p.card_copy.rank for p in ours) == [1, 2, 3]
        assert all(p.loaded_size() == p.model_size() > 0 for p in ours)
        mm.unload_all_models()
        assert decoder.shards[0] is not None and all(decoder.shards[r] is None for r in (1, 2, 3))
        before = total_bytes_read()
        second = encode(parallel)
        assert all(s is not None for s in decoder.shards) and total_bytes_read() == before
        assert torch.equal(first, second)


def test_an_eviction_frees_the_replicas_own_copies(upstream, hook, h3_file):
    """The fp32 file loaded as bf16: each replica holds its own bf16 copy of the weights (not
    the base views), so what an eviction drops is measurable: every byte of those copies, while
    the base stays; the next prompt rebuilds them from RAM (0 bytes from disk), bit-identical."""
    import comfy.model_management as mm
    import comfy.sd
    from comfy.multidevice.weights.checkpoint import total_bytes_read
    model = comfy.sd.load_diffusion_model(str(h3_file), model_options={"dtype": torch.bfloat16})
    coord, parallel = node_dit(model, 2)
    replicas = parallel.multinpu_dit_replicas
    with coord:
        first = sample(parallel)
        held = replicas.base_replicas[0].resident_bytes
        # private bf16 copies; weights kept fp32 stay base views on a CPU rank (a card holds all)
        assert 0 < held <= replicas.device_bytes(0)
        mm.unload_all_models()
        assert replicas.base_replicas[0].resident_bytes == 0 and not replicas.resident(0)
        before = total_bytes_read()
        second = sample(parallel)
        assert total_bytes_read() == before and replicas.base_replicas[0].resident_bytes == held
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_sharded_dit_two_prompts_with_an_eviction_between_read_nothing_from_disk(upstream, hook, h3_file,
                                                                                 world, dtype):
    """dit_weights=shard: the shards of cards 1..W-1 are the MODEL's additional models (card 0's
    shard is the MODEL itself), loaded by ComfyUI with it, evicted by unload_all_models and by
    free_memory on their card, and brought back from RAM by the next prompt: 0 bytes from disk,
    latents bit-identical to the first prompt's and to replicate's. Loaded as bf16 the shard
    holds its own copies of its tensors, so the eviction frees a measurable amount."""
    import comfy.model_management as mm
    import comfy.sd
    from comfy.multidevice.roles.model_management import ADDITIONAL_MODELS_KEY
    from comfy.multidevice.weights.checkpoint import shared_checkpoint_sources, total_bytes_read
    from tests.upstream.test_dit_shards import node_dit as node_dit_with

    model = comfy.sd.load_diffusion_model(str(h3_file), model_options={} if dtype is None else {"dtype": dtype})
    coord, replicated = node_dit_with(model, world, "replicate")
    with coord:
        reference = sample(replicated)
    mm.unload_all_models()
    coord, parallel = node_dit_with(model, world, "shard")
    shards = parallel.multinpu_dit_shards
    ours = parallel.get_additional_models_with_key(ADDITIONAL_MODELS_KEY)
    others = range(1, world)
    assert len(ours) == world - 1 and [p.load_device for p in ours] == coord.devices[1:]
    assert [p.model_size() for p in ours] == [shards.card_bytes(r) for r in others]
    with coord:
        first = sample(parallel)
        assert _registered(ours) == [True] * (world - 1)        # loaded by ComfyUI with the MODEL
        assert all(p.loaded_size() == p.model_size() > 0 for p in ours)
        held = [shards.resident_bytes(r) for r in others]
        if dtype is not None:  # private bf16 copies of the card's own tensors
            assert all(0 < h <= shards.card_bytes(r) for h, r in zip(held, others))

        mm.unload_all_models()                                  # e.g. the UI's "unload models"
        assert _registered(ours) == [False] * (world - 1)
        assert not any(shards.replicas[r].resident for r in others)
        assert all(shards.resident_bytes(r) == 0 for r in others)
        assert any(key[0] == str(h3_file.resolve()) for key in shared_checkpoint_sources())  # base stays

        before = total_bytes_read()
        second = sample(parallel)
        assert total_bytes_read() == before                     # restored from RAM
        assert _registered(ours) == [True] * (world - 1)
        assert [shards.resident_bytes(r) for r in others] == held
        assert all(torch.equal(a, b) for a, b in zip(first, second))

        mm.free_memory(1e30, coord.devices[1])                  # another model needing card 1
        assert not shards.replicas[1].resident and _registered(ours)[0] is False
        third = sample(parallel)
        assert total_bytes_read() == before
        assert all(torch.equal(a, b) for a, b in zip(first, third))
        shards.family.close()
    assert all(torch.equal(a, b) for a, b in zip(first, reference))
