"""The DiT's role: per-rank DiT replicas (from the shared checkpoint base) and the SP set-up on them.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Sequence

import torch

from comfy.multidevice.comfy_objects import (dit_module, is_model_patcher, lazily_patched_layers,
                                             move_load_device)
from comfy.multidevice.devices import module_device, resolve_device
from comfy.multidevice.progress import CardProgress
from comfy.multidevice.roles.dit_shards import rank0_shard_primary, sharded_primary
from comfy.multidevice.roles.model_management import CardCopy, register_with_model
from comfy.multidevice.roles.plan import RolePlanError
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel, enable_sequence_parallel_on_patcher
from comfy.multidevice.tensor_bytes import module_bytes
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.comfy_replicas import comfy_diffusion_model_replicas
from comfy.multidevice.weights.module_copies import replica_on
from comfy.multidevice.weights.replicas import RankReplicas
from comfy.multidevice.workers.comfy_dit import comfy_dit_recipe, sharded_recipe
from comfy.multidevice.workers.pool_runner import workers_on_patcher

log = logging.getLogger(__name__)

APPLIED_DIT_RANKS = ("threads", "processes")  # rank threads of this process, or worker processes
DIT_RANKS = ("auto", *APPLIED_DIT_RANKS)  # the node's dit_ranks


def resolve_dit_ranks(choice: str, remote_ranks: int) -> str:
    """The node's dit_ranks as applied: "auto" is processes when ranks of other servers join
    (threads cannot leave this process), else threads (every workflow runs that way)."""
    if choice not in DIT_RANKS:
        raise RolePlanError(f"dit_ranks={choice!r} is unknown: set dit_ranks to one of {', '.join(DIT_RANKS)}")
    if choice == "auto":
        return "processes" if remote_ranks else "threads"
    if choice == "threads" and remote_ranks:
        raise RolePlanError(f"COMFYUI_MULTI_DEVICE_REMOTE_RANKS={remote_ranks} asks for DiT ranks on other "
                            "servers, which rank threads cannot reach: set dit_ranks to processes or auto, "
                            "or unset the variable and restart ComfyUI")
    return choice

# ----------------------------------------------------------------------------- DiT

class DitReplicas:
    """The DiT of ranks 1..W-1 on the patcher path, one entry per rank for the SP adapter.

    From the shared checkpoint base when it can be built (comfy/multidevice/weights/: the
    loader's file read once per process, or the model's own CPU weights zero-copy; the MODEL's
    weight patches, e.g. a Turbo LoRA loaded before this node, applied identically on every
    rank): made resident on the first forward, dropped again by `unload()`.

    ComfyUI records on the shared model which patch set its weights carry right now
    (ModelPatcher sets model.current_weight_patches_uuid when it patches them). When that is
    another set than the MODEL this node received had (a LoRA loader placed *after* the
    node), replicas built from the base would miss it; then, and when no base can be built,
    the primary's loaded weights are copied to the other cards instead (device to device),
    and copied again when the patch set changes.
    """

    def __init__(self, primary, devices: Sequence[torch.device]):
        self.primary = primary
        self.devices = list(devices)
        self.base_replicas = None
        self.base_problem: str | None = None
        self.armed = False  # until the adapter is installed, entries only serve its checks
        self._copies: dict = {}
        self._copy_version = None
        self._progress = None  # over the replica builds, made at the first one
        try:
            self.base_replicas = comfy_diffusion_model_replicas(primary, self.devices, load=False)
        except Exception as exc:  # any reason the base cannot serve: the copy path always can
            self.base_problem = f"{type(exc).__name__}: {exc}"
            log.warning("DiT replicas: no shared checkpoint base (%s); the loaded weights will be "
                        "copied to %s at the first step", self.base_problem, ", ".join(map(str, self.devices)))

    def entries(self) -> list:
        return [RankDit(self.module, i) for i in range(len(self.devices))]

    def _applied_patches(self):
        return getattr(getattr(self.primary, "model", None), "current_weight_patches_uuid", None)

    def uses_base(self) -> bool:
        applied = self._applied_patches()
        return self.base_replicas is not None and (
            applied is None or applied == getattr(self.primary, "patches_uuid", None))

    def module(self, index: int):
        if self.uses_base():
            replica = self.base_replicas[index]
            if not self.armed:
                return replica.module
            if replica.resident:
                return replica.load().module  # refreshes patches only if they changed
            start = time.monotonic()
            replica.load()
            self._built(index, replica.resident_bytes, "from the shared checkpoint base", start)
            return replica.module
        source = dit_module(self.primary)
        device = self.devices[index]
        if not self.armed or module_device(source) in (None, device):
            return source
        version = (id(source), self._applied_patches())
        if version != self._copy_version:
            _refuse_partially_loaded(source)
            self._copies.clear()  # stale copies go before new ones are made
            self._copy_version = version
            if self.base_replicas is not None:
                log.info("DiT replicas: the weights carry patches added after this node (e.g. a LoRA "
                         "loader placed after it); copying the loaded weights to the other cards")
        if index not in self._copies:
            start = time.monotonic()
            self._copies[index] = replica_on(source, device)
            self._built(index, module_bytes(self._copies[index]),
                        "copied from the loaded model", start)
        return self._copies[index]

    def _built(self, index: int, nbytes: int, how: str, start: float) -> None:
        # The first prompt builds W-1 replicas: minutes for a 66 GB DiT, shown per card.
        if self._progress is None:
            self._progress = CardProgress("DiT replica", len(self.devices), log)
        self._progress.done(self.devices[index], nbytes, how, start)

    def unload(self, index: int | None = None) -> int:
        """Drop the device residency of one rank's replica, or of all (the base stays in RAM);
        return the bytes dropped."""
        self._progress = None  # the next build is a new run of the bar
        indices = range(len(self.devices)) if index is None else [index]
        dropped = 0
        for i in indices:
            if self.base_replicas is not None:
                dropped += self.base_replicas[i].unload()
            copy = self._copies.pop(i, None)
            if copy is not None:
                dropped += module_bytes(copy)
        if index is None:
            self._copy_version = None
        return dropped

    def resident(self, index: int) -> bool:
        if self.uses_base():
            return self.base_replicas[index].resident
        return index in self._copies

    def device_bytes(self, index: int) -> int:
        """Bytes rank `index`'s replica takes on its card."""
        if self.uses_base():
            return self.base_replicas[index].device_bytes
        return module_bytes(dit_module(self.primary))

    def card_copies(self) -> list:
        """One CardCopy per card, for ComfyUI's model management (roles/model_management.py)."""
        return [CardCopy("DiT replica", self, i, d, *(functools.partial(f, i) for f in (
                    self.device_bytes, self.resident, self._load_from_base, self.unload)))
                for i, d in enumerate(self.devices)]

    def _load_from_base(self, index: int) -> None:
        # From the base only: a copy of the loaded weights is made at the first forward, once
        # ComfyUI has loaded (and patched) the primary it copies from.
        if self.uses_base():
            self.module(index)


