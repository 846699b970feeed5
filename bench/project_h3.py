#!/usr/bin/env python3
"""Performance model of sequence-parallel MiniMax-H3 at the real model's sizes.

For the 768p workloads (5 s and 15 s of video, token counts from the upstream layout) it
computes, per sampling step (one DiT forward): FLOPs (linear layers and attention), bytes each
rank exchanges for `allgather` and `ulysses` (comfy/multidevice/sp/cost_model.py, the formula the tests
check against measured byte counters), and projected seconds per step for W = 1..8 on the
device profiles below, next to the seed project's measured 4-NPU figures. Writes a PNG of the
projected speedup against W (Pillow) and prints one JSON object as the last line.

  .venv/bin/python bench/project_h3.py [--plot out/project_h3_speedup.png] [--text-tokens 256]
                                       [--half-rows H] [--card-json card.json]

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

The calibrated model (`full_step_seconds`, `calibrate`) adds the costs that leaves out and is
fitted on published runs of H3 (ANCHORS), each modelled with its own workload (clip length,
resolution, steps, precision). Only runs whose workload is fully known are fitted (today: the
seed's three 4-NPU runs); the others are printed beside the model with the values the
comparison assumes for what they do not publish. One constant is fitted, the compute fraction;
the band is the largest error on the fitted runs. The W = 8 figure is set by an assumption, not
by the fit: per-card kernel efficiency at short row counts, rows / (rows + h), h =
HALF_EFFICIENCY_ROWS (0: no loss), with the W = 8 speedup at other h beside it.
`--card-json` (bench/bench_card.py's JSON from a card) fits h and that card's compute fraction
from its measured block times instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from comfy.multidevice.sp.cost_model import DiTShape, forward_traffic, ulysses_degree  # noqa: E402
from bench.h3_costs import AUDIO_PATCH, forward_flops, linear_flops_per_token, VIDEO_PATCH  # noqa: E402
from comfy.multidevice.sp.mode_choice import choose_sp_mode  # noqa: E402

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

# Profiles of the anchors' hardware that the projection itself does not cover.
ANCHOR_PROFILES = [
    {"name": "nvidia-h20", "peak_bf16_tflops": 148.0, "topology": "switch", "link_gbps": 450.0, "hbm_tbps": 4.0,
     "sources": ["NVIDIA H20 spec: 148 TFLOPS bf16 dense, NVLink 900 GB/s, 4.0 TB/s HBM3"]},
    {"name": "amd-mi300x", "peak_bf16_tflops": 1307.4, "topology": "mesh", "link_gbps": 64.0, "hbm_tbps": 5.3,
     "sources": ["AMD MI300X datasheet: 1307.4 TFLOPS bf16 dense, 7 Infinity Fabric links of 64 GB/s "
                 "per direction, 5.3 TB/s HBM3"]},
]

# Published runs of H3 (theirs, not measured here; the figures are the issue's). Each point says
# what is known of its workload: clip length (s), resolution, sampling steps, precision, and what
# the seconds cover; None = not published / not known here. A point enters the fit only when
# clip, resolution, steps and precision are all known (`in_fit`); every other point is printed
# beside the model as a comparison, with the values it assumes for what is unknown
# (COMPARISON_ASSUMES), and does not move the fitted constant.
ANCHORS = [
    {"name": "seed-910b-4npu", "hardware": "4 x Ascend 910B", "profile": "ascend-910b", "mode": "allgather",
     "source": "the seed project's 4-NPU runs, one each: sampling 35.00 / 14.98 / 5.79 min at 50 / 21 / "
               "8 steps, BF16, 1344x768, 15 s; 495.79 s end to end for Turbo 8 steps",
     "points": [{"cards": 4, "clip_s": 15, "resolution": "768p", "steps": steps, "precision": "bf16",
                 "seconds": round(minutes * 60, 2), "covers": "sampling"}
                for steps, minutes in ((50, 35.00), (21, 14.98), (8, 5.79))]},
    {"name": "sglang-h200-8", "hardware": "8 x NVIDIA H200", "profile": "nvidia-h200-sxm", "mode": "ulysses",
     "source": "SGLang diffusion, H3 5 s 768p, 50 steps, Ulysses 8: 39.67 s; precision, attention "
               "kernel (FP8, sparse attention) and caching not known here",
     "points": [{"cards": 8, "clip_s": 5, "resolution": "768p", "steps": 50, "precision": None,
                 "seconds": 39.67, "covers": None}]},
    {"name": "vllm-omni-910b4-8", "hardware": "8 x Ascend 910B4", "profile": "ascend-910b", "mode": "ulysses",
     "source": "vllm-omni on 8 x 910B4: 160.7 s (5 s) and about 950 s (15 s); resolution, steps and "
               "precision not known here; the 910B4 is modelled with the 910B profile (its own peak is "
               "not known here)",
     "points": [{"cards": 8, "clip_s": clip, "resolution": None, "steps": None, "precision": None,
                 "seconds": seconds, "covers": None} for clip, seconds in ((5, 160.7), (15, 950.0))]},
    {"name": "vllm-omni-h20", "hardware": "NVIDIA H20", "profile": "nvidia-h20", "mode": "ulysses",
     "source": "vllm-omni sequence parallel on H20, a 5 s clip, 2 -> 4 -> 8 GPUs: 637.85 -> 327.94 -> "
               "166.97 s; resolution, steps and precision not known here",
     "points": [{"cards": cards, "clip_s": 5, "resolution": None, "steps": None, "precision": None,
                 "seconds": seconds, "covers": None} for cards, seconds in ((2, 637.85), (4, 327.94), (8, 166.97))]},
    {"name": "sglang-mi300x", "hardware": "AMD MI300X", "profile": "amd-mi300x", "mode": "ulysses",
     "source": "SGLang diffusion on MI300X, denoise 978 s on 1 GPU -> 167 s on 8; the workload is not "
               "known here",
     "points": [{"cards": cards, "clip_s": None, "resolution": None, "steps": None, "precision": None,
                 "seconds": seconds, "covers": "denoise"} for cards, seconds in ((1, 978.0), (8, 167.0))]},
]
FIT_FIELDS = ("clip_s", "resolution", "steps", "precision")
COMPARISON_ASSUMES = {"clip_s": 15, "resolution": "768p", "steps": 50, "precision": "bf16"}
CLIP_FRAMES = {5: 124, 15: 362}  # 24 fps on H3's 17k+5 grid
RESOLUTIONS = {"768p": (1344, 768)}
# The assumption that sets the W = 8 figure until a card has measured it: a card's kernels reach
# rows / (rows + h) of their large-shape rate on `rows` query rows per rank. h = 0: no loss at
# short row counts. bench_card.py measures the block at W = 1..8 on one card, and
# `--card-json` fits h from that instead.
HALF_EFFICIENCY_ROWS = 0.0
SENSITIVITY_ROWS = (0, 1024, 3364, 8192)  # 3364: the constant the earlier fit produced

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
    """The most bytes any rank receives in one forward (cost model, the hidden state gathered
    before the final layer)."""
    return max(forward_traffic(mode, H3, tokens["total"], world, r)["total"].received
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
    layer (projected rows, under 1%) is left out."""
    h, a = H3.hidden, H3.attention_width
    embed = 2 * h * (tokens["video"] * VIDEO_PATCH + tokens["audio"] * AUDIO_PATCH + tokens["text"] * 5120)
    block = linear_flops_per_token(H3) * tokens["text"] + 4 * tokens["text"] ** 2 * a
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


