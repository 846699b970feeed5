"""The dry run's report: its keys, its timing and parity figures, and the files it writes.

One schema for both launchers (rank threads in cli/dry_run.py, one process per rank in
cli/torchrun_run.py) and for the benches that read it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from safetensors.torch import save

REPORT_KEYS = ("world_size", "backend", "sp_mode", "devices", "tokens", "tokens_per_rank", "steps",
               "max_abs_diff", "rel_diff", "tolerance", "parity", "seconds_per_step",
               "reference_seconds_per_step", "speedup", "exchanged_bytes_per_step", "dtype",
               "cpu_threads_per_rank", "reference_cpu_threads", "checkpoint", "checkpoint_reused",
               "weights_source", "checkpoint_bytes_read", "out", "sp_overlap", "sp_mode_used",
               "byte_counts", "model_bytes_per_step", "dit_weights", "dit_weight_bytes_per_rank",
               "dit_gathered_bytes_per_step", "speedup_baseline", "machine_load", "speedup_quiet")


def speedup_baseline(devices: list[str], reference_threads: int | None) -> str:
    """What `speedup` compares, in words for the report."""
    if reference_threads is None:
        return f"{len(devices)} ranks vs the same forward on one device ({devices[0]})"
    return (f"{len(devices)} CPU ranks sharing {reference_threads} cores vs one device using all "
            f"{reference_threads} cores: on CPU the ranks split the same cores, so ~1.0 means no "
            "parallel overhead, not a scaling figure (that needs one accelerator per rank)")


def _steady_steps(seconds: list[float]) -> list[float]:
    # the first step includes one-time costs (allocations, thread start-up): leave it out when we can
    return seconds[1:] if len(seconds) > 1 else seconds


def steady_seconds(seconds: list[float]) -> float:
    """Seconds of one steady step: the median of the steps after the first (the first alone if
    one); one slow step under load moves a mean, not this."""
    return statistics.median(_steady_steps(seconds))


def paired_speedup(reference_seconds: list[float], sp_seconds: list[float]) -> float:
    """Median over the steady steps of (reference step / SP step): each pair ran back to back,
    under the load of the same moment."""
    return statistics.median(r / s for r, s in zip(_steady_steps(reference_seconds), _steady_steps(sp_seconds)))


def parity_figures(latents, ref_latents, tolerance: float) -> dict:
    """max |diff| of the W-rank latents against the one-device ones, relative to max |reference|,
    and whether that is within `tolerance`."""
    diff = max(float((a.float().cpu() - b.float().cpu()).abs().max()) for a, b in zip(latents, ref_latents))
    scale = max(float(b.float().abs().max()) for b in ref_latents)
    rel = diff / scale if scale > 0 else diff
    return {"max_abs_diff": diff, "rel_diff": rel, "parity": "ok" if rel <= tolerance else "fail"}


def parity_line(report: dict) -> str:
    return (f"[parity] max |diff| {report['max_abs_diff']:.3e}, relative {report['rel_diff']:.3e} "
            f"(tolerance {report['tolerance']:g}): {report['parity']}")


def write_outputs(out_dir: Path, latents, ref_latents, report: dict) -> None:
    """latents.safetensors and report.json, both as ordinary files (0666 less the umask):
    safetensors' save_file would make the latents 0600."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {"video": latents[0], "audio": latents[1]}
    if ref_latents is not None:
        tensors.update(reference_video=ref_latents[0], reference_audio=ref_latents[1])
    (out_dir / "latents.safetensors").write_bytes(
        save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