class RankDit:
    """What the SP adapter resolves each forward: `.diffusion_model` of one rank, whether the
    ranks run replicas (DitReplicas) or shards (roles/dit_shards.py DitShards)."""

    def __init__(self, running_module, rank: int):
        self.running_module = running_module  # rank -> the module that rank runs now
        self.rank = rank

    @property
    def diffusion_model(self):
        return self.running_module(self.rank)


def _refuse_partially_loaded(module) -> None:
    # ComfyUI's low-VRAM mode keeps some weights off the card and applies their patches at
    # compute time (per-layer weight_function lists); a copy of that state is not the model.
    lazy = lazily_patched_layers(module)
    if lazy:
        raise RolePlanError(
            f"the DiT is only partially loaded on its first card ({lazy} layers patched at compute "
            f"time); sequence parallel copies the loaded weights to the other cards, so the DiT must "
            f"fit on one card: use the INT8 DiT or keep fewer models resident, or place "
            f"MultiNPUParallelConfig after the LoRA loader so replicas come from the checkpoint base")


def place_dit(model, device, what="DiT"):
    """Single-card DiT: a clone whose load device is `device` (patcher) / the module on it."""
    if is_model_patcher(model):
        out = model.clone()
        move_load_device(out, device, what)
        return out
    if isinstance(model, torch.nn.Module) and module_device(model) not in (None, device):
        return replica_on(model, device)
    return model


def _module_replicas(model: torch.nn.Module, devices: Sequence[torch.device]) -> list:
    """Rank replicas of a plain DiT module from a shared base over its own weights (zero-copy)."""
    home = module_device(model)
    if home is not None and home.type != "cpu":  # a base lives in CPU memory
        return [model if d == home else replica_on(model, d) for d in devices]
    base = SharedCheckpoint.from_state_dict(model.state_dict(), copy=False,
                                            label=f"{type(model).__name__} weights")
    others = RankReplicas(base, devices[1:], template=model, load=True) if len(devices) > 1 else []
    first = model if home in (None, devices[0]) else replica_on(model, devices[0])
    return [first] + [r.module for r in others]


