"""What every communicator shares, with no dependency on any of them (a leaf module).

The errors a collective raises, the shard metadata each rank publishes (`ShardMeta`), the
checks that turn disagreeing ranks into one clear error on every rank, the layout math of
variable-length all-gathers and all-to-alls (counts, displacements, packing, concatenation),
the logical-byte accounting (`exchange_traffic`, `all_to_all_traffic`, `TrafficCounter`), and
`Communicator`, the per-rank interface that every `comm` argument in this package satisfies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable, Sequence

import torch

log = logging.getLogger(__name__)

VALID_REDUCE_OPS = ("sum", "max")


class CollectiveError(RuntimeError):
    """A collective could not complete (another rank failed, timed out, or inputs disagree)."""


class CollectiveAborted(CollectiveError):
    """Raised in a rank whose collective was cancelled because another rank failed."""


class CollectiveTimeout(CollectiveError):
    """Raised when some ranks did not reach a collective within the timeout."""


class BackendUnavailable(RuntimeError):
    """A forced backend cannot start (library missing, symbols missing, init failed)."""


# ----------------------------------------------------------------------------- metadata

@dataclass(frozen=True)
class ShardMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype


def gathered_shape(metas: Sequence[ShardMeta], dim: int) -> tuple[int, ...]:
    shape = list(metas[0].shape)
    shape[dim] = sum(m.shape[dim] for m in metas)
    return tuple(shape)


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


def check_exchange_metadata(per_rank: Sequence[Sequence[ShardMeta]], dims: Sequence[int]) -> None:
    """Raise the same clear error on every rank when the ranks' shards cannot be concatenated."""
    counts = [len(m) for m in per_rank]
    if len(set(counts)) != 1:
        raise CollectiveError(f"ranks passed different numbers of tensors to exchange: {counts}")
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
            other_r = [s for d, s in enumerate(m.shape) if d != dim]
            other_0 = [s for d, s in enumerate(first.shape) if d != dim]
            if other_r != other_0:
                raise CollectiveError(
                    f"exchange tensor {i}: shapes {first.shape} (rank 0) and {m.shape} (rank {r}) "
                    f"differ outside the concat dim {dim}")


def numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def nbytes(meta_or_tensor) -> int:
    """Bytes of a ShardMeta or tensor (shape x dtype item size)."""
    return numel(meta_or_tensor.shape) * meta_or_tensor.dtype.itemsize


def displacements(counts: Sequence[int]) -> list[int]:
    """Where each rank's part starts in a rank-major flat buffer (exclusive prefix sums)."""
    out, total = [], 0
    for count in counts:
        out.append(total)
        total += count
    return out


def chunks_back_to_back(tensor: torch.Tensor, dim: int) -> bool:
    """Whether `tensor`'s chunks along `dim` lie back to back in its memory, in order (dense,
    and `dim` is its outermost dim of more than one element)."""
    return tensor.is_contiguous() and all(s == 1 for s in tensor.shape[:dim])


def pack_chunks(tensor: torch.Tensor, sizes: Sequence[int], dim: int,
                workspace: dict | None = None, key=None) -> torch.Tensor:
    """The chunks of `tensor` along `dim`, each flattened, back to back in one dense buffer.

    One copy at most: each chunk is copied straight into its slot of the buffer (new, or
    `workspace[key]`, see `scratch`); none when the chunks already lie back to back in memory.
    """
    if chunks_back_to_back(tensor, dim):
        return tensor.view(-1)  # chunks along the outermost non-trivial dim already are that
    flat = scratch(workspace, key, tensor.numel(), tensor.dtype, tensor.device)
    offset = 0
    for chunk in tensor.split(list(sizes), dim):
        flat.narrow(0, offset, chunk.numel()).view(chunk.shape).copy_(chunk)
        offset += chunk.numel()
    return flat


def pack_peer_chunks(tensor: torch.Tensor, sizes: Sequence[int], dim: int, rank: int,
                     workspace: dict | None = None, key=None,
                     back_to_back: bool = False) -> tuple[torch.Tensor, list[int], list[int]]:
    """What an all-to-all library call sends: the chunks of `tensor` along `dim` for every rank
    but `rank` in one dense flat buffer, and their (counts, displacements) in elements; `rank`'s
    own count is 0 (its chunk is copied straight into its place instead of going through the
    library). One copy per peer chunk at most; none when the chunks already lie back to back
    (the own chunk's elements then sit unused between the others), unless `back_to_back`: then
    the peers' chunks are always packed without that gap (for a call that takes counts but no
    displacements, as torch.distributed's all_to_all_single)."""
    counts = [numel(chunk_shape(tensor.shape, dim, n)) for n in sizes]
    if not back_to_back and chunks_back_to_back(tensor, dim):
        displs = displacements(counts)
        counts[rank] = 0
        return tensor.view(-1), counts, displs
    counts[rank] = 0
    displs = displacements(counts)
    flat = scratch(workspace, key, sum(counts), tensor.dtype, tensor.device)
    for j, chunk in enumerate(tensor.split(list(sizes), dim)):
        if counts[j]:
            flat.narrow(0, displs[j], counts[j]).view(chunk.shape).copy_(chunk)
    return flat, counts, displs


