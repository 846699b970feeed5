"""Tensor parallelism for Llama/Qwen-style decoders (MiniMax-H3's Qwen3-VL text encoder).

H3's text encoder (Qwen3-VL-32B cut to 50 layers, ~51.5 GB in BF16) does not fit on one
card beside anything else. Split over W ranks, each rank holds about 1/W of it:

  attention  q/k/v projections are column-parallel by heads: rank r owns query heads
             [r*Hq/W, (r+1)*Hq/W) and max(Hkv/W, 1) KV heads starting at r*Hkv//W. When
             W > Hkv each KV head is replicated on W/Hkv ranks; rank r's query heads are
             exactly the ones that read KV head r*Hkv//W (query head h reads KV head
             h // (Hq/Hkv)), so attention stays rank-local. o_proj is row-parallel.
  MLP        gate and up are column-parallel over the intermediate width (a fused
             gate|up weight is cut so each rank keeps its gate rows and the matching up
             rows); down_proj is row-parallel.
  row-parallel layers end in comm.all_reduce(partial, "sum"): two per layer.
  replicated everything else: embeddings, RMSNorms (incl. per-head q/k norms), RoPE.

Only the per-rank communicator interface is used (comm.rank, comm.world_size,
comm.device, comm.all_reduce), so a shard runs over RankComm (comfy/multidevice.py,
one process, W threads) or over the torch.distributed communicator (comfy/multinode.py,
one process per rank) alike.

Weights come from the module being split or from a mapping of full tensors (a state
dict, or the zero-copy read-only views of comfy/shared_checkpoint.py). Each rank copies
only its own slice to its device: a narrow() view of the full tensor, copied into a
fresh tensor of the slice's size. No rank ever holds or creates a full copy.

Entry points
  shard_decoder(decoder, comm, weights=None)            one rank's shard (any communicator)
  build_tensor_parallel_decoder(decoder, coordinator)   all shards + a fan-out module
  tensor_parallel_clip(clip, coordinator)               upstream ComfyUI CLIP -> a new CLIP
                                                        (the node's entry point; input untouched)
  check_tensor_parallel_clip(clip, world_size)          its checks alone, for planners
  apply_tensor_parallel_text_encoder(clip, coordinator) the same, in place on `clip`
  remove_tensor_parallel_text_encoder(clip)             undo the in-place version
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Mapping

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
    if q_heads % world_size:
        fits = [w for w in range(1, q_heads + 1) if q_heads % w == 0 and _kv_fits(kv_heads, w)]
        raise TensorParallelError(
            f"{where}: cannot split {q_heads} query heads over W={world_size} ranks "
            f"({q_heads} is not a multiple of {world_size}); use W in {fits}")
    if not _kv_fits(kv_heads, world_size):
        fits = [w for w in range(1, q_heads + 1) if q_heads % w == 0 and _kv_fits(kv_heads, w)]
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

def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if isinstance(tensor, nn.Parameter) else tensor


def copy_rows(src: torch.Tensor, spans: list[tuple[int, int]], device) -> torch.Tensor:
    """Rows [start, start+count) of every span, stacked, as a fresh tensor on `device`.

    Only the slices' bytes are read and written: narrow() is a view, and copy_ fills a
    new tensor of the slice size, so a read-only or memory-mapped source stays untouched
    and no full copy is made.
    """
    src = _plain(src)
    rows = sum(count for _, count in spans)
    out = torch.empty((rows, *src.shape[1:]), dtype=src.dtype, device=device)
    offset = 0
    for start, count in spans:
        out.narrow(0, offset, count).copy_(src.narrow(0, start, count))
        offset += count
    return out


def copy_columns(src: torch.Tensor, start: int, count: int, device) -> torch.Tensor:
    """Columns [start, start+count) of a 2-D tensor as a fresh contiguous tensor on `device`."""
    src = _plain(src)
    out = torch.empty((src.shape[0], count), dtype=src.dtype, device=device)
    out.copy_(src.narrow(1, start, count))
    return out


def copy_whole(src: torch.Tensor, device) -> torch.Tensor:
    """A rank's own copy of a replicated tensor (never a view of the shared source)."""
    src = _plain(src)
    out = torch.empty(src.shape, dtype=src.dtype, device=device)
    out.copy_(src)
    return out