def anchor_point(name: str, **match) -> dict:
    """One anchor point, flattened with its anchor's fields and workload name (e.g.
    anchor_point("seed-910b-4npu", steps=8))."""
    anchor = next(a for a in ANCHORS if a["name"] == name)
    point = next(p for p in anchor["points"] if all(p[k] == v for k, v in match.items()))
    filled = {**COMPARISON_ASSUMES, **{k: v for k, v in point.items() if v is not None}}
    return {**{k: v for k, v in anchor.items() if k != "points"}, **point,
            "workload": f"{filled['resolution']}_{filled['clip_s']}s"}


def all_profiles() -> list[dict]:
    return PROFILES + ANCHOR_PROFILES


def profile_named(name: str) -> dict:
    return next(p for p in all_profiles() if p["name"] == name)


def point_tokens(point: dict, text_tokens: int) -> dict:
    width, height = RESOLUTIONS[point["resolution"]]
    return token_counts(CLIP_FRAMES[point["clip_s"]], width, height, text_tokens)


def anchor_points(text_tokens: int) -> list[dict]:
    """Every anchor point with its workload as modelled: its own fields where known, the
    comparison's assumptions where not (listed in `assumed`)."""
    out = []
    for anchor in ANCHORS:
        for point in anchor["points"]:
            unknown = [k for k in FIT_FIELDS if point[k] is None]
            filled = {**point, **{k: COMPARISON_ASSUMES[k] for k in unknown}}
            out.append({"source": anchor["name"], "hardware": anchor["hardware"], "profile": anchor["profile"],
                        "mode": anchor["mode"], **filled, "in_fit": not unknown, "assumed": unknown,
                        "tokens": point_tokens(filled, text_tokens)})
    return out


