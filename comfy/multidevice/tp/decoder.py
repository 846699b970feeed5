"""The tensor-parallel decoder: W shards of one decoder run concurrently on a coordinator's rank threads.

build_tensor_parallel_decoder(decoder, coordinator) checks the split, has every rank slice its
own shard (tp/shard.py), and returns TensorParallelDecoder, which runs one forward on all ranks
and hands rank 0's result back on the caller's device.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

import torch
import torch.nn as nn

from comfy.multidevice.devices import copy_for_rank
from comfy.multidevice.progress import CardProgress
from comfy.multidevice.tensor_bytes import storage_bytes
from comfy.multidevice.tp.layers import TensorParallelError
from comfy.multidevice.tp.shard import check_decoder_split, shard_decoder, WeightSource

log = logging.getLogger(__name__)


def _first_tensor_device(obj):
    if isinstance(obj, torch.Tensor):
        return obj.device
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return next((d for d in map(_first_tensor_device, items) if d is not None), None)


class TensorParallelDecoder(nn.Module):
    """Runs a decoder's W shards concurrently on a coordinator's rank threads.

    forward(*args, **kwargs) takes whatever the original decoder's forward takes: every
    tensor argument is copied to each rank's device, each rank runs its shard, and rank
    0's result comes back on the device of the first tensor argument. The shards are
    kept outside the module tree (model managers moving this module must not move
    them); the original's input embedding is kept as a submodule so callers that embed
    tokens themselves (upstream's SDClipModel) still find `embed_tokens`, and the shards
    hold none (see _EmbeddingOnFirstUse).
    """

    # Upstream's ComfyUI model code reads these flags from the language model.
    fixed_kv = False
    graph_dynamic_vbar_blocks = False
    prefetch_dynamic_vbars = False

    def __init__(self, coordinator, shards: list[nn.Module], source: nn.Module | None = None,
                 weights: Mapping[str, torch.Tensor] | None = None):
        super().__init__()
        if len(shards) != coordinator.world_size:
            raise TensorParallelError(f"{len(shards)} shards for {coordinator.world_size} ranks")
        self.coordinator = coordinator
        self.shards = list(shards)  # a plain list: not registered as submodules
        self._source = [source]     # ditto: the single-device decoder, for remove/re-shard
        self._weights = weights     # what the shards were sliced from, to rebuild a dropped one
        self.shard_bytes = [storage_bytes(s) for s in shards]
        # called on the caller's thread before each forward (roles/ loads the shards through
        # ComfyUI's model management there)
        self.before_forward = None
        if source is not None:
            if getattr(source, "embed_tokens", None) is not None:
                self.embed_tokens = source.embed_tokens
            if hasattr(source, "config"):
                self.config = source.config

    @property
    def source_decoder(self) -> nn.Module | None:
        return self._source[0]

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def drop_shard(self, rank: int) -> int:
        """Free rank `rank`'s shard (its card's memory); the next forward or ensure_shards()
        slices it again from the kept decoder (or weights), never from disk. Returns its bytes."""
        if self.shards[rank] is None:
            return 0
        self.shards[rank] = None
        return self.shard_bytes[rank]

    def ensure_shards(self) -> None:
        """Rebuild every dropped shard, each on its own rank thread."""
        missing = [r for r, s in enumerate(self.shards) if s is None]
        if not missing:
            return
        if self.source_decoder is None:
            raise TensorParallelError("a dropped tensor-parallel shard cannot be rebuilt: no source decoder")
        source, weights, shards = self.source_decoder, self._weights, self.shards

        def rebuild(rank, comm):
            if shards[rank] is None:
                shards[rank] = shard_decoder(source, comm, weights)

        self.coordinator.run(rebuild)
        log.info("tensor parallel: rebuilt the shards of ranks %s from RAM", missing)

    def get_dynamic_vram__units(self):
        # Upstream's CLIP wrapper asks the language model for offloadable units; the
        # shards stay resident on their ranks, so there are none.
        return [], []

    def forward(self, *args, **kwargs):
        if kwargs.get("past_key_values") is not None:
            raise TensorParallelError(
                "text generation (past_key_values) is not supported by the tensor-parallel text "
                "encoder; it only encodes prompts. Use the single-device CLIP for generation")
        if self.before_forward is not None:
            self.before_forward()
        self.ensure_shards()
        out_device = _first_tensor_device((args, kwargs))
        per_rank = [(copy_for_rank(args, dev, True), copy_for_rank(kwargs, dev, True))
                    for dev in self.coordinator.devices]
        shards = self.shards

        def run_shard(rank, comm, call):
            return shards[rank](*call[0], **call[1])

        results = self.coordinator.run(run_shard, per_rank)
        # a call with token ids has made the shards copy the embedding: count it
        self.shard_bytes = [storage_bytes(s) if s is not None else n for s, n in zip(shards, self.shard_bytes)]
        if out_device is None:
            return results[0]
        return copy_for_rank(results[0], out_device)


def build_tensor_parallel_decoder(decoder: nn.Module, coordinator,
                                  weights: Mapping[str, torch.Tensor] | None = None) -> TensorParallelDecoder:
    """Split `decoder` over all ranks of `coordinator` and return the fan-out module.

    Every check runs on the caller's thread before any weight moves; then each rank
    slices its own shard onto its device in its own thread. `decoder` is not modified.
    """
    check_decoder_split(decoder, coordinator.world_size)
    if weights is not None:
        WeightSource(decoder, weights).check_all()

    progress = CardProgress(f"text encoder shard (1/{coordinator.world_size} of each layer)",
                            coordinator.world_size, log)

    def build(rank, comm):
        start = time.monotonic()
        shard = shard_decoder(decoder, comm, weights)
        progress.done(comm.device, storage_bytes(shard), "sliced from the loaded weights", start)
        return shard

    shards = coordinator.run(build)
    return TensorParallelDecoder(coordinator, shards, source=decoder, weights=weights)
