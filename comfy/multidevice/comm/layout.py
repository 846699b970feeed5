"""Layout maths of variable-length all-gathers and all-to-alls (a leaf module).

The shard metadata each rank publishes (`ShardMeta`), counts and displacements, chunk shapes,
packing into flat buffers and unpacking of what arrived: what every transport computes the
same way, with no dependency on any of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import Sequence

import torch


@dataclass(frozen=True)
class ShardMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def nbytes(meta_or_tensor) -> int:
    """Bytes of a ShardMeta or tensor (shape x dtype item size)."""
    return numel(meta_or_tensor.shape) * meta_or_tensor.dtype.itemsize


def gathered_shape(metas: Sequence[ShardMeta], dim: int) -> tuple[int, ...]:
    return chunk_shape(metas[0].shape, dim, sum(m.shape[dim] for m in metas))


def chunk_shape(shape: Sequence[int], split_dim: int, size: int) -> tuple[int, ...]:
    """Shape of one all-to-all chunk: `shape` with `size` rows along `split_dim`."""
    out = list(shape)
    out[split_dim] = size
    return tuple(out)


def displacements(counts: Sequence[int]) -> list[int]:
    """Where each rank's part starts in a rank-major flat buffer (exclusive prefix sums)."""
    return list(accumulate(counts[:-1], initial=0)) if counts else []


def chunks_back_to_back(tensor: torch.Tensor, dim: int) -> bool:
    """Whether `tensor`'s chunks along `dim` lie back to back in its memory, in order (dense,
    and `dim` is its outermost dim of more than one element)."""
    return tensor.is_contiguous() and all(s == 1 for s in tensor.shape[:dim])