def modelled_seconds(point: dict, fractions: dict, half_rows: float) -> float:
    """The DiT sampling seconds of a point: steps x one step of the full model."""
    profile = profile_named(point["profile"])
    step = full_step_seconds(profile, point["tokens"], point["cards"], point["mode"],
                             fractions.get(profile["name"], fractions["default"]), half_rows)
    return point["steps"] * step["total_s"]


def fit_fraction(points: list[dict], half_rows: float) -> float:
    """The compute fraction (of the bf16 peak) that fits the in-fit points best: least squares
    in log time, over a fine grid (one constant; the model is monotone in it)."""
    fitted = [p for p in points if p["in_fit"]]
    grid = [k / 1000 for k in range(5, 1001)]
    return min(grid, key=lambda f: sum(math.log(modelled_seconds(p, {"default": f}, half_rows) / p["seconds"]) ** 2
                                       for p in fitted))


def card_profile(label: str) -> str | None:
    """The profile of a card from the name its runtime gives it (None: not one of the profiles)."""
    text = label.lower().replace(" ", "")
    for key, name in (("h200", "nvidia-h200-sxm"), ("h100pcie", "nvidia-h100-pcie"), ("h100", "nvidia-h100-sxm"),
                      ("h20", "nvidia-h20"), ("910b", "ascend-910b"), ("mi300x", "amd-mi300x")):
        if key in text:
            return name
    return None


def block_flops(seq: int, rows: int) -> float:
    """One block's FLOPs on one rank: its rows through the linear layers, against all keys."""
    return linear_flops_per_token(H3) * rows + 4 * rows * seq * H3.attention_width


def fit_card(card: dict) -> dict:
    """From bench_card.py's measured block times on one card: the half-efficiency rows h and the
    rate R of `time = flops / (R * rows / (rows + h))`, least squares in log time; each point's
    error; the compute fraction when the card's profile is known."""
    dims = card["dims"]
    if (dims["hidden"], dims["heads"], dims["head_dim"], dims["ffn"]) != (H3.hidden, H3.heads, H3.head_dim, H3.ffn):
        raise SystemExit(f"--card-json holds a run at dims {dims}, not H3's (a --cpu run?): run "
                         "bench/bench_card.py on a card and pass its JSON")
    measured = [p for p in card["points"] if p["block_s"]]
    if len(measured) < 2:
        raise SystemExit("--card-json has fewer than two measured points: nothing to fit")

    def log_rate(h):  # the best log R for this h, and the squared error left
        logs = [math.log(block_flops(p["tokens"], p["rows"]) * (p["rows"] + h) / p["rows"] / p["block_s"])
                for p in measured]
        mean = sum(logs) / len(logs)
        return mean, sum((x - mean) ** 2 for x in logs)

    half_rows = min([0.0] + [250 * 2 ** (k / 4) for k in range(41)], key=lambda h: log_rate(h)[1])
    rate = math.exp(log_rate(half_rows)[0])
    points = []
    for p in measured:
        model = block_flops(p["tokens"], p["rows"]) / (rate * kernel_efficiency(p["rows"], half_rows))
        points.append({"source": f"card {card['card']['label']}", "workload": p["workload"], "world": p["world"],
                       "measured_block_s": p["block_s"], "model_block_s": model, "error": round(model / p["block_s"] - 1, 4)})
    profile = card_profile(card["card"]["label"])
    fraction = rate / (profile_named(profile)["peak_bf16_tflops"] * 1e12) if profile else None
    return {"label": card["card"]["label"], "profile": profile, "half_efficiency_rows": round(half_rows),
            "rate_tflops": round(rate / 1e12, 1), "compute_fraction": None if fraction is None else round(fraction, 4),
            "points": points}


