"""The attention working set of ranks that share one memory (CPU "cards").

On its own card, each rank's attention may take what that card has free. CPU ranks share the
host's RAM, and upstream's CPU attention (the sub-quadratic one in
comfy/ldm/modules/attention.py) sizes its query chunks from the free memory it sees: the
largest chunk whose fp32 score block [batch*heads, rows, keys] takes at most a quarter of it.
Every rank sees the same free memory, so W ranks at once would hold W such blocks: W times what
one card needs, which is how four CPU ranks at 768p 15 s ran out of memory where one fitted.

So a rank that shares memory hands the attention at most 1/W of those rows per call (with its
own heads: under Ulysses a rank holds H/W heads and its pieces stay one card's size): the W
ranks together hold one card's blocks. Attention rows are independent of each other (each
query row sees every key), so the rows computed are the same.
"""

from __future__ import annotations

from typing import Callable

import torch

from comfy.multidevice.devices import available_memory_bytes

SCORE_BYTES = 4  # fp32 scores: upstream's CPU attention computes them in fp32
FREE_SHARE = 4  # all ranks' score blocks together: at most a quarter of the free memory


def shares_host_memory(device) -> bool:
    """Whether ranks on `device` draw on the host's RAM together (CPU ranks of one host)."""
    return torch.device(device).type == "cpu"


def score_block_bytes(batch_heads: int, rows: int, keys: int) -> int:
    return batch_heads * rows * keys * SCORE_BYTES


def rows_per_call(world: int, batch_heads: int, keys: int, free_bytes: int) -> int:
    """Query rows one rank may hand the attention at once so that `world` ranks' score blocks
    together take at most 1/FREE_SHARE of `free_bytes` (at least one row)."""
    per_rank = free_bytes // (FREE_SHARE * max(world, 1))
    return max(1, per_rank // max(score_block_bytes(batch_heads, 1, keys), 1))


def attend_within_budget(comm, attention_fn: Callable, q, k, v, heads, *args, rows: int | None = None, **kwargs):
    """The rank's attention call `attention_fn(q, k, v, heads, ...)`; on ranks that share one
    memory, over pieces of at most `rows` query rows (default `rows_per_call` from the host's
    available memory now, with this rank's batch x heads), joined. One function, not two: it
    sits on every attention call's path.

    q is [B, heads, L, D] with skip_reshape (H3's layout), else [B, L, heads*D]; the output is
    [B, heads, L, D] with skip_output_reshape, else [B, L, heads*D]."""
    seq_dim = 2 if kwargs.get("skip_reshape", False) else 1
    if rows is None and comm.world_size > 1 and shares_host_memory(getattr(comm, "device", q.device)):
        free = available_memory_bytes()
        if free is not None:
            rows = rows_per_call(comm.world_size, q.shape[0] * heads, k.shape[seq_dim], free)
    if rows is None or q.shape[seq_dim] <= rows:
        return attention_fn(q, k, v, heads, *args, **kwargs)
    out_dim = 2 if kwargs.get("skip_output_reshape", False) else 1
    pieces = [attention_fn(piece, k, v, heads, *args, **kwargs) for piece in q.split(rows, dim=seq_dim)]
    return torch.cat(pieces, dim=out_dim)