def sequence_parallel_dit(model, devices, coordinator, dit_weights="replicate", lane=None, sp_mode="allgather",
                          split=None):
    """The DiT's role on several cards: a MODEL (or bare module) set up for sequence parallel
    over `devices`, its per-card weights replicated or sharded as `dit_weights` says, its
    attention exchanged as `sp_mode` says (strategies.py), its rows shared as `split` says
    (sp/split.py; None: even)."""
    if not is_model_patcher(model):  # a plain DiT module (tests, the dry run)
        models = _module_replicas(model, devices)
        if dit_weights == "shard" and models[0] is model:  # sharding strips rank 0's copy, not the input
            models[0] = replica_on(model, devices[0])
        return enable_sequence_parallel(models, coordinator, sp_mode=sp_mode, dit_weights=dit_weights, split=split)
    if dit_weights == "shard":  # roles/dit_shards.py: every card, card 0 included, holds a shard
        primary, shards = sharded_primary(model, devices, coordinator, lane=lane)
        enable_sequence_parallel_on_patcher(primary, coordinator, [RankDit(shards.running_module, r) for r in range(len(devices))],
                                            sp_mode=sp_mode, split=split,
                                            block_weights=lambda: shards.family)
        primary.multinpu_dit_shards = shards  # for unload / inspection
        register_with_model(primary, shards.card_copies())
        return primary
    primary = place_dit(model, devices[0], "DiT rank 0")
    replicas = DitReplicas(primary, devices[1:])
    enable_sequence_parallel_on_patcher(primary, coordinator, [None] + replicas.entries(), sp_mode=sp_mode,
                                        split=split)
    replicas.armed = True
    primary.multinpu_dit_replicas = replicas  # for unload / inspection
    register_with_model(primary, replicas.card_copies())
    return primary


def workers_dit(model, devices, remote_ranks: int = 0, rendezvous: tuple[str, int] = ("127.0.0.1", 0),
                dit_weights: str = "replicate", prelude: Sequence[tuple[str, str]] = (), sp_mode: str = "allgather",
                split=None):
    """The DiT's role with its ranks as processes: a clone of the MODEL whose forward runs on
    devices[0] here, on one worker process per other card (workers/pool_runner.py) and on
    `remote_ranks` ranks of other servers meeting at `rendezvous` (host, port); the pool
    starts at the first step. With dit_weights="shard" every rank holds 1/W of the block
    weights: rank 0's shard is made here (the MODEL output runs it), each worker makes its own.
    Refused before anything is made for a bare module or a MODEL a worker cannot rebuild.
    `prelude`: functions a worker calls first (workers/comfy_dit.py; tests' stand-ins). `sp_mode`:
    the attention exchange every rank runs (strategies.py). `split`: how the rows are shared
    (a RowSplit of sp/split.py; None: even), sent to the workers with the build message."""
    if not is_model_patcher(model):
        raise RolePlanError("dit_ranks=processes needs a ComfyUI MODEL (its workers load it as ComfyUI "
                            f"did), got {type(model).__name__}; use dit_ranks=threads")
    devices = [resolve_device(d) for d in devices]
    recipe, rank0_weights = None, None
    if dit_weights == "shard":
        # from the input MODEL (the clone's patches go into rank 0's shard), refused here, before
        # the shard is made, when it cannot be made
        plain = comfy_dit_recipe(model, prelude)
        primary, shard = rank0_shard_primary(model, devices[0], len(devices) + remote_ranks)
        recipe, rank0_weights = sharded_recipe(plain, shard.layout.plan), shard.weights
        log.info("DiT shard of rank 0 on %s: %.2f GiB of weights (1/%d of the blocks)", devices[0],
                 (shard.layout.shared_bytes + shard.layout.plan.owned_bytes(0)) / 2 ** 30, len(devices) + remote_ranks)
    else:
        primary = place_dit(model, devices[0], "DiT rank 0")
    primary.multinpu_workers = workers_on_patcher(primary, devices, sp_mode, remote=remote_ranks, address=rendezvous[0],
                                                  port=rendezvous[1], recipe=recipe, prelude=prelude,
                                                  rank0_weights=rank0_weights, split=split)  # for close / inspection
    return primary

