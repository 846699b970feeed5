"""`minimax_h3_parallel.py run` (the dry run) at tiny sizes, as a user runs it."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from comfy.multidevice.cli import dry_run as minimax_h3_dry_run
from comfy.multidevice.cli import dry_run_settings
from comfy.multidevice.cli import report
from comfy.multidevice.cli.report import REPORT_KEYS
from comfy.multidevice.comm import compression
from comfy.multidevice.comm.compression import STEP_REL_ERROR_BOUND
from comfy.multidevice.sp.plan import shard_sizes

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
    (["--split", "3,0"], "--split 3,0: split='3,0' does not give 4 card(s) their shares"),
    (["--split", "3,1,1,1", "--sp-mode", "ulysses", "--heads", "4"],
     "--split 3,1,1,1: split 3,1,1,1 gives the ranks different rows, but sp_mode ulysses"),
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


def test_shard_dry_run_gives_the_replicate_latents_with_less_per_rank(tmp_path):
    """--dit-weights shard against replicate, same settings: bit-identical latents (the same
    SP computation over the owners' bytes), each rank holding less of the DiT."""
    reports, latents = {}, {}
    for mode in ("replicate", "shard"):
        reports[mode] = _report(tmp_path, ["--devices", "3", "--dit-weights", mode], mode)
        latents[mode] = load_file(str(tmp_path / mode / "latents.safetensors"))
    assert reports["shard"]["parity"] == "ok" and reports["shard"]["dit_weights"] == "shard"
    assert all(torch.equal(latents["shard"][k], latents["replicate"][k]) for k in latents["replicate"])
    full = reports["replicate"]["dit_weight_bytes_per_rank"]
    assert all(s < f for s, f in zip(reports["shard"]["dit_weight_bytes_per_rank"], full))
    assert all(g > 0 for g in reports["shard"]["dit_gathered_bytes_per_step"])
    assert reports["replicate"]["dit_gathered_bytes_per_step"] == [0, 0, 0]


@pytest.mark.timeout(120)
def test_int8_exchange_dry_run_within_its_bound_with_fewer_bytes(tmp_path):
    """--exchange-precision int8: parity within the documented bound (the default tolerance
    becomes it), fewer bytes between the ranks than exact; fp8 without the dtype exits 2."""
    reports = {}
    for precision in ("exact", "int8"):
        reports[precision] = _report(tmp_path, ["--devices", "2", "--exchange-precision", precision], precision)
    int8 = reports["int8"]
    assert int8["exchange_precision"] == "int8" and int8["parity"] == "ok"
    assert int8["tolerance"] == STEP_REL_ERROR_BOUND["int8"] and int8["rel_diff"] > 0
    assert int8["exchanged_bytes_per_step"] < reports["exact"]["exchanged_bytes_per_step"]


def test_fp8_without_the_dtype_exits_2_naming_int8(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(compression, "fp8_dtype", lambda: None)
    err = _exit_2_before_anything(tmp_path, capsys, ["--exchange-precision", "fp8"], "set exchange_precision to int8")
    assert "--exchange-precision fp8" in err


@pytest.mark.parametrize("split", ["3,1,2", "auto"])
def test_an_uneven_split_dry_run_keeps_parity_with_its_rows(tmp_path, split):
    result = _report(tmp_path, ["--devices", "3", "--split", split, "--sp-mode", "auto"], "o")
    assert result["parity"] == "ok" and result["sp_mode_used"] == "allgather"
    rows = result["tokens_per_rank"]
    assert sum(rows) == result["tokens"] and len(rows) == 3
    if split != "auto":
        assert rows == shard_sizes(result["tokens"], 3, (3, 1, 2))
    # every rank receives the others' K/V rows: the byte model follows the uneven rows
    assert result["model_bytes_per_step"] == result["exchanged_bytes_per_step"]


def _report(tmp_path, extra, out_dir: str) -> dict:
    """run() on CPU ranks with TINY_ARGS + extra (cache tmp_path/c, output tmp_path/out_dir):
    exit 0, and its JSON report."""
    args = _parser().parse_args(TINY_ARGS + ["--cpu", "--cache", str(tmp_path / "c"),
                                             "--out", str(tmp_path / out_dir)] + extra)
    out = io.StringIO()
    assert minimax_h3_dry_run.run(args, out=out) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def _parser():
    import argparse
    parser = argparse.ArgumentParser()
    dry_run_settings.add_arguments(parser, repo_dir=REPO)
    return parser


# ----------------------------------------------------------------------------- every option checked first

def _exit_2_before_anything(tmp_path, capsys, extra, message, cache=None, out=None):
    """run() with TINY_ARGS + extra: exit 2, the message on stderr, nothing written."""
    before = sorted(tmp_path.rglob("*"))
    args = _parser().parse_args(TINY_ARGS + ["--cpu", "--cache", str(cache or tmp_path / "c"),
                                             "--out", str(out or tmp_path / "o")] + extra)
    printed = io.StringIO()
    assert minimax_h3_dry_run.run(args, out=printed) == 2
    assert printed.getvalue() == ""
    err = capsys.readouterr().err
    assert message in err, err
    assert sorted(tmp_path.rglob("*")) == before  # no cache, no output, no checkpoint
    return err


@pytest.mark.parametrize("bad, message", [
    (["--steps", "1001"], "--steps 1001: above the dry run's limit of 1000; use --steps 1000 or less"),
    (["--refs", "10000000"], "--refs 10000000: above the dry run's limit of 64"),
    (["--width", "10000000000000"], "--width 10000000000000: above the dry run's limit of 16384"),
    (["--frames", str(10**30 * 17 + 5)], "above the dry run's limit of 34005"),
    (["--seed", "-1"], "--seed -1: must be 0 or more"),
    (["--seed", str(2**63)], f"--seed {2**63}: above the dry run's limit"),
    (["--tolerance", "2"], "--tolerance 2.0: above 1 any result passes"),
    (["--sp-mode", "ulysses", "--sp-overlap", "3"], "--sp-overlap 3: more chunks than the 2 heads"),
    (["--devices", "500"], "--devices 500: CPU ranks are threads sharing this machine's"),
    (["--hidden", "60000"], "GiB available; lower --frames"),
    (["--text-tokens", str(2**20), "--width", "16384", "--height", "16384", "--frames", "34005"],
     "GiB available; lower --frames"),
])
def test_sizes_beyond_the_limits_exit_2_before_anything_is_built(tmp_path, capsys, bad, message):
    _exit_2_before_anything(tmp_path, capsys, bad, message)


def test_output_folders_are_checked_before_the_sampling(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    _exit_2_before_anything(tmp_path, capsys, [], f"--out {a_file}: is an existing file, not a folder",
                            out=a_file)
    _exit_2_before_anything(tmp_path, capsys, [], f"--cache {a_file}: is an existing file", cache=a_file)
    _exit_2_before_anything(tmp_path, capsys, [], f"cannot be created: {a_file} is a file",
                            out=a_file / "sub")
    (tmp_path / "o2" / "report.json").mkdir(parents=True)
    _exit_2_before_anything(tmp_path, capsys, [], "holds a folder named report.json", out=tmp_path / "o2")
    assert a_file.read_text() == "keep me"


def test_an_unwritable_output_folder_exits_2(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # root may write anywhere: answer as for a user
        from comfy.multidevice.cli import options
        real_access = os.access
        monkeypatch.setattr(options.os, "access",
                            lambda path, mode: Path(path) != locked and real_access(path, mode))
    try:
        _exit_2_before_anything(tmp_path, capsys, [], "is not writable", out=locked / "out")
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "\uff13"], "'\uff13' is not an integer; write it with the digits 0-9"),  # full-width 3
    (["--devices", "\u0663"], "is not an integer"),  # Arabic-Indic 3
    (["--steps", "1_0"], "'1_0' is not an integer"),
    (["--tolerance", "nan"], "'nan' is not a finite number"),
    (["--tolerance", "inf"], "'inf' is not a finite number"),
    (["--out", ""], "argument --out: an empty path would write into the current folder"),
    (["--cache", "  "], "argument --cache: an empty path would write into the current folder"),
])
def test_malformed_values_are_refused_by_the_parser_with_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