# ----------------------------------------------------------------------------- layers

def _frozen(tensor: torch.Tensor | None):
    return None if tensor is None else nn.Parameter(tensor, requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """This rank's output rows of a linear layer: y_local = x @ W_local.T + b_local.

    No communication: the next layer consumes the local slice (heads, or the MLP's
    intermediate columns).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = _frozen(weight)
        self.bias = _frozen(bias)
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
        self.weight = _frozen(weight)
        self.bias = _frozen(bias)
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


# ----------------------------------------------------------------------------- decoder layout
#
# The layout this converter relies on, shared by upstream ComfyUI's Llama-family decoder
# (comfy/text_encoders/llama.py: Llama2_, TransformerBlock, Attention, MLP) and by
# comfy/text_encoders/miniature_decoder.py:
#   decoder.layers                   a ModuleList of blocks
#   block.self_attn, block.mlp       the two parts that get split
#   self_attn.num_heads / num_kv_heads / head_dim   ints that the attention's forward reads
#       each call to reshape q/k/v and to decide on grouped-query attention (upstream
#       passes enable_gqa when num_heads != num_kv_heads), so a shard only sets them
#   self_attn.inner_size / kv_size   num_heads*head_dim and num_kv_heads*head_dim; upstream
#       splits a fused qkv output and views the attention output with them
#   self_attn.q_proj/k_proj/v_proj or qkv_proj (q rows, then k rows, then v rows),
#       self_attn.o_proj                         weights [out, in], optional bias
#   mlp.gate_proj/up_proj or gate_up_proj (gate rows first: upstream chunks the fused
#       output into gate, up), mlp.down_proj
# Everything else (embed_tokens, RMSNorms, q_norm/k_norm over head_dim, the final norm,
# RoPE, which has no weights) is replicated.

_ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class _LayerLayout:
    index: int
    q_heads: int
    kv_heads: int
    head_dim: int
    fused_qkv: bool
    fused_mlp: bool
    intermediate: int


def _linear_weight_shape(module: nn.Module, where: str) -> tuple[int, int]:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TensorParallelError(f"{where} has no 2-D weight (found {type(weight).__name__}); "
                                  "only plain dense linear layers can be split")
    if not weight.is_floating_point() or type(_plain(weight)) is not torch.Tensor:
        raise QuantizedWeightsError(
            f"{where}.weight is a {type(weight).__name__} of dtype {weight.dtype}; quantized or "
            "wrapped weights cannot be sliced for tensor parallel: use the bf16/fp16/fp32 "
            "text-encoder file, or keep this (smaller) encoder on one card")
    return tuple(weight.shape)


def inspect_decoder(decoder: nn.Module) -> list[_LayerLayout]:
    """Read and check every layer's split-relevant layout; raises TensorParallelError."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TensorParallelError(
            f"{type(decoder).__name__} has no non-empty `layers` ModuleList; expected a "
            "Llama/Qwen-style decoder (layers[i].self_attn, layers[i].mlp)")
    out = []
    for i, block in enumerate(layers):
        where = f"layers.{i}"
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        if attn is None or mlp is None:
            raise TensorParallelError(f"{where} ({type(block).__name__}) lacks self_attn or mlp")
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            if not isinstance(getattr(attn, name, None), int):
                raise TensorParallelError(f"{where}.self_attn has no integer attribute `{name}`")
        hq, hkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        fused_qkv = getattr(attn, "qkv_proj", None) is not None
        if fused_qkv:
            shapes = {"qkv_proj": (hq * hd + 2 * hkv * hd, None)}
        else:
            shapes = {"q_proj": (hq * hd, None), "k_proj": (hkv * hd, None), "v_proj": (hkv * hd, None)}
        shapes["o_proj"] = (None, hq * hd)
        fused_mlp = getattr(mlp, "gate_up_proj", None) is not None
        names = {**{k: attn for k in shapes}, **{k: mlp for k in
                 (("gate_up_proj", "down_proj") if fused_mlp else ("gate_proj", "up_proj", "down_proj"))}}
        found = {}
        for name, owner in names.items():
            module = getattr(owner, name, None)
            part = "self_attn" if owner is attn else "mlp"
            if module is None:
                raise TensorParallelError(f"{where}.{part} has no `{name}` linear layer")
            found[name] = _linear_weight_shape(module, f"{where}.{part}.{name}")
        for name, (rows, cols) in shapes.items():
            got = found[name]
            if (rows is not None and got[0] != rows) or (cols is not None and got[1] != cols):
                raise TensorParallelError(
                    f"{where}.self_attn.{name} weight is {list(got)} but {hq} query heads, "
                    f"{hkv} KV heads and head_dim {hd} need {[rows, cols]} (None = any)")
        inter = found["down_proj"][1]
        gate_rows = found["gate_up_proj"][0] if fused_mlp else found["gate_proj"][0]
        want_gate = 2 * inter if fused_mlp else inter
        if gate_rows != want_gate or (not fused_mlp and found["up_proj"][0] != inter):
            raise TensorParallelError(
                f"{where}.mlp: gate/up rows {gate_rows} do not match down_proj's input width {inter}")
        out.append(_LayerLayout(i, hq, hkv, hd, fused_qkv, fused_mlp, inter))
    return out