def scratch(workspace: dict | None, key, numel: int, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A flat buffer for one collective: new, or kept in the caller's `workspace` (a dict the
    caller passes again for the same call site once it no longer uses the last results from
    it). Reuse spares the fresh pages a new CPU buffer faults in on every call, which cost
    about as much as the copy into them."""
    if workspace is None:
        return torch.empty(numel, dtype=dtype, device=device)
    buf = workspace.get(key)
    if buf is None or buf.numel() != numel or buf.dtype != dtype or buf.device != device:
        buf = workspace[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf


def pack_chunks(tensor: torch.Tensor, sizes: Sequence[int], dim: int,
                workspace: dict | None = None, key=None) -> torch.Tensor:
    """The chunks of `tensor` along `dim`, each flattened, back to back in one dense buffer (new,
    or `workspace[key]`, see `scratch`): one copy at most, none when they lie that way already."""
    return pack_peer_chunks(tensor, sizes, dim, None, workspace, key)[0]


def pack_peer_chunks(tensor: torch.Tensor, sizes: Sequence[int], dim: int, rank: int | None,
                     workspace: dict | None = None, key=None,
                     back_to_back: bool = False) -> tuple[torch.Tensor, list[int], list[int]]:
    """What an all-to-all library call sends: the chunks of `tensor` along `dim` for every rank
    but `rank` (None: every rank) in one dense flat buffer, and their (counts, displacements) in
    elements; `rank`'s own count is 0 (its chunk is copied straight into its place instead of
    going through the library). One copy per peer chunk at most; none when the chunks already
    lie back to back (the own chunk's elements then sit unused between the others), unless
    `back_to_back`: then the peers' chunks are always packed without that gap (for a call that
    takes counts but no displacements, as torch.distributed's all_to_all_single)."""
    counts = [numel(chunk_shape(tensor.shape, dim, n)) for n in sizes]
    packed = counts[:]
    if rank is not None:
        packed[rank] = 0
    if not back_to_back and chunks_back_to_back(tensor, dim):
        return tensor.view(-1), packed, displacements(counts)
    displs = displacements(packed)
    flat = scratch(workspace, key, sum(packed), tensor.dtype, tensor.device)
    for j, chunk in enumerate(tensor.split(list(sizes), dim)):
        if packed[j]:
            flat.narrow(0, displs[j], packed[j]).view(chunk.shape).copy_(chunk)
    return flat, packed, displs


def sequence_major(tensor: torch.Tensor, dim: int, workspace: dict | None = None, key=None) -> torch.Tensor:
    """`tensor` with its concat dim moved to the front, dense: what an all-gather-V sends so
    that the gathered flat buffer, rank after rank, is the concat itself (no cat on unpack).
    A view when that is how the tensor lies in memory already, else one row copy (into a new
    buffer or `workspace[key]`; H3's K/V are [1, H, S_r, D] views of fused qkv rows)."""
    moved = tensor.movedim(dim, 0)
    if moved.is_contiguous():
        return moved
    return scratch(workspace, key, tensor.numel(), tensor.dtype, tensor.device).view(moved.shape).copy_(moved)


def unflatten_gathered(flat: torch.Tensor, metas: Sequence[ShardMeta], dim: int) -> torch.Tensor:
    """The flat rank-major all-gather buffer of `sequence_major` shards -> their concat along
    `dim`, as a view (the concat's values; not contiguous when dim is not the outermost)."""
    shape = gathered_shape(metas, dim)
    return flat.view(shape[dim], *(s for d, s in enumerate(shape) if d != dim)).movedim(0, dim)


def normalize_dims(tensors: Sequence[torch.Tensor], cat_dims: int | Sequence[int]) -> list[int]:
    if isinstance(cat_dims, int):
        cat_dims = [cat_dims] * len(tensors)
    if len(cat_dims) != len(tensors):
        raise ValueError(f"exchange got {len(tensors)} tensors but {len(cat_dims)} cat_dims")
    dims = []
    for t, d in zip(tensors, cat_dims):
        if not -t.dim() <= d < t.dim():
            raise ValueError(f"cat dim {d} is out of range for a tensor of shape {tuple(t.shape)}")
        dims.append(d % t.dim())
    return dims


def received_chunk_shapes(metas: Sequence[Sequence[ShardMeta]], splits: Sequence[Sequence[int]],
                          split_dim: int, rank: int) -> list[list[tuple[int, ...]]]:
    """Per tensor, per source rank: the shape of the chunk `rank` receives in an all-to-all
    (from every rank's shard metadata and send splits)."""
    return [[chunk_shape(metas[src][t].shape, split_dim, splits[src][rank]) for src in range(len(metas))]
            for t in range(len(metas[rank]))]


def planned_chunk_shapes(shapes: Sequence[Sequence[int]], send_splits: Sequence[int],
                         recv_splits: Sequence[int], split_dim: int, cat_dim: int,
                         rank: int) -> list[list[tuple[int, ...]]]:
    """`received_chunk_shapes` as `rank`'s plan says, without asking the others: the chunk from
    rank j is like this rank's own chunk (`send_splits[rank]` along split_dim) except along
    cat_dim, where it has `recv_splits[j]`; a source that sends nothing has an empty chunk."""
    owns = [chunk_shape(shape, split_dim, send_splits[rank]) for shape in shapes]
    return [[chunk_shape(own, cat_dim, n) if n else chunk_shape(own, split_dim, 0) for n in recv_splits]
            for own in owns]


def same_chunk_shape(a: Sequence[int], b: Sequence[int]) -> bool:
    """Two all-to-all chunk shapes that describe the same chunk: equal, or both empty (an empty
    chunk's other dims do not matter: nothing is sent)."""
    return numel(a) == numel(b) and (not numel(a) or tuple(a) == tuple(b))


def concat_received(parts: Sequence[torch.Tensor], sizes: Sequence[int], cat_dim: int) -> torch.Tensor:
    """A rank's all-to-all result: the chunks it received, in source order, along cat_dim.

    A source whose split size for this rank is 0 takes no part (its empty chunk need not fit
    the others), so a sub-group of ranks can exchange through one world-wide call; when every
    chunk is empty they are concatenated as they are.
    """
    kept = [p for p, n in zip(parts, sizes) if n] or list(parts)
    return torch.cat(kept, dim=cat_dim)


def alone_all_to_all(tensors: Sequence[torch.Tensor], write_own=None) -> list[torch.Tensor]:
    """A group of one's all-to-all result: the tensors themselves, each one's own chunk (all
    of it) written by `write_own` first where the caller left it to that."""
    if write_own is not None:
        for t, tensor in enumerate(tensors):
            write_own(t, tensor)
    return list(tensors)


def unpack_received(recv: torch.Tensor, shapes: Sequence[Sequence[int]], sizes: Sequence[int],
                    cat_dim: int) -> torch.Tensor:
    """`concat_received` of the chunks lying back to back in the flat buffer `recv` (shapes in
    source order): along dim 0 that concat is the buffer itself, a view; else one cat copy."""
    kept = [tuple(s) for s, n in zip(shapes, sizes) if n]
    if cat_dim == 0 and kept and all(s[1:] == kept[0][1:] for s in kept):
        return recv.view(sum(s[0] for s in kept), *kept[0][1:])  # empty chunks hold no elements
    counts = [numel(shape) for shape in shapes]
    parts = [part.view(shape) for part, shape in zip(recv[:sum(counts)].split(counts), shapes)]
    return concat_received(parts, sizes, cat_dim)
