"""Ranks as processes from a real server (COMFYUI_DIR, the pack installed by our installer): the
node's dit_ranks=processes starts one worker process per other card at the first step.

A tiny t2va prompt at 4 CPU cards with processes equals the same prompt at 1 card; a worker
killed with SIGKILL between prompts fails the next prompt naming its rank, and the prompt
after it (fresh workers) equals the 1-card prompt again; so does the prompt with
dit_weights=shard (each process holding its rank's block weights); so does one with the node's
split auto; one with sp_mode ulysses and exchange_precision int8 stays within the int8 bound of one card. On v0.33.0 sequence parallel is
refused by design (test_install_ways.py checks that), so this file skips there.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from comfy.multidevice.comm.compression import STEP_REL_ERROR_BOUND
from tests import comfyui_server
from tests.comfyui_server import request
from tests.e2e.test_install_ways import error_text, make_tree, MAX_LEVELS, run_prompt, saved_frames, t2va_prompt
from tests.e2e.test_install_ways import tiny_models  # noqa: F401 - a fixture


# The int8 exchange's decoded 8-bit frames against one card's, relative (Frobenius): measured
# 3e-4 (at most 1 level) on the tiny t2va prompt, 2 steps; bounded by the documented step bound of
# the latents (comm/compression.py). Exact modes: MAX_LEVELS.
INT8_FRAMES_REL = STEP_REL_ERROR_BOUND["int8"]


def prompt_with(prefix: str, seed: int, processes: bool, steps: int = 2, dit_weights: str | None = None) -> dict:
    """The tiny t2va prompt at 4 cards with processes (else at 1 card), sampled with `seed`: a
    new seed makes ComfyUI sample again instead of reusing the cached result."""
    prompt = t2va_prompt(4 if processes else 1, prefix)
    prompt["8"]["inputs"].update(seed=seed, steps=steps)
    if processes:
        prompt["5"]["inputs"]["dit_ranks"] = "processes"
    if dit_weights is not None:
        prompt["5"]["inputs"]["dit_weights"] = dit_weights
    return prompt


def wait_for_end(server, prompt_id: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, history = request(f"{server.url}/history/{prompt_id}")
        entry = (history or {}).get(prompt_id)
        if entry and entry.get("status", {}).get("completed") is not None:
            return entry
        time.sleep(0.2)
    raise AssertionError(f"prompt {prompt_id} did not end in {timeout_s} s")


def worker_pids(server_pid: int) -> list[int]:
    """The server's worker processes (children running comfy.multidevice.workers.worker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat[1]) == server_pid and b"comfy.multidevice.workers.worker" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


