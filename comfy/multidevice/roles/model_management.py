"""Our per-card copies under ComfyUI's model management.

ComfyUI counts, loads and evicts what its memory manager knows: ModelPatchers, each with a
load device, in `comfy.model_management.current_loaded_models`. Upstream's own multi-GPU
clones become known by being ModelPatchers with their card as load device, listed among the
primary's additional models: `prepare_sampling` loads a MODEL's additional models with it
(`load_models_gpu`), so each clone is registered on its card, `free_memory` (called when
another model needs that card) and `unload_all_models` can evict it, and the next prompt
loads it again.

Ours go the same way, with one difference in what loading means: a `CardCopy` (a DiT replica
on card r, a VAE decoder copy ...) is made resident from the shared base in RAM and evicted by
dropping only its device copy, so a reload reads nothing from disk. `CardPatcher` is the
ModelPatcher that stands for one CardCopy; it is always loaded or evicted whole (the rank needs
every weight on its card), never partially.

ComfyUI is imported lazily: nothing here runs without it, and nothing else needs it.
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

import torch

from comfy.multidevice.tp.clip import language_model_of

log = logging.getLogger(__name__)

ADDITIONAL_MODELS_KEY = "multidevice_card_copies"  # not upstream's "multigpu": its scheduler reads that


class CardCopy:
    """Copy `index` of `owner` (a DiT replica or shard on card r, a VAE decoder copy, a
    text-encoder shard), which ComfyUI may load and evict, answered by the owner's functions:
    `nbytes()` what it holds on its card when resident, `resident()`, `load()` makes it resident
    (from RAM), `unload()` drops the device copy, keeps the base and returns the bytes dropped."""

    def __init__(self, what: str, owner, index, device, nbytes, resident, load, unload):
        self.what, self.owner, self.index, self.device = what, owner, index, device  # what: for the log
        self._nbytes, self._resident, self.load, self.unload = nbytes, resident, load, unload

    @property
    def nbytes(self) -> int:
        return self._nbytes()

    @property
    def resident(self) -> bool:
        return self._resident()


class _Holder(torch.nn.Module):
    """What ComfyUI sees as the patcher's `.model` (it keeps weak references to it and logs its
    class name); the weights themselves belong to the CardCopy."""

    def __init__(self, copy: CardCopy):
        super().__init__()
        self.card_copy = copy

    def extra_repr(self) -> str:
        return f"{self.card_copy.what} on {self.card_copy.device}"


@functools.lru_cache(maxsize=None)
def _card_patcher_class():
    import comfy.model_patcher

    class CardPatcher(comfy.model_patcher.ModelPatcher):
        """A ModelPatcher standing for one CardCopy: loaded and evicted whole, from RAM."""

        def __init__(self, copy: CardCopy):
            super().__init__(_Holder(copy), load_device=torch.device(copy.device),
                             offload_device=torch.device("cpu"), size=copy.nbytes)
            self.card_copy = copy

        def clone(self, *args, **kwargs):
            # A clone of the primary clones its additional models. The copy has one residency,
            # so every clone is this patcher: ComfyUI then sees one loaded model, not several
            # clones of the same weights that it would unload and reload in turn.
            return self

        def is_dynamic(self):
            return False

        def model_size(self):
            return self.card_copy.nbytes

        def loaded_size(self):
            return self.card_copy.nbytes if self.card_copy.resident else 0

        def current_loaded_device(self):
            return self.load_device if self.card_copy.resident else self.offload_device

        def model_dtype(self):
            return None

        def model_patches_to(self, device):
            return None

        def model_patches_models(self):
            return []

        def lowvram_patch_counter(self):
            return 0

        def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
            before = self.loaded_size()
            self.card_copy.load()
            return self.loaded_size() - before

        def patch_model(self, device_to=None, *args, **kwargs):
            self.card_copy.load()
            return self.model

        def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
            return self._evict()

        def unpatch_model(self, device_to=None, unpatch_weights=True, *args, **kwargs):
            self._evict()

        def detach(self, unpatch_all=True, *args, **kwargs):
            # ComfyUI detaches with unpatch_all=False when it re-loads a loaded model (and when
            # a patcher is collected): the weights stay; only a full detach is an eviction.
            if unpatch_all:
                self._evict()
            return self.model

        def _evict(self) -> int:
            size = self.loaded_size()
            if size or self.card_copy.resident:
                dropped = self.card_copy.unload()
                log.info("%s on %s evicted by ComfyUI's model management (%d bytes dropped; the "
                         "base stays in RAM)", self.card_copy.what, self.card_copy.device, dropped)
            return size

    return CardPatcher


def card_patcher(copy: CardCopy):
    """The ModelPatcher that makes `copy` known to ComfyUI's memory manager."""
    return _card_patcher_class()(copy)


def is_managed_by_comfyui(patcher) -> bool:
    """True for upstream's ModelPatcher (subclasses included): what ComfyUI's model management
    loads and evicts. A stand-in with a patcher's interface (a test's, a script's) has no
    manager behind it, even in a process where ComfyUI can be imported; nothing is without
    ComfyUI (tests, the dry run)."""
    try:
        import comfy.model_patcher
    except ImportError:
        return False
    return isinstance(patcher, comfy.model_patcher.ModelPatcher)


