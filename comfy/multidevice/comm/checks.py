"""Validators of collective calls: one rank's arguments checked locally, the ranks' metadata checked together.

A local problem raises ValueError before anything is sent; ranks that disagree get the same
CollectiveError on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from comfy.multidevice.comm.errors import CollectiveError
from comfy.multidevice.comm.layout import (chunk_shape, normalize_dims, planned_chunk_shapes,
                                           received_chunk_shapes, same_chunk_shape, ShardMeta)
from comfy.multidevice.comm.protocol import VALID_REDUCE_OPS


def planned_metas(tensors: Sequence[torch.Tensor], dims: Sequence[int], shard_sizes: Sequence[int],
                  rank: int) -> list[list[ShardMeta]]:
    """Every rank's shard metadata of an all-gather-V whose lengths along the cat dims a shard
    plan fixes (`shard_sizes[r]` rows on rank r; the other dims are this rank's): known
    without asking the others. Raises ValueError when this rank's own tensors disagree."""
    sizes = [int(n) for n in shard_sizes]
    if not 0 <= rank < len(sizes) or any(n < 0 for n in sizes):
        raise ValueError(f"exchange shard_sizes {sizes} must give every rank's length (rank {rank})")
    for t, dim in zip(tensors, dims):
        if t.shape[dim] != sizes[rank]:
            raise ValueError(
                f"exchange: rank {rank}'s tensor of shape {tuple(t.shape)} has {t.shape[dim]} rows "
                f"along dim {dim}, but shard_sizes {sizes} gives it {sizes[rank]}; pass the shard "
                "plan the tensors were cut by")
    return [[ShardMeta(chunk_shape(t.shape, dim, n), t.dtype) for t, dim in zip(tensors, dims)] for n in sizes]


def _same_tensor_count(per_rank: Sequence[Sequence[ShardMeta]], what: str) -> int:
    counts = [len(m) for m in per_rank]
    if len(set(counts)) != 1:
        raise CollectiveError(f"ranks passed different numbers of tensors to {what}: {counts}")
    return counts[0]


def check_exchange_metadata(per_rank: Sequence[Sequence[ShardMeta]], dims: Sequence[int]) -> None:
    """Raise the same clear error on every rank when the ranks' shards cannot be concatenated."""
    _same_tensor_count(per_rank, "exchange")
    for i, dim in enumerate(dims):
        first = per_rank[0][i]
        for r, metas in enumerate(per_rank):
            m = metas[i]
            if m.dtype != first.dtype:
                raise CollectiveError(
                    f"exchange tensor {i}: rank {r} has dtype {m.dtype}, rank 0 has {first.dtype}")
            if len(m.shape) != len(first.shape):
                raise CollectiveError(
                    f"exchange tensor {i}: rank {r} has shape {m.shape}, rank 0 has {first.shape}")
            if chunk_shape(m.shape, dim, 0) != chunk_shape(first.shape, dim, 0):
                raise CollectiveError(
                    f"exchange tensor {i}: shapes {first.shape} (rank 0) and {m.shape} (rank {r}) "
                    f"differ outside the concat dim {dim}")


def check_reduce_op(op: str) -> None:
    """Refuse an all_reduce op other than VALID_REDUCE_OPS locally, before anything is sent."""
    if op not in VALID_REDUCE_OPS:
        raise ValueError(f"all_reduce op {op!r} is not supported; use one of {VALID_REDUCE_OPS}")


def check_all_reduce_metadata(metas: Sequence[ShardMeta]) -> None:
    """Raise the same clear error on every rank when the ranks' all-reduce inputs differ."""
    first = metas[0]
    for r, m in enumerate(metas):
        if m != first:
            raise CollectiveError(f"all_reduce: rank {r} has {m.shape}/{m.dtype}, "
                                  f"rank 0 has {first.shape}/{first.dtype}")


def _integers(values, name: str, world_size: int) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in values)
    except (TypeError, ValueError):
        raise ValueError(f"all_to_all_v {name} must be {world_size} integers, got {values!r}") from None


def check_send_splits(tensors: Sequence[torch.Tensor], send_splits: Sequence[int], split_dim: int,
                      world_size: int) -> tuple[int, ...]:
    """Validate one rank's all-to-all split sizes locally, before anything is sent."""
    splits = _integers(send_splits, "send_splits", world_size)
    if len(splits) != world_size:
        raise ValueError(f"all_to_all_v send_splits {list(splits)} has {len(splits)} entries; "
                         f"give one size per rank ({world_size})")
    if any(s < 0 for s in splits):
        raise ValueError(f"all_to_all_v send_splits {list(splits)} has a negative size")
    for t in tensors:
        if sum(splits) != t.shape[split_dim]:
            raise ValueError(
                f"all_to_all_v send_splits {list(splits)} sum to {sum(splits)} but the tensor of "
                f"shape {tuple(t.shape)} has {t.shape[split_dim]} along split dim {split_dim}; "
                "the splits must cover that dim exactly")
    return splits


