#!/usr/bin/env python3
"""Performance model of sequence-parallel MiniMax-H3 at the real model's sizes.

For the 768p workloads (5 s and 15 s of video, token counts from the upstream layout) it
computes, per sampling step (one DiT forward): FLOPs (linear layers and attention), bytes each
rank exchanges for `allgather` and `ulysses` (comfy/multidevice/sp/cost_model.py, the formula the tests
check against measured byte counters), and projected seconds per step for W = 1..8 on the
device profiles below, next to the seed project's measured 4-NPU figures. Writes a PNG of the
projected speedup against W (Pillow) and prints one JSON object as the last line.

  .venv/bin/python bench/project_h3.py [--plot out/project_h3_speedup.png] [--text-tokens 256]

What the model assumes (each is a field of the JSON, so a reader can redo the arithmetic):
- one DiT forward per step (cfg 1, as the Turbo workflows run); blocks only (embeddings, text
  refiner, final layer and VAE are < 1% of the DiT FLOPs and are left out);
- compute time = FLOPs / W / (peak bf16 x achieved fraction): the ranks' work is balanced
  (shards differ by at most one row) and W ranks run in parallel;
- communication time = bytes received per rank / usable bandwidth; a full mesh (HCCS) gives a
  rank W-1 links, a switch (NVLink/NVSwitch, PCIe) a fixed per-device bandwidth;
- "serial" adds the two; "overlap bound" hides the exchange behind the attention compute
  (the best the head-chunked overlap can do);
- memory fit is not modelled.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from comfy.multidevice.sp.cost_model import (DiTShape, choose_sp_mode, forward_flops, forward_traffic,
                                             h3_targets, ulysses_degree)

H3 = DiTShape()  # hidden 5376, 50 blocks, 56 heads x 128, SwiGLU 14336 (docs/ARCHITECTURE.md)
WORLDS = list(range(1, 9))
MODES = ("allgather", "ulysses")

# Achieved fractions of the peaks. Assumptions, not measurements, except where noted.
ACHIEVED_COMPUTE = 0.5  # assumption: large bf16 GEMMs and flash attention at ~50% of peak
ACHIEVED_LINK = 0.8     # NVLink: ~370 of 450 GB/s per direction reached by NCCL (see sources)

# Device profiles: data, each figure with where it comes from.
PROFILES = [
    {
        "name": "ascend-910b",
        "hbm_tbps": 1.6,
        "achieved_compute_fraction": ACHIEVED_COMPUTE,  # assumption, see above
        "peak_bf16_tflops": 280.0,
        "topology": "mesh",  # Atlas 800T A2: 8 NPUs, HCCS full mesh, one link per peer
        "link_gbps": 56.0,   # per peer link, per direction
        "sources": [
            "HBM: 1.6 TB/s (HBM2e, the commonly quoted 910B figure; not verified against a datasheet here)",
            "peak: 280 TFLOPS FP16 theoretical peak, Ascend 910B spec table, ai.gitee.com/docs/"
            "compute/clusters_gpu/ascend_gpu (other public figures range up to 320); "
            "assumption: bf16 at the fp16 rate",
            "link: 56 GB/s per HCCS link and direction, 7 links in the 8-card full mesh - the "
            "commonly quoted figure for Atlas 800T A2; not verified against a Huawei datasheet "
            "here (measure with hccl_test on your server)",
        ],
    },
    {
        "name": "nvidia-h100-sxm",
        "hbm_tbps": 3.35,
        "achieved_compute_fraction": ACHIEVED_COMPUTE,  # assumption, see above
        "peak_bf16_tflops": 989.4,
        "topology": "switch",
        "link_gbps": 450.0,  # NVLink 4 through NVSwitch: 900 GB/s both directions
        "sources": [
            "HBM: 3.35 TB/s HBM3 (same datasheet)",
            "peak: 1,979 TFLOPS bf16 with sparsity = 989.4 dense, NVIDIA H100 datasheet "
            "(nvidia.com/en-us/data-center/h100)",
            "link: NVLink 900 GB/s total = 450 per direction (same datasheet); app-level ~370 GB/s "
            "per direction per NVIDIA/nccl issue #1442",
        ],
    },
    {
        "name": "nvidia-h200-sxm",
        "hbm_tbps": 4.8,
        "achieved_compute_fraction": ACHIEVED_COMPUTE,  # assumption, see above
        "peak_bf16_tflops": 989.4,
        "topology": "switch",
        "link_gbps": 450.0,
        "sources": [
            "HBM: 4.8 TB/s HBM3e (same datasheet)",
            "peak: 1,979 TFLOPS bf16 with sparsity = 989.4 dense, NVIDIA H200 datasheet "
            "(nvidia.com/en-us/data-center/h200); same compute as H100 SXM, more and faster HBM",
            "link: NVLink 900 GB/s total = 450 per direction (same datasheet)",
            "note: in this compute/link model the H200 projects the same as the H100 SXM (its "
            "advantage, 141 GB HBM3e, is memory, which the model does not cover)",
        ],
    },
    {
        "name": "nvidia-h100-pcie",
        "hbm_tbps": 2.0,
        "achieved_compute_fraction": ACHIEVED_COMPUTE,  # assumption, see above
        "peak_bf16_tflops": 756.0,
        "topology": "switch",
        "link_gbps": 64.0,  # PCIe Gen5 x16 per direction, no NVLink bridge
        "sources": [
            "HBM: 2.0 TB/s (same datasheet)",
            "peak: 1,513 TFLOPS bf16 with sparsity = 756 dense, NVIDIA H100 PCIe datasheet",
            "link: PCIe Gen5 x16, 128 GB/s both directions = 64 per direction (same datasheet); "
            "the case Ulysses is for: a PCIe server without NVLink",
        ],
    },
]

# Published multi-GPU scaling of video DiTs, used only to calibrate the projection (see
# `calibrate`): elapsed seconds per run at each GPU count, with the hardware they ran on.
PUBLISHED_SCALING = [
    {"name": "vllm-omni-h20", "gpus": {2: 637.85, 4: 327.94, 8: 166.97},
     "profile": {"name": "nvidia-h20", "peak_bf16_tflops": 148.0, "topology": "switch",
                 "link_gbps": 450.0, "hbm_tbps": 4.0},
     "source": "vllm-omni sequence-parallel video generation on H20, 2 -> 4 -> 8 GPUs (the issue's "
               "figures); H20: 148 TFLOPS bf16 dense, NVLink 900 GB/s, 4.0 TB/s HBM3 (NVIDIA H20 spec)"},
    {"name": "sglang-mi300x", "gpus": {1: 978.0, 8: 167.0},
     "profile": {"name": "amd-mi300x", "peak_bf16_tflops": 1307.4, "topology": "mesh",
                 "link_gbps": 64.0, "hbm_tbps": 5.3},
     "source": "SGLang diffusion on MI300X, denoise 978 s on 1 GPU -> 167 s on 8 (the issue's figures); "
               "MI300X: 1307.4 TFLOPS bf16 dense, 7 Infinity Fabric links of 64 GB/s per direction, "
               "5.3 TB/s HBM3 (AMD MI300X datasheet)"},
]
# What the published runs' workloads were is not known here: they are modelled as H3's 768p 15 s
# step with ulysses (both frameworks' sequence-parallel default), i.e. they calibrate the *shape*
# of the scaling curve, not the absolute time.
SEED_STEP_SECONDS = (42.0, 42.8, 43.4)  # the seed's 4-NPU s/step at 50, 21 and 8 steps (below)

# Costs the FLOP/link model leaves out, as modelled by `full_step_seconds`:
ELEMENTWISE_PASSES = 12     # assumption: hidden-wide bf16 reads+writes per token per block
                            # (norms, modulation, RoPE, residuals, gates) at HBM speed
COLLECTIVE_LATENCY_S = 30e-6  # assumption: fixed cost per collective (launch + handshake)

# The seed project's measurements: 4 Ascend NPUs, all-gather K/V, BF16, 768p, 15 s, one run.
SEED_MEASURED = {
    "devices": "4 x Ascend NPU (seed project)",
    "mode": "allgather",
    "workload": "768p_15s",
    "end_to_end_s_turbo_8_steps": 495.79,
    "sampling_min": {"50": 35.00, "21": 14.98, "8": 5.79},
}


# ----------------------------------------------------------------------------- workloads

def latent_frames(frames: int) -> int:
    """The video VAE's 4x temporal compression: 17k+5 frames <-> 5k+2 latent frames."""
    if (frames - 5) % 17:
        raise ValueError(f"{frames} frames is not a valid H3 length (17k+5)")
    return (frames - 5) // 17 * 5 + 2


