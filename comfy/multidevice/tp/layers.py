"""The tensor-parallel building blocks: head and width shards, column- and row-parallel linears.

`head_shard` / `width_shard` say which heads / columns rank r of W holds (the same formula as
the sequence shard plan); `ColumnParallelLinear` holds 1/W of the output features,
`RowParallelLinear` 1/W of the input features and all-reduces its output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger(__name__)


class TensorParallelError(ValueError):
    """A model cannot be split as asked (head counts, widths, layout, weights)."""


class QuantizedWeightsError(TensorParallelError):
    """The weights are quantized or wrapped (e.g. the NVFP4 text-encoder file) and cannot be
    sliced. Such a file is small enough for one card: planners may catch this and keep
    the encoder on one card."""


# ----------------------------------------------------------------------------- split plans

@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns."""
    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def check_head_split(q_heads: int, kv_heads: int, world_size: int, where: str = "attention") -> None:
    """Raise TensorParallelError naming the counts and W when the heads cannot be split."""
    if world_size < 1:
        raise TensorParallelError(f"{where}: world size W={world_size} must be at least 1")
    if kv_heads < 1 or q_heads % kv_heads:
        raise TensorParallelError(
            f"{where}: {q_heads} query heads are not a multiple of {kv_heads} KV heads, "
            "so query heads cannot be grouped onto KV heads")
    fits = [w for w in range(1, q_heads + 1) if q_heads % w == 0 and _kv_fits(kv_heads, w)]
    if q_heads % world_size:
        raise TensorParallelError(
            f"{where}: cannot split {q_heads} query heads over W={world_size} ranks "
            f"({q_heads} is not a multiple of {world_size}); use W in {fits}")
    if not _kv_fits(kv_heads, world_size):
        raise TensorParallelError(
            f"{where}: cannot split {kv_heads} KV heads over W={world_size} ranks: W must "
            f"divide {kv_heads} or be a multiple of it (then KV heads are replicated); use W in {fits}")


def _kv_fits(kv_heads: int, world_size: int) -> bool:
    return kv_heads % world_size == 0 or world_size % kv_heads == 0


def head_shard(q_heads: int, kv_heads: int, world_size: int, rank: int) -> HeadShard:
    check_head_split(q_heads, kv_heads, world_size)
    q_count = q_heads // world_size
    kv_count = max(kv_heads // world_size, 1)
    # r*Hkv//W is rank r's first KV head in both cases: with W <= Hkv it is r*(Hkv/W);
    # with W > Hkv it is the one KV head that query head r*Hq/W reads.
    return HeadShard(q_start=rank * q_count, q_count=q_count,
                     kv_start=rank * kv_heads // world_size, kv_count=kv_count)


def width_shard(width: int, world_size: int, rank: int, what: str) -> tuple[int, int]:
    """(start, count) of rank's equal share of `width` columns/rows."""
    if width % world_size:
        raise TensorParallelError(
            f"cannot split {what} of width {width} over W={world_size} ranks: "
            f"{width} is not a multiple of {world_size}")
    count = width // world_size
    return rank * count, count


# ----------------------------------------------------------------------------- slicing

def detached(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor behind a parameter (other tensors as they are)."""
    return tensor.detach() if isinstance(tensor, nn.Parameter) else tensor


def copy_rows(src: torch.Tensor, spans: list[tuple[int, int]], device) -> torch.Tensor:
    """Rows [start, start+count) of every span, stacked, as a fresh tensor on `device`.

    Only the slices' bytes are read and written: narrow() is a view, and copy_ fills a
    new tensor of the slice size, so a read-only or memory-mapped source stays untouched
    and no full copy is made.
    """
    src = detached(src)
    rows = sum(count for _, count in spans)
    out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device=device)
    offset = 0
    for start, count in spans:
        out.narrow(0, offset, count).copy_(src.narrow(0, start, count))
        offset += count
    return out


def copy_columns(src: torch.Tensor, start: int, count: int, device) -> torch.Tensor:
    """Columns [start, start+count) of a 2-D tensor as a fresh contiguous tensor on `device`."""
    return copy_whole(detached(src).narrow(1, start, count), device)


def copy_whole(src: torch.Tensor, device) -> torch.Tensor:
    """A rank's own copy of a replicated tensor (never a view of the shared source)."""
    src = detached(src)
    out = torch.empty(src.shape, dtype=src.dtype, device=device)
    out.copy_(src)
    return out


# ----------------------------------------------------------------------------- layers

def frozen_parameter(tensor: torch.Tensor | None):
    """`tensor` as a parameter that takes no gradient (None stays None)."""
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """This rank's output rows of a linear layer: y_local = x @ W_local.T + b_local.

    No communication: the next layer consumes the local slice (heads, or the MLP's
    intermediate columns).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = frozen_parameter(weight)
        self.bias = frozen_parameter(bias)
        self.out_features, self.in_features = weight.shape

    @classmethod
    def from_full(cls, weight, bias, spans: list[tuple[int, int]], device) -> "ColumnParallelLinear":
        return cls(copy_rows(weight, spans, device),
                   None if bias is None else copy_rows(bias, spans, device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Weights may be stored narrower than the activations (bf16 weights, fp32
        # activations as ComfyUI runs its text encoders): compute in x's dtype.
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features(local)={self.out_features}"


class RowParallelLinear(nn.Module):
    """This rank's input columns of a linear layer; the ranks' partial products are summed.

    y = all_reduce_sum(x_local @ W[:, cols].T) + b. The bias is added once, after the sum.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm):
        super().__init__()
        self.weight = frozen_parameter(weight)
        self.bias = frozen_parameter(bias)
        self.out_features, self.in_features = weight.shape
        self.comm = comm

    @classmethod
    def from_full(cls, weight, bias, start: int, count: int, comm) -> "RowParallelLinear":
        return cls(copy_columns(weight, start, count, comm.device),
                   None if bias is None else copy_whole(bias, comm.device), comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight.to(x.dtype))
        out = self.comm.all_reduce(partial, "sum")
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"in_features(local)={self.in_features}, out_features={self.out_features}, all_reduce=sum"