def check_recv_splits(recv_splits, world_size: int) -> tuple[int, ...] | None:
    """Validate one rank's all_to_all_v `recv_splits` locally (None: not given)."""
    if recv_splits is None:
        return None
    sizes = _integers(recv_splits, "recv_splits", world_size)
    if len(sizes) != world_size or any(n < 0 for n in sizes):
        raise ValueError(f"all_to_all_v recv_splits {list(sizes)} must give one size >= 0 per rank "
                         f"({world_size}): the length along cat_dim of the chunk each rank sends this one")
    return sizes


def check_all_to_all_metadata(per_rank: Sequence[Sequence[ShardMeta]], splits: Sequence[Sequence[int]],
                              split_dim: int, cat_dim: int) -> None:
    """Raise the same clear error on every rank when the chunks a rank receives cannot be concatenated."""
    world = len(per_rank)
    for t in range(_same_tensor_count(per_rank, "all_to_all_v")):
        first = per_rank[0][t]
        for i, metas in enumerate(per_rank):
            if metas[t].dtype != first.dtype or len(metas[t].shape) != len(first.shape):
                raise CollectiveError(
                    f"all_to_all_v tensor {t}: rank {i} has {metas[t].shape}/{metas[t].dtype}, "
                    f"rank 0 has {first.shape}/{first.dtype}")
        for j in range(world):  # every chunk sent to rank j must fit next to the others
            sources = [i for i in range(world) if splits[i][j]] or list(range(world))
            ref = sources[0]
            want = chunk_shape(per_rank[ref][t].shape, split_dim, splits[ref][j])
            for i in sources[1:]:
                got = chunk_shape(per_rank[i][t].shape, split_dim, splits[i][j])
                if chunk_shape(got, cat_dim, 0) != chunk_shape(want, cat_dim, 0):
                    raise CollectiveError(
                        f"all_to_all_v tensor {t}: the chunk rank {i} sends to rank {j} has shape "
                        f"{got}, rank {ref}'s has {want}; they must agree outside the concat dim "
                        f"{cat_dim}")


def check_all_to_all_plans(per_rank: Sequence[Sequence[ShardMeta]], splits: Sequence[Sequence[int]],
                           recv_splits: Sequence[Sequence[int] | None], split_dim: int, cat_dim: int) -> None:
    """Raise the same clear error on every rank when a rank's `recv_splits` disagree with what
    the ranks send it (every rank checks every rank's plan), or only some ranks passed one."""
    given = [r for r, p in enumerate(recv_splits) if p is not None]
    if given and len(given) != len(per_rank):
        raise CollectiveError(f"all_to_all_v: ranks {given} passed recv_splits and the others did not; "
                              "every rank must pass them, or none")
    for r in given:
        want = received_chunk_shapes(per_rank, splits, split_dim, r)
        got = planned_chunk_shapes([m.shape for m in per_rank[r]], splits[r], recv_splits[r], split_dim,
                                   cat_dim, r)
        for t, (w, g) in enumerate(zip(want, got)):
            if not all(same_chunk_shape(a, b) for a, b in zip(w, g)):
                raise CollectiveError(
                    f"all_to_all_v tensor {t}: rank {r}'s recv_splits {list(recv_splits[r])} give chunks "
                    f"{[tuple(s) for s in g]}, but the ranks send it {[tuple(s) for s in w]}; pass, per "
                    f"source rank, the length along cat_dim {cat_dim} of the chunk it sends (0 for none)")


def all_to_all_arguments(tensors, send_splits, split_dim, cat_dim, world_size):
    """Check one rank's all_to_all_v call locally, before anything is sent.

    Returns (single, tensors as a list, split_dim, cat_dim, send splits as a tuple); `single`
    says a lone tensor was passed (and a lone tensor is returned).
    """
    single = isinstance(tensors, torch.Tensor)
    tensors = [tensors] if single else list(tensors)
    if not tensors:
        raise ValueError("all_to_all_v needs at least one tensor")
    split_dim = normalize_dims(tensors, split_dim)[0]
    cat_dim = split_dim if cat_dim is None else normalize_dims(tensors, cat_dim)[0]
    splits = check_send_splits(tensors, send_splits, split_dim, world_size)
    return single, tensors, split_dim, cat_dim, splits
