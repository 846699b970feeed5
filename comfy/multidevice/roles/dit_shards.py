"""The DiT's role with `dit_weights="shard"`: every card keeps 1/W of the block weights.

Every rank, card 0 included, runs a DiT built from the shared checkpoint base (the loader's
file read once per process, or the loaded CPU weights zero-copy) with the MODEL's weight
patches (a Turbo LoRA loaded before the node) applied by ComfyUI's own patch math
(weights/replicas.py). Each card is given only the non-block weights and the block tensors
its rank owns, patched there once (a quantized layer as ComfyUI patches it when it loads the
MODEL on a card: dequantized, patched, requantized with rounding seeded by the key); the
others are gathered block by block while the DiT runs (weights/block_shards.py). A card
never holds a whole replica, not even while it is built.

Rank 0's sharded DiT is also what ComfyUI loads on card 0: the node's MODEL output is a clone
whose BaseModel is a shallow copy with that DiT in place of the full one, so ComfyUI's memory
accounting sees the shard (the input MODEL is not changed). Its weight patches are already
in the shard, so the clone carries none; a LoRA added after the node is refused, since it
would reach card 0's shard only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import uuid
from typing import Sequence

import torch

from comfy.multidevice.comfy_objects import dit_module, lazily_patched_layers, move_load_device
from comfy.multidevice.comm.group import prefetch_lane
from comfy.multidevice.roles.model_management import CardCopy
from comfy.multidevice.roles.plan import RolePlanError
from comfy.multidevice.tp.shard import shallow_module_copy
from comfy.multidevice.weights.block_shards import ShardedBlockWeights
from comfy.multidevice.weights.comfy_replicas import comfy_diffusion_model_replicas
from comfy.multidevice.weights.shard_layout import dit_blocks, rank_shard, ShardLayout

log = logging.getLogger(__name__)

SHARD_NEEDS_BASE = ("dit_weights=shard builds every card's DiT from the shared checkpoint base; "
                    "use dit_weights=replicate (or the INT8 DiT file) for this MODEL")


def loaded_in_inference_mode(model) -> bool:
    """Whether the MODEL's DiT weights are inference tensors (ComfyUI loads inside a prompt's
    inference mode); a shard built for it is made in the same mode."""
    first = next(dit_module(model).parameters(), None)
    return bool(first is not None and first.is_inference())


class DitShards:
    """Per-rank sharded DiTs of a ComfyUI MODEL; `running_module(rank)` is what the SP adapter runs."""

    def __init__(self, primary, devices: Sequence[torch.device], coordinator, prefetch: bool = True,
                 lane=None):
        self.devices = list(devices)
        self.coordinator = coordinator
        self.prefetch = prefetch
        self.lane = lane  # a shared coordinator for the prefetches (roles/apply.py), or None
        # ComfyUI's loaders run inside the prompt's inference mode, so the loaded weights are
        # inference tensors; card 0's shard is loaded by ComfyUI in their place, and upstream's
        # quantized layers can only be moved there (ops._quantized_apply re-wraps each weight)
        # when they are inference tensors too. So every shard is built in the input's mode.
        self.inference = loaded_in_inference_mode(primary)
        try:
            with self._as_loaded():
                self.replicas = comfy_diffusion_model_replicas(primary, self.devices, load=False)
        except Exception as exc:  # the base is what makes a card-by-card shard possible
            raise RolePlanError(f"{SHARD_NEEDS_BASE} ({type(exc).__name__}: {exc})") from exc
        self.layout = ShardLayout(self.replicas[0], len(self.devices))
        self.plan = self.layout.plan
        self.num_blocks = self.layout.num_blocks
        self.shared_bytes = self.layout.shared_bytes
        self.family: ShardedBlockWeights | None = None
        self._lock = threading.RLock()  # rank threads resolve their DiT at once; ComfyUI evicts between prompts
        self.output_model = None  # the BaseModel ComfyUI loads for rank 0 (sharded_primary)
        self.patches_uuid = None  # the weight-patch set that BaseModel may carry: ours (none)

    def _as_loaded(self):
        return torch.inference_mode() if self.inference else contextlib.nullcontext()

    def keep_names(self, rank: int) -> list[str]:
        """What card `rank` holds between blocks: the non-block weights and its own block tensors."""
        return self.layout.keep_names(self.replicas[rank], rank)

    def load(self) -> ShardedBlockWeights:
        """Make every card's shard resident (from RAM) and the block gathers ready."""
        with self._lock, self._as_loaded():
            if self.family is not None:  # a card ComfyUI evicted comes back (0 bytes from disk)
                for rank in range(len(self.devices)):
                    self.load_rank(rank)
                return self.family
            for rank, replica in enumerate(self.replicas):
                replica.load(self.keep_names(rank), only=True)
            lane, own_lane = self.lane, False
            if lane is None and self.prefetch and len(self.devices) > 1:
                lane, own_lane = prefetch_lane(self.coordinator), True
            self.family = ShardedBlockWeights([r.module for r in self.replicas], dit_blocks, self.devices,
                                              lane=lane if self.prefetch else None, own_lane=own_lane,
                                              timeout_s=self.coordinator.timeout_s, plan=self.plan)
            log.info("DiT shards: %s", ", ".join(
                f"{d}: {self.resident_bytes(r) / 2 ** 30:.2f} GiB" for r, d in enumerate(self.devices)))
            return self.family

    def load_rank(self, rank: int) -> None:
        """Bring back card `rank`'s shard after an eviction (a no-op while it is resident): its
        kept tensors from the base in RAM, and empty slots again for the tensors other ranks own."""
        with self._lock, self._as_loaded():
            replica = self.replicas[rank]
            if replica.resident:
                return
            replica.load(self.keep_names(rank), only=True)
            if self.family is not None:
                self.family.drop_unowned(rank)

    def unload_rank(self, rank: int) -> int:
        """Drop card `rank`'s shard (its weights point at the base in RAM again); bytes dropped.
        Between prompts only: a rank running a block needs its tensors."""
        with self._lock:
            return self.replicas[rank].unload()

    def card_bytes(self, rank: int) -> int:
        """Bytes card `rank`'s shard takes on its card: the non-block weights and its own block
        tensors (the blocks gathered while one runs come and go with the forward)."""
        return self.shared_bytes + self.plan.owned_bytes(rank)

    def card_copies(self) -> list:
        """Cards 1..W-1's shards as CardCopies for ComfyUI's model management
        (roles/model_management.py); card 0's shard is the MODEL ComfyUI loads itself."""
        return [CardCopy("DiT shard", self, r, self.devices[r], *(functools.partial(f, r) for f in (
                    self.card_bytes, self.resident, self.load_rank, self.unload_rank)))
                for r in range(1, len(self.devices))]

    def resident(self, rank: int) -> bool:
        return self.replicas[rank].resident

    def refuse_patches_added_after(self) -> None:
        """ComfyUI records on the BaseModel which patch set it applied to its weights; another
        set than ours is a LoRA loader placed after the node, which would reach card 0 only."""
        applied = getattr(self.output_model, "current_weight_patches_uuid", None)
        # ComfyUI's low-VRAM load applies patches at compute time instead (per-layer lists)
        if lazily_patched_layers(self.module(0)) or (applied is not None and applied != self.patches_uuid):
            raise RolePlanError(
                "the DiT carries weight patches added after MultiNPUParallelConfig (e.g. a LoRA "
                "loader placed after it); with dit_weights=shard they would reach card 0's shard "
                "only: place the LoRA loader before the node, or use dit_weights=replicate")

    def resident_bytes(self, rank: int) -> int:
        """Bytes copied to card `rank` for its shard (non-block weights + its block tensors; 0 on
        a CPU rank in the stored dtype, which uses the base's memory in place)."""
        return self.replicas[rank].resident_bytes

    def module(self, rank: int):
        return self.replicas[rank].module

    def running_module(self, rank: int):
        """What rank `rank` runs at a forward: its DiT, the shards resident (rank 0's checked
        for weight patches added after the node)."""
        if rank == 0:
            self.refuse_patches_added_after()
        self.load()
        return self.module(rank)

    def unload(self) -> int:
        """Drop every card's shard (the base stays in RAM); return the bytes dropped."""
        family, self.family = self.family, None
        if family is not None:
            family.close()
        return self.replicas.unload()