def register_with_model(model_patcher, copies: Sequence[CardCopy]) -> list:
    """List `copies` among the MODEL's additional models, as upstream lists its multi-GPU
    clones: ComfyUI loads them with the MODEL at every prompt and may evict them between
    prompts. Returns their patchers (none for a MODEL that ComfyUI does not manage)."""
    if not is_managed_by_comfyui(model_patcher):
        return []
    patchers = [card_patcher(c) for c in copies]
    model_patcher.set_additional_models(ADDITIONAL_MODELS_KEY, patchers)
    return patchers


def cached_copy(cache, device, what: str) -> CardCopy:
    """The copy a ReplicaCache keeps on one device (e.g. a VAE decoder on card r)."""
    device = torch.device(device)
    return CardCopy(what, cache, device, device, lambda: cache.copy_bytes(device),
                    lambda: cache.holds(device), lambda: cache.get(device), lambda: cache.drop(device))


def manage_decoder_copies(decoder, what: str = "video VAE decoder copy") -> list:
    """Make a ChunkedDecode's per-card decoder copies known to ComfyUI: before each decode they
    are loaded through `load_models_gpu` (registered on their cards, room made by evicting
    others), and ComfyUI may evict them between decodes. The merge card has no copy: the merge
    rank decodes with the VAE's own module, counted by the VAE's own patcher, which upstream's
    VAE.decode loads there; this call makes room on the other cards only, so it cannot evict
    that patcher. Returns the patchers."""
    patchers = [card_patcher(cached_copy(decoder.replicas, d, what))
                for d in dict.fromkeys(decoder.devices) if d != decoder.merge_device]
    decoder.before_decode = lambda: load_card_copies(patchers)
    return patchers


def shard_copy(decoder, rank: int) -> CardCopy:
    """Rank `rank`'s tensor-parallel text-encoder shard (one coordinator run rebuilds every
    dropped shard)."""
    return CardCopy("text encoder shard", decoder, rank, decoder.coordinator.devices[rank],
                    lambda: decoder.shard_bytes[rank], lambda: decoder.shards[rank] is not None,
                    decoder.ensure_shards, lambda: decoder.drop_shard(rank))


class LoadedWith:
    """A model patch whose `models()` ComfyUI loads together with the patcher that carries it.

    Upstream's `load_models_gpu` adds every model patch's `models()` to the models of its call
    (`ModelPatcher.model_patches_models`). A call first takes each of its models out of the
    loaded list and only then makes room, so nothing of one call can evict another part of the
    same call: the CLIP's own load (at the start of every encode) brings our shards with it and
    can never evict the CLIP to make room for them. Clones of the patcher share this entry."""

    def __init__(self, patchers: Sequence):
        self.patchers = list(patchers)

    def models(self) -> list:
        return list(self.patchers)


def manage_tensor_parallel_shards(clip) -> list:
    """Make a tensor-parallel CLIP's shards, rank 0's included, known to ComfyUI.

    Every shard is extra memory on its card: rank 0's holds its own copies of its slices and
    of the replicated tensors, none of them the CLIP patcher's. The shards ride on the CLIP's
    patcher as a model patch (LoadedWith), so ComfyUI loads them in the CLIP's own call at each
    encode, counts each on its card and may evict them between encodes (an evicted shard is
    sliced again from the kept decoder, 0 bytes from disk). `clip` must be a CLIP of its own,
    not one sharing its patcher with another CLIP (tensor_parallel_clip makes such a copy).
    Returns the patchers (ranks 0..W-1; none for a CLIP that ComfyUI does not manage)."""
    if not is_managed_by_comfyui(clip.patcher):
        return []
    decoder = language_model_of(clip)
    patchers = [card_patcher(shard_copy(decoder, r)) for r in range(decoder.world_size)]
    clip.patcher.set_model_patch(LoadedWith(patchers), ADDITIONAL_MODELS_KEY)
    owner = clip.patcher.model  # what every clone of the CLIP's patcher manages too
    decoder.before_forward = lambda: load_with_running_owner(patchers, owner)
    return patchers


def load_with_running_owner(patchers: Sequence, owner) -> None:
    """Before a forward: load `patchers` through ComfyUI if any is not resident and registered
    (normally all are: they came with the owner's own load). The loaded patchers that manage
    `owner` (the running CLIP's) go into the same call, so making room cannot evict them."""
    import comfy.model_management as mm
    loaded = [lm.model for lm in mm.current_loaded_models if lm.model is not None]
    if all(p.card_copy.resident and any(p is m for m in loaded) for p in patchers):
        return
    running = [m for m in loaded if getattr(m, "model", None) is owner]
    mm.load_models_gpu(running + list(patchers))


def load_card_copies(patchers: Sequence) -> None:
    """Load `patchers` through ComfyUI (for copies used outside a sampling run, e.g. VAE
    decoder copies): each is registered on its card, and room is made by evicting others."""
    if patchers:
        import comfy.model_management
        comfy.model_management.load_models_gpu(list(patchers))
