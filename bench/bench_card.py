#!/usr/bin/env python3
"""The real MiniMax-H3 block on the card this machine has: one command, absolute figures.

    python bench/bench_card.py              # the whole run: S = 5 s and 15 s, W = 1, 2, 4, 8
    python bench/bench_card.py --quick      # S = 5 s, W = 1 and 8
    python bench/bench_card.py --cpu        # small dims on the CPU (the test suite's run)
    COMFYUI_DIR=<ComfyUI> <its python> bench/bench_card.py    # upstream's own DiTBlock

The card is found the way the project finds cards (comfy/multidevice/devices.py: the NPUs
when any are visible, else the CUDA GPUs; `--device npu:3` picks one). On it, one H3 block at
the released sizes (hidden 5376, 56 heads x 128, SwiGLU 14336, bf16, random weights) runs as
rank 0 of W: its S/W query rows (the shard plan of sp/plan.py) against all S keys and values,
gathered by the project's own `allgather` strategy into the same sequence-major buffer the
real exchange fills. The other ranks' rows are already in that buffer, so the block time is
the compute of one rank with the copy of its own K/V into place. The block is upstream's
`DiTBlock` (comfy/ldm/minimax/model.py) when COMFYUI_DIR names a ComfyUI tree, else the
project's miniature (comfy/multidevice/miniature/h3_blocks.py) built at the same sizes. Attention:
what the block itself calls (SDPA / flash on CUDA), except on Ascend, where the fused
attention the seed project used (`torch_npu.npu_fusion_attention`) takes the call.

Per (S, W) it reports: the block's time (median of `--repeats` after `--warmup` calls, the
card synchronised around each), the card's peak memory (weights + activations + gathered
K/V) beside the memory plan's estimate (sp/cost_model.py `activation_bytes`), the bytes one
rank receives per block (sp/cost_model.py) and the time the card's copy engine takes to move
them (a device-to-device copy: the in-node lower bound of the exchange; one card has no
peer), and what exchange_precision=int8 would move instead and the time its coding takes on
the card (this rank's K/V coded, every rank's decoded). From those: the DiT time per step (50 blocks, the exchange added: overlap is not
proven) and per 50-step run at W = 1, 2, 4, 8, the same for the seed's run (4 cards, 15 s,
8 steps) and SGLang's (8 cards, 5 s, 50 steps) beside those anchors (bench/project_h3.py
ANCHORS) as ratios. Human-readable lines go to stderr, one JSON object to stdout (its only
line): `python bench/bench_card.py > card.json`, then `bench/project_h3.py --card-json
card.json` calibrates the projection from it.

Time on an H200 (estimated from FLOPs, 9 block calls per point, at an assumed 30% of the
989 TFLOP/s bf16 peak, i.e. ~300 TFLOP/s): one block is 7.2e13 FLOPs at 5 s, W = 1 and
4.3e14 at 15 s, W = 1 (halving with each doubling of W), 8.5e15 FLOPs for the whole grid:
~30 s of compute, plus ~30 s to start (torch, the card, ComfyUI's import) -> ~1 min for the
whole run (limit: 8 min); `--quick`, 7.3e14 FLOPs: ~3 s of compute, under 1 min with start-up
(limit: 3 min). Peak memory: 27.7 GiB at 15 s, W = 1 by the memory plan (a point that does
not fit is reported as out of memory and the run goes on).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench import project_h3  # noqa: E402
from comfy.multidevice.comm.layout import numel, scratch, unflatten_gathered  # noqa: E402
from comfy.multidevice.comm.checks import planned_metas  # noqa: E402
from comfy.multidevice.comm.compression import bytes_ratio, dequantize, quantize  # noqa: E402
from comfy.multidevice.devices import accelerator_api, resolve_device, set_thread_device  # noqa: E402
from comfy.multidevice.cards import auto_kind, probe_devices, visible_device_names  # noqa: E402
from comfy.multidevice.sp.attention import ExchangingAttention  # noqa: E402
from comfy.multidevice.sp.cost_model import activation_bytes, attention_traffic, DiTShape  # noqa: E402
from comfy.multidevice.sp.minimax_h3 import ROPE_SEQ_DIM  # noqa: E402
from comfy.multidevice.sp.plan import ShardPlan, shard_sizes, slice_mod_segments, take_rows  # noqa: E402
from comfy.multidevice.sp.strategies import make_kv_strategy  # noqa: E402

WORLDS = (1, 2, 4, 8)
QUICK = {"workloads": ("768p_5s",), "worlds": (1, 8)}


@dataclass(frozen=True)
class Dims:
    """One block's sizes (names as upstream's constructor arguments)."""

    hidden: int
    heads: int
    head_dim: int
    ffn: int
    t_dim: int
    rope_pairs: int  # rotated pairs per head: 3 axes x rope_inv_freq_len
    blocks: int = 50
    eps: float = 1e-5

    def shape(self) -> DiTShape:
        return DiTShape(hidden=self.hidden, blocks=self.blocks, heads=self.heads,
                        head_dim=self.head_dim, ffn=self.ffn)


H3_DIMS = Dims(hidden=5376, heads=56, head_dim=128, ffn=14336, t_dim=2688, rope_pairs=48)
CPU_DIMS = Dims(hidden=128, heads=2, head_dim=64, ffn=256, t_dim=64, rope_pairs=24)
CPU_TOKEN_DIVISOR = 128  # --cpu: the same layouts, 1/128 of the rows


def workloads(divisor: int = 1) -> dict:
    """The packed sequences of the node's plan_tokens: 768p 5 s (38,592) and 15 s (109,952),
    video and audio rows from the H3 layout (project_h3.token_counts), text the rest."""
    out = {}
    width, height = project_h3.RESOLUTIONS["768p"]
    for name, clip, total in (("768p_5s", 5, 38_592), ("768p_15s", 15, 109_952)):
        rows = project_h3.token_counts(project_h3.CLIP_FRAMES[clip], width, height, 0)
        video, audio = rows["video"] // divisor, rows["audio"] // divisor
        out[name] = {"tokens": total // divisor, "video": video, "audio": audio,
                     "text": total // divisor - video - audio}
    return out


# ----------------------------------------------------------------------------- the card

@dataclass
class Card:
    """Where the block runs: `device` holds the tensors, `api` (torch.cuda / torch.npu, as
    devices.accelerator_api gives it; None for the CPU) synchronises and counts memory."""

    name: str
    device: torch.device
    api: Any
    attention: str  # "block": what the block calls; "npu_fusion": torch_npu's fused attention
    label: str

    def synchronize(self) -> None:
        # as devices.synchronize: wait for the card's current stream
        if self.api is not None:
            self.api.current_stream(self.device).synchronize()

    def reset_peak(self) -> None:
        if self.api is not None:
            self.api.empty_cache()
            self.api.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int | None:
        return None if self.api is None else int(self.api.max_memory_allocated(self.device))


def find_card(device: str | None = None, cpu: bool = False) -> Card:
    """The card to measure, by the project's rules; raises SystemExit naming the fix."""
    if cpu:
        # one intra-op thread: on a shared CPU, OpenMP threads wait on each other and the small
        # block takes 50x longer at random
        torch.set_num_threads(1)
        return Card("cpu", torch.device("cpu"), None, "block", "cpu")
    inventory = probe_devices()
    if device is None:
        kind = auto_kind(inventory)
        if kind == "cpu":
            raise SystemExit(f"no NPU or CUDA card is visible ({inventory.describe()}): run this on a "
                             "machine with one, or pass --cpu for the small CPU check")
        device = visible_device_names(kind, inventory)[0]
    kind = device.split(":")[0]
    visible = visible_device_names("npu", inventory) + visible_device_names("cuda", inventory)
    if device not in visible:
        raise SystemExit(f"--device {device} is not a visible card ({inventory.describe()}): pass one "
                         f"of {', '.join(visible) or 'none'}")
    torch_device = resolve_device(device)
    set_thread_device(torch_device)
    api = accelerator_api(kind)
    return Card(device, torch_device, api, "npu_fusion" if kind == "npu" else "block",
                str(api.get_device_name(torch_device)))