def check_decoder_split(decoder: nn.Module, world_size: int) -> list[_LayerLayout]:
    """Everything that could make a split fail, checked before any weight is touched."""
    layouts = inspect_decoder(decoder)
    for lay in layouts:
        check_head_split(lay.q_heads, lay.kv_heads, world_size, where=f"layers.{lay.index}.self_attn")
        width_shard(lay.intermediate, world_size, 0, f"layers.{lay.index}.mlp intermediate")
    return layouts


# ----------------------------------------------------------------------------- weight source

class _WeightSource:
    """Full tensors by decoder-relative name: from `weights` if given, else from the module.

    With `weights`, every parameter must come from it (that is the point: the module may
    hold nothing useful, e.g. meta tensors); buffers missing from it (non-persistent ones
    such as precomputed tables) fall back to the module's own.
    """

    def __init__(self, decoder: nn.Module, weights: Mapping[str, torch.Tensor] | None):
        self.weights = weights
        self.own = dict(decoder.named_parameters(remove_duplicate=False))
        self.own.update(decoder.named_buffers(remove_duplicate=False))

    def has(self, name: str) -> bool:
        return name in self.own

    def get(self, name: str) -> torch.Tensor:
        own = self.own.get(name)
        use_weights = self.weights is not None and (
            own is None or isinstance(own, nn.Parameter) or name in self.weights)
        if not use_weights:
            if own is None:
                raise TensorParallelError(f"the decoder has no tensor named {name!r}")
            return own
        if name not in self.weights:
            raise TensorParallelError(
                f"weight {name!r} is missing from the given weights; pass weights keyed like the "
                "decoder's state_dict (prefixed_weights() strips a checkpoint's prefix)")
        tensor = self.weights[name]
        if own is not None and tuple(own.shape) != tuple(tensor.shape):
            raise TensorParallelError(f"weight {name!r} has shape {list(tensor.shape)} in the given "
                                      f"weights but {list(own.shape)} in the model")
        return tensor

    def check_all(self) -> None:
        """Fetch every parameter once (no copy), so missing or mis-shaped weights fail early."""
        for name, tensor in self.own.items():
            if isinstance(tensor, nn.Parameter):
                self.get(name)


