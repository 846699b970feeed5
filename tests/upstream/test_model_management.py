"""Our per-card DiT replicas under upstream's model management (roles/model_management.py):
two prompts in a row through `comfy.sample.sample` with an eviction between them.

ComfyUI loads the replicas with the MODEL (they are among its additional models, as upstream's
multi-GPU clones are), so they appear in `current_loaded_models` on their cards;
`unload_all_models` and `free_memory` (what `load_models_gpu` calls when another model needs a
card) evict them, dropping only the device copy while the base stays in RAM; the next prompt
loads them again reading 0 bytes from disk and gives the same result bit for bit. Ranks are CPU
devices here, so a replica's "device copy" is the base view itself: what is measured is the
bookkeeping (registered, evicted, restored, bytes read), not freed card memory.

The text encoder's tensor-parallel shards (rank 0's included) come in with the CLIP's own load
and are evicted and rebuilt the same way; the video VAE's merge card decodes with the VAE's own
weights, which its patcher counts.
"""

from __future__ import annotations

import pytest
import torch

from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, tiny_state_dict
from tests.upstream.test_sampling import node_dit, sample
from tests.upstream import test_text_encoder
from tests.upstream.test_text_encoder import encode
from tests.upstream import test_video_vae
from tests.upstream.test_video_vae import parallel_vae

tiny_clip = test_text_encoder.tiny_clip  # the text encoder cases' fixture, used here too
tiny_vae = test_video_vae.tiny_vae        # and the video VAE cases'


@pytest.fixture(scope="module")
def h3_file(upstream, tmp_path_factory):
    import safetensors.torch
    path = tmp_path_factory.mktemp("models") / "tiny_minimax_h3.safetensors"
    safetensors.torch.save_file(tiny_state_dict(upstream), str(path))
    return path


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
    from comfy.multidevice.roles.model_management import cached_copy, card_patcher
    from comfy.multidevice.weights.module_copies import ReplicaCache
    decoder = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    cache = ReplicaCache(decoder, "decoder")
    patcher = card_patcher(cached_copy(cache, "meta", "video VAE decoder copy"))
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


def _storages(module):
    return {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}


@pytest.fixture
def loads_with_model_patches(upstream):
    import inspect
    import comfy.model_management as mm
    if "model_patches_models" not in inspect.getsource(mm.load_models_gpu):
        pytest.skip("this ComfyUI's load_models_gpu does not load a patcher's model patches with it "
                    "(the text encoder shards then come in before each forward instead)")


def _our_shards(decoder):
    import comfy.model_management as mm
    return {p.card_copy.index: (lm, p) for lm in mm.current_loaded_models if (p := lm.model) is not None
            and getattr(getattr(p, "card_copy", None), "owner", None) is decoder}


@pytest.mark.parametrize("world", [2, 4])
def test_every_text_encoder_shard_rank_0_included_comes_with_the_clips_own_load(
        upstream, tiny_clip, loads_with_model_patches, monkeypatch, world):
    """Rank 0's shard is memory of its own on card 0, beside what the CLIP's patcher counts
    there (no storage in common), so ComfyUI must count it: after an encode every shard, rank
    0's included, is in current_loaded_models on its card with its real size, and card 0's
    accounting is the CLIP's loaded size plus rank 0's shard. They came in the CLIP's own
    load_models_gpu call (the only call of the encode), so making room for them could not
    evict the CLIP. Ranks are CPU devices here: what is checked is the accounting, by object."""
    import comfy.model_management as mm
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.roles.apply import tensor_parallel_text_encoder
    from comfy.multidevice.tp.clip import language_model_of
    from comfy.multidevice.tensor_bytes import storage_bytes
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
        parallel = tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        decoder = language_model_of(parallel)
        calls, real = [], mm.load_models_gpu
        monkeypatch.setattr(mm, "load_models_gpu", lambda models, *a, **k: calls.append(list(models)) or real(models, *a, **k))
        encode(parallel)
        assert len(calls) == 1 and calls[0][0] is parallel.patcher  # the CLIP's own, nothing else
        ours = _our_shards(decoder)
        assert sorted(ours) == list(range(world))
        assert parallel.patcher.model_patches_models() == [ours[r][1] for r in range(world)]
        assert parallel.clone().patcher.model_patches_models() == parallel.patcher.model_patches_models()
        for rank, (loaded, patcher) in ours.items():
            assert loaded.device == coord.devices[rank]
            assert patcher.loaded_size() == storage_bytes(decoder.shards[rank]) > 0
        clip_loaded = next(lm for lm in mm.current_loaded_models if lm.model is parallel.patcher)
        assert not _storages(decoder.shards[0]) & _storages(parallel.patcher.model)  # extra memory
        card_0 = clip_loaded.model_loaded_memory() + ours[0][0].model_loaded_memory()
        assert card_0 == parallel.patcher.loaded_size() + storage_bytes(decoder.shards[0])