def token_counts(frames: int, width: int, height: int, text_tokens: int, fps: float = 24.0) -> dict:
    """Packed sequence rows: video (16x VAE, 2x2 patches), audio (40 latent frames/s, 2 rows each)."""
    video = latent_frames(frames) * (height // 32) * (width // 32)
    audio = 2 * round(frames / fps * 40)
    return {"video": video, "audio": audio, "text": text_tokens, "total": video + audio + text_tokens}


def workloads(text_tokens: int) -> dict:
    # 1344x768, 124 frames (5 s) and 362 frames (15 s): 37,296 + 414 and 107,856 + 1,206 rows
    # in docs/ARCHITECTURE.md; the text length is an assumption (--text-tokens).
    return {"768p_5s": token_counts(124, 1344, 768, text_tokens),
            "768p_15s": token_counts(362, 1344, 768, text_tokens)}


# ----------------------------------------------------------------------------- projection

def usable_gbps(profile: dict, world: int, link_fraction: float) -> float:
    """Bandwidth into one rank: a mesh gives W-1 parallel links, a switch one fixed port."""
    links = world - 1 if profile["topology"] == "mesh" else 1
    return profile["link_gbps"] * links * link_fraction


def received_per_rank(mode: str, tokens: dict, world: int) -> int:
    """The most bytes any rank receives in one forward (cost model, rank-local final layer)."""
    targets = h3_targets(H3, tokens["total"], tokens["video"], tokens["audio"])
    return max(forward_traffic(mode, H3, tokens["total"], world, r, targets)["total"].received
               for r in range(world))


def step_seconds(profile: dict, tokens: dict, world: int, mode: str, compute_fraction: float,
                 link_fraction: float) -> dict:
    flops = forward_flops(H3, tokens["total"])
    rate = profile["peak_bf16_tflops"] * 1e12 * compute_fraction
    compute = flops["total"] / world / rate
    attention = flops["attention"] / world / rate
    received = received_per_rank(mode, tokens, world)
    comm = received / (usable_gbps(profile, world, link_fraction) * 1e9) if world > 1 else 0.0
    return {"compute_s": compute, "comm_s": comm, "serial_s": compute + comm,
            "overlap_bound_s": compute + max(0.0, comm - attention)}


def replicated_flops(tokens: dict) -> float:
    """FLOPs every rank repeats in full: the patch embeddings of every row, the text projection
    and token refiner (2 blocks on the text rows), the time embedder (negligible). The final
    layer runs rank-local, so it is parallel."""
    h, a, ffn = H3.hidden, H3.attention_width, H3.ffn
    embed = 2 * h * (tokens["video"] * H3.video_out + tokens["audio"] * H3.audio_out + tokens["text"] * 5120)
    block = 2 * (h * 3 * a + a * h + h * 2 * ffn + ffn * h) * tokens["text"] + 4 * tokens["text"] ** 2 * a
    return embed + 2 * block


def kernel_efficiency(rows_per_rank: float, half_rows: float) -> float:
    """The fraction of the large-shape rate a rank's kernels reach on its rows (attention and
    GEMMs lose efficiency as the per-rank shapes shrink): rows / (rows + half_rows)."""
    return rows_per_rank / (rows_per_rank + half_rows)


def full_step_seconds(profile: dict, tokens: dict, world: int, mode: str, compute_fraction: float,
                      half_rows: float, link_fraction: float = ACHIEVED_LINK) -> dict:
    """One step with the costs the FLOP/link model leaves out: replicated work, elementwise
    traffic, a latency per collective, and kernel efficiency falling as per-rank rows shrink."""
    rate = profile["peak_bf16_tflops"] * 1e12 * compute_fraction
    seq = tokens["total"]
    flops = forward_flops(H3, seq)["total"]
    parallel = flops / world / (rate * kernel_efficiency(seq / world, half_rows))
    replicated = replicated_flops(tokens) / rate
    elementwise = ELEMENTWISE_PASSES * seq * H3.hidden * 2 * H3.blocks / world / (profile["hbm_tbps"] * 1e12)
    comm = (received_per_rank(mode, tokens, world) / (usable_gbps(profile, world, link_fraction) * 1e9)
            if world > 1 else 0.0)
    collectives = (H3.blocks * (1 if mode == "allgather" else 2) + 2) if world > 1 else 0
    sync = collectives * COLLECTIVE_LATENCY_S
    total = parallel + replicated + elementwise + comm + sync
    return {"parallel_s": parallel, "replicated_s": replicated, "elementwise_s": elementwise,
            "comm_s": comm, "sync_s": sync, "total_s": total}


def _fraction_from_seed(profile, tokens, half_rows) -> float:
    """The compute fraction that makes the full model reproduce the seed's 4-NPU step."""
    measured = sorted(SEED_STEP_SECONDS)[len(SEED_STEP_SECONDS) // 2]
    at_one = full_step_seconds(profile, tokens, 4, "allgather", 1.0, half_rows)
    rate_bound = at_one["parallel_s"] + at_one["replicated_s"]  # the terms that scale with 1/f
    rest = at_one["total_s"] - rate_bound
    return rate_bound / (measured - rest)


def _scaling_errors(tokens, compute_fraction, half_rows) -> list[dict]:
    """Each published speedup (against that source's smallest GPU count) beside the model's."""
    out = []
    for source in PUBLISHED_SCALING:
        counts = sorted(source["gpus"])
        base = counts[0]
        t = {w: full_step_seconds(source["profile"], tokens, w, "ulysses", compute_fraction, half_rows)["total_s"]
             for w in counts}
        for w in counts[1:]:
            measured = source["gpus"][base] / source["gpus"][w]
            modelled = t[base] / t[w]
            out.append({"source": source["name"], "from_gpus": base, "to_gpus": w,
                        "measured_speedup": round(measured, 3), "model_speedup": round(modelled, 3),
                        "error": round(modelled / measured - 1, 4)})
    return out


def calibrate(text_tokens: int) -> dict:
    """Fit the two free constants of `full_step_seconds` on published points and report the
    error left on each: the compute fraction from the seed's 4-NPU step (910B profile), the
    half-efficiency rows from the published scaling curves (least squares in log speedup)."""
    tokens = workloads(text_tokens)["768p_15s"]
    best = None
    for half_rows in [250 * 2 ** (k / 4) for k in range(0, 41)]:  # 250 .. 256k rows
        fraction = _fraction_from_seed(PROFILES[0], tokens, half_rows)
        if not 0 < fraction <= 1:
            continue
        errors = _scaling_errors(tokens, fraction, half_rows)
        cost = sum(math.log(1 + e["error"]) ** 2 for e in errors)
        if best is None or cost < best[0]:
            best = (cost, half_rows, fraction, errors)
    _, half_rows, fraction, errors = best
    seed_model = full_step_seconds(PROFILES[0], tokens, 4, "allgather", fraction, half_rows)["total_s"]
    seed_errors = [{"source": "seed-910b-4npu", "measured_s_per_step": m, "model_s_per_step": round(seed_model, 2),
                    "error": round(seed_model / m - 1, 4)} for m in SEED_STEP_SECONDS]
    worst = max(abs(e["error"]) for e in errors + seed_errors)
    return {"half_efficiency_rows": round(half_rows), "compute_fraction": round(fraction, 4),
            "points": seed_errors + errors, "max_abs_error": round(worst, 4),
            "sources": [s["source"] for s in PUBLISHED_SCALING],
            "assumptions": {"elementwise_passes": ELEMENTWISE_PASSES,
                            "collective_latency_s": COLLECTIVE_LATENCY_S,
                            "published_workloads": "modelled as H3 768p 15 s, ulysses (their own "
                                                   "workloads are not known here)"}}


def calibrated_projection(text_tokens: int, calibration: dict) -> dict:
    """W = 1, 2, 4, 8 on every profile with the calibrated full model; each speedup carries the
    calibration's largest error as a band."""
    tokens = workloads(text_tokens)["768p_15s"]
    band = calibration["max_abs_error"]
    out = {}
    for profile in PROFILES:
        per_mode = {}
        for mode in MODES:
            t = {w: full_step_seconds(profile, tokens, w, mode, calibration["compute_fraction"],
                                      calibration["half_efficiency_rows"])["total_s"] for w in (1, 2, 4, 8)}
            per_mode[mode] = {
                "seconds_per_step": {w: round(v, 2) for w, v in t.items()},
                "speedup": {w: round(t[1] / v, 2) for w, v in t.items()},
                "speedup_band": {w: [round(t[1] / v * (1 - band), 2), round(t[1] / v * (1 + band), 2)]
                                 for w, v in t.items()},
            }
        out[profile["name"]] = per_mode
    return out


def project(text_tokens: int) -> dict:
    result = {}
    for profile in PROFILES:
        per_workload = {}
        for name, tokens in workloads(text_tokens).items():
            per_mode = {}
            for mode in MODES:
                steps = {w: step_seconds(profile, tokens, w, mode,
                                         profile["achieved_compute_fraction"], ACHIEVED_LINK)
                         for w in WORLDS}
                base = steps[1]["serial_s"]
                per_mode[mode] = {
                    "seconds_per_step": {w: round(s["serial_s"], 3) for w, s in steps.items()},
                    "overlap_bound_seconds_per_step": {w: round(s["overlap_bound_s"], 3) for w, s in steps.items()},
                    "comm_seconds_per_step": {w: round(s["comm_s"], 3) for w, s in steps.items()},
                    "speedup": {w: round(base / s["serial_s"], 3) for w, s in steps.items()},
                }
            per_mode["auto_picks"] = {w: choose_sp_mode(w, H3.heads) for w in WORLDS}
            per_workload[name] = per_mode
        result[profile["name"]] = per_workload
    return result


def seed_check(text_tokens: int) -> dict:
    """The model against the seed's measured 4-NPU run, and what the measurement implies."""
    seq = workloads(text_tokens)[SEED_MEASURED["workload"]]
    profile = PROFILES[0]
    measured_step = {steps: minutes * 60 / int(steps) for steps, minutes in SEED_MEASURED["sampling_min"].items()}
    step_8 = measured_step["8"]
    outside_sampling = SEED_MEASURED["end_to_end_s_turbo_8_steps"] - SEED_MEASURED["sampling_min"]["8"] * 60
    # The compute fraction that reproduces the measured 8-step time at W=4, allgather.
    comm = step_seconds(profile, seq, 4, "allgather", 1.0, ACHIEVED_LINK)["comm_s"]
    full_rate = step_seconds(profile, seq, 4, "allgather", 1.0, ACHIEVED_LINK)["compute_s"]
    implied = full_rate / (step_8 - comm) if step_8 > comm else None
    calibrated = {}
    if implied:
        for mode in MODES:
            calibrated[mode] = {}
            for w in (1, 2, 4, 8):
                s = step_seconds(profile, seq, w, mode, implied, ACHIEVED_LINK)["serial_s"]
                calibrated[mode][w] = {"seconds_per_step": round(s, 2),
                                       "turbo_8_steps_end_to_end_s": round(outside_sampling + 8 * s, 1)}
    return {
        "measured": SEED_MEASURED,
        "measured_seconds_per_step": {k: round(v, 2) for k, v in measured_step.items()},
        "measured_outside_sampling_s": round(outside_sampling, 2),
        "model_at_assumed_fraction_w4_allgather_s": round(
            step_seconds(profile, seq, 4, "allgather", profile["achieved_compute_fraction"],
                         ACHIEVED_LINK)["serial_s"], 2),
        "implied_achieved_compute_fraction": round(implied, 3) if implied else None,
        "calibrated_910b": calibrated,
        "note": ("calibrated_910b re-uses the implied fraction and the measured non-sampling time "
                 "(text encoder, VAE, loading); it is a projection, not a measurement"),
    }


def model_table(text_tokens: int) -> dict:
    out = {}
    for name, tokens in workloads(text_tokens).items():
        flops = forward_flops(H3, tokens["total"])
        bytes_per_rank = {}
        for mode in MODES:
            bytes_per_rank[mode] = {w: received_per_rank(mode, tokens, w) for w in WORLDS}
        out[name] = {"tokens": tokens,
                     "flops_per_step": {k: v for k, v in flops.items()},
                     "attention_flops_share": round(flops["attention"] / flops["total"], 3),
                     "bytes_received_per_rank_per_step": bytes_per_rank,
                     "ulysses_degree": {w: ulysses_degree(w, H3.heads) for w in WORLDS}}
    return out


# ----------------------------------------------------------------------------- plot

COLORS = [(200, 40, 40), (30, 110, 200), (20, 150, 80), (150, 80, 180)]


def _dashed(draw, a, b, fill, width, dash=8):
    (x0, y0), (x1, y1) = a, b
    length = math.hypot(x1 - x0, y1 - y0)
    steps = max(1, int(length // dash))
    for i in range(0, steps, 2):
        t0, t1 = i / steps, min(1.0, (i + 1) / steps)
        draw.line([(x0 + (x1 - x0) * t0, y0 + (y1 - y0) * t0),
                   (x0 + (x1 - x0) * t1, y0 + (y1 - y0) * t1)], fill=fill, width=width)


def draw_plot(projection: dict, path: Path) -> None:
    from PIL import Image, ImageDraw, ImageFont

    names = list(workloads(0))
    panel_w, panel_h, legend_h = 560, 420, 150
    image = Image.new("RGB", (panel_w * len(names), panel_h + legend_h), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default()
    left, right, top, bottom = 60, 20, 40, 50
    ymax = max(WORLDS)
    for p, workload in enumerate(names):
        ox = p * panel_w
        x0, x1, y0, y1 = ox + left, ox + panel_w - right, top, panel_h - bottom

        def xy(w, s):
            return (x0 + (w - 1) / (max(WORLDS) - 1) * (x1 - x0), y1 - s / ymax * (y1 - y0))

        draw.text((ox + left, 12), f"MiniMax-H3 {workload.replace('_', ' ')}: projected speedup vs W",
                  fill="black", font=font)
        draw.rectangle([x0, y0, x1, y1], outline="black")
        for w in WORLDS:
            x, _ = xy(w, 0)
            draw.line([(x, y1), (x, y1 + 4)], fill="black")
            draw.text((x - 3, y1 + 8), str(w), fill="black", font=font)
            _, y = xy(1, w)
            draw.line([(x0 - 4, y), (x0, y)], fill="black")
            draw.text((x0 - 20, y - 6), str(w), fill="black", font=font)
        draw.text((x0 + (x1 - x0) // 2 - 40, y1 + 24), "W (devices)", fill="black", font=font)
        draw.text((ox + 6, y0 - 16), "speedup", fill="black", font=font)
        _dashed(draw, xy(1, 1), xy(max(WORLDS), max(WORLDS)), (150, 150, 150), 1, dash=4)
        for i, profile in enumerate(PROFILES):
            for mode in MODES:
                speed = projection[profile["name"]][workload][mode]["speedup"]
                points = [xy(w, speed[w]) for w in WORLDS]
                for a, b in zip(points, points[1:]):
                    if mode == "ulysses":
                        draw.line([a, b], fill=COLORS[i], width=2)
                    else:
                        _dashed(draw, a, b, COLORS[i], 2)
    ly = panel_h + 10
    draw.text((left, ly), "solid: ulysses   dashed: allgather   grey: ideal (= W)   "
              f"assumed achieved fractions: compute {ACHIEVED_COMPUTE}, link {ACHIEVED_LINK}",
              fill="black", font=font)
    for i, profile in enumerate(PROFILES):
        y = ly + 24 + 22 * i
        draw.line([(left, y + 6), (left + 40, y + 6)], fill=COLORS[i], width=3)
        draw.text((left + 50, y), f"{profile['name']}: {profile['peak_bf16_tflops']:g} TFLOP/s bf16, "
                  f"{profile['link_gbps']:g} GB/s {'per peer link (mesh)' if profile['topology'] == 'mesh' else 'per device'}",
                  fill="black", font=font)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plot", type=Path, default=REPO / "out" / "project_h3_speedup.png",
                        help="PNG of projected speedup vs W (default: out/project_h3_speedup.png)")
    parser.add_argument("--text-tokens", type=int, default=256,
                        help="text rows in the packed sequence (assumption; default 256)")
    args = parser.parse_args(argv)
    if args.text_tokens < 0:
        parser.error(f"--text-tokens must be >= 0, got {args.text_tokens}")

    table = model_table(args.text_tokens)
    projection = project(args.text_tokens)
    seed = seed_check(args.text_tokens)
    calibration = calibrate(args.text_tokens)
    calibrated = calibrated_projection(args.text_tokens, calibration)
    draw_plot(projection, args.plot)
    for name, entry in table.items():
        print(f"{name}: {entry['tokens']['total']} tokens, "
              f"{entry['flops_per_step']['total'] / 1e15:.2f} PFLOP/step "
              f"({entry['attention_flops_share']:.0%} attention)", file=sys.stderr)
        for w in (2, 4, 8):
            ag = entry["bytes_received_per_rank_per_step"]["allgather"][w] / 1e9
            ul = entry["bytes_received_per_rank_per_step"]["ulysses"][w] / 1e9
            print(f"  W={w}: received per rank per step allgather {ag:.1f} GB, ulysses {ul:.1f} GB",
                  file=sys.stderr)
    print(f"seed check: measured {seed['measured_seconds_per_step']['8']} s/step at W=4 implies an "
          f"achieved compute fraction of {seed['implied_achieved_compute_fraction']} on the 910B profile",
          file=sys.stderr)
    print(f"calibration: compute fraction {calibration['compute_fraction']}, half-efficiency rows "
          f"{calibration['half_efficiency_rows']}; error on each point:", file=sys.stderr)
    for point in calibration["points"]:
        what = (f"{point['source']} {point['from_gpus']}->{point['to_gpus']} GPUs: speedup measured "
                f"{point['measured_speedup']}, model {point['model_speedup']}" if "from_gpus" in point else
                f"{point['source']}: measured {point['measured_s_per_step']} s/step, model {point['model_s_per_step']}")
        print(f"  {what}: error {point['error']:+.1%}", file=sys.stderr)
    for name, modes in calibrated.items():
        print(f"  {name} W=8 (768p 15 s, calibrated, band +-{calibration['max_abs_error']:.1%}): "
              + ", ".join(f"{m} {v['speedup'][8]}x {v['speedup_band'][8]}" for m, v in modes.items()),
              file=sys.stderr)
    print(f"plot: {args.plot}", file=sys.stderr)
    print(json.dumps({
        "model": {"shape": H3.__dict__, "worlds": WORLDS, "modes": list(MODES),
                  "assumptions": {"achieved_compute_fraction": ACHIEVED_COMPUTE,
                                  "achieved_link_fraction": ACHIEVED_LINK,
                                  "text_tokens": args.text_tokens, "forwards_per_step": 1,
                                  "activation_bytes": 2}},
        "workloads": table,
        "profiles": PROFILES,
        "projection": projection,
        "seed": seed,
        "calibration": calibration,
        "calibrated_projection_768p_15s": calibrated,
        "plot": str(args.plot),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
