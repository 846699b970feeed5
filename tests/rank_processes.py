"""Run a worker in W real processes, one rank each, over comfy/multidevice/comm/torch_dist.py (gloo on CPU).

`run_rank_processes(world, "tests.some_module", "worker_name", tmp_path)` starts W processes;
each joins the process group, calls `worker_name(comm)` from that module and reports
`(status, payload)`; the result maps rank -> (status, payload). Hard limits: a join timeout
per run and a kill of every process still alive afterwards, so a test never hangs.

Processes start through a "forkserver" that has torch and the worker's module imported
already: each is a fork of a clean, single-threaded server, so starting one costs
milliseconds instead of a fresh torch import.
"""

import importlib
import multiprocessing as mp
import os
import queue
import time
import traceback

import torch

JOIN_TIMEOUT_S = 90


def _entry(rank, world, init, module_name, worker_name, results, env):
    """Process body: join the group, run the named worker, report (rank, status, payload)."""
    os.environ.update(env)
    torch.set_num_threads(1)  # W processes share 2 cores
    comm = None
    try:
        from comfy.multidevice.comm import torch_dist as multinode
        timeout_s = float(env["TEST_DIST_TIMEOUT_S"])
        if init == "env":
            comm = multinode.init_from_env(device="cpu", timeout_s=timeout_s)
        else:
            comm = multinode.init_process_group(rank, world, "cpu", init_method=init, timeout_s=timeout_s)
        worker = getattr(importlib.import_module(module_name), worker_name)
        results.put((rank, "ok", worker(comm)))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if comm is not None:
            comm.close()


def run_rank_processes(world, module_name, worker_name, tmp_path, init="file", env=None,
                       dist_timeout_s=60):
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "comfy.multidevice.comm.torch_dist", module_name])
    results = ctx.Queue()
    env = {"TEST_DIST_TIMEOUT_S": str(dist_timeout_s), **(env or {})}
    if init == "file":
        init = f"file://{tmp_path / 'rendezvous'}"
    procs = []
    for rank in range(world):
        rank_env = dict(env)
        if init == "env":
            rank_env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        procs.append(ctx.Process(target=_entry, daemon=True,
                                 args=(rank, world, init, module_name, worker_name, results, rank_env)))
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    out = {}
    try:
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
                out[rank] = (status, payload)
            except queue.Empty:
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
        grace = time.monotonic() + 10  # all reported: give the processes a moment to exit
        for p in procs:
            p.join(timeout=max(0.1, min(deadline, grace) - time.monotonic()))
    finally:
        for p in procs:  # never leave a process behind
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    missing = sorted(set(range(world)) - set(out))
    assert not missing, f"rank(s) {missing} reported nothing (exit codes {[p.exitcode for p in procs]})"
    return out


def payloads(out):
    """The payloads by rank, after checking that every rank succeeded."""
    errors = {r: p for r, (s, p) in out.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}: {p}" for r, p in errors.items())
    return [out[r][1] for r in sorted(out)]
