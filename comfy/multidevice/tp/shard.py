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
  replicated everything else: RMSNorms (incl. per-head q/k norms), RoPE.
  embedding  none in a shard until a caller passes token ids: ComfyUI's text encoders embed
             the tokens themselves and pass `embeds` (H3: a 151936 x 5120 table, 1.56 GB in
             BF16, that W shards would each copy for nothing); a shard called with token ids
             copies the decoder's embedding onto its device on that first call.

Only the per-rank communicator interface is used (comm.rank, comm.world_size,
comm.device, comm.all_reduce), so a shard runs over RankComm (comfy/multidevice/comm/group.py,
one process, W threads) or over the torch.distributed communicator (comfy/multidevice/comm/torch_dist.py,
one process per rank) alike.

Weights come from the module being split or from a mapping of full tensors (a state
dict, or the zero-copy read-only views of comfy/multidevice/weights/). Each rank copies
only its own slice to its device: a narrow() view of the full tensor, copied into a
fresh tensor of the slice's size. No rank ever holds or creates a full copy.

Entry points
  shard_decoder(decoder, comm, weights=None)            one rank's shard (any communicator)
  planned_shard_bytes(decoder, world_size)              what each rank's shard will hold, before
                                                        anything is built (memory plans)
All shards and the module that runs them: tp/decoder.py; a ComfyUI CLIP: tp/clip.py.
"""

from __future__ import annotations

import copy
import logging
import weakref
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn as nn

from comfy.multidevice.comm.layout import numel
from comfy.multidevice.tensor_bytes import storage_bytes
from comfy.multidevice.tp.layers import (check_head_split, ColumnParallelLinear, copy_whole, detached,
                                         frozen_parameter, head_shard, QuantizedWeightsError,
                                         RowParallelLinear, TensorParallelError, width_shard)

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- decoder layout
#
# The layout this converter relies on, shared by upstream ComfyUI's Llama-family decoder
# (comfy/text_encoders/llama.py: Llama2_, TransformerBlock, Attention, MLP) and by
# tests/qwen_decoder.py (the tests' miniature):
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
    if not weight.is_floating_point() or type(detached(weight)) is not torch.Tensor:
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

class WeightSource:
    """Full tensors by decoder-relative name: from `weights` if given, else from the module.
    check_all() is the early check the fan-out runs before any rank slices.

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

def shallow_module_copy(module: nn.Module) -> nn.Module:
    """Same class and attributes, but its own parameter/buffer/child/hook containers, so
    assigning into the copy never changes the original."""
    new = copy.copy(module)
    for key, value in module.__dict__.items():
        if key.startswith("_") and isinstance(value, (dict, set)):
            new.__dict__[key] = copy.copy(value)
    return new


