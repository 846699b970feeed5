"""The H3 projection (bench/project_h3.py): the uncalibrated model's output, the fit on the anchors
whose workload is fully known, the error on every anchor point, the assumption that sets the
W = 8 figure, and the calibration from a card's measurement (bench/bench_card.py's JSON)."""

import json
import subprocess
import sys

import pytest

from bench import project_h3
from tests.comfyui_server import REPO


def run_projection(tmp_path, *args):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "project_h3.py"), "--plot", str(tmp_path / "p.png"),
                          *args], capture_output=True, text=True, timeout=240)
    return run, (json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None)


@pytest.fixture(scope="module")
def projection(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("projection")
    run, result = run_projection(tmp)
    assert run.returncode == 0, run.stderr
    return run, result, tmp


def test_projection_prints_json_last_and_writes_the_plot(projection):
    _, result, tmp = projection
    tokens = result["workloads"]["768p_15s"]["tokens"]
    assert (tokens["video"], tokens["audio"]) == (107_856, 1_206)  # docs/ARCHITECTURE.md
    five = result["workloads"]["768p_5s"]["tokens"]
    assert (five["video"], five["audio"]) == (37_296, 414)
    bytes_w8 = result["workloads"]["768p_15s"]["bytes_received_per_rank_per_step"]
    assert bytes_w8["ulysses"]["8"] < bytes_w8["allgather"]["8"] / 3
    assert {p["name"] for p in result["profiles"]} >= {"ascend-910b", "nvidia-h100-sxm", "nvidia-h200-sxm"}
    assert all(p["sources"] for p in result["profiles"] + result["anchor_profiles"])
    assert all(0 < p["achieved_compute_fraction"] <= 1 for p in result["profiles"])  # profile data
    assert result["seed"]["measured"]["end_to_end_s_turbo_8_steps"] == 495.79
    assert 0 < result["seed"]["implied_achieved_compute_fraction"] < 1
    from PIL import Image
    with Image.open(tmp / "p.png") as image:
        assert image.format == "PNG" and image.size[0] > 400


def test_only_anchors_whose_workload_is_fully_known_are_fitted_and_each_says_what_it_assumes():
    points = project_h3.anchor_points(256)
    for p in points:
        raw = next(a for a in project_h3.ANCHORS if a["name"] == p["source"])
        assert p["in_fit"] == (not p["assumed"])
        assert set(p["assumed"]) <= set(project_h3.FIT_FIELDS)
        for field in project_h3.FIT_FIELDS:  # what is assumed was unknown in the anchor's own data
            known = {pt[field] for pt in raw["points"] if pt["cards"] == p["cards"] and pt["seconds"] == p["seconds"]}
            assert (None in known) == (field in p["assumed"])
    fitted = {p["source"] for p in points if p["in_fit"]}
    assert fitted == {"seed-910b-4npu"}  # the others lack their precision, steps or resolution
    # each anchor is modelled with its own clip: the H20 runs were a 5 s clip, not 15 s
    h20 = [p for p in points if p["source"] == "vllm-omni-h20"]
    assert {p["clip_s"] for p in h20} == {5} and all(p["tokens"]["video"] == 37_296 for p in h20)
    sglang = project_h3.anchor_point("sglang-h200-8")
    assert (sglang["cards"], sglang["steps"], sglang["seconds"], sglang["workload"]) == (8, 50, 39.67, "768p_5s")


def test_the_fit_reports_every_anchor_point_and_the_band_comes_from_the_fitted_ones(projection):
    run, result, _ = projection
    calibration = result["calibration"]
    names = {a["name"] for a in project_h3.ANCHORS}
    assert {p["source"] for p in calibration["points"]} == names
    assert len(calibration["points"]) == sum(len(a["points"]) for a in project_h3.ANCHORS)
    fitted = [p for p in calibration["points"] if p["in_fit"]]
    assert calibration["max_abs_error"] == max(abs(p["error"]) for p in fitted)
    for p in calibration["points"]:  # the error is the model against the anchor's own seconds
        assert p["error"] == pytest.approx(p["model_s"] / p["measured_s"] - 1, abs=1e-3)
    # every point is printed with its error and whether it was fitted or only compared
    lines = [line for line in run.stderr.splitlines() if "error" in line and "measured" in line]
    assert len(lines) == len(calibration["points"])
    assert sum("(fitted)" in line for line in lines) == len(fitted)
    assert 0 < calibration["compute_fraction"] <= 1


def test_the_w8_figure_names_the_assumption_that_sets_it(projection):
    _, result, _ = projection
    calibration = result["calibration"]
    assert calibration["half_efficiency_rows"] == project_h3.HALF_EFFICIENCY_ROWS
    assert "row counts" in calibration["assumptions"]["w8_set_by"]
    for modes in result["calibrated_projection_768p_15s"].values():
        for mode in modes.values():
            low, high = mode["speedup_band"]["8"]
            assert low < mode["speedup"]["8"] <= high <= 8
            by_h = [mode["w8_speedup_if_half_rows"][str(h)] for h in project_h3.SENSITIVITY_ROWS]
            assert by_h == sorted(by_h, reverse=True) and by_h[0] > by_h[-1]  # fewer rows per rank cost more


def synthetic_card(half_rows, fraction, label="NVIDIA H200", dims=None):
    """bench_card.py's JSON shape, with block times made from the model itself at a known h."""
    rate = fraction * project_h3.profile_named("nvidia-h200-sxm")["peak_bf16_tflops"] * 1e12
    points = []
    for name, seq in (("768p_5s", 38_592), ("768p_15s", 109_952)):
        for world in (1, 2, 4, 8):
            rows = -(-seq // world)
            seconds = project_h3.block_flops(seq, rows) / (rate * project_h3.kernel_efficiency(rows, half_rows))
            points.append({"workload": name, "tokens": seq, "world": world, "rows": rows, "block_s": seconds})
    dims = dims or {"hidden": 5376, "heads": 56, "head_dim": 128, "ffn": 14336}
    return {"card": {"label": label}, "dims": dims, "points": points}


def test_a_card_measurement_replaces_the_assumption(tmp_path):
    card = tmp_path / "card.json"
    card.write_text("a progress line\n" + json.dumps(synthetic_card(2000, 0.6)) + "\n")
    run, result = run_projection(tmp_path, "--card-json", str(card))
    assert run.returncode == 0, run.stderr
    calibration = result["calibration"]
    assert calibration["half_efficiency_rows"] == 2000 and calibration["card"]["profile"] == "nvidia-h200-sxm"
    assert calibration["card"]["compute_fraction"] == pytest.approx(0.6, rel=1e-3)
    assert calibration["fractions"]["nvidia-h200-sxm"] == pytest.approx(0.6, rel=1e-3)
    assert calibration["half_efficiency_rows_from"] == "card measurement"
    assert all(abs(p["error"]) < 1e-3 for p in calibration["card"]["points"])


def test_a_cpu_run_or_an_empty_one_is_refused(tmp_path):
    card = tmp_path / "card.json"
    card.write_text(json.dumps(synthetic_card(0, 0.5, dims={"hidden": 128, "heads": 2, "head_dim": 64, "ffn": 256})))
    run, _ = run_projection(tmp_path, "--card-json", str(card))
    assert run.returncode != 0 and "not H3's" in run.stderr
    empty = synthetic_card(0, 0.5)
    empty["points"] = empty["points"][:1]
    card.write_text(json.dumps(empty))
    run, _ = run_projection(tmp_path, "--card-json", str(card))
    assert run.returncode != 0 and "fewer than two" in run.stderr


@pytest.mark.parametrize("label,profile", [("NVIDIA H200", "nvidia-h200-sxm"), ("NVIDIA H100 80GB HBM3", "nvidia-h100-sxm"),
                                           ("NVIDIA H100 PCIe", "nvidia-h100-pcie"), ("Ascend910B3", "ascend-910b"),
                                           ("NVIDIA H20", "nvidia-h20"), ("NVIDIA A100-SXM4-80GB", None)])
def test_a_card_is_matched_to_its_profile_by_its_runtime_name(label, profile):
    assert project_h3.card_profile(label) == profile
