"""`minimax_h3_parallel.py doctor`: the CLI's exit codes and JSON (subprocesses), and the
report's content for the backends (in process, over the fake libraries)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comfy.multidevice.cli import doctor

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "minimax_h3_parallel.py"

# Variables that would change what the doctor selects on a developer's machine.
_STEERING = ("COMFYUI_MULTI_DEVICE_BACKEND", "HCCL_SO_PATH", "NCCL_SO_PATH", "RANK", "WORLD_SIZE",
             "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")


def run_doctor(*args, env=None):
    base = {k: v for k, v in os.environ.items() if k not in _STEERING}
    return subprocess.run([sys.executable, str(CLI), "doctor", *args], capture_output=True, text=True,
                          timeout=120, env={**base, **(env or {})}, cwd=REPO)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in _STEERING:
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------- CLI

@pytest.mark.timeout(150)
def test_json_report_exits_zero_on_this_machine():
    proc = run_doctor("--json", env={"HCCL_BUFFSIZE": "200"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["reason"] is None
    assert set(report["backends"]) == {"peer", "hccl", "nccl", "torch.distributed"}
    assert report["versions"]["torch"] and report["versions"]["python"]
    test = report["self_test"]
    assert test["ok"] and all(test["checks"].values())
    if report["devices"]["npu"]["count"] == 0 and report["devices"]["cuda"]["count"] == 0:
        # No accelerator: CPU ranks and peer-copy, as documented.
        assert test["devices"] == ["cpu"] * doctor.CPU_SELF_TEST_RANKS and test["backend"] == "peer"
    assert report["environment"]["HCCL_BUFFSIZE"] == "200"  # every HCCL_* variable is shown
    assert "COMFYUI_MULTI_DEVICE_BACKEND" in report["environment"]


@pytest.mark.timeout(150)
def test_too_many_devices_exits_nonzero_naming_the_count_found():
    proc = run_doctor("--devices", "64")
    assert proc.returncode == 1
    report = doctor.collect_report(count=64)  # the same selection, in process
    found = report["devices"]["npu"]["count"] or report["devices"]["cuda"]["count"]
    assert f"found {found}" in proc.stderr and "64" in proc.stderr
    assert "result     NOT OK" in proc.stdout


@pytest.mark.timeout(150)
def test_forced_backend_that_cannot_start_exits_nonzero(tmp_path):
    proc = run_doctor("--json", "--device-kind", "cpu", "--backend", "hccl",
                      env={"HCCL_SO_PATH": str(tmp_path / "missing.so")})
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert not report["ok"] and "HCCL_SO_PATH" in report["reason"]
    assert report["backends"]["hccl"]["loaded"] is False
    assert "HCCL_SO_PATH" in proc.stderr


# ----------------------------------------------------------------------------- report content

def test_backends_over_the_fake_libraries(monkeypatch, fake_nccl_path, fake_hccl_no_allgatherv_path):
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_no_allgatherv_path)
    report = doctor.collect_report(device_kind="cpu", count=3, backend="nccl", timeout_s=20)
    assert report["ok"], report["reason"]
    nccl, hccl = report["backends"]["nccl"], report["backends"]["hccl"]
    assert nccl["usable"] and nccl["path"] == fake_nccl_path and nccl["path_from"] == "NCCL_SO_PATH"
    for name in ("ncclCommInitAll", "ncclGroupStart", "ncclGroupEnd", "ncclBroadcast", "ncclAllGather",
                 "ncclAllReduce", "ncclCommDestroy", "ncclGetErrorString"):
        assert nccl["symbols"][name] is True
    assert "ncclBroadcast" in nccl["exchange_method"]
    assert hccl["usable"] and hccl["symbols"]["HcclAllGatherV"] is False and not hccl["all_gather_v"]
    assert hccl["exchange_method"].startswith("one HcclBroadcast per rank")
    test = report["self_test"]
    assert test["backend"] == "nccl" and test["world_size"] == 3 and test["ok"]
    assert "NCCL_SO_PATH" in report["environment"]


def test_a_library_without_required_symbols_is_not_usable(monkeypatch, fake_hccl_path):
    monkeypatch.setenv("NCCL_SO_PATH", fake_hccl_path)  # loads, but it is not NCCL
    nccl = doctor.backends_report()["nccl"]
    assert nccl["loaded"] and not nccl["usable"]
    assert "ncclCommInitAll" in nccl["missing_required"]


def test_self_test_failure_is_reported_with_the_library_error(monkeypatch, fake_nccl_path):
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    monkeypatch.setenv("FAKE_NCCL_FAIL", "ncclBroadcast:3")
    report = doctor.collect_report(device_kind="cpu", count=2, backend="nccl", timeout_s=20)
    assert not report["ok"]
    assert "ncclBroadcast failed with ncclResult_t 3" in report["reason"]


def test_bad_backend_variable_is_the_reason(monkeypatch):
    monkeypatch.setenv("COMFYUI_MULTI_DEVICE_BACKEND", "mpi")
    report = doctor.collect_report()
    assert not report["ok"] and "auto, hccl, nccl, peer" in report["reason"]


def inventory(npu=0, cuda=0):
    return {"npu": {"count": npu}, "cuda": {"count": cuda}, "cpu": {"count": 2}}


def test_device_selection():
    assert doctor.self_test_devices("auto", None, inventory()) == ["cpu", "cpu"]
    assert doctor.self_test_devices("cpu", 3, inventory()) == ["cpu"] * 3
    assert doctor.self_test_devices("auto", None, inventory(npu=4)) == ["npu:0", "npu:1", "npu:2", "npu:3"]
    assert doctor.self_test_devices("auto", 2, inventory(cuda=8)) == ["cuda:0", "cuda:1"]
    with pytest.raises(doctor.DoctorFailure, match=r"asked for 4 npu device\(s\) but found 2 npu.*--devices 2"):
        doctor.self_test_devices("npu", 4, inventory(npu=2))
    with pytest.raises(doctor.DoctorFailure, match=r"found 0 cuda device\(s\) \(CUDA_VISIBLE_DEVICES"):
        doctor.self_test_devices("cuda", None, inventory(npu=2))
    with pytest.raises(doctor.DoctorFailure, match="found 0 accelerators.*--device-kind cpu"):
        doctor.self_test_devices("auto", 2, inventory())
    with pytest.raises(doctor.DoctorFailure, match="positive"):
        doctor.self_test_devices("cpu", 0, inventory())


def test_text_report_names_every_part(monkeypatch, fake_nccl_path):
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    text = doctor.format_text(doctor.collect_report(device_kind="cpu", backend="nccl", timeout_s=20))
    for part in ("platform", "torch", "npu", "cuda", "cpu", "backends", "hccl:", "nccl: usable",
                 "environment", "self-test  2 rank(s) on cpu, cpu, backend nccl: passed", "result     OK"):
        assert part in text


def test_malformed_doctor_options_exit_2_naming_the_value(capsys):
    import argparse
    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    for argv, message in ((["--timeout", "nan"], "'nan' is not a number of seconds"),
                          (["--timeout", "-1"], "'-1' must be more than 0 seconds"),
                          (["--timeout", "1e9"], "'1e9' is not a number of seconds"),
                          (["--devices", "\uff12"], "is not an integer; write it with the digits 0-9")):
        with pytest.raises(SystemExit) as info:
            parser.parse_args(argv)
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_too_many_cpu_ranks_are_refused_naming_the_cores():
    from comfy.multidevice.cli.options import max_cpu_ranks
    with pytest.raises(doctor.DoctorFailure, match=f"use --devices {max_cpu_ranks()} or fewer"):
        doctor.self_test_devices("cpu", 500, inventory())


# ----------------------------------------------------------------------------- --deep

DEEP = ("exchange_between_nonzero_ranks", "shard_gather_beside_exchange", "quantized_gather_and_release",
        "stuck_rank_recovered", "attention_exchanges_timed")


@pytest.mark.parametrize("backend", ["peer", "hccl", "nccl"])
def test_deep_checks_pass_over_every_backend_on_three_cpu_ranks(backend, monkeypatch, fake_hccl_path, fake_nccl_path):
    # the fake libraries enforce the vendors' rules (tests/fakes): a path that breaks one fails here
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    report = doctor.collect_report(device_kind="cpu", count=3, backend=backend, timeout_s=20, deep=True)
    assert list(report["deep"]) == list(DEEP)
    assert report["ok"], report["reason"]
    assert all(v["ok"] for v in report["deep"].values()), report["deep"]
    assert "exact on rank(s) [0, 1, 2]" in report["deep"]["exchange_between_nonzero_ranks"]["detail"]
    assert "naming rank 2: True" in report["deep"]["stuck_rank_recovered"]["detail"]
    assert "skipped, nothing recorded" in report["deep"]["attention_exchanges_timed"]["detail"]  # 56 % 3


def test_deep_checks_default_to_three_cpu_ranks_and_print_one_line_each():
    proc = run_doctor("--deep")
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("deep ")]
    assert [line.split()[1].rstrip(":") for line in lines] == list(DEEP)
    assert all(": ok in " in line for line in lines)


def test_a_deep_check_that_finds_wrong_data_fails_the_report(monkeypatch):
    from comfy.multidevice.weights import block_shards
    real = block_shards.ShardedBlockWeights.gather

    def stale(self, rank, comm, index):  # a gather that hands out the previous block's bytes
        out, flat = real(self, rank, comm, index)
        return (real(self, rank, comm, index - 1) if index else (out, flat))
    monkeypatch.setattr(block_shards.ShardedBlockWeights, "gather", stale)
    report = doctor.collect_report(device_kind="cpu", count=3, backend="peer", timeout_s=20, deep=True)
    assert not report["ok"]
    assert "quantized_gather_and_release" in report["reason"]
    assert not report["deep"]["shard_gather_beside_exchange"]["ok"]
    assert report["deep"]["exchange_between_nonzero_ranks"]["ok"]


@pytest.mark.parametrize("backend", ["hccl", "nccl"])
def test_the_deep_shard_check_catches_a_second_communicator_beside_the_exchange(backend, monkeypatch, fake_hccl_path,
                                                                                 fake_nccl_path):
    # what the node did before: a prefetch lane of its own communicators on the same cards. The
    # fake HCCL refuses the overlap; the fake NCCL records it (the vendors forbid both), and the
    # suite's autouse check reads that record: it is taken here, and asserted, instead
    from comfy.multidevice.comm import group
    from tests.fakes.violations import take_nccl_violations
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    monkeypatch.setattr(group, "lane_allowed", lambda coordinator: True)
    # every call stays in flight 0.2 s, so the lane's gather and the ranks' exchange overlap
    # however a busy machine schedules the threads (a CI run under load once saw none)
    monkeypatch.setenv("FAKE_IN_FLIGHT_HOLD_MS", "200")
    verdict = deep_check(backend, "shard_gather_beside_exchange")
    if backend == "hccl":
        assert not verdict["ok"] and "overlap" in verdict["detail"], verdict
    else:
        assert take_nccl_violations(fake_nccl_path), verdict


def deep_check(backend, name, world=3):
    from comfy.multidevice.cli.deep_checks import DEEP_CHECKS, verdict_of
    return verdict_of(lambda: DEEP_CHECKS[name](["cpu"] * world, backend, 20))


def test_the_report_names_the_broadcast_exchange_on_a_training_series_chip(monkeypatch, fake_hccl_path):
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_path)  # it has HcclAllGatherV
    assert doctor.backends_report(["Ascend910B3"])["hccl"]["exchange_method"].startswith("HcclAllGatherV")
    method = doctor.backends_report(["Ascend910ProA", "Ascend910ProA"])["hccl"]["exchange_method"]
    assert method.startswith("one HcclBroadcast per rank (Ascend910ProA: no HcclAllGatherV on this chip)")


# ----------------------------------------------------------------------------- --deep: exchange timing

@pytest.fixture
def own_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from comfy.multidevice.sp.mode_choice import measurements_path
    return measurements_path()


@pytest.mark.parametrize("backend", ["peer", "hccl", "nccl", "hccl without HcclAlltoAllV"])
def test_the_exchange_timing_is_kept_where_auto_reads_it(backend, monkeypatch, own_cache, fake_hccl_path,
                                                         fake_nccl_path, fake_hccl_no_alltoallv_path):
    from comfy.multidevice.sp.mode_choice import choose_sp_mode, measurement_for
    monkeypatch.setenv("HCCL_SO_PATH", fake_hccl_no_alltoallv_path if "without" in backend else fake_hccl_path)
    monkeypatch.setenv("NCCL_SO_PATH", fake_nccl_path)
    verdict = deep_check(backend.split()[0], "attention_exchanges_timed", world=4)
    assert verdict["ok"], verdict
    kept = measurement_for("cpu", 4)
    assert kept["measured_by"] == "doctor --deep" and kept["heads"] == 56 and kept["rows_per_rank"] == 128
    assert kept["backend"] == backend.split()[0]
    choice = choose_sp_mode("auto", 4, 56, measured=kept)
    assert choice.mode == ("ulysses" if kept["ulysses_s"] < kept["allgather_s"] else "allgather")
    assert "measured on this machine" in choice.reason
    detail = verdict["detail"]
    assert f"allgather {kept['allgather_s'] * 1e3:.2f} ms, ulysses {kept['ulysses_s'] * 1e3:.2f} ms" in detail
    assert f"auto at W=4 on cpu now picks {choice.name}; written to {own_cache}" in detail


def test_the_hybrid_is_timed_where_the_heads_divide_by_a_group_only(own_cache):
    from comfy.multidevice.sp.mode_choice import measurement_for
    verdict = deep_check("peer", "attention_exchanges_timed", world=6)
    assert verdict["ok"] and "hybrid (Ulysses in groups of 2)" in verdict["detail"], verdict
    assert measurement_for("cpu", 6) is not None


def test_the_exchange_timing_records_nothing_where_ulysses_cannot_run(own_cache):
    verdict = deep_check("peer", "attention_exchanges_timed", world=3)
    assert verdict["ok"] and "skipped, nothing recorded" in verdict["detail"]
    assert "rerun with --device-kind cpu --devices N, N one of 2, 4, 6, 7, 8" in verdict["detail"]
    assert not own_cache.exists()


def test_an_exchange_that_misplaces_rows_fails_the_timing_and_records_nothing(monkeypatch, own_cache):
    from comfy.multidevice.sp import ulysses
    real = ulysses.UlyssesKV._assemble
    monkeypatch.setattr(ulysses.UlyssesKV, "_assemble", staticmethod(lambda layout, outs: real(layout, outs).flip(1)))
    verdict = deep_check("peer", "attention_exchanges_timed", world=2)
    assert not verdict["ok"] and "outputs wrong for ulysses on rank 0" in verdict["detail"], verdict
    assert not own_cache.exists()


def test_an_unwritable_cache_is_a_verdict_naming_the_file(monkeypatch, own_cache):
    own_cache.parent.parent.mkdir(parents=True, exist_ok=True)
    own_cache.parent.write_text("a file where the cache folder goes")
    verdict = deep_check("peer", "attention_exchanges_timed", world=2)
    assert not verdict["ok"] and f"could not write {own_cache}" in verdict["detail"], verdict
    assert "XDG_CACHE_HOME" in verdict["detail"]