TIMEOUT_VARIABLE = "COMFYUI_MULTI_DEVICE_TIMEOUT_S"
NOT_SECONDS = "is not a number of seconds (plain digits, e.g. 600)"


@pytest.mark.parametrize("value, problem", [
    ("nan", NOT_SECONDS), ("inf", NOT_SECONDS),
    ("-5", "must be more than 0 seconds"), ("0", "must be more than 0 seconds"),
    ("\u0661\u0662", NOT_SECONDS), ("1e3", NOT_SECONDS), ("1_0", NOT_SECONDS),
    ("100000", "is above the limit of 86400 seconds (one day)"),
])
def test_a_bad_timeout_variable_is_refused_the_same_by_run_and_doctor(tmp_path, capsys, monkeypatch,
                                                                      value, problem):
    from comfy.multidevice.cli import doctor
    monkeypatch.setenv(TIMEOUT_VARIABLE, value)
    expected = f"environment variable {TIMEOUT_VARIABLE}={value!r} {problem}; set it to seconds"
    run_err = _exit_2_before_anything(tmp_path, capsys, [], expected)
    doctor_args = argparse_namespace(json=True, devices=None, device_kind="cpu", backend=None, timeout=5.0)
    assert doctor.main(doctor_args) == 2
    doctor_err = capsys.readouterr().err
    assert expected in doctor_err
    assert run_err.split(": ", 1)[1] == doctor_err.split(": ", 1)[1]  # word for word