def npu_fusion_attention(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
    """ComfyUI's attention calling convention over torch_npu's fused attention (BNSD)."""
    import torch_npu

    if mask is not None:
        raise ValueError("the fused attention here runs H3's full self-attention only (mask=None)")
    if not skip_reshape:
        b, s, width = q.shape
        q, k, v = (t.reshape(b, t.shape[1], heads, width // heads).transpose(1, 2) for t in (q, k, v))
    # the gathered K/V are views of a sequence-major buffer: the kernel takes dense BNSD
    q, k, v = (t.contiguous() for t in (q, k, v))
    out = torch_npu.npu_fusion_attention(q, k, v, heads, "BNSD", scale=q.shape[-1] ** -0.5, keep_prob=1.0)[0]
    if skip_output_reshape:
        return out
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


def attention_override(card: Card) -> Callable | None:
    """The override the exchange hands each call to (ComfyUI's override(func, ...) form); None
    keeps the block's own attention."""
    if card.attention == "block":
        return None
    if card.attention == "npu_fusion":
        return lambda func, *args, **kwargs: npu_fusion_attention(*args, **kwargs)
    raise ValueError(f"unknown attention {card.attention!r}: use 'block' or 'npu_fusion'")


# ----------------------------------------------------------------------------- the block

def upstream_tree() -> str | None:
    """The ComfyUI tree of COMFYUI_DIR, put on sys.path (None when unset)."""
    tree = os.environ.get("COMFYUI_DIR")
    if not tree:
        return None
    if not (Path(tree) / "comfy" / "ldm" / "minimax" / "model.py").is_file():
        raise SystemExit(f"COMFYUI_DIR={tree} has no comfy/ldm/minimax/model.py: name a ComfyUI tree "
                         "with MiniMax-H3, or unset it to run the project's miniature block")
    if tree not in sys.path:
        sys.path.append(tree)  # after this repository: comfy.multidevice stays ours
    from tests.upstream import standins
    standins.install()  # torchvision/torchaudio stand-ins where they cannot be imported
    return tree


def build_block(dims: Dims, dtype: torch.dtype, card: Card, seed: int = 0):
    """One transformer block with seeded random weights on the card; (block, which)."""
    tree = upstream_tree()
    if tree is None:
        from comfy.multidevice.miniature.h3_blocks import DiTBlock
        with torch.device(card.device):
            block = DiTBlock(dims.hidden, dims.heads, dims.head_dim, dims.ffn, dims.t_dim, dims.eps, dtype)
        which = "miniature (comfy/multidevice/miniature/h3_blocks.py)"
    else:
        import comfy.cli_args
        if card.device.type == "cpu":
            comfy.cli_args.args.cpu = True  # before model_management picks a device
        import comfy.ldm.minimax.model as upstream
        import comfy.ops
        # H3 contract: the block's forward takes `attention` (v0.33.0's does not)
        if "attention" not in inspect.signature(upstream.DiTBlock.forward).parameters:
            raise SystemExit(f"the DiTBlock of COMFYUI_DIR={tree} takes no `attention` argument (ComfyUI "
                             "v0.33.0 or older): sequence parallel cannot run on it; update ComfyUI, or "
                             "unset COMFYUI_DIR to measure the project's miniature block")
        block = upstream.DiTBlock(dims.hidden, dims.heads, dims.head_dim, dims.ffn, dims.t_dim, dims.eps,
                                  dims.eps, dtype=dtype, device=card.device,
                                  operations=comfy.ops.disable_weight_init)
        which = f"upstream DiTBlock ({tree})"
    torch.manual_seed(seed)  # the global seed: a per-device Generator is not a given on every card
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:  # std 1/sqrt(fan in): activations stay O(1) through the block
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.requires_grad_(False).eval(), which


def block_inputs(dims: Dims, workload: dict, world: int, dtype, device, seed: int = 1) -> dict:
    """Rank 0's inputs of one block: its rows of h, the RoPE table of the whole sequence (the
    forward holds it for every block) sliced to its rows, its modulation spans, t_emb."""
    from comfy.multidevice.miniature.h3_blocks import rope_rotation_table

    seq = workload["tokens"]
    plan = ShardPlan(seq, world, 0)
    torch.manual_seed(seed)
    text, audio = workload["text"], workload["audio"]
    # two timestep rows (video/text, audio), three modality tags each: row = t_row * 3 + tag
    full_segments = [(0, text, 1), (text, text + audio, 5), (text + audio, seq, 0)]
    angles = torch.rand(seq, dims.rope_pairs, device=device) * math.pi
    rope_full = rope_rotation_table(angles, dtype)
    return {
        "plan": plan,
        "h": torch.randn(plan.length, dims.hidden, dtype=dtype, device=device),
        "t_emb": torch.randn(2, dims.t_dim, dtype=dtype, device=device),
        "rope_full": rope_full,
        "rope": take_rows(rope_full, plan, ROPE_SEQ_DIM),
        "mod_segments": slice_mod_segments(full_segments, plan),
    }


class OneRankOfW:
    """Rank 0 of `world` for the allgather exchange, on one card: its K/V rows are copied into
    its place of the sequence-major gathered buffer (as the real exchange does); the other
    ranks' rows are already there (random, written when the buffer is made, as if received)."""

    def __init__(self, world: int, device: torch.device):
        self.rank, self.world_size, self.device = 0, world, device

    def exchange(self, tensors, cat_dims, shard_sizes=None, workspace=None):
        dims = [cat_dims] * len(tensors) if isinstance(cat_dims, int) else list(cat_dims)
        metas = planned_metas(tensors, dims, shard_sizes, self.rank)
        out = []
        for i, (tensor, dim) in enumerate(zip(tensors, dims)):
            shards = [m[i] for m in metas]
            counts = [numel(m.shape) for m in shards]
            known = None if workspace is None else workspace.get(("recv", i))
            flat = scratch(workspace, ("recv", i), sum(counts), tensor.dtype, tensor.device)
            if flat is not known:
                flat.normal_()  # the peers' rows
            moved = tensor.movedim(dim, 0)
            flat[:counts[self.rank]].view(moved.shape).copy_(moved)  # rank 0's place: the start
            out.append(unflatten_gathered(flat, shards, dim))
        return out


def rank_attention(block, card: Card, world: int, seq: int):
    """args["attention"] as the SP adapter builds it: the block's own attention module inside
    an SP region of the project's ExchangingAttention with the allgather strategy."""
    strategy = make_kv_strategy("allgather")
    exchanging = ExchangingAttention(OneRankOfW(world, card.device), strategy)
    exchanging.shard_sizes = shard_sizes(seq, world)
    strategy.begin_forward()  # one set of exchange buffers for every call, as a forward's blocks share
    preferred = getattr(getattr(block.attn, "comfy_attention", None), "function", None)
    card_attention = attention_override(card)

    def attention(h, rope_freqs=None, transformer_options=None):
        options = dict(transformer_options or {})
        if card_attention is not None:  # installed first, so the exchange chains it
            options["optimized_attention_override"] = card_attention
        exchanging.install(options)
        with exchanging.region("bench block attention", preferred=preferred):
            return block.attn(h, rope_freqs=rope_freqs, transformer_options=options)
    return attention


def timed(card: Card, fn: Callable, warmup: int, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls after `warmup` untimed ones, the card synchronised
    before and after each."""
    for _ in range(warmup):
        fn()
    card.synchronize()
    seconds = []
    for _ in range(repeats):
        card.synchronize()
        start = time.perf_counter()
        fn()
        card.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def measure_point(block, dims: Dims, workload: dict, world: int, card: Card, dtype,
                  warmup: int, repeats: int) -> dict:
    """One (S, W): the block's time and peak memory, the exchange's bytes and copy time."""
    seq = workload["tokens"]
    itemsize = torch.empty((), dtype=dtype).element_size()
    shape = dims.shape()
    received = attention_traffic("allgather", seq, world, 0, dims.heads, dims.head_dim, itemsize).received
    weights = sum(p.numel() * p.element_size() for p in block.parameters())
    gathered = 0 if world == 1 else 2 * seq * dims.heads * dims.head_dim * itemsize
    plan_activations = activation_bytes(shape, seq, world, itemsize)
    # what the plan counts that a middle block does not hold: the full hidden state before
    # block 0 and after the last one
    plan_block = weights + plan_activations - 2 * seq * dims.hidden * itemsize
    point = {"workload": None, "tokens": seq, "world": world, "rows": shard_sizes(seq, world)[0],
             "block_s": None, "block_s_all": [], "exchange_bytes": received, "exchange_copy_s": None,
             "int8_exchange_bytes": round(received * bytes_ratio(dims.head_dim, dtype)), "int8_code_s": None,
             "weights_bytes": weights, "gathered_kv_bytes": gathered, "peak_bytes": None,
             "activation_bytes": None, "plan_activation_bytes": plan_activations,
             "plan_block_bytes": plan_block, "measured_vs_plan": None, "error": None}
    inputs = None
    try:
        inputs = block_inputs(dims, workload, world, dtype, card.device)
        card.reset_peak()  # from here: the inputs a block gets, and what the block makes
        options, attention = {}, None
        if world > 1:
            attention = rank_attention(block, card, world, seq)
        elif attention_override(card) is not None:  # one card: the card's attention, no exchange
            options["optimized_attention_override"] = attention_override(card)

        def run():
            return block(inputs["h"], inputs["t_emb"], inputs["mod_segments"], inputs["rope"],
                         transformer_options=options, attention=attention)

        with torch.inference_mode():
            seconds = timed(card, run, warmup, repeats)
        point["block_s_all"] = [round(s, 6) for s in seconds]
        point["block_s"] = statistics.median(seconds)
        peak = card.peak_bytes()
        if peak is not None:
            point["peak_bytes"] = peak
            point["activation_bytes"] = peak - weights - gathered
            point["measured_vs_plan"] = round(peak / plan_block, 4)
        del inputs, attention
        inputs = None
        point["exchange_copy_s"] = copy_seconds(card, received, dtype, warmup, repeats)
        point["int8_code_s"] = int8_code_seconds(card, dims, seq, world, dtype, warmup, repeats)
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not is_out_of_memory(exc):
            raise
        point["error"] = f"out of memory: {str(exc).splitlines()[0][:200]}"
    finally:
        inputs = None
        card.reset_peak()
    return point


def copy_seconds(card: Card, nbytes: int, dtype, warmup: int, repeats: int) -> float:
    """Median seconds of one device-to-device copy of `nbytes` (the copy engine's in-node
    bound on moving a block's exchange into place); 0 when nothing moves (W = 1)."""
    if nbytes == 0:
        return 0.0
    itemsize = torch.empty((), dtype=dtype).element_size()
    src = torch.empty(nbytes // itemsize, dtype=dtype, device=card.device).normal_()
    dst = torch.empty_like(src)
    seconds = timed(card, lambda: dst.copy_(src), warmup, repeats)
    del src, dst
    return statistics.median(seconds)


def int8_code_seconds(card: Card, dims: Dims, seq: int, world: int, dtype, warmup: int, repeats: int) -> float:
    """Median seconds exchange_precision=int8 adds to one block's all-gather on this rank: its
    own K and V coded into records, every rank's records decoded (comm/compression.py); 0 at W = 1."""
    if world == 1:
        return 0.0
    rows = shard_sizes(seq, world)[0]
    own = torch.empty(2, rows, dims.heads, dims.head_dim, dtype=dtype, device=card.device).normal_()
    received = quantize(torch.empty(2, seq, dims.heads, dims.head_dim, dtype=dtype, device=card.device).normal_(),
                        "int8")
    seconds = timed(card, lambda: (quantize(own, "int8"), dequantize(received, "int8", dtype, dims.head_dim)),
                    warmup, repeats)
    del own, received
    return statistics.median(seconds)


# ----------------------------------------------------------------------------- the projection

def step_seconds(point: dict, blocks: int) -> float | None:
    """One DiT forward: `blocks` times (block + exchange); the exchange is added because
    overlapping it with the attention is not proven on the card."""
    if point is None or point["block_s"] is None:
        return None
    return blocks * (point["block_s"] + point["exchange_copy_s"])


def projection(points: list[dict], dims: Dims, names) -> dict:
    """Per workload and W (every one of the grid; None where not measured): the DiT time per
    step and per 50-step run, and the exchange's share of the step."""
    found = {(p["workload"], p["world"]): p for p in points}
    out = {}
    for name in names:
        out[name] = {}
        for world in WORLDS:
            point = found.get((name, world))
            step = step_seconds(point, dims.blocks)
            share = None if step is None else dims.blocks * point["exchange_copy_s"] / step
            base = step_seconds(found.get((name, 1)), dims.blocks)
            out[name][str(world)] = {
                "step_s": step, "run_50_steps_s": None if step is None else 50 * step,
                "exchange_share": share,
                "speedup_vs_1": None if step is None or base is None else base / step}
    return out


def anchor_ratios(projected: dict) -> dict:
    """The seed's run and SGLang's, projected from this card's figures, beside the anchors."""
    out = {}
    # the seed's Turbo run (4 cards, 15 s, 8 steps) and SGLang's (8 cards, 5 s, 50 steps)
    for key, name, match in (("seed", "seed-910b-4npu", {"steps": 8}), ("sglang", "sglang-h200-8", {})):
        anchor = project_h3.anchor_point(name, **match)
        step = projected[anchor["workload"]][str(anchor["cards"])]["step_s"]
        modelled = None if step is None else anchor["steps"] * step
        out[key] = {"anchor": anchor["name"], "hardware": anchor["hardware"], "workload": anchor["workload"],
                    "cards": anchor["cards"], "steps": anchor["steps"], "anchor_s": anchor["seconds"],
                    "anchor_covers": anchor["covers"], "projected_dit_s": modelled,
                    "ratio_projected_to_anchor": None if modelled is None else modelled / anchor["seconds"]}
    return out


def table_rows(card: Card, points: list[dict], projected: dict) -> list[str]:
    """The measured points as rows of the docs' table (card, S, W, block, step, run, memory)."""
    rows = []
    for p in points:
        if p["error"]:
            rows.append(f"| {card.label} | {p['workload']} | {p['world']} | {p['error']} | | | | |")
            continue
        step = projected[p["workload"]][str(p["world"])]
        gib = "n/a" if p["peak_bytes"] is None else f"{p['peak_bytes'] / 2 ** 30:.1f}"
        rows.append(f"| {card.label} | {p['workload']} | {p['world']} | {p['block_s'] * 1e3:.1f} | "
                    f"{p['exchange_copy_s'] * 1e3:.2f} | {step['step_s']:.2f} | {step['run_50_steps_s']:.0f} | "
                    f"{gib} / {p['plan_block_bytes'] / 2 ** 30:.1f} |")
    return rows


# ----------------------------------------------------------------------------- main

def run(card: Card, dims: Dims, names, worlds, divisor: int, warmup: int, repeats: int,
        mode: str, log=print) -> dict:
    started = time.perf_counter()
    dtype = torch.bfloat16
    block, which = build_block(dims, dtype, card)
    log(f"card {card.name} ({card.label}), block: {which}, attention: {card.attention}")
    grid = workloads(divisor)
    points = []
    for name in names:
        for world in worlds:
            point = measure_point(block, dims, grid[name], world, card, dtype, warmup, repeats)
            point["workload"] = name
            points.append(point)
            if point["error"]:
                log(f"  {name} W={world}: {point['error']}")
                continue
            peak = "n/a" if point["peak_bytes"] is None else f"{point['peak_bytes'] / 2 ** 30:.2f} GiB"
            log(f"  {name} W={world}: {point['rows']} rows x {point['tokens']} keys, block "
                f"{point['block_s'] * 1e3:.2f} ms, exchange {point['exchange_bytes'] / 1e6:.1f} MB in "
                f"{point['exchange_copy_s'] * 1e3:.3f} ms (copy engine), peak {peak}"
                + (f"; int8 exchange {point['int8_exchange_bytes'] / 1e6:.1f} MB, coding "
                   f"{point['int8_code_s'] * 1e3:.3f} ms" if point["world"] > 1 else ""))
    projected = projection(points, dims, workloads(divisor))
    anchors = anchor_ratios(projected)
    if mode == "cpu":
        log("  (cpu: small dims, so the anchor ratios below only exercise the arithmetic)")
    for value in anchors.values():
        if value["projected_dit_s"] is not None:
            log(f"  {value['anchor']} ({value['hardware']}, {value['workload']}, {value['steps']} steps): "
                f"{value['anchor_s']} s there, DiT {value['projected_dit_s']:.1f} s projected here "
                f"(x{value['ratio_projected_to_anchor']:.2f})")
    log("rows for docs/performance.md, \"Figures on a card\":")
    for line in table_rows(card, points, projected):
        log(line)
    return {
        "mode": mode,
        "card": {"name": card.name, "label": card.label, "kind": card.device.type, "attention": card.attention,
                 "block": which, "dtype": str(dtype).replace("torch.", "")},
        "dims": asdict(dims),
        "workloads": workloads(divisor),
        "warmup": warmup, "repeats": repeats,
        "points": points,
        "projection": projected,
        "anchors": anchors,
        "seconds": time.perf_counter() - started,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="S = 5 s only, W = 1 and 8")
    parser.add_argument("--cpu", action="store_true", help="small dims on the CPU (tests)")
    parser.add_argument("--device", help="the card, e.g. npu:3 or cuda:1 (default: the first visible)")
    parser.add_argument("--warmup", type=int, help="untimed calls per point (default 2; --cpu 1)")
    parser.add_argument("--repeats", type=int, help="timed calls per point, median (default 7; --cpu 3)")
    args = parser.parse_args(argv)
    warmup, repeats = (1, 3) if args.cpu else (2, 7)
    args.warmup = warmup if args.warmup is None else args.warmup
    args.repeats = repeats if args.repeats is None else args.repeats
    if args.warmup < 0 or args.repeats < 1:
        parser.error("--warmup must be >= 0 and --repeats >= 1")
    card = find_card(args.device, cpu=args.cpu)
    dims, divisor = (CPU_DIMS, CPU_TOKEN_DIVISOR) if args.cpu else (H3_DIMS, 1)
    names = QUICK["workloads"] if args.quick else tuple(workloads())
    worlds = QUICK["worlds"] if args.quick else WORLDS
    mode = "cpu" if args.cpu else ("quick" if args.quick else "full")
    result = run(card, dims, names, worlds, divisor, args.warmup, args.repeats, mode,
                 log=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
