"""The dry run's settings: its command-line options, their checks, and the sizes they give.

Every option (and the multi-device environment variables) is checked before anything is built;
a wrong one raises DryRunError naming the option and the fix.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from comfy.multidevice.cards import auto_kind, probe_devices, visible_device_names
from comfy.multidevice.cli.options import cpu_ranks_problem, finite_number, folder, folder_problem, integer
from comfy.multidevice.comm.compression import EXACT, EXCHANGE_PRECISIONS, STEP_REL_ERROR_BOUND
from comfy.multidevice.comm.settings import check_environment, user_cache_dir, VALID_BACKENDS
from comfy.multidevice.devices import available_memory_bytes
from comfy.multidevice.miniature.h3 import MiniatureConfig, MiniatureH3Model
from comfy.multidevice.sp.plan import SequenceParallelError, shard_sizes
from comfy.multidevice.sp.split import check_mode_for_split, EVEN, parse_split, RowSplit
from comfy.multidevice.sp.strategies import DEFAULT_SP_MODE, SP_MODES, SPMode
from comfy.multidevice.weights.block_shards import APPLIED_DIT_WEIGHT_MODES

VIDEO_FPS = 24           # H3 generates 24 fps video
AUDIO_LATENT_HZ = 40     # audio VAE: 40 latent frames per second
VAE_SPATIAL = 16         # video VAE: 16x spatial, latent frames = 5k+2 for 17k+5 pixel frames
PATCH = 2                # DiT patch (1, 2, 2)
DEFAULT_CPU_RANKS = 4
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}  # relative to max |reference latent|
OUTPUT_FILES = ("latents.safetensors", "report.json")
# Upper bounds of the options: far above any useful dry run, low enough that the arithmetic
# and the memory estimate below stay meaningful. The memory estimate is the machine's limit.
LIMITS = {"steps": 1000,  # H3 samples with 50 steps at most
          "frames": 17 * 2000 + 5, "width": 16384, "height": 16384,  # ComfyUI's largest image side
          "refs": 64, "text_tokens": 1 << 20, "hidden": 1 << 16, "blocks": 1024, "heads": 1024,
          "head_dim": 1024, "seed": 2**63 - 2,  # the noise uses seed + 1, torch seeds are 64-bit
          "sp_overlap": 1024}


class DryRunError(ValueError):
    """A dry-run option is wrong; the message names it and the fix."""


def add_arguments(parser: argparse.ArgumentParser, repo_dir: Path) -> None:
    g = parser.add_argument_group("ranks")
    g.add_argument("--devices", type=integer, default=None,
                   help="number of ranks (default: all visible NPUs/GPUs, else 4 CPU ranks)")
    g.add_argument("--cpu", action="store_true", help="use CPU ranks even when accelerators are visible")
    g.add_argument("--backend", choices=VALID_BACKENDS, default=None,
                   help="collective backend (default: COMFYUI_MULTI_DEVICE_BACKEND, else auto)")
    g.add_argument("--sp-mode", choices=list(SP_MODES), default=DEFAULT_SP_MODE,
                   help="how the ranks share attention: allgather = every rank gathers all keys "
                        "and values (simple; the most bytes at 8 cards), ulysses = each rank takes a "
                        "block of heads over the whole sequence (fewer bytes at 4-8 cards), auto = "
                        "whichever moves fewer bytes for these cards and heads (default %(default)s)")
    g.add_argument("--split", default="even", metavar="SPLIT",
                   help="how the rows are shared over the ranks (mixed cards): even, auto (each rank "
                        "times one block at the first step and takes rows by its speed) or one weight "
                        "per rank such as 3,1 (default %(default)s)")
    g.add_argument("--sp-overlap", type=integer, default=1, metavar="CHUNKS",
                   help="ulysses/auto: cut each rank's heads into CHUNKS whose exchange overlaps the "
                        "attention (default 1: no overlap)")
    g.add_argument("--exchange-precision", choices=list(EXCHANGE_PRECISIONS), default=EXACT,
                   help="what the ranks send each other for attention: exact, or int8 / fp8 with a "
                        "scale per 128 values (about half the bytes of bf16; the result is close to "
                        "exact, not identical; the default --tolerance becomes the documented bound) "
                        "(default %(default)s)")
    g.add_argument("--dit-weights", choices=list(APPLIED_DIT_WEIGHT_MODES), default="replicate",
                   help="replicate = a full DiT on every rank; shard = each rank keeps 1/N of the "
                        "block weights and gathers a block just before it runs, the same result "
                        "with less memory per card (default %(default)s)")
    g = parser.add_argument_group("sampling")
    g.add_argument("--steps", type=integer, default=10, help="Euler steps (default %(default)s)")
    g.add_argument("--frames", type=integer, default=39, help="video frames, 17k+5 (default %(default)s)")
    g.add_argument("--width", type=integer, default=384,
                   help="video width in pixels, a multiple of 32 (default %(default)s)")
    g.add_argument("--height", type=integer, default=256,
                   help="video height in pixels, a multiple of 32 (default %(default)s)")
    g.add_argument("--refs", type=integer, default=0,
                   help="reference images packed ahead of the video, as in ref2va (default 0)")
    g.add_argument("--text-tokens", type=integer, default=64, help="text tokens (default %(default)s)")
    g.add_argument("--seed", type=integer, default=0, help="seed of the weights and the noise (default 0)")
    g.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32",
                   help="precision of the DiT blocks (default %(default)s)")
    g.add_argument("--no-reference", action="store_true", help="skip the single-device reference run")
    g.add_argument("--tolerance", type=finite_number, default=None,
                   help="parity tolerance, relative to max |reference| (default: 1e-5 fp32, 2e-2 bf16)")
    g = parser.add_argument_group("miniature model")
    g.add_argument("--hidden", type=integer, default=256, help="hidden size (default %(default)s)")
    g.add_argument("--blocks", type=integer, default=6, help="DiT blocks (default %(default)s)")
    g.add_argument("--heads", type=integer, default=6, help="attention heads (default %(default)s)")
    g.add_argument("--head-dim", type=integer, default=64, help="head dim (default %(default)s)")
    g = parser.add_argument_group("files")
    # outside the checkout: a clone where the tests ran would otherwise report "reused"
    g.add_argument("--cache", type=folder, default=user_cache_dir(),
                   help="folder of the miniature checkpoint (default: minimax-h3-multinpu in "
                        "$XDG_CACHE_HOME, else in ~/.cache; now %(default)s)")
    g.add_argument("--out", type=folder, default=repo_dir / "out",
                   help="folder for latents.safetensors and report.json (default ./out)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    g.add_argument("--debug", action="store_true",
                   help="under torchrun, a failing rank prints its full traceback instead of one line")


@dataclass
class RunSettings:
    """Validated options: sizes in latent rows, the model config, the devices."""

    devices: list[str]
    latent_t: int
    latent_h: int
    latent_w: int
    audio_t: int
    config: MiniatureConfig
    dtype: torch.dtype
    tolerance: float
    args: argparse.Namespace
    split: RowSplit = EVEN  # --split for these ranks (sp/split.py)


def visible_accelerators() -> list[str]:
    inventory = probe_devices()
    kind = auto_kind(inventory)
    return [] if kind == "cpu" else visible_device_names(kind, inventory)


def choose_devices(n: int | None, cpu: bool) -> list[str]:
    if n is not None and n < 1:
        raise DryRunError(f"--devices {n}: need at least 1 rank")
    accelerators = [] if cpu else visible_accelerators()
    if not accelerators:
        if problem := cpu_ranks_problem(n):
            raise DryRunError(problem)
        return ["cpu"] * (n or DEFAULT_CPU_RANKS)
    if n is None:
        return accelerators
    if n > len(accelerators):
        raise DryRunError(f"--devices {n}: only {len(accelerators)} accelerator(s) visible "
                          f"({', '.join(accelerators)}); use --devices {len(accelerators)} or --cpu")
    return accelerators[:n]


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_upper_bounds(args: argparse.Namespace) -> None:
    for name, most in LIMITS.items():
        value = getattr(args, name)
        if value > most:
            raise DryRunError(f"{_option(name)} {value}: above the dry run's limit of {most}; "
                              f"use {_option(name)} {most} or less")
    if args.seed < 0:
        raise DryRunError(f"--seed {args.seed}: must be 0 or more")
    if args.tolerance is not None and args.tolerance > 1:
        raise DryRunError(f"--tolerance {args.tolerance}: above 1 any result passes (it is relative to "
                          "max |reference|); use a value between 0 and 1")


def _check_folders(args: argparse.Namespace) -> None:
    for name, files in (("out", OUTPUT_FILES), ("cache", ())):
        problem = folder_problem(Path(getattr(args, name)), files)
        if problem:
            raise DryRunError(f"--{name} {getattr(args, name)}: {problem}")


def _check_memory(settings: "RunSettings") -> None:
    """Refuse sizes whose estimated host memory exceeds what this machine has available."""
    available = available_memory_bytes()
    if available is None:
        return
    need, tokens, params = estimated_memory_bytes(settings)
    if need > available:
        raise DryRunError(
            f"{tokens} tokens and a {params / 1e6:,.1f}M-parameter model need about "
            f"{need / 2**30:.1f} GiB, and this machine has {available / 2**30:.1f} GiB available; "
            "lower --frames, --width, --height, --refs or --text-tokens (the tokens) or --hidden, "
            "--blocks, --heads or --head-dim (the model)")


def estimated_memory_bytes(settings: "RunSettings") -> tuple[int, int, int]:
    """(bytes, tokens, parameters): the model three times (built, saved file in the page cache,
    loaded base) plus one fp32 forward's working set over all tokens and the K/V every rank
    gathers. An estimate to catch sizes that cannot fit, not a measurement."""
    cfg = settings.config
    with torch.device("meta"):  # counts the parameters, allocates nothing
        params = sum(p.numel() for p in MiniatureH3Model(cfg, dtype=settings.dtype).parameters())
    tokens = sequence_length(settings)
    width = cfg.num_attention_heads * cfg.attention_head_dim
    forward = tokens * (cfg.ffn_hidden_size + 8 * cfg.hidden_size + 4 * width) * 4
    gathered_kv = len(settings.devices) * 2 * tokens * width * 4
    return 3 * params * settings.dtype.itemsize + forward + gathered_kv, tokens, params


def make_settings(args: argparse.Namespace) -> RunSettings:
    """Check every option (and the multi-device environment variables) before anything is built."""
    check_environment()
    _check_upper_bounds(args)
    if args.steps < 1:
        raise DryRunError(f"--steps {args.steps}: need at least 1 step")
    if args.frames < 5 or (args.frames - 5) % 17:
        k = max(0, round((args.frames - 5) / 17))
        raise DryRunError(f"--frames {args.frames}: H3's video VAE takes 17k+5 frames; use "
                          f"--frames {17 * k + 5} or {17 * (k + 1) + 5}")
    step = VAE_SPATIAL * PATCH
    for name in ("width", "height"):
        value = getattr(args, name)
        if value < step or value % step:
            raise DryRunError(f"--{name} {value}: must be a positive multiple of {step} "
                              f"(16x VAE x 2x2 patch); e.g. --{name} {max(step, round(value / step) * step)}")
    for name, least in (("refs", 0), ("text_tokens", 1)):
        if getattr(args, name) < least:
            raise DryRunError(f"{_option(name)} {getattr(args, name)} is out of range")
    try:
        SPMode(args.sp_mode, overlap_chunks=args.sp_overlap, exchange_precision=args.exchange_precision)
    except ValueError as exc:
        raise DryRunError(f"--sp-mode {args.sp_mode} --sp-overlap {args.sp_overlap} --exchange-precision "
                          f"{args.exchange_precision}: {exc}") from exc
    if args.tolerance is not None and not args.tolerance >= 0:
        raise DryRunError(f"--tolerance {args.tolerance}: must be >= 0")
    for name, least in (("hidden", 2), ("blocks", 1), ("heads", 1), ("head_dim", 8)):
        # head_dim >= 8: H3 rotates only part of each head (here at least 6 dims)
        if getattr(args, name) < least:
            raise DryRunError(f"{_option(name)} {getattr(args, name)}: too small for the "
                              f"miniature; use {_option(name)} {least} or more")
    if args.heads * args.head_dim == args.hidden:
        raise DryRunError(f"--heads {args.heads} x --head-dim {args.head_dim} equals --hidden {args.hidden}; "
                          "H3's attention width differs from its hidden size, pick another --hidden")
    try:
        config = MiniatureConfig(hidden_size=args.hidden, num_layers=args.blocks,
                                 num_attention_heads=args.heads, attention_head_dim=args.head_dim,
                                 ffn_hidden_size=2 * args.hidden, text_dim=args.hidden // 2 + 16,
                                 time_embed_hidden_size=args.hidden, time_embed_dim=args.hidden // 2,
                                 timestep_input_dim=64, rope_inv_freq_len=max(1, (args.head_dim * 3 // 4) // 6))
    except ValueError as exc:
        raise DryRunError(f"miniature size options: {exc}") from exc
    devices = choose_devices(args.devices, args.cpu)
    dtype = getattr(torch, args.dtype)
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
    if args.tolerance is None and args.exchange_precision != EXACT:  # rounded on purpose: its bound
        tolerance = max(tolerance, STEP_REL_ERROR_BOUND[args.exchange_precision])
    audio_t = math.ceil(args.frames / VIDEO_FPS * AUDIO_LATENT_HZ)
    settings = RunSettings(devices, (args.frames - 5) // 17 * 5 + 2, args.height // VAE_SPATIAL, args.width // VAE_SPATIAL,
                audio_t, config, dtype, tolerance, args)
    seq = sequence_length(settings)
    if seq < len(devices):
        raise DryRunError(f"{seq} tokens cannot be split over {len(devices)} ranks; use --devices {seq} or fewer")
    settings.split = checked_split(args, len(devices))
    if args.sp_overlap > args.heads:
        raise DryRunError(f"--sp-overlap {args.sp_overlap}: more chunks than the {args.heads} heads; "
                          f"use --sp-overlap {args.heads} or fewer")
    _check_memory(settings)
    _check_folders(args)
    return settings


def planned_rows(split: RowSplit, seq_len: int, world: int) -> list[int] | None:
    """Tokens per rank under `split`; None for auto, whose rows its first step's probe decides."""
    return None if split.kind == "auto" else shard_sizes(seq_len, world, split.weights)


def rows_text(rows: list[int] | None) -> str:
    """The [sequence] line's tokens per rank."""
    return str(rows) if rows is not None else "by split auto's probe at the first step"


def checked_split(args: argparse.Namespace, world: int) -> RowSplit:
    """--split for `world` ranks, with --sp-mode (Ulysses needs even rows); DryRunError naming the fix."""
    try:
        split = parse_split(args.split, world)
        check_mode_for_split(SPMode(args.sp_mode, overlap_chunks=args.sp_overlap), split)
    except (ValueError, SequenceParallelError) as exc:
        raise DryRunError(f"--split {args.split}: {exc}") from exc
    return split


def latent_rows(settings: RunSettings) -> dict[str, int]:
    """Packed rows per part of the sequence."""
    frame_rows = (settings.latent_h // PATCH) * (settings.latent_w // PATCH)
    return {"text": settings.args.text_tokens, "refs": settings.args.refs * frame_rows,
            "audio": 2 * settings.audio_t, "video": settings.latent_t * frame_rows}


def sequence_length(settings: RunSettings) -> int:
    return sum(latent_rows(settings).values())