def test_a_bad_backend_variable_is_worded_as_a_variable(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "gloo")
    err = _exit_2_before_anything(tmp_path, capsys, [], "environment variable "
                                  "COMFYUI_MULTI_DEVICE_BACKEND='gloo' is not a backend")
    assert "--backend" not in err


def test_a_forced_backend_from_the_variable_that_cannot_start_names_the_variable(tmp_path, capsys,
                                                                                   monkeypatch):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "hccl")
    monkeypatch.setenv("HCCL_SO_PATH", str(tmp_path / "no-such-libhccl.so"))
    err = _exit_2_before_anything(tmp_path, capsys, ["--devices", "2"],
                                  "environment variable COMFYUI_MULTI_DEVICE_BACKEND='hccl': ")
    assert "--backend" not in err and "no-such-libhccl.so" in err


def argparse_namespace(**values):
    import argparse
    return argparse.Namespace(**values)


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
    text = report.speedup_baseline(["cpu"] * 4, 16)
    assert "4 CPU ranks sharing 16 cores" in text and "all 16 cores" in text and "not a scaling" in text
    assert report.speedup_baseline(["cuda:0", "cuda:1"], None).startswith("2 ranks vs")


@pytest.mark.parametrize("reason", [None, "4 CPU ranks on 2 core(s): fewer cores than ranks"])
def test_the_speedup_is_printed_only_when_the_machine_was_quiet(tmp_path, monkeypatch, reason):
    monkeypatch.setattr(minimax_h3_dry_run, "not_quiet_reason", lambda *a: reason)
    args = _parser().parse_args(TINY_ARGS + ["--cpu", "--devices", "2", "--cache", str(tmp_path / "c"),
                                             "--out", str(tmp_path / "o")])
    printed = io.StringIO()
    assert minimax_h3_dry_run.run(args, out=printed) == 0
    lines = printed.getvalue().splitlines()
    said = [line for line in lines if line.startswith("[speedup]")]
    result = json.loads(lines[-1])
    assert result["speedup"] > 0 and result["speedup_quiet"] is (reason is None)  # the figure stays
    if reason is None:
        assert said == [f"[speedup] {result['speedup']:.2f}x = {result['speedup_baseline']}"]
    else:
        assert said == [f"[speedup] not measured: {reason} (the ratio is in the JSON report, with "
                        "speedup_quiet false)"]