def test_text_encoder_shards_are_evicted_and_rebuilt_from_ram(upstream, tiny_clip):
    """unload_all_models and free_memory on card 0 evict every shard, rank 0's included (its
    memory freed: the shard object is gone); the next encode brings them back with the CLIP,
    sliced again from the kept single-card decoder in RAM (no file is read), bit-identical."""
    import comfy.model_management as mm
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.roles.apply import tensor_parallel_text_encoder
    from comfy.multidevice.tp.clip import language_model_of
    from comfy.multidevice.weights.checkpoint import total_bytes_read
    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=60) as coord:
        parallel = tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        decoder = language_model_of(parallel)
        first = encode(parallel)
        mm.unload_all_models()
        assert _our_shards(decoder) == {} and all(s is None for s in decoder.shards)
        before = total_bytes_read()
        second = encode(parallel)
        assert sorted(_our_shards(decoder)) == [0, 1, 2, 3] and all(s is not None for s in decoder.shards)
        assert total_bytes_read() == before and torch.equal(first, second)

        mm.free_memory(1e30, coord.devices[0])  # another model needing card 0
        assert 0 not in _our_shards(decoder) and decoder.shards[0] is None
        third = encode(parallel)
        assert decoder.shards[0] is not None and torch.equal(first, third)


def test_an_encode_that_skips_the_clips_load_brings_the_shards_in_with_the_running_clip(
        upstream, tiny_clip, monkeypatch):
    """A caller that encodes without CLIP.load_model (straight through cond_stage_model) while
    a shard is evicted: the decoder loads the shards through ComfyUI before it runs, in one call
    with the loaded CLIP patcher that runs it (so that call cannot evict it), bit-identical."""
    import comfy.model_management as mm
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.roles.apply import tensor_parallel_text_encoder
    from comfy.multidevice.tp.clip import language_model_of
    from tests.upstream.test_text_encoder import PROMPT
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=60) as coord:
        parallel = tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        decoder = language_model_of(parallel)
        tokens = parallel.tokenize(PROMPT)
        with torch.inference_mode():
            parallel.load_model(tokens)
            first = parallel.cond_stage_model.encode_token_weights(tokens)[0]
        _our_shards(decoder)[0][1].detach()  # evicted, still listed
        assert decoder.shards[0] is None
        calls, real = [], mm.load_models_gpu
        monkeypatch.setattr(mm, "load_models_gpu", lambda models, *a, **k: calls.append(list(models)) or real(models, *a, **k))
        with torch.inference_mode():
            second = parallel.cond_stage_model.encode_token_weights(tokens)[0]
        ours = [p for _, (_, p) in sorted(_our_shards(decoder).items())]
        assert len(calls) == 1 and calls[0] == [parallel.patcher] + ours
        assert decoder.shards[0] is not None and torch.equal(first, second)