def sequence_major(tensor: torch.Tensor, dim: int, workspace: dict | None = None, key=None) -> torch.Tensor:
    """`tensor` with its concat dim moved to the front, dense: what an all-gather-V sends so
    that the gathered flat buffer, rank after rank, is the concat itself (no cat on unpack).
    A view when that is how the tensor lies in memory already, else one row copy (into a new
    buffer or `workspace[key]`; H3's K/V are [1, H, S_r, D] views of fused qkv rows)."""
    moved = tensor.movedim(dim, 0)
    if moved.is_contiguous():
        return moved
    return scratch(workspace, key, tensor.numel(), tensor.dtype, tensor.device).view(moved.shape).copy_(moved)


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


def check_all_reduce_metadata(metas: Sequence[ShardMeta]) -> None:
    """Raise the same clear error on every rank when the ranks' all-reduce inputs differ."""
    first = metas[0]
    for r, m in enumerate(metas):
        if m != first:
            raise CollectiveError(f"all_reduce: rank {r} has {m.shape}/{m.dtype}, "
                                  f"rank 0 has {first.shape}/{first.dtype}")


class TrafficCounter:
    """Logical bytes one rank sent to / received from other ranks, per collective kind."""

    def __init__(self):
        self._per_op: dict[str, list[int]] = {}  # op -> [sent, received, calls]

    def add(self, op: str, sent: int, received: int) -> None:
        entry = self._per_op.setdefault(op, [0, 0, 0])
        entry[0] += sent
        entry[1] += received
        entry[2] += 1

    def summary(self) -> dict:
        """{"sent", "received", "calls", "by_op": {op: {"sent", "received", "calls"}}}."""
        by_op = {op: {"sent": v[0], "received": v[1], "calls": v[2]} for op, v in self._per_op.items()}
        return {"sent": sum(v[0] for v in self._per_op.values()),
                "received": sum(v[1] for v in self._per_op.values()),
                "calls": sum(v[2] for v in self._per_op.values()),
                "by_op": by_op}


def chunk_shape(shape: Sequence[int], split_dim: int, size: int) -> tuple[int, ...]:
    """Shape of one all-to-all chunk: `shape` with `size` rows along `split_dim`."""
    out = list(shape)
    out[split_dim] = size
    return tuple(out)


def check_send_splits(tensors: Sequence[torch.Tensor], send_splits: Sequence[int], split_dim: int,
                      world_size: int) -> tuple[int, ...]:
    """Validate one rank's all-to-all split sizes locally, before anything is sent."""
    try:
        splits = tuple(int(s) for s in send_splits)
    except (TypeError, ValueError):
        raise ValueError(f"all_to_all_v send_splits must be {world_size} integers, got {send_splits!r}") from None
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


def check_all_to_all_metadata(per_rank: Sequence[Sequence[ShardMeta]], splits: Sequence[Sequence[int]],
                              split_dim: int, cat_dim: int) -> None:
    """Raise the same clear error on every rank when the chunks a rank receives cannot be concatenated."""
    counts = [len(m) for m in per_rank]
    if len(set(counts)) != 1:
        raise CollectiveError(f"ranks passed different numbers of tensors to all_to_all_v: {counts}")
    world = len(per_rank)
    for t in range(counts[0]):
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
                if [s for d, s in enumerate(got) if d != cat_dim] != \
                        [s for d, s in enumerate(want) if d != cat_dim]:
                    raise CollectiveError(
                        f"all_to_all_v tensor {t}: the chunk rank {i} sends to rank {j} has shape "
                        f"{got}, rank {ref}'s has {want}; they must agree outside the concat dim "
                        f"{cat_dim}")


def received_chunk_shapes(metas: Sequence[Sequence[ShardMeta]], splits: Sequence[Sequence[int]],
                          split_dim: int, rank: int) -> list[list[tuple[int, ...]]]:
    """Per tensor, per source rank: the shape of the chunk `rank` receives in an all-to-all
    (from every rank's shard metadata and send splits)."""
    return [[chunk_shape(metas[src][t].shape, split_dim, splits[src][rank]) for src in range(len(metas))]
            for t in range(len(metas[rank]))]


def check_recv_splits(recv_splits, world_size: int) -> tuple[int, ...] | None:
    """Validate one rank's all_to_all_v `recv_splits` locally (None: not given)."""
    if recv_splits is None:
        return None
    try:
        sizes = tuple(int(n) for n in recv_splits)
    except (TypeError, ValueError):
        raise ValueError(f"all_to_all_v recv_splits must be {world_size} integers, got {recv_splits!r}") from None
    if len(sizes) != world_size or any(n < 0 for n in sizes):
        raise ValueError(f"all_to_all_v recv_splits {list(sizes)} must give one size >= 0 per rank "
                         f"({world_size}): the length along cat_dim of the chunk each rank sends this one")
    return sizes