def _clone_structure(module: nn.Module, prefix: str, device, source: WeightSource,
                     skip: set[str]) -> nn.Module:
    """A copy of `module` whose replicated tensors are fresh copies on `device`.

    The object itself is copied shallowly (same class, same plain attributes, so its own
    forward runs unchanged); its parameter/buffer/child registries are rebuilt, so the
    original is never modified. Children whose qualified name is in `skip` are left out
    (the caller installs parallel layers there).
    """
    new = shallow_module_copy(module)
    for name, param in module._parameters.items():
        new._parameters[name] = None if param is None else frozen_parameter(
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


@dataclass(frozen=True)
class _Split:
    """One linear layer's share on one rank.

    column  rows `spans` ((start, count), ...) of the weight and of the bias
    row     columns spans[0] of the weight; the bias whole (added once, after the all-reduce)
    """
    name: str  # decoder-relative, e.g. "layers.0.self_attn.q_proj"
    column: bool
    spans: tuple


def _layer_splits(lay: _LayerLayout, world: int, rank: int) -> list[_Split]:
    """Rank `rank`'s share of every split linear layer of one block (see the module notes)."""
    heads = head_shard(lay.q_heads, lay.kv_heads, world, rank)
    hd, attn, mlp = lay.head_dim, f"layers.{lay.index}.self_attn.", f"layers.{lay.index}.mlp."
    q_span = (heads.q_start * hd, heads.q_count * hd)
    kv_span = (heads.kv_start * hd, heads.kv_count * hd)
    if lay.fused_qkv:
        q_rows, kv_rows = lay.q_heads * hd, lay.kv_heads * hd
        out = [_Split(attn + "qkv_proj", True, (q_span, (q_rows + kv_span[0], kv_span[1]),
                                                (q_rows + kv_rows + kv_span[0], kv_span[1])))]
    else:
        out = [_Split(attn + "q_proj", True, (q_span,)), _Split(attn + "k_proj", True, (kv_span,)),
               _Split(attn + "v_proj", True, (kv_span,))]
    out.append(_Split(attn + "o_proj", False, (q_span,)))
    start, count = width_shard(lay.intermediate, world, rank, f"layers.{lay.index}.mlp intermediate")
    if lay.fused_mlp:
        # Gate rows [start, start+count) and the matching up rows, so the local output
        # still chunks into (gate, up) halves that belong together.
        out.append(_Split(mlp + "gate_up_proj", True, ((start, count), (lay.intermediate + start, count))))
    else:
        out += [_Split(mlp + "gate_proj", True, ((start, count),)),
                _Split(mlp + "up_proj", True, ((start, count),))]
    out.append(_Split(mlp + "down_proj", False, ((start, count),)))
    return out


def _split_skip(layouts: list[_LayerLayout]) -> set[str]:
    """The qualified names a shard does not copy whole: every split linear, the input embedding."""
    skip = {"embed_tokens"}
    for lay in layouts:
        skip.update(f"layers.{lay.index}.self_attn.{n}" for n in _ATTN_LINEARS)
        skip.update(f"layers.{lay.index}.mlp.{n}" for n in _MLP_LINEARS)
    return skip


def _whole_tensors(module: nn.Module, prefix: str, skip: set[str]):
    """(name, tensor) of every parameter and buffer _clone_structure copies whole."""
    for name, t in (*module._parameters.items(), *module._buffers.items()):
        if t is not None:
            yield prefix + name, t
    for name, child in module._modules.items():
        if child is not None and prefix + name not in skip:
            yield from _whole_tensors(child, prefix + name + ".", skip)


def _nbytes(shape, dtype) -> int:
    return numel(shape) * dtype.itemsize


def planned_shard_bytes(decoder: nn.Module, world_size: int) -> list[int]:
    """Bytes each rank's shard_decoder(decoder, comm) shard will hold, computed before anything
    is built (each rank's slices plus the tensors every rank copies whole, in the decoder's
    dtypes; no input embedding: see _EmbeddingOnFirstUse). Raises what shard_decoder raises."""
    layouts = check_decoder_split(decoder, world_size)
    skip = _split_skip(layouts)
    whole = sum(_nbytes(t.shape, t.dtype) for _, t in _whole_tensors(decoder, "", skip))
    linears = dict(decoder.named_modules())
    out = []
    for rank in range(world_size):
        total = whole
        for lay in layouts:
            for split in _layer_splits(lay, world_size, rank):
                linear = linears[split.name]
                weight, bias = linear.weight, getattr(linear, "bias", None)
                rows = sum(count for _, count in split.spans)  # output rows (column), input columns (row)
                total += _nbytes((rows, weight.shape[1] if split.column else weight.shape[0]), weight.dtype)
                if bias is not None:  # a row-parallel layer keeps its bias whole
                    total += _nbytes((rows,) if split.column else bias.shape, bias.dtype)
        out.append(total)
    return out


class _EmbeddingOnFirstUse(nn.Module):
    """Stands in for a shard's input embedding and holds no weights until it is called.

    ComfyUI's text encoders embed the tokens themselves, on the CLIP's card, and hand the
    decoder `embeds`, so a shard never reads an embedding. A caller that passes token ids
    (the miniature, the dry run) gets the same embedding as before: on the first call this
    copies the decoder's embedding onto the shard's device, exactly as the replicated
    tensors are copied, puts the copy in its own place and runs it.
    """

    def __init__(self, owner: nn.Module, original: nn.Module, device, source: "WeightSource"):
        super().__init__()
        # a plain tuple: nothing registered; a weak reference to the shard, so that a dropped
        # shard is freed at once (no reference cycle waiting for the garbage collector)
        self._build = (weakref.ref(owner), original, device, source)

    def forward(self, *args, **kwargs):
        owner, original, device, source = self._build
        embedding = _clone_structure(original, "embed_tokens.", device, source, set())
        owner().embed_tokens = embedding
        log.debug("tensor parallel: a shard copied the input embedding on %s (token ids passed)", device)
        return embedding(*args, **kwargs)


def shard_decoder(decoder: nn.Module, comm, weights: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """This rank's tensor-parallel shard of a Llama/Qwen-style decoder.

    Returns a module of the same class that runs the decoder's own forward on rank
    comm.rank of comm.world_size: split linear layers in place of the originals, each
    attention's head counts set to this rank's share, everything else replicated on
    comm.device except the input embedding, which is copied only when a call passes
    token ids instead of `embeds`. `decoder` is not modified. `weights` (optional) maps
    decoder-relative names to full tensors, e.g. read-only views of a shared checkpoint;
    otherwise the decoder's own tensors are sliced. Call it on every rank; the shards'
    row-parallel layers all-reduce through `comm`.
    """
    world, rank, device = comm.world_size, comm.rank, comm.device
    layouts = check_decoder_split(decoder, world)
    source = WeightSource(decoder, weights)
    shard = _clone_structure(decoder, "", device, source, _split_skip(layouts))
    if getattr(decoder, "embed_tokens", None) is not None:
        shard.embed_tokens = _EmbeddingOnFirstUse(shard, decoder.embed_tokens, device, source)
    for lay in layouts:
        for split in _layer_splits(lay, world, rank):
            _install_split(shard, split, comm, source)
        heads = head_shard(lay.q_heads, lay.kv_heads, world, rank)
        attn = shard.layers[lay.index].self_attn
        attn.num_heads, attn.num_kv_heads = heads.q_count, heads.kv_count
        if hasattr(attn, "inner_size"):
            attn.inner_size = heads.q_count * lay.head_dim
        if hasattr(attn, "kv_size"):
            attn.kv_size = heads.kv_count * lay.head_dim
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
              storage_bytes(shard))
    return shard


def _install_split(shard: nn.Module, split: _Split, comm, source: WeightSource) -> None:
    weight = source.get(split.name + ".weight")
    bias = source.get(split.name + ".bias") if source.has(split.name + ".bias") else None
    if split.column:
        layer = ColumnParallelLinear.from_full(weight, bias, list(split.spans), comm.device)
    else:
        (start, count), = split.spans
        layer = RowParallelLinear.from_full(weight, bias, start, count, comm)
    parent, _, name = split.name.rpartition(".")
    setattr(shard.get_submodule(parent), name, layer)

