"""Ranks as processes against an outside audit's findings, on one server (the default set-up:
no COMFYUI_MULTI_DEVICE_* variable): nothing listens beyond loopback, a stranger who reaches the
door or the store neither joins nor changes the result, an idle pool outlives the collective
timeout, a start that fails leaves no pool marked running, and a pool the next prompt does
not use is stopped. Exact against one device (fp32, FP32_TOL of max |reference|)."""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import re
import socket
import subprocess
import threading
import time

import pytest
import torch

from comfy.multidevice.miniature.h3 import save_miniature
from comfy.multidevice.workers import admission, control, pool as pool_module
from comfy.multidevice.workers.admission import AdmissionError
from comfy.multidevice.workers.door_client import RankLink
from comfy.multidevice.workers.pool import stop_unused_pool, WorkerPool, WorkerPoolError
from comfy.multidevice.workers.recipe import ModelRecipe, RecipeError
from tests.sp_cases import FP32_TOL, make_inputs, rel_diff, tiny_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model(seed=5)
    path = tmp_path_factory.mktemp("hardening") / "tiny.safetensors"
    save_miniature(model, path)
    inputs = make_inputs("plain")
    with torch.inference_mode():
        reference = model(inputs[0], inputs[1], inputs[2], **inputs[3])
    return path, inputs, reference


def _recipe(path) -> ModelRecipe:
    return ModelRecipe("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint", {"path": str(path)})


def _forward(pool, inputs):
    x, t, ctx, kw = inputs
    return pool.forward(x, t, ctx, **kw)


class _Marker:
    """Unpickled, it would create its file: a harmless stand-in for a stranger's code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def marker_pickle(path) -> bytes:
    return pickle.dumps(_Marker(path))


def _listeners(pids: set[int]) -> list[str]:
    """The local addresses the processes `pids` listen on (TCP)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines()
            if any(int(p) in pids for p in re.findall(r"pid=(\d+)", line))]


def test_a_default_pool_listens_on_loopback_only_and_binds_gloo_there(checkpoint):
    path, inputs, reference = checkpoint
    with WorkerPool(["cpu"] * 3, _recipe(path), timeout_s=60) as pool:
        assert rel_diff(_forward(pool, inputs), reference) <= FP32_TOL
        pids = {os.getpid(), *(w.process.pid for w in pool.workers)}
        listening = _listeners(pids)
        # the door, the store behind it and gloo's listeners of every rank
        assert len(listening) >= 3, listening
        assert all(a.startswith("127.0.0.1:") for a in listening), listening
        for worker in pool.workers:  # whatever the host name resolves to (Docker: the LAN address)
            environ = open(f"/proc/{worker.process.pid}/environ", "rb").read().split(b"\0")
            assert b"GLOO_SOCKET_IFNAME=lo" in environ
            assert not any(pool.admission.key.hex().encode() in item for item in environ)  # the key: stdin only
            cmdline = open(f"/proc/{worker.process.pid}/cmdline", "rb").read()
            assert pool.admission.key.hex().encode() not in cmdline


def test_a_stranger_at_the_door_or_the_store_neither_joins_nor_changes_the_result(checkpoint, caplog, tmp_path):
    """The audit's stranger took the last rank of the next pool (reading `generation` from the
    store) and, once joined, sent pickles to every rank and changed the result; now it is
    refused at the door, named by address, and cannot name the pool's store keys."""
    path, inputs, reference = checkpoint
    marker = tmp_path / "marker"
    payload = marker_pickle(marker)
    pool = WorkerPool(["cpu"] * 2, _recipe(path), timeout_s=60)
    door = pool.rendezvous
    stop = threading.Event()
    tries = {"refused": 0, "admitted": 0}

    def stranger():
        import torch.distributed as dist
        store = dist.TCPStore("127.0.0.1", door.store_port, is_master=False, timeout=datetime.timedelta(seconds=5))
        while not stop.is_set():
            generation = door.generation + 1
            # the old way in: the old store keys of the next pool, and a pickle that would run code
            store.set(f"pool{generation}/world", "2")
            store.set("generation", "999")
            store.set(f"pool{generation}/0", payload)
            try:
                with socket.create_connection(("127.0.0.1", door.port)) as conn:
                    conn.sendall(payload + b"\n")
            except OSError:
                pass
            try:
                RankLink("127.0.0.1", door.port, os.urandom(32), 1, max(1, door.generation)).close()
                tries["admitted"] += 1
            except AdmissionError:
                tries["refused"] += 1
            except OSError:
                pass
            time.sleep(0.01)

    thread = threading.Thread(target=stranger, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="comfy.multidevice.workers.door"):
            for _ in range(2):  # a first pool and the next one (a LoRA change, a failure)
                pool.start()
                assert rel_diff(_forward(pool, inputs), reference) <= FP32_TOL
                assert sorted(pool.admission.members) == [1]  # the real worker only
                pool.close()
                pool = WorkerPool(["cpu"] * 2, _recipe(path), timeout_s=60)
    finally:
        stop.set()
        thread.join(10)
        pool.close()
    assert tries["refused"] >= 1 and tries["admitted"] == 0
    assert not marker.exists()  # no process unpickled the stranger's bytes
    assert "refused 127.0.0.1:" in caplog.text and "does not prove the pool's secret" in caplog.text


