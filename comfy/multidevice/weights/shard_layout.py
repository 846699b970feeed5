"""Which DiT block tensors each rank keeps under `dit_weights="shard"`, and one process's shard.

`ShardLayout` reads the block tensors of one replica still bound to the shared base (their
sizes as a card will hold them) and balances them over W ranks (weights/block_shards.py
`BlockShardPlan`); a quantized layer's tensors go to one owner, since its loader rebuilds and
patches them as one. Every process that reads the same checkpoint with the same patches makes
the same layout, so ranks of different processes agree on who owns what without sending it;
a worker still compares its layout with rank 0's (`check_same_as`) before it serves.

`rank_shard` makes one rank's shard in a process that holds only that rank (ranks as
processes): the replica keeps the non-block weights and its own block tensors, the others are
gathered block by block over the process group while the DiT runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from comfy.multidevice.tensor_bytes import is_flattenable, tensor_nbytes
from comfy.multidevice.weights.block_shards import (block_tensors, BlockShardError, BlockShardPlan,
                                                    RankBlockWeights, ShardedBlockWeights)


def dit_blocks(model):
    return model.blocks  # H3 contract: the transformer blocks are model.blocks[i]


class ShardLayout:
    """The shard plan over W ranks of a replica's blocks, and what each rank's card keeps."""

    def __init__(self, replica, world_size: int):
        self.num_blocks = len(dit_blocks(replica.module))
        sizes = [self._block_sizes(replica, i) for i in range(self.num_blocks)]
        together = [{n: replica.loaded_with(f"blocks.{i}.{n}")[0] for n in b} for i, b in enumerate(sizes)]
        self.plan = BlockShardPlan.balanced(sizes, world_size, together)
        block_names = {f"blocks.{i}.{n}" for i in range(self.num_blocks) for n in self.plan.nbytes[i]}
        # a quantized block layer's scales and format record go with its weight, to its owner
        # only: a card that rebuilt (and patched) every quantized layer would hold a replica
        in_blocks = {m for n in block_names for m in replica.loaded_with(n)}
        self.shared_names = [n for n in replica.names if n not in in_blocks]
        # bytes every card holds outside the blocks (embeddings, refiner, final layer)
        self.shared_bytes = sum(replica.device_nbytes(n) for n in replica.sources if not n.startswith("blocks."))

    @staticmethod
    def _block_sizes(replica, index: int) -> dict:
        # bytes of each block tensor as the card will hold it (the loaded model's dtype); the
        # replica is still bound to the base here
        sizes = {}
        for name, value in block_tensors(dit_blocks(replica.module)[index]).items():
            full = f"blocks.{index}.{name}"
            sizes[name] = (tensor_nbytes(value) if is_flattenable(value)  # e.g. a QuantizedTensor
                           else value.numel() * replica.target_dtype(full, value).itemsize)
        return sizes

    def keep_names(self, replica, rank: int) -> list[str]:
        """What card `rank` holds between blocks: the non-block weights and its own block tensors."""
        owned = [f"blocks.{i}.{n}" for i in range(self.num_blocks) for n in self.plan.names_of(i, rank)]
        return self.shared_names + [m for n in owned for m in replica.loaded_with(n)]

    def check_same_as(self, plan: BlockShardPlan, where: str) -> None:
        """Refuse to serve with another layout than rank 0's (another file, other patches)."""
        if plan.world_size != self.plan.world_size or plan.nbytes != self.plan.nbytes:
            differs = next((f"block {i}" for i, (a, b) in enumerate(zip(plan.nbytes, self.plan.nbytes)) if a != b),
                           f"{len(plan.nbytes)} blocks against {len(self.plan.nbytes)}")
            raise BlockShardError(
                f"{where}: the DiT's block tensors differ from rank 0's ({differs}); every server must "
                "have the same model file at the same path, with the same ComfyUI")
        if plan.owner != self.plan.owner:
            raise BlockShardError(f"{where}: the shard plan differs from rank 0's; run the same version "
                                  "of this pack on every server")


@dataclass
class ProcessShard:
    """One rank's sharded DiT in its own process: the module and its block-weights handle."""

    module: torch.nn.Module
    weights: RankBlockWeights
    layout: ShardLayout


def rank_shard(replica, rank: int, world_size: int, rank0_plan: BlockShardPlan | None = None,
               inference: bool = False) -> ProcessShard:
    """Rank `rank`'s shard of `replica` (bound to the base, not yet loaded) in a process that
    holds no other rank: its card gets the non-block weights and its own block tensors only.
    `rank0_plan`: the plan rank 0 made, which this rank's layout must equal. `inference`:
    build the card's tensors as inference tensors (ComfyUI loads its MODEL in inference mode)."""
    layout = ShardLayout(replica, world_size)
    if rank0_plan is not None:
        layout.check_same_as(rank0_plan, f"rank {rank}")
    with torch.inference_mode() if inference else contextlib.nullcontext():
        replica.load(layout.keep_names(replica, rank), only=True)
    models, devices = [None] * world_size, [None] * world_size
    models[rank], devices[rank] = replica.module, replica.device

    def loaded_dtype(index: int, name: str, value: torch.Tensor) -> torch.dtype:
        # a tensor another rank owns is bound to the base here: the dtype its owner's card holds
        return replica.target_dtype(f"blocks.{index}.{name}", value)

    family = ShardedBlockWeights(models, dit_blocks, devices, plan=layout.plan, remote_dtype=loaded_dtype)
    return ProcessShard(replica.module, family.rank_view(rank), layout)