def test_making_room_for_a_call_never_evicts_a_model_of_that_call(upstream, monkeypatch):
    """Why the shards ride on the CLIP's own load: upstream's load_models_gpu takes the models
    of its call out of the loaded list before it makes room, so a card with no free memory
    gives up the other models, never one of that call; a separate call for our shard alone (as
    rank 0's used to be, mid-encode) evicts the CLIP. Stand-ins on the meta device (nothing
    allocated) with ComfyUI told the card is full; the bookkeeping is upstream's own."""
    import comfy.model_management as mm
    from comfy.multidevice.roles.model_management import cached_copy, card_patcher
    from comfy.multidevice.weights.module_copies import ReplicaCache

    def stand_in(what, width):
        return card_patcher(cached_copy(ReplicaCache(torch.nn.Linear(width, width)), "meta", what))

    other, clip, shard = stand_in("another model", 8), stand_in("the CLIP", 6), stand_in("rank 0 shard", 4)
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(mm, "get_free_memory", lambda *a, **k: (free["bytes"],) * 2 if k.get("torch_free_too") else free["bytes"])
    mm.load_models_gpu([other])
    mm.load_models_gpu([clip])
    free["bytes"] = 0  # the card is full from here on
    try:
        mm.load_models_gpu([clip, shard])  # one call: the CLIP and its shard
        assert _registered([other, clip, shard]) == [False, True, True]
        assert clip.loaded_size() > 0 and shard.loaded_size() > 0
        mm.free_memory(1e30, torch.device("meta"))
        mm.load_models_gpu([clip])
        mm.load_models_gpu([shard])  # a call of its own while the CLIP is loaded
        assert _registered([clip, shard]) == [False, True] and clip.loaded_size() == 0
    finally:
        mm.free_memory(1e30, torch.device("meta"))


def test_the_merge_card_decodes_with_the_vaes_own_weights_counted_by_its_patcher(upstream, tiny_vae, monkeypatch):
    """The video VAE's merge card holds no decoder copy of ours: the merge rank decodes with the
    very module upstream's VAE.decode loaded through the VAE's patcher, so ComfyUI's accounting
    of that card (the patcher's loaded size) is every weight the merge rank decoded with. Ranks
    are CPU devices here (all of them the merge device), so no copy is asked for at all."""
    import comfy.model_management as mm
    from comfy.multidevice.tensor_bytes import storage_bytes
    from comfy.multidevice.vae.chunked import H3ChunkInterface
    coord, parallel = parallel_vae(tiny_vae, 2)
    chunked = parallel.first_stage_model.parallel_decode
    used, asked = [], []
    real_decode, real_get = H3ChunkInterface.decode_window, chunked.replicas.get
    monkeypatch.setattr(H3ChunkInterface, "decode_window",
                        staticmethod(lambda module, z: used.append(module) or real_decode(module, z)))
    monkeypatch.setattr(chunked.replicas, "get", lambda device: asked.append(device) or real_get(device))
    z = torch.randn(1, 24, 12, 2, 3, generator=torch.Generator().manual_seed(3))
    with coord, torch.inference_mode():
        out = parallel.decode(z)
        reference = tiny_vae.decode(z)
    assert torch.equal(out, reference) and len(used) == 2 and asked == []
    assert all(m is parallel.patcher.model for m in used)  # the VAE patcher's own module
    loaded = next(lm for lm in mm.current_loaded_models if lm.model is parallel.patcher)
    # upstream counts state-dict tensors: all but the non-persistent buffers (a few small tables)
    persistent = used[0].state_dict()
    tables = sum(b.nbytes for n, b in used[0].named_buffers() if n not in persistent)
    assert loaded.device == coord.devices[0]
    assert loaded.model_loaded_memory() == storage_bytes(used[0]) - tables > 0 and tables < 1024


