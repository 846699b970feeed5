"""`doctor --deep`: a few seconds on each path a first card run is most likely to break.

Each check runs rank threads over the selected cards and backend, as the node does, and
returns one verdict ({"ok": bool, "seconds": float, "detail": str}); none raises. The paths
(`../shared/CARDS.md` has the vendors' rules behind each):

  exchange_between_nonzero_ranks  an all-gather-V whose every shard was made on its own card
      (never copied from card 0), under ComfyUI's allocator setting: NCCL reads peers' buffers
      directly, and stream-ordered pool memory is peer-readable only where access was granted
  shard_gather_beside_exchange    sharded block weights gathered (the product's own prefetch
      choice) while the ranks exchange K/V between blocks, block outputs checked against the
      full weights: one card may not run two collectives at a time
  quantized_gather_and_release    tensor-subclass weights (data + scale, as upstream's quantized
      tensors) gathered, bound, released and gathered again twice over: clones made on a side
      stream must outlive their use on the main one
  stuck_rank_recovered            one rank stalls past a short timeout: the others fail naming
      it, and a fresh coordinator on the same cards then exchanges correctly
  attention_exchanges_timed       both K/V exchanges timed as H3 attends (56 heads x 128, a
      no-math attention, so the exchange and its layout work are what is timed; each output
      checked against its q): the slowest rank's median per mode is kept in the user cache
      folder, where `auto` picks the faster at this card count (sp/mode_choice.py's rule 3).
      Skipped, nothing kept, where no group above one divides both the cards and the heads

On CPU they run against whatever libraries the backend loads (the tests' fakes enforce the
vendors' rules), so the suite runs them too.
"""

from __future__ import annotations

import os
import re
import statistics
import time

import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.devices import synchronize
from comfy.multidevice.sp.cost_model import ulysses_degree
from comfy.multidevice.sp.minimax_h3 import shard_dit_blocks
from comfy.multidevice.sp.mode_choice import (choose_sp_mode, measurement_for, measurements_path,
                                            record_measurement)
from comfy.multidevice.sp.strategies import make_kv_strategy
from comfy.multidevice.weights.block_shards import ShardedBlockWeights

COMFYUI_ALLOC_CONF = "backend:cudaMallocAsync"  # what ComfyUI sets on torch 2.x CUDA builds
STUCK_TIMEOUT_S = 2.0
BLOCKS, WIDTH = 8, 128
KV_ROWS = 512  # per rank and block: long enough for a gather on a second communicator to overlap it
H3_HEADS, H3_HEAD_DIM = 56, 128
TIMED_ROWS = {"cpu": 128}  # per rank; CPU ranks share the cores, so fewer rows keep a repeat short
TIMED_ROWS_ON_CARDS = 2048
WARMUPS, REPEATS = 2, 5
TIMED_MODES = ("allgather", "ulysses")


def verdict_of(check) -> dict:
    start = time.perf_counter()
    try:
        ok, detail = check()
    except Exception as exc:  # noqa: BLE001 - a verdict, never a crash
        ok, detail = False, f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    return {"ok": bool(ok), "seconds": round(time.perf_counter() - start, 3), "detail": detail}


def _with_comfyui_allocator(devices) -> str:
    """ComfyUI's allocator setting for CUDA cards, when the user left it unset and CUDA is not
    initialised yet (after that it cannot change); what applies, in words."""
    if not any(torch.device(d).type == "cuda" for d in devices):
        return "no CUDA card: allocator setting not applicable"
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and not torch.cuda.is_initialized():
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = COMFYUI_ALLOC_CONF
    return f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}"


