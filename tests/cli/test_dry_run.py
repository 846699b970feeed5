"""`minimax_h3_parallel.py run` (the dry run) at tiny sizes, as a user runs it."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comfy.multidevice.cli import dry_run as minimax_h3_dry_run
from comfy.multidevice.cli.dry_run import REPORT_KEYS

REPO = Path(__file__).resolve().parents[2]
TINY_ARGS = ["--frames", "5", "--width", "64", "--height", "64", "--text-tokens", "9", "--hidden", "40",
             "--blocks", "2", "--heads", "2", "--head-dim", "24", "--steps", "2", "--no-progress"]


def run_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, str(REPO / "minimax_h3_parallel.py"), "run", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


@pytest.mark.timeout(240)
def test_dry_run_cli_parity_cache_and_outputs(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    first = run_cli("--devices", "3", "--cpu", "--refs", "1", "--cache", str(cache), "--out", str(out), *TINY_ARGS)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert set(REPORT_KEYS) <= set(report)
    assert report["world_size"] == 3 and report["backend"] == "peer" and report["steps"] == 2
    assert report["parity"] == "ok" and report["rel_diff"] <= report["tolerance"] == 1e-5
    assert report["tokens"] == sum(report["tokens_per_rank"]) and len(report["tokens_per_rank"]) == 3
    assert report["exchanged_bytes_per_step"] > 0 and report["checkpoint_reused"] is False
    assert "[sampling]" in first.stdout and "[reference]" in first.stdout
    saved = load_file(str(out / "latents.safetensors"))
    assert set(saved) == {"video", "audio", "reference_video", "reference_audio"}
    assert saved["video"].shape == (1, 24, 2, 4, 4) and saved["audio"].shape == (1, 32, 2, 9)
    assert json.loads((out / "report.json").read_text()) == report
    assert len(list(cache.glob("*.safetensors"))) == 1
    # three replicas from one read-only base: the checkpoint was read from disk exactly once
    assert report["weights_source"] == "shared_checkpoint"
    assert report["checkpoint_bytes_read"] == os.path.getsize(report["checkpoint"])

    # the second run loads the cached checkpoint; the fake HCCL library drives --backend hccl
    from tests.fakes.build import build_fake
    fake = build_fake("fake_hccl", out_dir=tmp_path / "fake")
    second = run_cli("--devices", "2", "--cpu", "--backend", "hccl", "--no-reference", "--cache", str(cache),
                     "--out", str(out), *TINY_ARGS, env={"HCCL_SO_PATH": str(fake)})
    assert second.returncode == 0, second.stderr
    report2 = json.loads(second.stdout.strip().splitlines()[-1])
    assert report2["checkpoint_reused"] is True and report2["backend"] == "hccl"
    assert report2["parity"] == "skipped" and report2["reference_seconds_per_step"] is None
    assert set(load_file(str(out / "latents.safetensors"))) == {"video", "audio"}


@pytest.mark.parametrize("bad, message", [
    (["--frames", "10"], "--frames 10: H3's video VAE takes 17k+5 frames; use --frames 5 or 22"),
    (["--width", "100"], "--width 100: must be a positive multiple of 32"),
    (["--devices", "0"], "--devices 0: need at least 1 rank"),
    (["--steps", "0"], "--steps 0: need at least 1 step"),
    (["--hidden", "48"], "--heads 2 x --head-dim 24 equals --hidden 48"),
    (["--tolerance", "-1"], "--tolerance -1.0: must be >= 0"),
    (["--head-dim", "4"], "--head-dim 4: too small for the miniature; use --head-dim 8 or more"),
    (["--hidden", "1"], "--hidden 1: too small for the miniature; use --hidden 2 or more"),
    (["--heads", "0"], "--heads 0: too small for the miniature; use --heads 1 or more"),
])
def test_bad_options_exit_2_with_the_fix(tmp_path, capsys, bad, message):
    args = _parser().parse_args(TINY_ARGS + ["--cpu", "--cache", str(tmp_path), "--out", str(tmp_path)] + bad)
    out = io.StringIO()
    assert minimax_h3_dry_run.run(args, out=out) == 2
    assert out.getvalue() == ""
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing built before the options were checked


def test_a_backend_that_cannot_start_exits_2_before_anything_is_built(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HCCL_SO_PATH", str(tmp_path / "no-such-libhccl.so"))
    args = _parser().parse_args(TINY_ARGS + ["--cpu", "--devices", "2", "--backend", "hccl",
                                             "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "o")])
    out = io.StringIO()
    assert minimax_h3_dry_run.run(args, out=out) == 2
    assert out.getvalue() == ""
    err = capsys.readouterr().err
    assert "--backend hccl:" in err and "no-such-libhccl.so" in err and "HCCL_SO_PATH" in err
    assert not (tmp_path / "c").exists() and not (tmp_path / "o").exists()


def test_sp_mode_offers_the_registered_modes_only():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--sp-mode", "ring"])
    assert _parser().parse_args(["--sp-mode", "allgather"]).sp_mode == "allgather"


@pytest.mark.timeout(120)
def test_parity_failure_exits_1(tmp_path, monkeypatch):
    real = minimax_h3_dry_run.enable_sequence_parallel

    def off_by_a_little(*a, **kw):
        sp = real(*a, **kw)

        def forward(*args, **kwargs):
            return [o + 1e-3 for o in sp(*args, **kwargs)]
        forward.tokens_per_rank = sp.tokens_per_rank
        forward.bytes_exchanged_last_forward = sp.bytes_exchanged_last_forward
        return forward

    monkeypatch.setattr(minimax_h3_dry_run, "enable_sequence_parallel", off_by_a_little)
    args = _parser().parse_args(TINY_ARGS + ["--devices", "2", "--cpu", "--cache", str(tmp_path / "c"),
                                             "--out", str(tmp_path / "o")])
    out = io.StringIO()
    assert minimax_h3_dry_run.run(args, out=out) == 1
    report = json.loads(out.getvalue().strip().splitlines()[-1])
    assert report["parity"] == "fail" and report["rel_diff"] > 1e-5


def _parser():
    import argparse
    parser = argparse.ArgumentParser()
    minimax_h3_dry_run.add_arguments(parser, repo_dir=REPO)
    return parser


def test_default_devices_without_accelerators(monkeypatch):
    monkeypatch.setattr(minimax_h3_dry_run, "visible_accelerators", lambda: [])
    assert minimax_h3_dry_run.choose_devices(None, cpu=False) == ["cpu"] * 4
    monkeypatch.setattr(minimax_h3_dry_run, "visible_accelerators", lambda: ["npu:0", "npu:1"])
    assert minimax_h3_dry_run.choose_devices(None, cpu=False) == ["npu:0", "npu:1"]
    assert minimax_h3_dry_run.choose_devices(3, cpu=True) == ["cpu"] * 3
    with pytest.raises(ValueError, match="only 2 accelerator"):
        minimax_h3_dry_run.choose_devices(4, cpu=False)


def test_intra_op_threads_are_set_inside_every_rank_thread():
    """torch.set_num_threads is per thread: set on the main thread it never reaches rank threads
    that already exist, which would then each run all the cores' threads (oversubscribed)."""
    from comfy.multidevice.comm.group import SequenceParallelCoordinator

    main_threads = torch.get_num_threads()
    with SequenceParallelCoordinator(["cpu"] * 3, backend="peer") as coord:
        try:
            minimax_h3_dry_run._set_rank_threads(coord, 1)
            assert coord.run(lambda rank, comm: torch.get_num_threads()) == [1, 1, 1]
            assert torch.get_num_threads() == main_threads  # the reference keeps every core
        finally:
            torch.set_num_threads(main_threads)  # MKL's setting is global: the caller's again


def test_report_says_what_the_speedup_compares():
    text = minimax_h3_dry_run.speedup_baseline(["cpu"] * 4, 16)
    assert "4 CPU ranks sharing 16 cores" in text and "all 16 cores" in text and "not a scaling" in text
    assert minimax_h3_dry_run.speedup_baseline(["cuda:0", "cuda:1"], None).startswith("2 ranks vs")