def calibrate(text_tokens: int, half_rows: float = HALF_EFFICIENCY_ROWS, card: dict | None = None) -> dict:
    """The compute fraction fitted on the anchors whose workload is fully known, the error on
    every anchor point (fitted or compared), the band from the fitted points' errors, and the
    half-efficiency rows: assumed, or fitted from a card's measurement (`card`, bench_card.py's
    JSON), whose own fraction then stands for its profile."""
    card_fit = fit_card(card) if card is not None else None
    if card_fit is not None:
        half_rows = card_fit["half_efficiency_rows"]
    points = anchor_points(text_tokens)
    fraction = fit_fraction(points, half_rows)
    fractions = {"default": fraction}
    if card_fit is not None and card_fit["compute_fraction"] is not None:
        fractions[card_fit["profile"]] = card_fit["compute_fraction"]
    errors = []
    for p in points:
        model = modelled_seconds(p, fractions, half_rows)
        errors.append({"source": p["source"], "hardware": p["hardware"], "cards": p["cards"],
                       "workload": f"{p['resolution']} {p['clip_s']} s, {p['steps']} steps, {p['precision']}",
                       "covers": p["covers"], "in_fit": p["in_fit"], "assumed": p["assumed"],
                       "measured_s": p["seconds"], "model_s": round(model, 2), "error": round(model / p["seconds"] - 1, 4)})
    fitted = [e for e in errors if e["in_fit"]] + (card_fit["points"] if card_fit else [])
    return {"compute_fraction": fraction, "fractions": {k: round(v, 4) for k, v in fractions.items()},
            "half_efficiency_rows": half_rows,
            "half_efficiency_rows_from": "card measurement" if card_fit else "assumption (HALF_EFFICIENCY_ROWS)",
            "points": errors, "card": card_fit,
            "max_abs_error": round(max(abs(e["error"]) for e in fitted), 4),
            "sources": [a["name"] for a in ANCHORS],
            "assumptions": {"elementwise_passes": ELEMENTWISE_PASSES, "collective_latency_s": COLLECTIVE_LATENCY_S,
                            "comparison_assumes": COMPARISON_ASSUMES,
                            "w8_set_by": "per-card kernel efficiency at short row counts: rows / (rows + h), "
                                         f"h = {half_rows:g} rows"}}