class prefixed_weights(Mapping):
    """A read-only view of `weights` with `prefix` stripped from its keys (no tensor copied).

    E.g. prefixed_weights(te_checkpoint, "model.") maps "layers.0.mlp.down_proj.weight" to
    te_checkpoint["model.layers.0.mlp.down_proj.weight"].
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], prefix: str):
        self.weights, self.prefix = weights, prefix

    def __getitem__(self, key):
        return self.weights[self.prefix + key]

    def __contains__(self, key):
        return (self.prefix + key) in self.weights

    def __iter__(self):
        n = len(self.prefix)
        return (k[n:] for k in self.weights if k.startswith(self.prefix))

    def __len__(self):
        return sum(1 for _ in self)


# ----------------------------------------------------------------------------- sharding

def _shallow_module_copy(module: nn.Module) -> nn.Module:
    """Same class and attributes, but its own parameter/buffer/child/hook containers, so
    assigning into the copy never changes the original."""
    new = copy.copy(module)
    for key, value in module.__dict__.items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    return new


def _clone_structure(module: nn.Module, prefix: str, device, source: _WeightSource,
                     skip: set[str]) -> nn.Module:
    """A copy of `module` whose replicated tensors are fresh copies on `device`.

    The object itself is copied shallowly (same class, same plain attributes, so its own
    forward runs unchanged); its parameter/buffer/child registries are rebuilt, so the
    original is never modified. Children whose qualified name is in `skip` are left out
    (the caller installs parallel layers there).
    """
    new = _shallow_module_copy(module)
    for name, param in module._parameters.items():
        new._parameters[name] = None if param is None else _frozen(
            copy_whole(source.get(prefix + name), device))
    for name, buf in module._buffers.items():
        new._buffers[name] = None if buf is None else copy_whole(source.get(prefix + name), device)
    for name, child in module._modules.items():
        qual = prefix + name
        if child is None or qual in skip:
            new._modules[name] = None
        else:
            new._modules[name] = _clone_structure(child, qual + ".", device, source, skip)
    return new


def shard_decoder(decoder: nn.Module, comm, weights: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """This rank's tensor-parallel shard of a Llama/Qwen-style decoder.

    Returns a module of the same class that runs the decoder's own forward on rank
    comm.rank of comm.world_size: split linear layers in place of the originals, each
    attention's head counts set to this rank's share, everything else replicated on
    comm.device. `decoder` is not modified. `weights` (optional) maps decoder-relative
    names to full tensors, e.g. read-only views of a shared checkpoint; otherwise the
    decoder's own tensors are sliced. Call it on every rank; the shards' row-parallel
    layers all-reduce through `comm`.
    """
    world, rank, device = comm.world_size, comm.rank, comm.device
    layouts = check_decoder_split(decoder, world)
    source = _WeightSource(decoder, weights)
    skip = set()
    for lay in layouts:
        skip.update(f"layers.{lay.index}.self_attn.{n}" for n in _ATTN_LINEARS)
        skip.update(f"layers.{lay.index}.mlp.{n}" for n in _MLP_LINEARS)
    shard = _clone_structure(decoder, "", device, source, skip)
    for lay in layouts:
        block = shard.layers[lay.index]
        _shard_attention(block.self_attn, lay, f"layers.{lay.index}.self_attn.", comm, source)
        _shard_mlp(block.mlp, lay, f"layers.{lay.index}.mlp.", comm, source)
    config = getattr(shard, "config", None)
    if config is not None and hasattr(config, "num_attention_heads"):
        # Keep the shard's config consistent with its layers (upstream sizes KV caches
        # from config.num_key_value_heads); the original config object is untouched.
        heads = head_shard(layouts[0].q_heads, layouts[0].kv_heads, world, rank)
        shard.config = copy.copy(config)
        shard.config.num_attention_heads = heads.q_count
        if hasattr(config, "num_key_value_heads"):
            shard.config.num_key_value_heads = heads.kv_count
    log.debug("rank %d/%d: decoder shard built on %s, %d weight bytes", rank, world, device,
              weight_bytes(shard))
    return shard


def _bias(source: _WeightSource, linear_prefix: str):
    name = linear_prefix + "bias"
    return source.get(name) if source.has(name) else None


def _shard_attention(attn: nn.Module, lay: _LayerLayout, prefix: str, comm, source: _WeightSource):
    heads = head_shard(lay.q_heads, lay.kv_heads, comm.world_size, comm.rank)
    hd, device = lay.head_dim, comm.device
    q_span = (heads.q_start * hd, heads.q_count * hd)
    kv_span = (heads.kv_start * hd, heads.kv_count * hd)
    if lay.fused_qkv:
        q_rows, kv_rows = lay.q_heads * hd, lay.kv_heads * hd
        spans = [q_span, (q_rows + kv_span[0], kv_span[1]), (q_rows + kv_rows + kv_span[0], kv_span[1])]
        attn.qkv_proj = ColumnParallelLinear.from_full(
            source.get(prefix + "qkv_proj.weight"), _bias(source, prefix + "qkv_proj."),
            spans, device)
    else:
        for name, span in (("q_proj", q_span), ("k_proj", kv_span), ("v_proj", kv_span)):
            setattr(attn, name, ColumnParallelLinear.from_full(
                source.get(prefix + name + ".weight"), _bias(source, prefix + name + "."),
                [span], device))
    attn.o_proj = RowParallelLinear.from_full(
        source.get(prefix + "o_proj.weight"), _bias(source, prefix + "o_proj."),
        q_span[0], q_span[1], comm)
    attn.num_heads, attn.num_kv_heads = heads.q_count, heads.kv_count
    if hasattr(attn, "inner_size"):
        attn.inner_size = heads.q_count * hd
    if hasattr(attn, "kv_size"):
        attn.kv_size = heads.kv_count * hd


def _shard_mlp(mlp: nn.Module, lay: _LayerLayout, prefix: str, comm, source: _WeightSource):
    start, count = width_shard(lay.intermediate, comm.world_size, comm.rank,
                               f"layers.{lay.index}.mlp intermediate")
    device = comm.device
    if lay.fused_mlp:
        # Gate rows [start, start+count) and the matching up rows, so the local output
        # still chunks into (gate, up) halves that belong together.
        spans = [(start, count), (lay.intermediate + start, count)]
        mlp.gate_up_proj = ColumnParallelLinear.from_full(
            source.get(prefix + "gate_up_proj.weight"),
            _bias(source, prefix + "gate_up_proj."), spans, device)
    else:
        for name in ("gate_proj", "up_proj"):
            setattr(mlp, name, ColumnParallelLinear.from_full(
                source.get(prefix + name + ".weight"), _bias(source, prefix + name + "."),
                [(start, count)], device))
    mlp.down_proj = RowParallelLinear.from_full(
        source.get(prefix + "down_proj.weight"), _bias(source, prefix + "down_proj."),
        start, count, comm)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of memory held by a module's parameters and buffers (each storage counted once).

    Counting storages, not tensor sizes, also catches a slice that keeps a whole source
    tensor alive.
    """
    seen, total = set(), 0
    for t in list(module.parameters()) + list(module.buffers()):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


