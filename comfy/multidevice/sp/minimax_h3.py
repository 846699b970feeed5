"""Sequence parallelism for the MiniMax-H3 DiT (upstream `MiniMaxH3Model` or the miniature).

Every rank holds a full replica of the DiT and runs the whole forward (embedding, text refiner,
final layer) but computes the transformer blocks on 1/W of the packed token sequence:

- block 0's replacement slices the full hidden state to the rank's rows (`ShardPlan`);
- every block runs the model's own block on the local rows with the RoPE table and the
  modulation spans sliced to those rows, and with `args["attention"]` = the block's attention
  inside an SP region, where the attention override exchanges K/V between the ranks;
- the last block all-gathers the rows back (the same exchange the attention uses), so the
  model's own final layer runs unpatched on the full sequence on every rank.

The adapter does not know which model it drives; it relies only on the contract below, and each
assumption is written next to the code that makes it ("H3 contract").

Entry points
------------
- `enable_sequence_parallel(models, coordinator, sp_mode="allgather") -> SequenceParallelDiT`:
  plain modules (tests, the dry run). `models[r]` is rank r's replica, already on
  `coordinator.devices[r]`; call the result like the model: `sp(x, timestep, context, ...)`.
- `enable_sequence_parallel_on_patcher(model_patcher, coordinator, replicas, sp_mode="allgather")`:
  ComfyUI. Adds the fan-out as a DIFFUSION_MODEL wrapper (key `WRAPPER_KEY`) to the patcher,
  so every sampling step runs on all ranks; `replicas[r]` is rank r's model (ModelPatcher,
  BaseModel or the DiT module; `None` or the patcher itself for rank 0), loaded on
  `coordinator.devices[r]` by the caller.
- `install_rank_sequence_parallel(model, comm, transformer_options, sp_mode)`: one rank's
  set-up, for runs where each process is one rank (torch.distributed communicator) and calls
  its own forward.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Sequence

import torch

from comfy.multidevice.comfy_cancel import BlockCancel
from comfy.multidevice.comfy_objects import block_patches_of, dit_module
from comfy.multidevice.comm.group import prefetch_lane
from comfy.multidevice.devices import module_device
from comfy.multidevice.sp.attention import all_keys_attention, ExchangingAttention
from comfy.multidevice.sp.fan_out import RankThreads, SequenceParallelFanOut
from comfy.multidevice.sp.fun_controlnet import (described_fun_controls, RankFunControl,
                                                 unsupported_control_patches)
from comfy.multidevice.sp.plan import (gather_rows, SequenceParallelError, ShardPlan,
                                       slice_mod_segments, take_rows)
from comfy.multidevice.sp.split import (check_mode_for_split, EVEN, measured_weights, parse_split, RowSplit,
                                        strategy_for_split)
from comfy.multidevice.sp.strategies import make_kv_strategy
from comfy.multidevice.weights.block_shards import APPLIED_DIT_WEIGHT_MODES, ShardedBlockWeights

log = logging.getLogger(__name__)

WRAPPER_KEY = "minimax_h3_sequence_parallel"
DIFFUSION_MODEL_WRAPPERS = "diffusion_model"  # ComfyUI's WrappersMP.DIFFUSION_MODEL
ROPE_SEQ_DIM = 1  # H3 contract: rope_freqs is [1, S, 1, rot/2, 2, 2], the sequence on dim 1
CHECKED_UPSTREAM = "01a56b76bba3f32021fa846104baf2e500adc0da"  # docs/ARCHITECTURE.md, "The upstream contract"
UPDATE_COMFYUI = (f"update ComfyUI (git pull in the ComfyUI folder; checked with upstream commit "
                  f"{CHECKED_UPSTREAM[:8]}) or run the DiT on one card (npu_count 1)")
# What contract_problems says of a ComfyUI whose H3 blocks lack the `attention` argument (v0.33.0)
# What a block whose attention bypassed the exchange at run time most likely means
STALE_BLOCKS_FIX = f"the installed ComfyUI's MiniMax-H3 blocks may ignore args['attention']: {UPDATE_COMFYUI}"
OLD_COMFYUI_PROBLEM = (f"its blocks' forward() takes no `attention` argument: this ComfyUI predates the "
                       f"hook sequence parallelism needs (ComfyUI v0.33.0 and older lack it); {UPDATE_COMFYUI}")


# ----------------------------------------------------------------------------- support check

def contract_problems(model: Any) -> list[str]:
    """What `model` lacks of the H3 contract this adapter relies on (empty: supported)."""
    problems = []
    # H3 contract: an H3 DiT is recognised by its two patch projections (model_detection's rule).
    for name in ("video_patch_proj", "audio_patch_proj"):
        if not hasattr(model, name):
            problems.append(f"no {name} (not a MiniMax-H3 DiT)")
    # H3 contract: forward() runs _forward through the DIFFUSION_MODEL wrappers.
    if not callable(getattr(model, "_forward", None)):
        problems.append("no _forward method")
    # H3 contract: the transformer blocks are model.blocks[i] (state-dict keys blocks.{i}.*),
    # each with its attention module at .attn (keys blocks.{i}.attn.*).
    blocks = getattr(model, "blocks", None)
    if blocks is None or len(blocks) == 0:
        problems.append("no transformer blocks at .blocks")
    elif not all(callable(getattr(b, "attn", None)) for b in blocks):
        problems.append("a block has no callable .attn")
    # H3 contract: a block's forward takes `attention`, which replaces its attention module.
    # ComfyUI v0.33.0 ships H3 blocks without it: there every rank would silently attend to
    # its own rows only, so such a model is refused here, before anything is set up.
    elif not all(takes_attention_argument(b) for b in blocks):
        problems.append(OLD_COMFYUI_PROBLEM)
    return problems


def takes_attention_argument(block) -> bool:
    """Whether a block's forward takes `attention` (H3 contract; v0.33.0's blocks do not)."""
    try:
        return "attention" in inspect.signature(block.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: cannot tell, so refuse
        return False


def refuse_full_sequence_patches(block_patches: dict, where: str) -> None:
    """Upstream's Fun ControlNet is driven exactly (sp/fun_controlnet.py); a control patch
    without its API works on the whole sequence in a way this adapter cannot drive: refused."""
    found = unsupported_control_patches(block_patches)
    if found:
        raise SequenceParallelError(
            f"{where}: the model carries block patches that need the whole sequence on one card: "
            f"{', '.join(found)} (a ControlNet-style patch this version cannot drive under sequence "
            "parallel): run this workflow with npu_count 1 or 2 (the DiT on one card), or remove it")


def _require_support(model: Any, what: str) -> None:
    problems = contract_problems(model)
    if problems:
        raise SequenceParallelError(
            f"{what} ({type(model).__name__}) cannot run sequence parallel: {'; '.join(problems)}. "
            "Sequence parallelism supports the MiniMax-H3 DiT (upstream's or the miniature) only.")


# ----------------------------------------------------------------------------- one rank

class H3RankSetup:
    """One rank's sequence-parallel set-up, made once and reused by every forward.

    Made once: the K/V strategy (an `auto` choice is made on the first call and kept), the
    exchanging attention and the table of block replacements. Per forward (`install`) only
    what the inputs decide: the model the rank runs (checked against the contract when it is
    a new object), the replacements chained in front of this forward's own, and at block 0
    the shard plan with the RoPE rows and modulation spans sliced once for all blocks.
    """

    def __init__(self, comm, sp_mode=None, block_weights=None, cancel_flag=None, split: RowSplit | None = None):
        """`cancel_flag`: rank 0's yes/no to every rank once per block (comfy_cancel.py
        `BlockCancel`: ComfyUI's Cancel stops every rank as the same block starts); None: no
        Cancel inside a forward (no ComfyUI). `split`: how the rows are shared (sp/split.py; None: even)."""
        self.comm = comm
        self.block_weights = block_weights  # RankBlockWeights when dit_weights="shard", else None
        self.cancel = None if cancel_flag is None else BlockCancel(cancel_flag, comm.rank)
        self.split = EVEN if split is None else split
        self.strategy = strategy_for_split(make_kv_strategy(sp_mode), self.split, comm.rank)
        # the plan's per-rank weights: explicit ones now, auto's after the first step's probe
        self.weights = self.split.weights if self.split.kind == "weights" else None
        self.exchanging = ExchangingAttention(comm, self.strategy)
        self.model = None
        self.num_blocks = 0
        self._table: dict = {}        # ("double_block", i) -> our replacement, made once per model
        self._previous: dict = {}     # i -> the replacement we chain to in this forward
        self.plan: ShardPlan | None = None
        self._sliced: dict = {}       # "rope_freqs" / "mod_segments" -> (full object, local rows)
        self._fun: dict = {}          # block index -> its FunBlockControl in this forward
        self._control = RankFunControl(comm.device)

    @property
    def tokens(self) -> int | None:
        return None if self.plan is None else self.plan.length

    def install(self, model, transformer_options: dict) -> "H3RankSetup":
        """Set up one forward: edits `transformer_options` (the rank's own copy) in place."""
        if model is not self.model:
            _require_support(model, f"rank {self.comm.rank}'s model")
            if self.block_weights is not None and model is not self.block_weights.model:
                raise SequenceParallelError(
                    f"rank {self.comm.rank} runs another DiT than the one its block weights were "
                    "sharded from; run the node again so the shards are made for this model")
            self.model = model
            self.num_blocks = len(model.blocks)
            # partials, not closures: one Python frame fewer in every block
            self._table = {("double_block", i): functools.partial(self._run_block, i) for i in range(self.num_blocks)}
        # H3 contract: block i is called through patches_replace["dit"][("double_block", i)] as
        # replace(args, {"original_block": fn}) and must return {"img": new_h}.
        patches = dict(transformer_options.get("patches_replace", {}))
        dit = dict(patches.get("dit", {}))
        refuse_full_sequence_patches(dit, f"rank {self.comm.rank}")
        ours = set(map(id, self._table.values()))
        self._previous = {i: None if id(dit.get(key)) in ours else dit.get(key)
                          for i, key in enumerate(self._table)}
        # A Fun ControlNet patch is driven here (its control stream per rank, over the full
        # sequence); what it chained itself is chained in its place.
        self._fun = described_fun_controls(dit)
        for i, patch in self._fun.items():
            self._previous[i] = None if id(patch.previous) in ours else patch.previous
        dit.update(self._table)
        patches["dit"] = dit
        transformer_options["patches_replace"] = patches
        self.plan = None
        self._sliced = {}
        if self.block_weights is not None:
            self.block_weights.begin_forward()
        return self

    def _local(self, key: str, args: dict, slicer) -> Any:
        # Every block gets the same RoPE table and modulation spans: slice them once per forward.
        full = args[key]
        cached = self._sliced.get(key)
        if cached is None or cached[0] is not full:
            cached = self._sliced[key] = (full, slicer(full))
        return cached[1]

    def _run_block(self, index, args, extra):
        if self.cancel is not None:
            self.cancel.at_block_start(index)
        h = args["img"]
        weights = self.block_weights
        bound = False
        if index == 0:
            if self.split.kind == "auto" and self.weights is None:
                if weights is not None:  # dit_weights="shard": the probe runs block 0's full weights
                    weights.bind(0, self.comm)
                    bound = True
                self.weights = self._measured_weights(args, extra, h)
            # H3 contract: block 0 receives the full hidden state [S, hidden] in packed order.
            self.plan = ShardPlan(h.shape[0], self.comm.world_size, self.comm.rank, self.weights)
            # every rank's rows, known from the plan: the K/V exchanges need no shape round
            self.exchanging.shard_sizes = self.plan.sizes
            self.strategy.begin_forward()  # exchange buffers shared by this forward's blocks
            self._sliced = {}
            self._control.start_forward(h, self._fun)
            # a copy, so the full [S, hidden] tensor is freed instead of pinned by a view
            h = take_rows(h, self.plan).clone()
        elif self.plan is None or h.shape[0] != self.plan.length:
            raise SequenceParallelError(
                f"rank {self.comm.rank}: block {index} got {h.shape[0]} rows, expected the rank's "
                f"{None if self.plan is None else self.plan.length} local rows; block 0 must run "
                "first in every forward")
        local = dict(args)
        local["img"] = h
        # H3 contract: RoPE and modulation are per token, so slicing their rows is exact.
        plan = self.plan
        local["rope_freqs"] = self._local("rope_freqs", args, lambda t: take_rows(t, plan, ROPE_SEQ_DIM))
        local["mod_segments"] = self._local("mod_segments", args, lambda m: slice_mod_segments(m, plan))
        # H3 contract: original_block honours args["attention"], called as
        # attention(h, rope_freqs=..., transformer_options=...) in place of the block's .attn.
        attn = self.model.blocks[index].attn
        local["attention"] = self._attention(attn)
        # args["layout"] still describes the full sequence; H3's block does not read it.
        previous = self._previous.get(index)
        if weights is not None and not bound:  # dit_weights="shard": block i's tensors are here only while it runs
            weights.bind(index, self.comm)
        # The region spans the whole block: a block that ignores args["attention"] and an
        # attention that bypasses the override both leave it with no exchanged call, an error
        # (this rank would have attended to its own rows only).
        # H3 contract: attn.comfy_attention.function, when set (e.g. a checkpoint's kitchen int8
        # attention), is the preferred_attention the module passes; ComfyUI drops it whenever an
        # override is installed, so the exchange is told to use it.
        preferred = getattr(getattr(attn, "comfy_attention", None), "function", None)
        try:
            with self.exchanging.region(f"block {index} did not call args['attention'] or its attention",
                                        preferred=preferred, fix=STALE_BLOCKS_FIX):
                out = previous(local, extra) if previous is not None else extra["original_block"](local)
        finally:
            if weights is not None:
                weights.release(index)
        h = out["img"]
        if index in self._fun:
            h = self._control.add_control(index, self._fun[index], args, h, self.plan)
        if index == self.num_blocks - 1:
            if self.cancel is not None:
                self.cancel.at_forward_end(self.num_blocks)
            self.strategy.end_forward()
            # H3 contract: the forward hands the last block's h straight to the final layer,
            # which then sees the full sequence, as on one card.
            h = gather_rows(self.comm, h, 0)
        return {**out, "img": h}

    def _measured_weights(self, args, extra, h) -> tuple[float, ...]:
        """split auto: block 0's forward on the same rows on every rank (the even share), timed
        and shared by sp/split.py's `measured_weights`. Its queries attend to as many keys as in
        a step (the rank's own K and V repeated to the whole sequence; nothing exchanged), so a
        card's attention weighs against the rest of its block as it does when the step runs."""
        probe = ShardPlan(h.shape[0], self.comm.world_size, 0)
        local = dict(args)
        local["img"] = take_rows(h, probe).clone()
        local["rope_freqs"] = take_rows(args["rope_freqs"], probe, ROPE_SEQ_DIM)
        local["mod_segments"] = slice_mod_segments(args["mod_segments"], probe)
        attn = self.model.blocks[0].attn
        preferred = getattr(getattr(attn, "comfy_attention", None), "function", None)  # as _run_block
        local["attention"] = all_keys_attention(attn, h.shape[0], preferred)
        return measured_weights(self.comm, lambda: extra["original_block"](local), self.split.caps)

    def _attention(self, attn):
        # H3 contract: the block's attention module is model.blocks[i].attn; it projects,
        # normalises and rotates q/k per token, then calls optimized_attention, which honours
        # transformer_options["optimized_attention_override"] with [1, heads, S, head_dim]
        # tensors and skip_reshape=True, mask=None (one full self-attention, no cross-attention).
        exchanging = self.exchanging

        def exchanging_attention(h, rope_freqs=None, transformer_options=None):
            # Our override only for this call: the text refiner and anything else outside the
            # blocks keep the rank's own transformer_options (and with them their preferred
            # attention) untouched.
            options = dict(transformer_options or {})
            exchanging.install(options)
            return attn(h, rope_freqs=rope_freqs, transformer_options=options)
        return exchanging_attention


def install_rank_sequence_parallel(model, comm, transformer_options: dict,
                                   sp_mode=None, setup: H3RankSetup | None = None,
                                   block_weights=None, split: RowSplit | None = None) -> H3RankSetup:
    """Set up one rank for one forward: exchanging attention + block replacements.

    Edits `transformer_options` (the rank's own copy) and returns the rank's set-up. Pass
    the set-up of the previous forward as `setup` to reuse it (one process per rank
    calling its own forward every step). `comm` is any per-rank `Communicator`. Every rank gets
    the full output (each process samples on with its own).
    `block_weights`: this rank's `RankBlockWeights` for dit_weights="shard" (a
    weights/block_shards.py family holding this process's rank), used by a new set-up.
    `split`: how the rows are shared (sp/split.py; None: even).
    """
    if setup is None:
        setup = H3RankSetup(comm, sp_mode, block_weights, split=split)
    return setup.install(model, transformer_options)


class _RankSetups:
    """The `prepare_rank` of a fan-out: each rank's H3RankSetup, made on its first forward."""

    def __init__(self, sp_mode, block_weights=None, split: RowSplit | None = None):
        self.sp_mode = sp_mode
        self.split = split
        self.block_weights = block_weights  # ShardedBlockWeights of all ranks, or None
        self.setups: dict[int, H3RankSetup] = {}  # each rank thread writes its own key

    def _family(self):
        # a family, or a callable that returns the current one (remade after an unload)
        weights = self.block_weights
        return weights() if callable(weights) else weights

    def __call__(self, rank, comm, model, transformer_options):
        setup = self.setups.get(rank)
        family = self._family()
        view = setup.block_weights if setup is not None else None
        if setup is None or setup.comm is not comm or (view.family if view else None) is not family:
            view = None if family is None else family.rank_view(rank)
            setup = self.setups[rank] = H3RankSetup(comm, self.sp_mode, view, comm.block_flag(), self.split)
        return setup.install(model, transformer_options)


def shard_dit_blocks(models: Sequence[torch.nn.Module], coordinator, prefetch: bool = True):
    """dit_weights="shard": keep 1/W of the block tensors on each rank (weights/block_shards.py).

    `models[r]` is rank r's DiT with its full weights; the tensors it does not own are dropped
    from it here. With `prefetch`, block i+1's gather runs on a second coordinator over the
    same cards (same backend) while block i computes, where the backend allows a second one
    beside the first (peer-copy; not HCCL or NCCL: comm/group.py `lane_allowed`).
    """
    lane = prefetch_lane(coordinator) if prefetch and coordinator.world_size > 1 else None
    # H3 contract: the transformer blocks are model.blocks[i].
    family = ShardedBlockWeights(models, lambda m: m.blocks, coordinator.devices, lane=lane,
                                 timeout_s=coordinator.timeout_s)
    log.info("DiT block weights sharded over %d rank(s): %s resident per rank of %.3f GiB of blocks",
             family.world_size, ", ".join(f"{family.resident_bytes(r) / 2 ** 30:.3f}"
                                          for r in range(family.world_size)),
             sum(family.plan.block_bytes(i) for i in range(family.num_blocks)) / 2 ** 30)
    return family


# ----------------------------------------------------------------------------- plain modules

class SequenceParallelDiT:
    """Calls like the DiT; runs each forward on all ranks of `coordinator` (rank 0's result)."""

    def __init__(self, models: Sequence[torch.nn.Module], coordinator, sp_mode: str | None = None,
                 dit_weights: str = "replicate", prefetch: bool = True, split=None):
        split = parse_split(split, coordinator.world_size)
        # a bad mode, or ulysses with an uneven split, fails here, before anything is set up
        check_mode_for_split(sp_mode, split)
        _check_dit_weights(dit_weights)
        if len(models) != coordinator.world_size:
            raise ValueError(f"enable_sequence_parallel got {len(models)} model replicas for "
                             f"{coordinator.world_size} ranks; pass one replica per rank")
        for r, model in enumerate(models):
            _require_support(model, f"replica {r}")
            device = module_device(model)
            if device is not None and device != coordinator.devices[r]:
                raise ValueError(f"replica {r} is on {device} but rank {r} runs on "
                                 f"{coordinator.devices[r]}; move it with .to({str(coordinator.devices[r])!r})")
        self.models = list(models)
        self.coordinator = coordinator
        self.sp_mode = sp_mode
        self.block_weights = (shard_dit_blocks(self.models, coordinator, prefetch)
                              if dit_weights == "shard" else None)
        self.ranks = RankThreads(coordinator, self.models,
                                 prepare_rank=_RankSetups(sp_mode, self.block_weights, split))
        self.fan_out = SequenceParallelFanOut(self.ranks)

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def __call__(self, x, timestep, context, transformer_options: dict | None = None, **kwargs):
        options = dict(transformer_options or {})
        wrappers = {kind: {key: list(ws) for key, ws in keyed.items()}
                    for kind, keyed in options.get("wrappers", {}).items()}
        wrappers.setdefault(DIFFUSION_MODEL_WRAPPERS, {})[WRAPPER_KEY] = [self.fan_out]
        options["wrappers"] = wrappers
        return self.models[0](x, timestep, context, transformer_options=options, **kwargs)

    def tokens_per_rank(self) -> list[int | None]:
        """Local rows per rank in the last forward."""
        return [None if s is None else s.tokens for s in self.ranks.last_rank_states]

    def bytes_exchanged_last_forward(self) -> int:
        """Bytes all ranks together received from each other in the last forward."""
        return self.ranks.bytes_received_last_forward()

    def close(self) -> None:
        """Stop the prefetch lane of sharded block weights (nothing to do for replicas)."""
        if self.block_weights is not None:
            self.block_weights.close()


def _check_dit_weights(dit_weights: str) -> None:
    if dit_weights not in APPLIED_DIT_WEIGHT_MODES:
        raise ValueError(f"dit_weights={dit_weights!r} is unknown here: use 'replicate' (a full DiT "
                         "per rank) or 'shard' (1/W of the block weights per rank)")


def enable_sequence_parallel(models: Sequence[torch.nn.Module], coordinator,
                             sp_mode: str | None = "allgather", dit_weights: str = "replicate",
                             prefetch: bool = True, split=None) -> SequenceParallelDiT:
    """Plain-module entry point: sequence parallelism over per-rank replicas.

    models[r]: rank r's DiT replica on coordinator.devices[r] (same weights on every rank).
    sp_mode: the K/V exchange ("allgather"). dit_weights: "replicate" keeps the replicas as
    they are; "shard" keeps 1/W of the block tensors on each rank (dropped from `models` here)
    and gathers a block just before it runs (`prefetch`: the next block's gather overlaps).
    Returns a callable with the DiT's forward signature
    `(x=[video, audio], timestep, context, transformer_options=None, **kwargs)` whose result is
    rank 0's output, equal to the single-device forward. `split`: how the rows are shared, a
    `RowSplit` or the node's text ("even", "auto", "3,1"; sp/split.py); None: even.
    """
    return SequenceParallelDiT(models, coordinator, sp_mode, dit_weights, prefetch, split)


# ----------------------------------------------------------------------------- ComfyUI

def enable_sequence_parallel_on_patcher(model_patcher, coordinator, replicas: Sequence[Any],
                                        sp_mode: str | None = "allgather",
                                        block_weights=None, split=None) -> SequenceParallelFanOut:
    """ComfyUI entry point: make `model_patcher`'s DiT forward run sequence parallel.

    replicas[r]: rank r's model on coordinator.devices[r] (ModelPatcher, BaseModel or the DiT
    module; replicas[0] may be None or `model_patcher` itself, whose load_device must be
    coordinator.devices[0]). They are resolved to their DiT at
    every forward, so the caller may (re)load them between runs. Installs the fan-out as the
    DIFFUSION_MODEL wrapper `WRAPPER_KEY` (replacing an earlier one) and returns it; every
    sampling step then runs on all ranks and returns rank 0's result. Raises ValueError /
    SequenceParallelError before changing the patcher when the mode, the replica count or the
    model is wrong. `block_weights`: for dit_weights="shard", a callable returning the
    ShardedBlockWeights of the replicas' current load (roles/dit_shards.py). `split`: how the
    rows are shared (a `RowSplit` or the node's text; None: even).
    """
    from comfy.patcher_extension import WrappersMP  # lazy: ComfyUI is optional for this module

    split = parse_split(split, coordinator.world_size)
    check_mode_for_split(sp_mode, split)
    if len(replicas) != coordinator.world_size:
        raise ValueError(f"enable_sequence_parallel_on_patcher got {len(replicas)} replicas for "
                         f"{coordinator.world_size} ranks; pass one per rank (None for rank 0)")
    _require_support(dit_module(model_patcher), "the patcher's diffusion model")
    refuse_full_sequence_patches(block_patches_of(model_patcher), "the MODEL input")
    load_device = getattr(model_patcher, "load_device", None)
    if load_device is not None and torch.device(load_device) != coordinator.devices[0]:
        # rank 0 runs the patcher's own model, so it must load where rank 0 computes
        raise ValueError(f"the model patcher loads on {load_device} but rank 0 runs on "
                         f"{coordinator.devices[0]}; set its load_device to {coordinator.devices[0]}")
    entries = [None if (r == 0 and (rep is None or rep is model_patcher)) else rep
               for r, rep in enumerate(replicas)]
    for r, rep in enumerate(entries):
        if rep is not None:
            _require_support(dit_module(rep), f"replica {r}")
    fan_out = SequenceParallelFanOut(RankThreads(coordinator, entries, prepare_rank=_RankSetups(sp_mode, block_weights, split),
                                                 resolve_model=dit_module))
    model_patcher.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, fan_out)
    log.info("sequence parallel (%s) enabled on %d rank(s): %s", sp_mode or "allgather",
             coordinator.world_size, ", ".join(map(str, coordinator.devices)))
    return fan_out