def _base_model_with(base_model, diffusion_model):
    """A shallow copy of a BaseModel whose diffusion_model is another module (the original is
    untouched: its module tables are copied, not shared)."""
    if isinstance(base_model, torch.nn.Module):
        light = shallow_module_copy(base_model)
        light._modules["diffusion_model"] = diffusion_model
    else:  # a stand-in object with its own attribute dict (tests)
        light = copy.copy(base_model)
        light.diffusion_model = diffusion_model
    # ComfyUI's load state of the original (weights loaded, patches applied) is not the copy's:
    # left as it is, ComfyUI would skip loading the copy, and with it any patch added later.
    for name, fresh in (("model_loaded_weight_memory", 0), ("model_offload_buffer_memory", 0),
                        ("lowvram_patch_counter", 0), ("model_lowvram", False),
                        ("current_weight_patches_uuid", None)):
        if hasattr(base_model, name):
            setattr(light, name, fresh)
    return light


def _primary_running(model, shard_module, device):
    """A clone of `model` on card 0 (`device`) whose BaseModel runs `shard_module` (rank 0's shard)."""
    primary = model.clone()
    move_load_device(primary, device, "DiT rank 0")
    primary.model = _base_model_with(primary.model, shard_module)
    primary.size = 0  # ComfyUI's model_size() is recounted from the shard
    # The patches are inside the shards already (ComfyUI's patch math on the base); a second
    # application by ComfyUI would patch card 0's weights twice.
    primary.patches = {}
    primary.patches_uuid = uuid.uuid4()
    primary.backup = {}
    return primary


def sharded_primary(model, devices, coordinator, prefetch: bool = True, lane=None):
    """The MODEL output for dit_weights=shard: a clone that runs rank 0's shard on card 0, and
    the DitShards behind every rank (rank 0 included)."""
    shards = DitShards(model, devices, coordinator, prefetch, lane)
    shards.load()  # before ComfyUI loads card 0: it must find the shard there, not a full DiT
    primary = _primary_running(model, shards.module(0), devices[0])
    shards.output_model, shards.patches_uuid = primary.model, primary.patches_uuid
    return primary, shards


def rank0_shard_primary(model, device, world_size: int):
    """dit_weights=shard with ranks as processes: rank 0's shard of `model`'s DiT made here on
    `device` (weights/shard_layout.py; the other ranks make theirs in their own processes), and
    the clone of `model` that runs it. Returns (clone, ProcessShard)."""
    inference = loaded_in_inference_mode(model)  # as DitShards: the input's mode
    try:
        with torch.inference_mode() if inference else contextlib.nullcontext():
            replica = comfy_diffusion_model_replicas(model, [device], load=False)[0]
    except Exception as exc:  # the base is what makes a card-by-card shard possible
        raise RolePlanError(f"{SHARD_NEEDS_BASE} ({type(exc).__name__}: {exc})") from exc
    shard = rank_shard(replica, 0, world_size, inference=inference)
    return _primary_running(model, shard.module, device), shard
