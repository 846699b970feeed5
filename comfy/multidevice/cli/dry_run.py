"""The dry run of `minimax_h3_parallel.py run`: the whole sequence-parallel pipeline, no weights.

Stages:
1. choose the ranks (all visible accelerators, else 4 CPU ranks; `--devices N` to change);
2. the miniature H3 DiT with seeded random weights, saved once as safetensors in the cache
   folder and loaded from there (every rank's replica is built from that file);
3. a flow-matching Euler sampling of a joint video + audio latent (text, optional reference
   images) on W ranks in sequence parallel, and the same sampling on one device (the reference);
4. parity of the final latents, a short report, latents + report.json in the output folder.

The last line printed is one JSON object (see `report.REPORT_KEYS`); the exit code is 1 when parity
fails, 2 on bad options.

The options and their checks live in cli/dry_run_settings.py, the report in cli/report.py;
torchrun_run.py reuses the stages one by one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from comfy.multidevice.cli.dry_run_settings import (DryRunError, latent_rows, make_settings, planned_rows,
                                                    rows_text, RunSettings, sequence_length)
from comfy.multidevice.cli.machine_load import LoadMeter, not_quiet_reason
from comfy.multidevice.cli.report import (paired_speedup, parity_figures, parity_line, speedup_baseline,
                                           steady_seconds, write_outputs)
from comfy.multidevice.comm.errors import BackendUnavailable
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.settings import BACKEND_ENV, read_variables, SettingError
from comfy.multidevice.devices import copy_for_rank
from comfy.multidevice.miniature.h3 import build_miniature, miniature_template, read_miniature_config, save_miniature
from comfy.multidevice.tensor_bytes import module_bytes
from comfy.multidevice.sp.cost_model import DiTShape, forward_traffic
from comfy.multidevice.sp.mode_choice import choose_sp_mode, measurement_for
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from comfy.multidevice.sp.strategies import SPMode
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.dispatch_warm_up import start_dispatch_warm_up
from comfy.multidevice.weights.replicas import RankReplicas

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- weights

def checkpoint_path(settings: RunSettings) -> Path:
    key = json.dumps({"config": settings.config.to_json(), "seed": settings.args.seed, "dtype": settings.args.dtype},
                     sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(settings.args.cache) / f"minimax-h3-miniature-{digest}.safetensors"


def ensure_checkpoint(settings: RunSettings) -> tuple[Path, bool]:
    """The seeded miniature as a safetensors file in the cache; (path, reused)."""
    path = checkpoint_path(settings)
    if path.exists():
        try:
            config, dtype = read_miniature_config(path)
        except Exception as exc:  # noqa: BLE001 - truncated or foreign: the cache is ours to rebuild
            log.warning("cached %s cannot be read (%s); rebuilding it", path, exc)
        else:
            if config == settings.config and dtype == settings.dtype:
                return path, True
            log.warning("cached %s does not match the requested model; rebuilding it", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = build_miniature(settings.config, seed=settings.args.seed, dtype=settings.dtype)
    tmp = path.with_suffix(".tmp")
    try:
        save_miniature(model, tmp)
        os.replace(tmp, path)  # never leave a half-written checkpoint under the final name
    finally:  # also on Ctrl-C or SIGTERM (minimax_h3_parallel.py turns it into an exception)
        tmp.unlink(missing_ok=True)
    return path, False


@dataclass
class Replicas:
    modules: list[torch.nn.Module]
    source: str        # how they were built
    bytes_read: int    # checkpoint bytes read from disk for them


def build_replicas(path: Path, devices: list[str]) -> Replicas:
    """One replica per rank from the checkpoint file, read from disk once.

    Through comfy/multidevice/weights/: one read-only base in RAM, and each rank's hot cache
    built from it (a zero-copy view of the base on a CPU rank, a device copy elsewhere).
    """
    base = SharedCheckpoint.open(path)
    read_before = base.bytes_read
    replicas = RankReplicas(base, devices, template=miniature_template(path), load=True)
    return Replicas([r.module for r in replicas], "shared_checkpoint", read_before)


# ----------------------------------------------------------------------------- sampling

def make_inputs(settings: RunSettings) -> tuple[list[torch.Tensor], torch.Tensor, dict]:
    """Seeded noise latents, text states and reference-image latents (on the CPU)."""
    cfg = settings.config
    g = torch.Generator().manual_seed(settings.args.seed + 1)
    video = torch.randn(1, cfg.latents_dim, settings.latent_t, settings.latent_h, settings.latent_w, generator=g)
    audio = torch.randn(1, cfg.audio_latents_dim, 2, settings.audio_t, generator=g)
    text = torch.randn(1, settings.args.text_tokens, cfg.text_dim, generator=g)
    refs = [torch.randn(1, cfg.latents_dim, 1, settings.latent_h, settings.latent_w, generator=g)
            for _ in range(settings.args.refs)]
    kwargs = {"minimax_payload": {"ref_image_latents": refs}} if refs else {}
    return [video, audio], text, kwargs


def sigma_schedule(steps: int, shift: float) -> torch.Tensor:
    """Flow-matching sigmas from 1 to 0, shifted like H3's video schedule."""
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * s / (1.0 + (shift - 1.0) * s)).float()


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.started = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * done / self.total)
        elapsed = time.perf_counter() - self.started
        rate = f"{elapsed / done:.2f} s/step" if done else ""
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} {rate}")
        if done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def euler_sample(forward: Callable, x: list[torch.Tensor], context, kwargs: dict, sigmas: torch.Tensor,
                 progress: Progress, after_step: Callable[[], None] | None = None) -> tuple[list, list[float]]:
    """x_{i+1} = x_i + (sigma_{i+1} - sigma_i) * v(x_i, sigma_i); returns (latents, step seconds)."""
    return sample_side_by_side([(forward, x, context, kwargs, after_step)], sigmas, progress)[0]