def test_processes_sample_like_one_card_and_a_killed_worker_fails_one_prompt_only(upstream, tiny_models,  # noqa: F811
                                                                                tmp_path):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_install_ways.py checks that)")
    tree = make_tree(upstream, tmp_path, "patch", tiny_models)
    server = comfyui_server.start(tree, tmp_path, args=("--cache-classic",))
    try:
        one = run_prompt(server, prompt_with("one_card", 7, processes=False))
        assert one["status"]["status_str"] == "success", error_text(one)
        reference = saved_frames(tree, "one_card")
        assert reference.std() > 1, "the frames are flat: the comparison would say nothing"

        with comfyui_server.NodeTexts(server) as texts:  # what the page shows on the nodes
            first = run_prompt(server, prompt_with("processes", 7, processes=True))
        starting = [text for node, text in texts.seen if text.startswith("starting 3 worker(s) for the DiT")]
        assert starting[0] == "starting 3 worker(s) for the DiT: 0/3 loaded" and "3/3 loaded" in starting[-1], \
            texts.seen  # the workers' start, apart from the sampler's progress bar
        assert first["status"]["status_str"] == "success", error_text(first) + server.log_text()[-3000:]
        assert np.abs(saved_frames(tree, "processes") - reference).max() <= MAX_LEVELS
        pids = worker_pids(server.process.pid)
        assert len(pids) == 3, pids  # cards 1-3; card 0 is the server itself
        assert "[rank 1]" in server.log_text()  # the workers' lines in ComfyUI's log, rank named

        os.kill(pids[1], signal.SIGKILL)
        failed = run_prompt(server, prompt_with("after_kill", 8, processes=True))
        assert failed["status"]["status_str"] == "error"
        assert "was killed by signal 9" in error_text(failed) and "rank 2" in error_text(failed), error_text(failed)
        assert not set(pids) & set(worker_pids(server.process.pid))  # every old worker is gone

        again = run_prompt(server, prompt_with("fresh_pool", 9, processes=True))
        assert again["status"]["status_str"] == "success", error_text(again)
        assert len(worker_pids(server.process.pid)) == 3  # a fresh pool
        # the workflow switched to rank threads at the same 4 cards: the node runs again and the
        # idle workers stop first, saying so on the node in the page and in the log
        threads = prompt_with("threads_9", 9, processes=True)
        threads["5"]["inputs"]["dit_ranks"] = "threads"
        with comfyui_server.NodeTexts(server) as texts:
            switched = run_prompt(server, threads)
        assert switched["status"]["status_str"] == "success", error_text(switched)
        said = ("stopped the worker pool's 3 rank(s) in other processes: the MultiNPUParallelConfig node ran again "
                "(the DiT on 4 card(s), ranks as threads)")
        assert ("5", said) in texts.seen, texts.seen
        assert said in server.log_text() and worker_pids(server.process.pid) == []
        run_prompt(server, prompt_with("one_card_9", 9, processes=False))
        assert np.abs(saved_frames(tree, "fresh_pool") - saved_frames(tree, "one_card_9")).max() <= MAX_LEVELS
        assert np.abs(saved_frames(tree, "threads_9") - saved_frames(tree, "one_card_9")).max() <= MAX_LEVELS

        # ComfyUI's Cancel in the middle of a 40-step sampling: the prompt ends interrupted, and
        # the next prompt runs on the same workers, exact: ComfyUI's per-layer check leaves the
        # flag to the pool's block starts (comfy_cancel.py), where every rank stops together.
        # (The node runs again after the 1-card prompt, so this prompt has a pool of its own.)
        status, answer = request(f"{server.url}/prompt", {"prompt": prompt_with("cancelled", 10, True, steps=40)})
        assert status == 200, answer
        deadline = time.monotonic() + 120
        while not re.search(r"\b[1-9]\d*/40\b", server.log_text()):  # the sampler's progress bar
            assert time.monotonic() < deadline, server.log_text()[-2000:]
            time.sleep(0.1)
        pids = worker_pids(server.process.pid)
        assert len(pids) == 3, pids
        request(f"{server.url}/interrupt", {})
        entry = wait_for_end(server, answer["prompt_id"])
        assert any(m[0] == "execution_interrupted" for m in entry["status"]["messages"]), entry["status"]
        assert "interrupted inside a block" not in server.log_text()
        after = run_prompt(server, prompt_with("after_cancel", 11, processes=True))
        assert after["status"]["status_str"] == "success", error_text(after)
        now = worker_pids(server.process.pid)
        assert now == pids, (now, pids)  # the same workers, none left behind
        run_prompt(server, prompt_with("one_card_11", 11, processes=False))
        assert np.abs(saved_frames(tree, "after_cancel") - saved_frames(tree, "one_card_11")).max() <= MAX_LEVELS

        # dit_weights=shard: every process (the server's rank 0 included) keeps 1/4 of the blocks
        sharded = run_prompt(server, prompt_with("sharded", 11, processes=True, dit_weights="shard"))
        assert sharded["status"]["status_str"] == "success", error_text(sharded) + server.log_text()[-3000:]
        assert "DiT shard of rank 0" in server.log_text()
        assert np.abs(saved_frames(tree, "sharded") - saved_frames(tree, "one_card_11")).max() <= MAX_LEVELS

        # mixed cards from the node's own input: split auto (each rank times a block at the first
        # step) is exact, as is any split
        auto = prompt_with("split_auto", 11, processes=True)
        auto["5"]["inputs"]["split"] = "auto"
        done = run_prompt(server, auto)
        assert done["status"]["status_str"] == "success", error_text(done) + server.log_text()[-3000:]
        assert "split auto: rank 0" in server.log_text(), server.log_text()[-3000:]
        assert np.abs(saved_frames(tree, "split_auto") - saved_frames(tree, "one_card_11")).max() <= MAX_LEVELS

        # a compressed exchange from the node's own input, Ulysses (16 heads over 4 cards: q, k, v
        # and the output cross as int8 records): not exact, its frames stay within INT8_FRAMES_REL
        # of one card's (the all-gather's int8 with uneven rows: tests/sp/test_strategies.py)
        compressed = prompt_with("ulysses_int8", 11, processes=True)
        compressed["5"]["inputs"].update(exchange_precision="int8", sp_mode="ulysses")
        done = run_prompt(server, compressed)
        assert done["status"]["status_str"] == "success", error_text(done) + server.log_text()[-3000:]
        assert "ulysses (int8 exchange)" in server.log_text()
        frames, one = saved_frames(tree, "ulysses_int8").astype(np.float64), saved_frames(tree, "one_card_11")
        rel = float(np.linalg.norm(frames - one) / np.linalg.norm(one))
        print(f"int8 exchange, frames against one card: {rel:.4f} relative (max {np.abs(frames - one).max():.0f} levels)")
        assert rel <= INT8_FRAMES_REL, rel  # int8 ran: the log line above
    finally:
        comfyui_server.stop(server)