def test_an_idle_pool_outlives_the_collective_timeout(checkpoint):
    path, inputs, reference = checkpoint
    # 6 s: the start's own collectives (rank 0 builds while the workers wait) fit it on a busy machine
    with WorkerPool(["cpu"] * 2, _recipe(path), timeout_s=6) as pool:
        assert rel_diff(_forward(pool, inputs), reference) <= FP32_TOL
        time.sleep(13)  # idle for more than twice the collective timeout
        assert rel_diff(_forward(pool, inputs), reference) <= FP32_TOL
        assert all(not w.ended() for w in pool.workers)


def test_a_malformed_status_is_a_named_error_and_leaves_no_pool_running(checkpoint, monkeypatch):
    path, _, _ = checkpoint
    real = control.ControlChannel.statuses

    def malformed(self, status):
        real(self, status)  # every rank takes part in the collective
        return [status, ("no", "pid")]

    monkeypatch.setattr(control.ControlChannel, "statuses", malformed)
    pool = WorkerPool(["cpu"] * 2, _recipe(path), timeout_s=30)
    with pytest.raises(WorkerPoolError, match="failed during starting the pool"):
        pool.start()
    assert not pool.running and pool.workers == []


def test_a_pool_the_next_prompt_does_not_use_is_stopped_saying_why(checkpoint, caplog):
    path, inputs, reference = checkpoint
    pool = WorkerPool(["cpu"] * 3, _recipe(path), timeout_s=60).start()
    processes = [w.process for w in pool.workers]
    assert rel_diff(_forward(pool, inputs), reference) <= FP32_TOL
    with caplog.at_level(logging.INFO, logger=pool_module.__name__):
        said = stop_unused_pool("the workflow switched to threads")
    assert all(p.poll() is not None for p in processes)  # both workers ended
    assert not pool.running
    assert said == "stopped the worker pool's 2 rank(s) in other processes: the workflow switched to threads"
    assert said in caplog.text  # the node shows the same line in the page (tests/test_progress.py)
    assert not stop_unused_pool("again")  # nothing left to stop


def test_a_cluster_secret_is_needed_before_any_process_starts(checkpoint, monkeypatch):
    path, _, _ = checkpoint
    monkeypatch.delenv(admission.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(admission.SECRET_ENV, raising=False)
    with pytest.raises(admission.SecretError, match="COMFYUI_MULTI_DEVICE_SECRET_FILE"):
        WorkerPool(["cpu"] * 2, _recipe(path), remote=1, address="127.0.0.1", port=0, timeout_s=30)


def test_a_dit_file_replaced_at_the_same_path_is_refused_naming_it_and_the_rank(checkpoint, tmp_path):
    """The audit replaced the DiT file after rank 0 had loaded it: the workers loaded the new
    one, the result was wrong without an error. Now every worker checks rank 0's identity of
    the file (taken when the pool was made) before it builds."""
    path, _, _ = checkpoint
    mine = tmp_path / "dit.safetensors"
    mine.write_bytes(path.read_bytes())
    pool = WorkerPool(["cpu"] * 2, _recipe(mine), timeout_s=60)  # rank 0's identity: now
    save_miniature(tiny_model(seed=6), tmp_path / "other.safetensors")  # other weights, same layout
    os.replace(tmp_path / "other.safetensors", mine)
    with pytest.raises(RecipeError, match=rf"rank 1 on .*the DiT file at {re.escape(str(mine))} on rank 1 on "
                                          r".* differs from rank 0's in its .*sampled data"):
        pool.start()
    assert not pool.running and pool.workers == []


def test_ranks_admitted_early_wait_for_a_late_remote_rank_beyond_the_timeout(checkpoint, monkeypatch, tmp_path):
    """A local worker is admitted at once; the other server's rank comes when its user starts
    the join command, later than the collective timeout: the admitted ranks wait on the door,
    not in the store's rendezvous, and meet once every rank is admitted."""
    from comfy.multidevice.workers.join import serve_pools
    from tests.helpers import free_port
    path, inputs, reference = checkpoint
    secret = tmp_path / "pool.secret"
    secret.write_text(os.urandom(32).hex())
    monkeypatch.setenv(admission.SECRET_FILE_ENV, str(secret))
    port = free_port()
    pool = WorkerPool(["cpu"] * 2, _recipe(path), remote=1, address="127.0.0.1", port=port, timeout_s=6)
    started: dict = {}
    starting = threading.Thread(target=lambda: started.update(pool=pool.start()), daemon=True)
    starting.start()
    time.sleep(13)  # past twice the timeout before the other server's user starts its command
    joined: dict = {}
    join = threading.Thread(target=lambda: joined.update(code=serve_pools("127.0.0.1", port, 2, ["cpu"], 6, 1, pools=1)),
                            daemon=True)
    join.start()
    starting.join(120)
    try:
        assert started.get("pool") is pool and pool.running
        assert rel_diff(_forward(pool, inputs), reference) <= FP32_TOL
    finally:
        pool.close()
    join.join(60)
    assert joined.get("code") == 0