def sample_side_by_side(runs, sigmas: torch.Tensor, progress: Progress) -> list[tuple[list, list[float]]]:
    """Euler-sample several (forward, x, context, kwargs, after_step) runs, step i of each right
    after step i of the one before, so their step times share the machine's load of the moment
    (a ratio of them is fair on a busy machine); returns (latents, step seconds) per run."""
    states = [[z.clone() for z in run[1]] for run in runs]
    seconds: list[list[float]] = [[] for _ in runs]
    progress.update(0)
    for i in range(len(sigmas) - 1):
        for r, (forward, _, context, kwargs, after_step) in enumerate(runs):
            x = states[r]
            t0 = time.perf_counter()
            with torch.inference_mode():
                v = forward(x, (sigmas[i] * 1000.0).reshape(1).to(x[0].device), context, **kwargs)
            states[r] = [z + (sigmas[i + 1] - sigmas[i]) * d.to(z.device, z.dtype) for z, d in zip(x, v)]
            seconds[r].append(time.perf_counter() - t0)
            if after_step is not None:
                after_step()
        progress.update(i + 1)
    return list(zip(states, seconds))


def _cpu_threads_per_rank(devices: list[str]) -> int | None:
    # CPU "devices" share the cores: one rank thread each, their intra-op threads split the cores
    if any(not d.startswith("cpu") for d in devices):
        return None
    return max(1, (os.cpu_count() or 1) // len(devices))


def _set_rank_threads(coord, threads: int) -> None:
    """Intra-op threads of every rank thread. The setting is per thread (OpenMP): set on the
    main thread it never reaches the rank threads, which then each run all the cores' worth."""
    coord.run(lambda rank, comm: torch.set_num_threads(threads))


# ----------------------------------------------------------------------------- the run

def run(args: argparse.Namespace, out=sys.stdout) -> int:
    # torch's one-time import for the weights' read-only views, while the run checks its
    # options, starts its ranks and reads the checkpoint
    start_dispatch_warm_up()
    try:
        settings = make_settings(args)
    except (DryRunError, SettingError) as exc:
        print(f"minimax_h3_parallel.py run: {exc}", file=sys.stderr)
        return 2
    try:  # a backend that cannot start is a bad option too: say so before anything is built
        coord = SequenceParallelCoordinator(settings.devices, backend=args.backend)
    except (BackendUnavailable, ValueError) as exc:
        where = (f"--backend {args.backend}" if args.backend is not None
                 else f"environment variable {BACKEND_ENV}={read_variables([BACKEND_ENV])[BACKEND_ENV] or ''!r}")
        print(f"minimax_h3_parallel.py run: {where}: {exc}", file=sys.stderr)
        return 2
    try:
        return _run_on(coord, settings, args, out)
    except OSError as exc:  # a folder filled up or changed under the run
        print(f"minimax_h3_parallel.py run: {file_problem(exc)}", file=sys.stderr)
        return 1
    finally:
        coord.close()


def file_problem(exc: OSError) -> str:
    """One line for a file that could not be read or written, and what to do."""
    where = f"{exc.filename}: " if exc.filename else ""
    return (f"{where}{exc.strerror or exc}; free space there or name another --out / --cache "
            "folder")


def _run_on(coord: SequenceParallelCoordinator, settings: RunSettings, args: argparse.Namespace, out) -> int:
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    cfg, world = settings.config, len(settings.devices)
    say(f"MiniMax-H3 dry run: miniature DiT (hidden {cfg.hidden_size}, {cfg.num_layers} blocks, "
        f"{cfg.num_attention_heads}x{cfg.attention_head_dim} heads), {args.dtype}, seed {args.seed}")

    path, reused = ensure_checkpoint(settings)
    size_mb = path.stat().st_size / 2 ** 20
    say(f"[weights] {path} ({size_mb:.1f} MiB, {'reused from the cache' if reused else 'built and saved'})")
    built = build_replicas(path, settings.devices)
    replicas = built.modules
    say(f"[weights] {world} replica(s) from one read-only base ({built.source}): "
        f"{built.bytes_read / 2 ** 20:.1f} MiB read from disk")

    x, context, kwargs = make_inputs(settings)
    sigmas = sigma_schedule(args.steps, cfg.sigma_shift_video)
    seq_len = sequence_length(settings)
    split = settings.split
    tokens_per_rank = planned_rows(split, seq_len, world)

    threads_before = torch.get_num_threads()
    per_rank_threads = _cpu_threads_per_rank(settings.devices)
    with coord:
        backend = coord.backend_name
        say(f"[ranks] {world} x {settings.devices[0].split(':')[0]} ({', '.join(settings.devices)}), backend {backend}"
            + (f" (fallback: {coord.fallback_reason})" if coord.fallback_reason else "")
            + f", sp mode {args.sp_mode}"
            + ("" if args.exchange_precision == "exact" else f", {args.exchange_precision} exchange"))
        parts = ", ".join(f"{k} {n}" for k, n in latent_rows(settings).items())
        say(f"[sequence] {seq_len} tokens ({parts}); tokens per rank {rows_text(tokens_per_rank)}")
        # shard strips the ranks' copies: the reference gets its own (from the same base, no read)
        reference = (build_replicas(path, settings.devices[:1]).modules[0]
                     if args.dit_weights == "shard" else replicas[0])
        sp = enable_sequence_parallel(replicas, coord, sp_mode=SPMode(args.sp_mode, args.sp_overlap,
                                                                  exchange_precision=args.exchange_precision),
                                      dit_weights=args.dit_weights, split=split)
        exchanged = []

        # torch.set_num_threads is per thread for OpenMP but global for MKL: each run sets its
        # threads right before its forward (the ranks cores / W each, the reference all cores)
        def sp_forward(*a, **kw):
            if per_rank_threads is not None:
                _set_rank_threads(coord, per_rank_threads)
            return sp(*a, **kw)

        def reference_forward(*a, **kw):
            torch.set_num_threads(threads_before)
            return reference(*a, **kw)

        runs = [(sp_forward, x, context, kwargs, lambda: exchanged.append(sp.bytes_exchanged_last_forward()))]
        ref_dev = settings.devices[0]
        if not args.no_reference:
            # One device with all the cores, stepped right after each SP step; the rank threads
            # wait on their queues meanwhile, using no core.
            runs.append((reference_forward, [z.to(ref_dev) for z in x], context.to(ref_dev),
                         copy_for_rank(kwargs, torch.device(ref_dev)), None))
        what = f"sampling on {world} rank(s)" + ("" if args.no_reference else " and on 1 device, step by step")
        try:
            if not args.no_reference:  # one untimed forward each: allocator and pools warm alike
                for forward, z, c, kw, _ in runs:
                    with torch.inference_mode():
                        forward(z, (sigmas[0] * 1000.0).reshape(1).to(z[0].device), c, **kw)
                coord.reset_byte_counts()
            # block weights gathered before the timed steps (the warm-up forward) are not counted
            gathered_before = list(sp.block_weights.gathered_bytes) if args.dit_weights == "shard" else None
            meter = LoadMeter()
            sampled = sample_side_by_side(runs, sigmas, Progress(what, args.steps, not args.no_progress))
            load = meter.stop()
        finally:
            if args.dit_weights == "shard":
                sp.close()  # the prefetch lane's rank threads
        latents, seconds = sampled[0]
        if tokens_per_rank is None:
            tokens_per_rank = sp.tokens_per_rank()
            say(f"[split] auto: tokens per rank {tokens_per_rank}")
        if sp.tokens_per_rank() != tokens_per_rank:
            raise RuntimeError(f"ranks held {sp.tokens_per_rank()} tokens, expected {tokens_per_rank}")
        byte_counts = coord.byte_counts()  # per rank, the whole sampling
    torch.set_num_threads(threads_before)  # the caller's setting again (MKL's is global)
    sp_seconds = steady_seconds(seconds)
    bytes_per_step = max(exchanged) if exchanged else 0
    say(f"[sampling] {world} rank(s): {args.steps} steps, {sp_seconds:.3f} s/step, "
        f"exchanged {bytes_per_step / 2 ** 20:.2f} MiB/step between ranks")
    dit_bytes = [module_bytes(m) for m in replicas]
    gathered = [0] * world
    if args.dit_weights == "shard":
        gathered = [(b - b0) // args.steps for b, b0 in zip(sp.block_weights.gathered_bytes, gathered_before)]
        say(f"[weights] shard: DiT MiB per rank between blocks {[round(b / 2 ** 20, 2) for b in dit_bytes]}, "
            f"block weights gathered per rank and step {[round(b / 2 ** 20, 2) for b in gathered]} MiB")
    mode_used, model_bytes = _traffic_model(settings, seq_len, world, tokens_per_rank)
    say(f"[traffic] sp mode {mode_used}: received per rank and step "
        f"{[round(c['received'] / args.steps / 2 ** 20, 2) for c in byte_counts]} MiB "
        f"(byte model: {model_bytes / 2 ** 20:.2f} MiB in all ranks per step)")

    ref_latents, ref_seconds = None, None
    reference_threads = threads_before if ref_dev.startswith("cpu") else None
    if not args.no_reference:
        ref_latents, rs = sampled[1]
        ref_seconds = steady_seconds(rs)
        speedup = round(paired_speedup(rs, seconds), 4)  # the figure the JSON keeps, printed from the same value
        noise = not_quiet_reason(load, os.cpu_count() or 1, world, reference_threads is not None)
        say(f"[reference] 1 device: {args.steps} steps, {ref_seconds:.3f} s/step")
        if noise is None:
            say(f"[speedup] {speedup:.2f}x = " + speedup_baseline(settings.devices, reference_threads))
        else:  # a figure printed here would be read as the parallel run's, whatever the next line says
            say(f"[speedup] not measured: {noise} (the ratio is in the JSON report, with speedup_quiet false)")

    report = {
        "world_size": world, "backend": backend, "sp_mode": args.sp_mode, "devices": settings.devices,
        "tokens": seq_len, "tokens_per_rank": tokens_per_rank, "steps": args.steps,
        "max_abs_diff": None, "rel_diff": None, "tolerance": settings.tolerance, "parity": "skipped",
        "seconds_per_step": round(sp_seconds, 6),
        "reference_seconds_per_step": None if ref_seconds is None else round(ref_seconds, 6),
        "speedup": None if ref_seconds is None else speedup,
        "speedup_quiet": None if ref_seconds is None else noise is None,
        "machine_load": None if load is None else load.as_report(),
        "exchanged_bytes_per_step": bytes_per_step, "dtype": args.dtype,
        "cpu_threads_per_rank": per_rank_threads,
        "reference_cpu_threads": reference_threads,
        "checkpoint": str(path), "checkpoint_reused": reused, "weights_source": built.source,
        "checkpoint_bytes_read": built.bytes_read,
        "out": str(args.out),
        "sp_overlap": args.sp_overlap, "sp_mode_used": mode_used, "exchange_precision": args.exchange_precision, "byte_counts": byte_counts,
        "model_bytes_per_step": model_bytes, "dit_weights": args.dit_weights,
        # DiT bytes each rank's module holds between blocks (on a card: resident there)
        "dit_weight_bytes_per_rank": dit_bytes, "dit_gathered_bytes_per_step": gathered,
        "speedup_baseline": speedup_baseline(settings.devices, reference_threads),
    }
    if ref_latents is not None:
        report.update(parity_figures(latents, ref_latents, settings.tolerance))
        say(parity_line(report))

    write_outputs(Path(args.out), latents, ref_latents, report)
    say(f"[output] {Path(args.out) / 'latents.safetensors'}, {Path(args.out) / 'report.json'}")
    print(json.dumps(report), file=out, flush=True)
    return 1 if report["parity"] == "fail" else 0


def _traffic_model(settings: RunSettings, seq_len: int, world: int, rows: list[int]) -> tuple[str, int]:
    """The mode `auto` resolves to, and the cost model's bytes received per step (all ranks) for
    the ranks' `rows`."""
    cfg = settings.config
    mode = settings.args.sp_mode
    if mode == "auto":  # the rule the ranks' AutoKV follows, with the same measurement
        measured = measurement_for(str(settings.devices[0]).split(":")[0], world)
        mode = choose_sp_mode("auto", world, cfg.num_attention_heads, cfg.attention_head_dim, measured=measured,
                              uneven_rows=settings.split.uneven).mode
    shape = DiTShape(hidden=cfg.hidden_size, blocks=cfg.num_layers, heads=cfg.num_attention_heads,
                     head_dim=cfg.attention_head_dim, ffn=cfg.ffn_hidden_size)
    itemsize = settings.dtype.itemsize
    total = sum(forward_traffic(mode, shape, seq_len, world, r, itemsize, weights=rows)["total"].received
                for r in range(world))
    return mode, total