def exchange_between_nonzero_ranks(devices, backend, timeout_s) -> tuple[bool, str]:
    if len(devices) < 3:
        return True, f"skipped: {len(devices)} card(s) have no pair of ranks other than 0 (needs 3 or more)"
    allocator = _with_comfyui_allocator(devices)

    def rank(r, comm):
        mine = torch.full((r + 2, 8), float(r + 1), device=comm.device)  # made here, uneven
        got = comm.exchange([mine], [0])[0].cpu()
        want = torch.cat([torch.full((q + 2, 8), float(q + 1)) for q in range(comm.world_size)])
        return torch.equal(got, want)

    with SequenceParallelCoordinator(devices, backend=backend, timeout_s=timeout_s) as coord:
        oks = coord.run(rank)
    return all(oks), f"{allocator}; exact on rank(s) {[r for r, ok in enumerate(oks) if ok]}"


class _Blocks(torch.nn.Module):
    """The H3 contract the shard code relies on: `model.blocks[i]`."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in weights)
        for block, weight in zip(self.blocks, weights):
            block.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)


def shard_gather_beside_exchange(devices, backend, timeout_s) -> tuple[bool, str]:
    weights = [torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(BLOCKS)]
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():  # the same kernels as the ranks', on the full weights
        want = torch.nn.Sequential(*_Blocks(weights).blocks)(x)
    with SequenceParallelCoordinator(devices, backend=backend, timeout_s=timeout_s) as coord:
        models = [_Blocks(weights).to(d) for d in coord.devices]
        family = shard_dit_blocks(models, coord)
        try:
            def rank(r, comm):
                view = family.rank_view(r)
                view.begin_forward()
                h = x.to(comm.device)
                for i in range(BLOCKS):
                    view.bind(i, comm)
                    kv = torch.full((KV_ROWS, WIDTH), float(r), device=comm.device)
                    comm.exchange([kv, kv + 1], [0, 0])  # the block's K and V, beside the next gather
                    h = models[r].blocks[i](h)
                    view.release(i)
                return torch.equal(h.cpu(), want)

            oks = coord.run(rank)
        finally:
            family.close()
    lane = "a prefetch lane" if family.lane is not None else "the ranks' own communicator"
    return all(oks), f"{BLOCKS} blocks gathered on {lane}; outputs exact against the full weights: {all(oks)}"


class ScaledWeight(torch.Tensor):
    """A stand-in for a quantized weight: int8 data and one fp32 scale per row, travelling as
    its two inner tensors (torch's __tensor_flatten__ protocol, as upstream's quantized
    tensors do). Ops that keep the layout act on both parts; any other op sees the value."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.float32, device=data.device)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor):
        self.data_int8, self.scale = data, scale

    def __tensor_flatten__(self):
        return ["data_int8", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return ScaledWeight(inner["data_int8"], inner["scale"])

    def value(self) -> torch.Tensor:
        return self.data_int8.float() * self.scale[:, None]

    _LAYOUT_OPS = ("detach", "alias", "clone", "_to_copy")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in cls._LAYOUT_OPS and isinstance(args[0], ScaledWeight):
            w, layout_kwargs = args[0], {k: v for k, v in kwargs.items() if k != "dtype"}
            return ScaledWeight(func(w.data_int8, *args[1:], **layout_kwargs),
                                func(w.scale, *args[1:], **layout_kwargs))
        plain = [a.value() if isinstance(a, ScaledWeight) else a for a in args]
        return func(*plain, **kwargs)


def quantized_gather_and_release(devices, backend, timeout_s) -> tuple[bool, str]:

    def parts(i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(-127, 128, (WIDTH, WIDTH), generator=g, dtype=torch.int8), torch.rand(WIDTH, generator=g)

    weights = [parts(i) for i in range(BLOCKS)]

    def model_on(device):
        model = _Blocks([torch.zeros(WIDTH, WIDTH)] * BLOCKS)
        for block, (data, scale) in zip(model.blocks, weights):
            block.weight = torch.nn.Parameter(ScaledWeight(data.to(device), scale.to(device)), requires_grad=False)
        return model

    with SequenceParallelCoordinator(devices, backend=backend, timeout_s=timeout_s) as coord:
        models = [model_on(d) for d in coord.devices]
        family = ShardedBlockWeights(models, lambda m: m.blocks, coord.devices, timeout_s=timeout_s)
        try:
            def rank(r, comm):
                view = family.rank_view(r)
                ok = True
                for _ in range(2):  # the second pass reuses what the first released
                    view.begin_forward()
                    for i in range(BLOCKS):
                        view.bind(i, comm)
                        weight = models[r].blocks[i].weight
                        ok &= (torch.equal(weight.data_int8.cpu(), weights[i][0])
                               and torch.equal(weight.scale.cpu(), weights[i][1]))
                        view.release(i)
                return ok

            oks = coord.run(rank)
        finally:
            family.close()
    return all(oks), f"{BLOCKS} blocks of int8 data + scale, two passes: every bound weight exact: {all(oks)}"


def stuck_rank_recovered(devices, backend, timeout_s) -> tuple[bool, str]:
    stalled = len(devices) - 1

    def rank(r, comm):
        if r == stalled:
            time.sleep(STUCK_TIMEOUT_S * 2)
        return comm.exchange([torch.ones(2, 2, device=comm.device)], [0])[0].shape[0]

    coord = SequenceParallelCoordinator(devices, backend=backend, timeout_s=STUCK_TIMEOUT_S)
    try:
        coord.run(rank)
        return False, f"rank {stalled} stalled {STUCK_TIMEOUT_S * 2:g} s past a {STUCK_TIMEOUT_S:g} s timeout: no error"
    except Exception as exc:  # noqa: BLE001 - the expected failure, checked for its words
        text = " ".join([str(exc), *getattr(exc, "__notes__", [])])
        named = bool(re.search(rf"rank {stalled}\b|rank\(s\) \[[^\]]*\b{stalled}\b", text))
        failure = f"{type(exc).__name__} naming rank {stalled}: {named}"
    finally:
        coord.close()
    with SequenceParallelCoordinator(devices, backend=backend, timeout_s=timeout_s) as fresh:
        rows = fresh.run(lambda r, comm: comm.exchange([torch.ones(2, 2, device=comm.device)], [0])[0].shape[0])
    usable = rows == [2 * len(devices)] * len(devices)
    return named and usable, f"{failure}; a fresh coordinator on the same cards exchanged correctly: {usable}"


def _no_math_attention(q, k, v, heads, *args, skip_output_reshape=False, **kwargs):
    """q itself, in the output layout asked for: the timing then holds the exchange and its
    layout work, not attention math; and an exchange that misplaced rows shows in the output."""
    if skip_output_reshape:
        return q
    b, h, s, d = q.shape  # called with skip_reshape (H3's layout)
    return q.transpose(1, 2).reshape(b, s, h * d)


def _h3_qkv(rank: int, rows: int, device) -> list[torch.Tensor]:
    """[1, heads, rows, head_dim] views of [rows, heads, head_dim] buffers, as H3's q, k, v."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(rows, H3_HEADS, H3_HEAD_DIM, generator=g).to(device, torch.bfloat16)
            .transpose(0, 1).unsqueeze(0) for _ in range(3)]


def _timed_attends(comm, mode: str, qkv, rows: int) -> tuple[float, bool]:
    """Median seconds of REPEATS calls of `mode`'s exchange (after WARMUPS) on this rank, and
    whether the last output equals this rank's q rows."""
    strategy = make_kv_strategy(mode)
    strategy.begin_forward()  # the node's path: one forward's blocks reuse the buffers
    sizes = [rows] * comm.world_size
    times = []
    try:
        for i in range(WARMUPS + REPEATS):
            synchronize(comm.device)
            comm.barrier()  # every rank starts together: a rank's time then spans the exchange
            start = time.perf_counter()
            out = strategy.attend(comm, _no_math_attention, *qkv, H3_HEADS, skip_reshape=True,
                                  shard_sizes=sizes)
            synchronize(comm.device)
            if i >= WARMUPS:
                times.append(time.perf_counter() - start)
    finally:
        strategy.end_forward()
    return statistics.median(times), torch.equal(out.cpu(), _no_math_attention(*qkv, H3_HEADS).cpu())


def _ulysses_name(world: int) -> str:
    degree = ulysses_degree(world, H3_HEADS)
    return "ulysses" if degree == world else f"hybrid (Ulysses in groups of {degree})"


def _slowest_medians(devices, backend, timeout_s, rows) -> tuple[dict, list[str], str]:
    """Per mode, the slowest rank's median seconds; which (mode, rank) outputs were wrong; the
    backend that ran."""
    def rank(r, comm):
        qkv = _h3_qkv(r, rows, comm.device)
        return {mode: _timed_attends(comm, mode, qkv, rows) for mode in TIMED_MODES}

    with SequenceParallelCoordinator(devices, backend=backend, timeout_s=timeout_s) as coord:
        per_rank = coord.run(rank)
        backend_name = coord.backend_name
    slowest = {mode: max(r[mode][0] for r in per_rank) for mode in TIMED_MODES}
    inexact = [f"{mode} on rank {i}" for i, r in enumerate(per_rank) for mode in TIMED_MODES if not r[mode][1]]
    return slowest, inexact, backend_name


def _nothing_to_measure(world: int, kind: str) -> str:
    counts = [n for n in range(2, 9) if ulysses_degree(n, H3_HEADS) > 1]
    return (f"skipped, nothing recorded: no group size above one divides both {world} card(s) and H3's "
            f"{H3_HEADS} heads, so auto runs the all-gather here without measuring; to measure, rerun with "
            f"{'--device-kind cpu ' if kind == 'cpu' else ''}--devices N, N one of {', '.join(map(str, counts))}")


def attention_exchanges_timed(devices, backend, timeout_s) -> tuple[bool, str]:
    world, kind = len(devices), torch.device(devices[0]).type
    if ulysses_degree(world, H3_HEADS) == 1:
        return True, _nothing_to_measure(world, kind)
    rows = TIMED_ROWS.get(kind, TIMED_ROWS_ON_CARDS)
    slowest, inexact, backend_name = _slowest_medians(devices, backend, timeout_s, rows)
    figures = (f"allgather {slowest['allgather'] * 1e3:.2f} ms, {_ulysses_name(world)} "
               f"{slowest['ulysses'] * 1e3:.2f} ms (slowest rank's median of {REPEATS}; {world} {kind} "
               f"rank(s), {backend_name}, {rows} rows per rank, {H3_HEADS} heads x {H3_HEAD_DIM}, bf16)")
    if inexact:  # a wrong exchange's time must not steer auto
        return False, f"{figures}; outputs wrong for {', '.join(inexact)}: nothing recorded"
    detail = {"measured_by": "doctor --deep", "backend": backend_name, "rows_per_rank": rows, "heads": H3_HEADS}
    try:
        path = record_measurement(kind, world, slowest["allgather"], slowest["ulysses"], detail)
    except OSError as exc:
        return False, (f"{figures}; could not write {measurements_path()}: {exc}; make that folder writable "
                       "or set XDG_CACHE_HOME to a writable folder")
    choice = choose_sp_mode("auto", world, H3_HEADS, H3_HEAD_DIM,
                            measured=measurement_for(kind, world, path))  # read back, as the node reads it
    return True, f"{figures}; auto at W={world} on {kind} now picks {choice.name}; written to {path}"


DEEP_CHECKS = {
    "exchange_between_nonzero_ranks": exchange_between_nonzero_ranks,
    "shard_gather_beside_exchange": shard_gather_beside_exchange,
    "quantized_gather_and_release": quantized_gather_and_release,
    "stuck_rank_recovered": stuck_rank_recovered,
    "attention_exchanges_timed": attention_exchanges_timed,
}


def deep_checks(devices: list[str], backend: str, timeout_s: float) -> dict:
    """Every check's verdict, by name, in the order above."""
    return {name: verdict_of(lambda check=check: check(devices, backend, timeout_s))
            for name, check in DEEP_CHECKS.items()}