def test_the_cache_is_outside_the_checkout_by_default(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _parser().parse_args([]).cache == tmp_path / "xdg" / "minimax-h3-multinpu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert REPO not in _parser().parse_args([]).cache.parents


def test_the_tests_cache_is_a_temporary_folder(tmp_path_factory):
    """tests/conftest.py points XDG_CACHE_HOME at a temporary folder for the whole session, so a
    dry run the suite starts without --cache (a bench's) leaves the user's cache alone."""
    assert tmp_path_factory.getbasetemp() in _parser().parse_args([]).cache.parents


@pytest.mark.parametrize("variable, value, problem", [
    ("COMFYUI_MULTI_DEVICE_WEIGHT_BASE", "bogus", "is not a weight base mode; set it to one of map, pin"),
    ("COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S", "nan", NOT_SECONDS),
    ("COMFYUI_MULTI_DEVICE_RUN_TIMEOUT_S", "0", "must be more than 0 seconds"),
])
def test_every_variable_is_refused_the_same_by_run_doctor_and_the_node(tmp_path, capsys, monkeypatch,
                                                                        variable, value, problem):
    from comfy.multidevice.cli import doctor
    from comfy.multidevice.comm.settings import SettingError
    from comfy_extras.nodes_multinpu import configure_parallel
    from tests.node_cases import inputs
    monkeypatch.setenv(variable, value)
    expected = f"environment variable {variable}={value!r} {problem}"
    run_err = _exit_2_before_anything(tmp_path, capsys, [], expected)
    assert run_err.count("\n") == 1  # one line, no traceback
    assert doctor.main(argparse_namespace(json=True, devices=None, device_kind="cpu", backend=None,
                                          timeout=5.0)) == 2
    doctor_err = capsys.readouterr().err
    assert run_err.split(": ", 1)[1] == doctor_err.split(": ", 1)[1]  # word for word
    with pytest.raises(SettingError, match="^" + re.escape(expected) + ".*restart ComfyUI"):
        configure_parallel(*inputs(), npu_count=4, device_kind="cpu")


# ----------------------------------------------------------------------------- files, Ctrl-C, SIGTERM

def cli_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("cli_under_test", REPO / "minimax_h3_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("option", ["out", "cache"])
def test_a_folder_that_cannot_be_made_exits_2_naming_it(tmp_path, capsys, option):
    err = _exit_2_before_anything(tmp_path, capsys, [], f"--{option} /proc/nope: cannot be written: "
                                  "making a folder in /proc fails", **{option: Path("/proc/nope")})
    assert err.count("\n") == 1 and "name another folder" in err


def test_a_truncated_cached_checkpoint_is_rebuilt(tmp_path, caplog):
    cache, out = tmp_path / "cache", tmp_path / "out"
    args = _parser().parse_args(TINY_ARGS + ["--cpu", "--devices", "2", "--no-reference",
                                             "--cache", str(cache), "--out", str(out)])
    path = minimax_h3_dry_run.checkpoint_path(dry_run_settings.make_settings(args))
    assert minimax_h3_dry_run.run(args, out=io.StringIO()) == 0
    whole = {k: v.clone() for k, v in load_file(str(path)).items()}
    cut = path.read_bytes()
    path.unlink()  # a new file: the first run's mapping of the old one stays as it was
    path.write_bytes(cut[: len(cut) // 2])  # a write that was cut off
    report = io.StringIO()
    assert minimax_h3_dry_run.run(args, out=report) == 0
    assert json.loads(report.getvalue().strip().splitlines()[-1])["checkpoint_reused"] is False
    rebuilt = load_file(str(path))  # the same tensors (the header's key order may differ)
    assert rebuilt.keys() == whole.keys() and all(torch.equal(rebuilt[k], whole[k]) for k in whole)
    assert any(f"cached {path} cannot be read" in r.getMessage() and "rebuilding it" in r.getMessage()
               for r in caplog.records)


def test_outputs_are_ordinary_files_honouring_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        report.write_outputs(tmp_path, [torch.ones(2), torch.ones(3)], None, {"parity": "ok"})
    finally:
        os.umask(old)
    for name in dry_run_settings.OUTPUT_FILES:
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name
    assert load_file(str(tmp_path / "latents.safetensors"))["audio"].shape == (3,)


def test_ctrl_c_while_the_checkpoint_is_written_exits_130_and_leaves_no_temporary_file(
        tmp_path, capsys, monkeypatch):
    def cut_off(model, path):
        Path(path).write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt
    monkeypatch.setattr(minimax_h3_dry_run, "save_miniature", cut_off)
    cache = tmp_path / "cache"
    try:
        code = cli_module().main(["run", *TINY_ARGS, "--cpu", "--devices", "2", "--cache", str(cache),
                                  "--out", str(tmp_path / "out")])
    except KeyboardInterrupt:
        pytest.fail("KeyboardInterrupt escaped main(): the user gets a traceback")
    assert code == 130
    assert capsys.readouterr().err == \
        "minimax_h3_parallel.py run: stopped by Ctrl-C; run it again to start over\n"
    assert list(cache.iterdir()) == []


@pytest.mark.timeout(120)
def test_sigterm_while_the_checkpoint_is_written_exits_143_and_leaves_no_temporary_file(tmp_path):
    import signal
    import time
    cache = tmp_path / "cache"
    args = [*TINY_ARGS, "--hidden", "256", "--blocks", "6", "--heads", "6", "--head-dim", "64"]
    proc = subprocess.Popen([sys.executable, str(REPO / "minimax_h3_parallel.py"), "run", *args, "--cpu",
                             "--devices", "2", "--cache", str(cache), "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (cache.is_dir() and any(cache.iterdir())) and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.005)  # the first file in the cache: the save has begun
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == \
        "minimax_h3_parallel.py run: stopped by SIGTERM; run it again to start over"
    assert "Traceback" not in err
    left = [p.name for p in cache.iterdir()]
    assert all(name.endswith(".safetensors") for name in left), left  # no temporary file
