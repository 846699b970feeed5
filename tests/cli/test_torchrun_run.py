"""`torchrun --nproc-per-node 2 minimax_h3_parallel.py run`: the dry run with one rank per
process over gloo (loopback), checked against the single-device reference by rank 0.

torchrun and its workers run in their own session, so a hung run is killed as a whole
when the time limit passes.
"""

import json
import time
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfy.multidevice.cli.report import REPORT_KEYS
from comfy.multidevice.sp.plan import shard_sizes
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
LIMIT_S = 240
TINY = ["--cpu", "--steps", "2", "--frames", "5", "--width", "64", "--height", "64", "--text-tokens", "8",
        "--hidden", "64", "--blocks", "2", "--heads", "2", "--head-dim", "16", "--no-progress"]


def torchrun(nproc, *args):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(REPO / "minimax_h3_parallel.py"), "run", *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every worker
        out, err = proc.communicate()
        pytest.fail(f"torchrun run did not finish in {LIMIT_S}s:\n{out[-2000:]}\n{err[-2000:]}")
    return proc.returncode, out, err


@pytest.mark.timeout(LIMIT_S + 30)
def test_torchrun_runs_one_rank_per_process_with_parity(tmp_path):
    code, out, err = torchrun(2, *TINY, "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"))
    assert code == 0, f"{out[-3000:]}\n{err[-3000:]}"
    report = json.loads(out.strip().splitlines()[-1])
    assert set(REPORT_KEYS) <= set(report)
    assert report["launcher"] == "torchrun" and report["world_size"] == 2
    assert report["backend"] == "torch.distributed gloo" and report["devices"] == ["cpu", "cpu"]
    assert sum(report["tokens_per_rank"]) == report["tokens"]
    assert report["exchanged_bytes_per_step"] > 0
    assert report["parity"] == "ok" and report["rel_diff"] <= 1e-5
    assert (tmp_path / "out" / "report.json").exists()
    assert out.count("MiniMax-H3 dry run under torchrun") == 1  # only rank 0 prints


@pytest.mark.timeout(LIMIT_S + 30)
@pytest.mark.parametrize("split", ["3,1", "auto"])
def test_torchrun_with_an_uneven_split_keeps_parity(tmp_path, split):
    code, out, err = torchrun(2, *TINY, "--split", split, "--cache", str(tmp_path / "cache"),
                              "--out", str(tmp_path / "out"))
    assert code == 0, f"{out[-3000:]}\n{err[-3000:]}"
    report = json.loads(out.strip().splitlines()[-1])
    rows = report["tokens_per_rank"]
    assert report["parity"] == "ok" and report["rel_diff"] <= 1e-5 and sum(rows) == report["tokens"]
    if split == "3,1":
        assert rows == shard_sizes(report["tokens"], 2, (3, 1))


@pytest.mark.timeout(2 * LIMIT_S + 30)
def test_torchrun_shard_gives_the_replicate_latents(tmp_path):
    """--dit-weights shard with one rank per process: each process keeps its rank's share of the
    block weights and gathers through the process group; latents bit-identical to replicate."""
    from safetensors.torch import load_file
    reports, latents = {}, {}
    for mode in ("replicate", "shard"):
        code, out, err = torchrun(2, *TINY, "--dit-weights", mode, "--cache", str(tmp_path / "cache"),
                                  "--out", str(tmp_path / mode))
        assert code == 0, f"{out[-3000:]}\n{err[-3000:]}"
        reports[mode] = json.loads(out.strip().splitlines()[-1])
        latents[mode] = load_file(str(tmp_path / mode / "latents.safetensors"))
    assert reports["shard"]["parity"] == "ok" and reports["shard"]["dit_weights"] == "shard"
    assert all(torch.equal(latents["shard"][k], latents["replicate"][k]) for k in latents["replicate"])
    assert all(s < f for s, f in zip(reports["shard"]["dit_weight_bytes_per_rank"],
                                      reports["replicate"]["dit_weight_bytes_per_rank"]))
    assert all(g > 0 for g in reports["shard"]["dit_gathered_bytes_per_step"])


# ----------------------------------------------------------------------------- a lost peer

def _start_ranks(tmp_path, *extra):
    """Two rank processes with torchrun's variables set by hand, so the test owns their pids."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "COMFYUI_MULTI_DEVICE_TIMEOUT_S": "60"}
        cmd = [sys.executable, str(REPO / "minimax_h3_parallel.py"), "run", *TINY, "--steps", "1000",
               "--no-reference", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "out"), *extra]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, start_new_session=True))
    return procs


def _kill_rank_1_while_sampling(procs):
    survivor, victim = procs
    for line in survivor.stdout:  # rank 0 prints the sequence line just before sampling
        if line.startswith("[sequence]"):
            break
    else:
        pytest.fail(f"rank 0 ended before sampling: {survivor.stderr.read()[-2000:]}")
    time.sleep(0.5)
    victim.kill()
    victim.wait(10)
    try:
        _, err = survivor.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(survivor.pid, signal.SIGKILL)
        pytest.fail("the surviving rank did not stop after its peer was killed")
    return survivor.returncode, err


@pytest.mark.timeout(LIMIT_S)
def test_a_killed_peer_leaves_one_clean_error_line_and_a_nonzero_exit(tmp_path):
    code, err = _kill_rank_1_while_sampling(_start_ranks(tmp_path))
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err, err
    ours = [line for line in lines if line.startswith("minimax_h3_parallel.py run: rank 0 of 2 stops:")]
    assert len(ours) == 1 and "--debug shows the traceback" in ours[0], err


@pytest.mark.timeout(LIMIT_S)
def test_debug_shows_the_traceback_of_a_lost_peer(tmp_path):
    code, err = _kill_rank_1_while_sampling(_start_ranks(tmp_path, "--debug"))
    assert code != 0 and "Traceback" in err, err