def test_stage_switching_two_prompts_in_a_row_through_model_management(upstream, hook, h3_file, tiny_clip,
                                                                        tiny_vae):
    """One server, two prompts in a row, each: text encoder (tensor parallel on both cards) ->
    DiT (sequence parallel, a replica on card 1) -> video VAE (chunks on both cards), all on the
    node's one coordinator. Between stages every card is made room on as load_models_gpu does
    when the cards are full (free_memory), which evicts the stage before; each stage's copies
    come back through ComfyUI from RAM. The second prompt reads 0 bytes from disk and repeats
    the first bit for bit. The stages take the test's own inputs (the tiny encoder's width is
    not the tiny DiT's, nor is its latent the tiny VAE's)."""
    import comfy.model_management as mm
    import comfy.sd
    from comfy.multidevice.comm.group import SequenceParallelCoordinator
    from comfy.multidevice.roles.apply import chunked_video_vae, tensor_parallel_text_encoder
    from comfy.multidevice.roles.dit import sequence_parallel_dit
    from comfy.multidevice.roles.model_management import ADDITIONAL_MODELS_KEY
    from comfy.multidevice.tp.clip import language_model_of
    from comfy.multidevice.weights.checkpoint import total_bytes_read
    model = comfy.sd.load_diffusion_model(str(h3_file))
    z = torch.randn(1, 24, 7, 2, 3, generator=torch.Generator().manual_seed(1))
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=60) as coord:
        clip = tensor_parallel_text_encoder(tiny_clip, coord.devices, coord)
        dit = sequence_parallel_dit(model, coord.devices, coord)
        vae = chunked_video_vae(tiny_vae, coord.devices, coord.devices[0], coord)
        decoder, replicas = language_model_of(clip), dit.get_additional_models_with_key(ADDITIONAL_MODELS_KEY)

        def make_room():  # every card full: what load_models_gpu does before the next stage
            for device in dict.fromkeys(coord.devices):
                mm.free_memory(1e30, device)

        def prompt():
            cond = encode(clip)
            assert sorted(_our_shards(decoder)) == [0, 1]
            make_room()
            assert _our_shards(decoder) == {} and all(s is None for s in decoder.shards)
            latents = sample(dit)
            assert _registered(replicas) == [True]
            make_room()
            assert _registered(replicas) == [False] and not dit.multinpu_dit_replicas.resident(0)
            with torch.inference_mode():
                frames = vae.decode(z)
            assert _registered([vae.patcher]) == [True]
            make_room()
            return cond, latents, frames

        first = prompt()
        before = total_bytes_read()
        second = prompt()
        assert total_bytes_read() == before
    assert torch.equal(first[0], second[0]) and torch.equal(first[2], second[2])
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))


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
    latents bit-identical to the first prompt's (the same bytes at the same places) and within
    fp32 rounding of replicate's (test_dit_shards.like_replicate says why). Loaded as bf16 the shard
    holds its own copies of its tensors, so the eviction frees a measurable amount."""
    import comfy.model_management as mm
    import comfy.sd
    from comfy.multidevice.roles.model_management import ADDITIONAL_MODELS_KEY
    from comfy.multidevice.weights.checkpoint import shared_checkpoint_sources, total_bytes_read
    from tests.upstream.test_dit_shards import like_replicate, node_dit as node_dit_with

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
    assert like_replicate(first, reference)


def test_a_stand_in_patcher_is_not_registered_where_comfyui_imports(upstream):
    """In a process that can import ComfyUI (this suite, a script beside a server), a MODEL or
    CLIP whose patcher is a stand-in with the same methods is not ComfyUI's to manage: nothing
    is registered on it (the unit suite's fakes, run after this suite in one process, failed
    here before)."""
    from comfy.multidevice.roles.model_management import (is_managed_by_comfyui, manage_tensor_parallel_shards,
                                                          register_with_model)

    class StandIn:
        def set_additional_models(self, *args):
            raise AssertionError("a stand-in patcher was registered with ComfyUI")
        set_model_patch = set_additional_models

    assert not is_managed_by_comfyui(StandIn())
    assert register_with_model(StandIn(), []) == []
    assert manage_tensor_parallel_shards(type("Clip", (), {"patcher": StandIn()})()) == []
