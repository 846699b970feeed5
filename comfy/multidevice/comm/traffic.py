"""Logical-byte accounting of collectives: what one rank sends to and receives from the others.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from comfy.multidevice.comm.layout import chunk_shape, nbytes, numel, received_chunk_shapes, ShardMeta


def exchange_traffic(metas: Sequence[Sequence[ShardMeta]], rank: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by `rank` in an all-gather of the shards `metas`."""
    own = sum(nbytes(m) for m in metas[rank])
    everyone = sum(nbytes(m) for shard in metas for m in shard)
    return own * (len(metas) - 1), everyone - own


def all_to_all_traffic(metas: Sequence[Sequence[ShardMeta]], splits: Sequence[Sequence[int]],
                       split_dim: int, rank: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by `rank` in an all-to-all: its chunks to every other rank,
    and every other rank's chunk for it (`splits[src][dst]` rows along `split_dim`)."""
    return all_to_all_bytes(metas[rank], splits[rank], received_chunk_shapes(metas, splits, split_dim, rank),
                            split_dim, rank)


def all_to_all_bytes(mine: Sequence[ShardMeta], send_splits: Sequence[int],
                     received: Sequence[Sequence[Sequence[int]]], split_dim: int, rank: int) -> tuple[int, int]:
    """`all_to_all_traffic` from what `rank` knows itself: its tensors and splits, and the
    shapes of the chunks it receives (per tensor, per source)."""
    sent = received_bytes = 0
    for meta, shapes in zip(mine, received):
        for other, n in enumerate(send_splits):
            if other != rank:
                sent += numel(chunk_shape(meta.shape, split_dim, n)) * meta.dtype.itemsize
                received_bytes += numel(shapes[other]) * meta.dtype.itemsize
    return sent, received_bytes


def all_reduce_traffic(meta_or_tensor, world_size: int) -> int:
    """Logical bytes of an all-reduce, each way: every rank needs every other rank's whole input."""
    return nbytes(meta_or_tensor) * (world_size - 1)


class TrafficCounter:
    """Logical bytes one rank sent to / received from other ranks, per collective kind."""

    FIELDS = ("sent", "received", "calls")

    def __init__(self):
        self._per_op: dict[str, Counter] = {}

    def add(self, op: str, sent: int, received: int) -> None:
        self._per_op.setdefault(op, Counter()).update(sent=sent, received=received, calls=1)

    def summary(self) -> dict:
        """{"sent", "received", "calls", "by_op": {op: {"sent", "received", "calls"}}}."""
        by_op = {op: {k: count[k] for k in self.FIELDS} for op, count in self._per_op.items()}
        return {**{k: sum(op[k] for op in by_op.values()) for k in self.FIELDS}, "by_op": by_op}