def planned_chunk_shapes(shapes: Sequence[Sequence[int]], send_splits: Sequence[int],
                         recv_splits: Sequence[int], split_dim: int, cat_dim: int,
                         rank: int) -> list[list[tuple[int, ...]]]:
    """`received_chunk_shapes` as `rank`'s plan says, without asking the others: the chunk from
    rank j is like this rank's own chunk (`send_splits[rank]` along split_dim) except along
    cat_dim, where it has `recv_splits[j]`; a source that sends nothing has an empty chunk."""
    out = []
    for shape in shapes:
        own = chunk_shape(shape, split_dim, send_splits[rank])
        out.append([chunk_shape(own, cat_dim, n) if n else chunk_shape(own, split_dim, 0)
                    for n in recv_splits])
    return out


def same_chunk_shape(a: Sequence[int], b: Sequence[int]) -> bool:
    """Two all-to-all chunk shapes that describe the same chunk: equal, or both empty (an empty
    chunk's other dims do not matter: nothing is sent)."""
    return numel(a) == numel(b) and (not numel(a) or tuple(a) == tuple(b))


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


def concat_received(parts: Sequence[torch.Tensor], sizes: Sequence[int], cat_dim: int) -> torch.Tensor:
    """A rank's all-to-all result: the chunks it received, in source order, along cat_dim.

    A source whose split size for this rank is 0 takes no part (its empty chunk need not fit
    the others), so a sub-group of ranks can exchange through one world-wide call; when every
    chunk is empty they are concatenated as they are.
    """
    kept = [p for p, n in zip(parts, sizes) if n] or list(parts)
    return torch.cat(kept, dim=cat_dim)


def unpack_received(recv: torch.Tensor, shapes: Sequence[Sequence[int]], sizes: Sequence[int],
                    cat_dim: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`concat_received` of the chunks lying back to back in the flat buffer `recv` (shapes in
    source order): along dim 0 that concat is the buffer itself, a view; else one cat copy
    (into the flat buffer `out` when given)."""
    kept = [tuple(s) for s, n in zip(shapes, sizes) if n]
    if cat_dim == 0 and kept and all(s[1:] == kept[0][1:] for s in kept):
        return recv.view(sum(s[0] for s in kept), *kept[0][1:])  # empty chunks hold no elements
    parts, offset = [], 0
    for shape in shapes:
        n = numel(shape)
        parts.append(recv.narrow(0, offset, n).view(shape))
        offset += n
    kept_parts = [p for p, n in zip(parts, sizes) if n]
    if out is None or not kept_parts:
        return concat_received(parts, sizes, cat_dim)
    shape = list(kept_parts[0].shape)
    shape[cat_dim] = sum(p.shape[cat_dim] for p in kept_parts)
    return torch.cat(kept_parts, dim=cat_dim, out=out.view(shape))


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


def unflatten_gathered(flat: torch.Tensor, metas, counts, displs, dim: int) -> torch.Tensor:
    """The flat rank-major all-gather buffer of `sequence_major` shards -> their concat along
    `dim`, as a view (the concat's values; not contiguous when dim is not the outermost)."""
    shape = gathered_shape(metas, dim)
    return flat.view(shape[dim], *(s for d, s in enumerate(shape) if d != dim)).movedim(0, dim)


@runtime_checkable
class Communicator(Protocol):
    """One rank's view of its group: what model code (SP, TP, VAE decode) calls, whatever the
    transport (the in-process coordinator's RankComm or the torch.distributed DistributedComm)."""

    rank: int
    world_size: int
    device: torch.device

    def exchange(self, tensors: Sequence[torch.Tensor], cat_dims: int | Sequence[int],
                 shard_sizes: Sequence[int] | None = None, workspace: dict | None = None) -> list[torch.Tensor]:
        """All-gather-V: per tensor, every rank's shard concatenated along its cat dim (may be
        a non-contiguous view). `shard_sizes`: every rank's length along the cat dims when a
        shard plan fixes them; then the shapes need not be exchanged again on every call.
        `workspace`: a dict of buffers the communicator may keep and reuse between calls of one
        call site (the results of the last call from it must be dead by then)."""

    def all_to_all_v(self, tensors, send_splits: Sequence[int], split_dim: int, cat_dim: int | None = None,
                     workspace: dict | None = None, recv_splits: Sequence[int] | None = None):
        """Chunk j of each tensor along split_dim goes to rank j; the received chunks, in source order.
        `recv_splits`: per source rank, the length along cat_dim of the chunk it sends this rank
        (0 for none), when a plan every rank shares fixes them; the first call with a plan
        checks it, later ones need not exchange the shapes again."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Elementwise sum or max over the ranks, bit-identical on every rank."""

    def barrier(self) -> None:
        """Wait until every rank arrives."""

    def byte_counts(self) -> dict:
        """{"sent", "received", "calls", "by_op"}: this rank's logical bytes to / from the others."""