# ----------------------------------------------------------------------------- fan-out

def _to_rank(obj, device, copy_tensors: bool):
    """Tensors inside obj (tuples, lists, dicts) on `device`; always copied if copy_tensors.

    Ranks need their own copies even on one device: upstream's blocks write results
    into their input buffer.
    """
    if isinstance(obj, torch.Tensor):
        if copy_tensors:
            return obj.to(device, copy=True)
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to_rank(o, device, copy_tensors) for o in obj)
    if isinstance(obj, list):
        return [_to_rank(o, device, copy_tensors) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_rank(v, device, copy_tensors) for k, v in obj.items()}
    return obj


def _first_tensor_device(obj):
    if isinstance(obj, torch.Tensor):
        return obj.device
    if isinstance(obj, (tuple, list)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    else:
        return None
    for item in items:
        device = _first_tensor_device(item)
        if device is not None:
            return device
    return None


class TensorParallelDecoder(nn.Module):
    """Runs a decoder's W shards concurrently on a coordinator's rank threads.

    forward(*args, **kwargs) takes whatever the original decoder's forward takes: every
    tensor argument is copied to each rank's device, each rank runs its shard, and rank
    0's result comes back on the device of the first tensor argument. The shards are
    kept outside the module tree (model managers moving this module must not move
    them); the original's input embedding is kept as a submodule so callers that embed
    tokens themselves (upstream's SDClipModel) still find `embed_tokens`.
    """

    # Upstream's ComfyUI model code reads these flags from the language model.
    fixed_kv = False
    graph_dynamic_vbar_blocks = False
    prefetch_dynamic_vbars = False

    def __init__(self, coordinator, shards: list[nn.Module], source: nn.Module | None = None):
        super().__init__()
        if len(shards) != coordinator.world_size:
            raise TensorParallelError(f"{len(shards)} shards for {coordinator.world_size} ranks")
        self.coordinator = coordinator
        self.shards = list(shards)  # a plain list: not registered as submodules
        self._source = [source]     # ditto: the single-device decoder, for remove/re-shard
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

    def get_dynamic_vram__units(self):
        # Upstream's CLIP wrapper asks the language model for offloadable units; the
        # shards stay resident on their ranks, so there are none.
        return [], []

    def forward(self, *args, **kwargs):
        if kwargs.get("past_key_values") is not None:
            raise TensorParallelError(
                "text generation (past_key_values) is not supported by the tensor-parallel text "
                "encoder; it only encodes prompts. Use the single-device CLIP for generation")
        out_device = _first_tensor_device((args, kwargs))
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        per_rank = [(_to_rank(args, dev, True), _to_rank(kwargs, dev, True))
                    for dev in self.coordinator.devices]
        shards = self.shards

        def run_shard(rank, comm, call):
            # Grad and inference mode are thread-local: mirror the caller's.
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                return shards[rank](*call[0], **call[1])

        results = self.coordinator.run(run_shard, per_rank)
        if out_device is None:
            return results[0]
        return _to_rank(results[0], out_device, False)


def build_tensor_parallel_decoder(decoder: nn.Module, coordinator,
                                  weights: Mapping[str, torch.Tensor] | None = None) -> TensorParallelDecoder:
    """Split `decoder` over all ranks of `coordinator` and return the fan-out module.

    Every check runs on the caller's thread before any weight moves; then each rank
    slices its own shard onto its device in its own thread. `decoder` is not modified.
    """
    check_decoder_split(decoder, coordinator.world_size)
    if weights is not None:
        _WeightSource(decoder, weights).check_all()

    def build(rank, comm):
        return shard_decoder(decoder, comm, weights)

    shards = coordinator.run(build)
    for rank, shard in enumerate(shards):
        log.info("tensor parallel: rank %d/%d on %s holds %.1f MiB of weights", rank,
                 coordinator.world_size, coordinator.devices[rank], weight_bytes(shard) / 2**20)
    return TensorParallelDecoder(coordinator, shards, source=decoder)


# ----------------------------------------------------------------------------- upstream CLIP
#
# Upstream facts this relies on (ComfyUI, comfy/text_encoders/{minimax,qwen3vl,llama}.py
# and comfy/sd1_clip.py, comfy/sd.py):
# - A loaded text encoder is a comfy.sd.CLIP whose `cond_stage_model` is an SD1ClipModel;
#   that object's `clip` attribute is a *string* naming the attribute that holds the
#   SDClipModel (for H3, MiniMaxH3TEModel uses the name "qwen3vl_32b").
# - SDClipModel.transformer is the Qwen3VL module (MiniMaxQwen3VL for H3). It holds the
#   language model at `.model` (a Llama2_) and the vision tower at `.visual`; its forward
#   calls self.model(input_ids, attention_mask=..., embeds=..., ..., position_ids=...,
#   visual_pos_masks=..., deepstack_embeds=...) and returns what that returns.
# - SDClipModel embeds the tokens itself through transformer.get_input_embeddings(),
#   which returns self.model.embed_tokens, on its execution device, then passes `embeds`.
# - Llama2_: embed_tokens, layers (TransformerBlock: self_attn, mlp, input_layernorm,
#   post_attention_layernorm), norm (None for the H3 encoder: final_norm False), config
#   (Qwen3VL_32BConfig: hidden 5120, 64 query heads, 8 KV heads inherited from the 8B
#   config, head_dim 128, intermediate 25600, 50 layers, merged_qkv/merged_mlp False).
#   Its forward computes RoPE (interleaved MRoPE) and the mask from its own inputs, on
#   x's device, then runs the layers with optimized_attention_for_device(x.device).
#   It runs each layer through comfy.model_prefetch.prefetch_queue_pop; the prefetch
#   queue is None unless prefetch_dynamic_vbars is requested, which Llama2_ only does
#   with a KV cache (generation), so for encoding each layer is simply called. CUDA
#   graph capture is likewise only enabled for KV-cache decoding.
# - Attention: q_proj/k_proj/v_proj (or qkv_proj when config.merged_qkv), o_proj without
#   bias, per-head q_norm/k_norm RMSNorms over head_dim; forward views q/k/v with
#   self.num_heads / self.num_kv_heads / self.head_dim, splits a fused qkv output with
#   self.inner_size / self.kv_size, and passes enable_gqa=True when the two head counts
#   differ. MLP: gate_proj/up_proj/down_proj (or gate_up_proj chunked gate-first).
# - TransformerBlock writes its output into the buffer of its input x
#   (torch.add(..., out=x)), hence the per-rank input copies in TensorParallelDecoder.
# - Weights in a text-encoder file are named relative to `transformer`, so the language
#   model's tensors carry the prefix "model." (loaded by SDClipModel.load_sd).
# - comfy.sd.CLIP.clone() returns a new CLIP with patcher = self.patcher.clone() and the
#   *same* cond_stage_model object; ModelPatcher.clone() builds a patcher around the same
#   `.model` (ModelPatcher keeps the module it manages in its `model` attribute).
# - Upstream's CLIP patcher applies weight patches (e.g. a CLIP LoRA) when it loads the
#   model; `clip.patcher.patches` maps state-dict keys of cond_stage_model to patches.

def _locate_language_model(clip) -> tuple[Any, nn.Module, str]:
    """(transformer, language model, state-dict prefix of the language model) or a clear error."""
    cond = getattr(clip, "cond_stage_model", None)
    if cond is None:
        raise TensorParallelError(
            f"expected a ComfyUI CLIP with a `cond_stage_model`, got {type(clip).__name__}")
    name = getattr(cond, "clip", None)
    inner = getattr(cond, name, None) if isinstance(name, str) else None
    transformer = getattr(inner, "transformer", None)
    model = getattr(transformer, "model", None)
    if model is None:
        raise TensorParallelError(
            f"{type(cond).__name__} does not hold a language model at "
            f"cond_stage_model.<clip name>.transformer.model (clip name {name!r}); "
            "tensor parallel supports the Llama/Qwen-family text encoders (e.g. CLIPLoader type minimax)")
    return transformer, model, f"{name}.transformer.model."


def _checked_source(clip, coordinator) -> nn.Module:
    """The single-device language model to split, after every check that can fail."""
    _, model, key_prefix = _locate_language_model(clip)
    if isinstance(model, TensorParallelDecoder):
        model = model.source_decoder  # re-split from the kept original
    patcher = getattr(clip, "patcher", None)
    patched = [k for k in (getattr(patcher, "patches", None) or {}) if k.startswith(key_prefix)]
    if patched:
        raise TensorParallelError(
            f"the CLIP carries {len(patched)} weight patch(es) on its language model (e.g. "
            f"{patched[0]!r}, from a CLIP LoRA); tensor parallel slices unpatched weights. "
            "Remove the CLIP LoRA or keep the text encoder on one card")
    check_decoder_split(model, coordinator.world_size)
    return model


def language_model_of(clip) -> nn.Module:
    """The language model inside a ComfyUI CLIP; TensorParallelError for another layout."""
    return _locate_language_model(clip)[1]


def check_tensor_parallel_clip(clip, world_size: int) -> None:
    """Every check tensor_parallel_clip makes for W=world_size, touching nothing.

    For planners that validate before creating a coordinator; raises TensorParallelError.
    """
    _checked_source(clip, _WorldSize(world_size))


@dataclass(frozen=True)
class _WorldSize:
    world_size: int


def apply_tensor_parallel_text_encoder(clip, coordinator, weights: Mapping[str, torch.Tensor] | None = None,
                                       weights_prefix: str = "model.") -> Any:
    """Put a ComfyUI CLIP's language model in tensor parallel over `coordinator`'s ranks.

    clip         a comfy.sd.CLIP (CLIPLoader output) of a Llama/Qwen-family encoder, e.g.
                 MiniMax-H3's Qwen3-VL (type minimax). Modified in place and returned.
    coordinator  a SequenceParallelCoordinator; its world size W must split the encoder's
                 heads (64 query / 8 KV heads for H3: W in 1, 2, 4, 8, 16, 32, 64) and MLP width.
    weights      optional full tensors of the text-encoder file (e.g. a SharedCheckpoint's
                 read-only views), named as in the file; `weights_prefix` is the language
                 model's prefix there ("model."). Without it the loaded module is sliced.

    What changes: clip.cond_stage_model.<name>.transformer.model becomes a
    TensorParallelDecoder; rank r holds 1/W of every layer's linear weights plus
    replicated norms and embeddings on coordinator.devices[r]. Encoding then runs on all
    ranks at once and returns rank 0's hidden states, equal to the single-device result
    up to float summation order. The vision tower stays where the CLIP's own patcher
    loads it (one card). The single-device language model is kept (not moved) for
    remove_tensor_parallel_text_encoder(). Calling again with the same coordinator is a
    no-op; with another coordinator the encoder is re-split from the kept original.
    Errors (TensorParallelError) are raised before anything is changed.
    """
    transformer, model, _ = _locate_language_model(clip)
    if isinstance(model, TensorParallelDecoder) and model.coordinator is coordinator:
        return clip
    model = _checked_source(clip, coordinator)
    source = prefixed_weights(weights, weights_prefix) if weights is not None else None
    wrapper = build_tensor_parallel_decoder(model, coordinator, weights=source)
    transformer.model = wrapper
    if getattr(transformer, "visual", None) is not None:
        log.info("tensor parallel text encoder: the vision tower is not split; it runs on one "
                 "card, the CLIP's load device")
    log.info("tensor parallel text encoder: %d layers over %d ranks (%s); the single-device "
             "language model is kept on %s for remove_tensor_parallel_text_encoder()",
             len(model.layers), coordinator.world_size, ", ".join(map(str, coordinator.devices)),
             _device_of(model))
    return clip


def tensor_parallel_clip(clip, coordinator, weights: Mapping[str, torch.Tensor] | None = None,
                         weights_prefix: str = "model.") -> Any:
    """A new CLIP whose language model runs tensor parallel over `coordinator`; `clip` is untouched.

    The entry point for MultiNPUParallelConfig. Same arguments, checks and result as
    apply_tensor_parallel_text_encoder, but on a copy: clip.clone() (upstream: a new CLIP
    whose patcher is a clone, both still sharing the one cond_stage_model), then fresh
    shallow copies of the objects on the path cond_stage_model -> <clip name> ->
    transformer, so that replacing transformer.model in the copy leaves the input CLIP's
    encoder as it was. Everything else (tokenizer, vision tower, embeddings, the
    single-device language model) is shared, not copied. The copy's patcher is pointed
    at the copied cond_stage_model. Errors are raised before anything is copied.
    """
    _checked_source(clip, coordinator)  # fail before copying anything
    new = clip.clone() if hasattr(clip, "clone") else copy.copy(clip)
    cond = clip.cond_stage_model
    new_cond = _shallow_module_copy(cond) if isinstance(cond, nn.Module) else copy.copy(cond)
    inner = getattr(cond, cond.clip)
    new_inner = _shallow_module_copy(inner)
    new_inner.transformer = _shallow_module_copy(inner.transformer)
    setattr(new_cond, cond.clip, new_inner)
    new.cond_stage_model = new_cond
    patcher = getattr(new, "patcher", None)
    if getattr(patcher, "model", None) is cond:  # upstream's patcher manages cond_stage_model
        patcher.model = new_cond
    return apply_tensor_parallel_text_encoder(new, coordinator, weights=weights,
                                              weights_prefix=weights_prefix)


def remove_tensor_parallel_text_encoder(clip) -> Any:
    """Undo apply_tensor_parallel_text_encoder: put the single-device language model back."""
    transformer, model, _ = _locate_language_model(clip)
    if isinstance(model, TensorParallelDecoder):
        transformer.model = model.source_decoder
    return clip


def _device_of(module: nn.Module) -> str:
    for t in module.parameters():
        return str(t.device)
    return "no parameters"


__all__ = [
    "TensorParallelError", "QuantizedWeightsError", "HeadShard", "check_head_split", "head_shard", "width_shard",
    "copy_rows", "copy_columns", "copy_whole", "ColumnParallelLinear", "RowParallelLinear",
    "inspect_decoder", "check_decoder_split", "prefixed_weights", "shard_decoder",
    "weight_bytes", "TensorParallelDecoder", "build_tensor_parallel_decoder",
    "tensor_parallel_clip", "check_tensor_parallel_clip", "apply_tensor_parallel_text_encoder",
    "remove_tensor_parallel_text_encoder",
]