def calibrated_projection(text_tokens: int, calibration: dict) -> dict:
    """W = 1, 2, 4, 8 on every profile with the calibrated full model; each speedup carries the
    calibration's largest error on its fitted points as a band, and the W = 8 speedup's
    dependence on the assumed h beside it."""
    tokens = workloads(text_tokens)["768p_15s"]
    band, h = calibration["max_abs_error"], calibration["half_efficiency_rows"]
    out = {}
    for profile in PROFILES:
        fraction = calibration["fractions"].get(profile["name"], calibration["compute_fraction"])
        per_mode = {}
        for mode in MODES:
            def speedups(half_rows):
                t = {w: full_step_seconds(profile, tokens, w, mode, fraction, half_rows)["total_s"]
                     for w in (1, 2, 4, 8)}
                return t, {w: t[1] / v for w, v in t.items()}
            t, speed = speedups(h)
            per_mode[mode] = {
                "seconds_per_step": {w: round(v, 2) for w, v in t.items()},
                "speedup": {w: round(v, 2) for w, v in speed.items()},
                "speedup_band": {w: [round(v * (1 - band), 2), round(min(w, v * (1 + band)), 2)]
                                 for w, v in speed.items()},
                "w8_speedup_if_half_rows": {str(r): round(speedups(r)[1][8], 2) for r in SENSITIVITY_ROWS},
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
            per_mode["auto_picks"] = {w: choose_sp_mode("auto", w, H3.heads, H3.head_dim).mode for w in WORLDS}
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
    parser.add_argument("--half-rows", type=float, default=HALF_EFFICIENCY_ROWS,
                        help="the assumed half-efficiency rows h that set the W = 8 figure (default "
                             f"{HALF_EFFICIENCY_ROWS:g}: no loss at short row counts)")
    parser.add_argument("--card-json", type=Path,
                        help="bench/bench_card.py's JSON from a card: h (and that card's compute "
                             "fraction) fitted from its measured block times instead")
    args = parser.parse_args(argv)
    if args.text_tokens < 0:
        parser.error(f"--text-tokens must be >= 0, got {args.text_tokens}")
    if args.half_rows < 0:
        parser.error(f"--half-rows must be >= 0, got {args.half_rows}")
    card = json.loads(args.card_json.read_text().strip().splitlines()[-1]) if args.card_json else None

    table = model_table(args.text_tokens)
    projection = project(args.text_tokens)
    seed = seed_check(args.text_tokens)
    calibration = calibrate(args.text_tokens, args.half_rows, card)
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
    print(f"calibration: compute fraction {calibration['compute_fraction']} (fitted on the points whose "
          f"workload is fully known), half-efficiency rows {calibration['half_efficiency_rows']:g} "
          f"({calibration['half_efficiency_rows_from']}); error on each anchor point:", file=sys.stderr)
    for point in calibration["points"]:
        how = "fitted" if point["in_fit"] else f"compared, assumes {', '.join(point['assumed'])}"
        print(f"  {point['source']} ({point['hardware']}, {point['cards']} cards, {point['workload']}): "
              f"measured {point['measured_s']} s, model {point['model_s']} s: error {point['error']:+.1%} ({how})",
              file=sys.stderr)
    if calibration["card"]:
        fit = calibration["card"]
        print(f"  card {fit['label']}: {fit['rate_tflops']} TFLOP/s at large shapes, fraction "
              f"{fit['compute_fraction']}, h = {fit['half_efficiency_rows']} rows; block errors "
              + ", ".join(f"{p['workload']} W={p['world']} {p['error']:+.1%}" for p in fit["points"]), file=sys.stderr)
    for name, modes in calibrated.items():
        print(f"  {name} W=8 (768p 15 s, band +-{calibration['max_abs_error']:.1%} from the fitted points, "
              f"h = {calibration['half_efficiency_rows']:g}): "
              + ", ".join(f"{m} {v['speedup'][8]}x {v['speedup_band'][8]} (if h = "
                          + ", ".join(f"{r}: {s}x" for r, s in v["w8_speedup_if_half_rows"].items()) + ")"
                          for m, v in modes.items()), file=sys.stderr)
    print(f"plot: {args.plot}", file=sys.stderr)
    print(json.dumps({
        "model": {"shape": H3.__dict__, "worlds": WORLDS, "modes": list(MODES),
                  "assumptions": {"achieved_compute_fraction": ACHIEVED_COMPUTE,
                                  "achieved_link_fraction": ACHIEVED_LINK,
                                  "text_tokens": args.text_tokens, "forwards_per_step": 1,
                                  "half_efficiency_rows": calibration["half_efficiency_rows"],
                                  "activation_bytes": 2}},
        "workloads": table,
        "profiles": PROFILES,
        "anchor_profiles": ANCHOR_PROFILES,
        "anchors": ANCHORS,
        "projection": projection,
        "seed": seed,
        "calibration": calibration,
        "calibrated_projection_768p_15s": calibrated,
        "plot": str(args.plot),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
