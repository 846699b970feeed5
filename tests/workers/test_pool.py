"""Ranks as processes (comfy/multidevice/workers/): this test process is rank 0, the workers are
real processes over gloo. Exact against one device and against the rank threads; a worker
killed with SIGKILL fails the next forward naming its rank, and the forward after it (a fresh
pool) is exact again; a recipe that cannot be followed is refused on every rank."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import pytest
import torch

from comfy.multidevice.comm.compression import STEP_REL_ERROR_BOUND
from comfy.multidevice.miniature.h3 import build_miniature, save_miniature
from comfy.multidevice.sp.plan import shard_sizes
from comfy.multidevice.sp.strategies import SPMode
from comfy.multidevice.workers.door import RendezvousError
from comfy.multidevice.workers.pool import enable_sequence_parallel_workers, WorkerPool, WorkerPoolError
from comfy.multidevice.workers.recipe import ModelRecipe, RecipeError
from tests.helpers import comfy_cancel_stand_ins, free_port, Interrupted
from tests.sp_cases import FOUR_HEADS, FP32_TOL, frobenius_rel, make_inputs, rel_diff, run_sp, tiny_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = tiny_model(seed=3)
    path = tmp_path_factory.mktemp("workers") / "tiny.safetensors"
    save_miniature(model, path)
    return model, path


@pytest.fixture(scope="module")
def plain(checkpoint):
    """The "plain" layout's inputs and the one-device forward of the checkpoint's model on them."""
    model, _ = checkpoint
    inputs = make_inputs("plain")
    with torch.inference_mode():
        return inputs, model(inputs[0], inputs[1], inputs[2], **inputs[3])


def recipe(path) -> ModelRecipe:
    return ModelRecipe("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint",
                       {"path": str(path)})


@pytest.mark.parametrize("world", [2, 3])
def test_workers_match_one_device_and_the_rank_threads(checkpoint, world):
    model, path = checkpoint
    dit = enable_sequence_parallel_workers(["cpu"] * world, recipe(path))
    try:
        for case in ("plain", "cond_refs", "masked"):
            x, t, ctx, kw = make_inputs(case)
            with torch.inference_mode():
                reference = model(x, t, ctx, **kw)
            out = dit(x, t, ctx, **kw)
            threads, _, _ = run_sp(model, world, "peer", case)
            assert rel_diff(out, reference) <= FP32_TOL, case
            # the same algorithm, but the workers run cores // W intra-op threads and the rank
            # threads another count: sums may come out in another order (seen on AMD EPYC)
            assert rel_diff(out, threads) <= FP32_TOL, case
        assert dit.pool.start_seconds > 0
        assert all(0 < n < 1 << 20 for n in dit.pool.bytes_sent_per_forward)  # the inputs only
    finally:
        dit.close()


@pytest.mark.parametrize("world, split, sharded", [(2, "3,1", False), (3, "auto", False), (3, "1,4.5,2", False),
                                                  (2, "auto", True)])
def test_workers_with_an_uneven_split_match_one_device(checkpoint, world, split, sharded):
    """Mixed cards: the split travels in the build message (a wire record, not a pickle) and
    every rank cuts the same uneven rows; exact against one device like the even split (with
    sharded block weights too: auto's probe runs block 0 on its gathered weights)."""
    model, path = checkpoint
    made = sharded_recipe(path) if sharded else recipe(path)
    dit = enable_sequence_parallel_workers(["cpu"] * world, made, sp_mode="auto", split=split)
    try:
        for case in ("plain", "masked"):
            x, t, ctx, kw = make_inputs(case)
            with torch.inference_mode():
                reference = model(x, t, ctx, **kw)
            assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL, case
        rows = dit.pool.setup.plan.sizes
        if split != "auto":
            assert rows == shard_sizes(sum(rows), world, [float(w) for w in split.split(",")])
        assert dit.pool.setup.weights is not None and len(dit.pool.setup.weights) == world
    finally:
        dit.close()


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_workers_hold_their_blocks_only_and_match_one_device(checkpoint, world):
    """dit_weights="shard" with ranks as processes: every rank (rank 0 here included) keeps the
    non-block weights and its own block tensors, and gathers the rest over the process group
    as each block runs; bit for bit what the replicated workers compute (the gathered tensors
    are the owners' bytes), within FP32_TOL of one device."""
    from comfy.multidevice.weights.block_shards import block_tensors
    model, path = checkpoint
    dit = enable_sequence_parallel_workers(["cpu"] * world, sharded_recipe(path))
    replicated = enable_sequence_parallel_workers(["cpu"] * world, recipe(path))
    try:
        for case in ("plain", "masked"):
            x, t, ctx, kw = make_inputs(case)
            with torch.inference_mode():
                reference = model(x, t, ctx, **kw)
            out = dit(x, t, ctx, **kw)
            assert rel_diff(out, reference) <= FP32_TOL, case
            assert all(torch.equal(a, b) for a, b in zip(out, replicated(x, t, ctx, **kw))), case
            dit(x, t, ctx, **kw)  # the replicated pool replaced this one: a fresh sharded pool
        weights = dit.pool.rank0_weights
        held = sum(t.numel() for block in dit.pool.model.blocks for t in block_tensors(block).values())
        total = sum(t.numel() for block in model.blocks for t in block_tensors(block).values())
        assert weights is not None and held == weights.family.plan.owned_bytes(0) // 4  # fp32
        assert held < total * (1 / world + 0.25), (held, total)  # about 1/W of the blocks
        assert sum(weights.family.gathered_bytes) > 0
        assert weights.family.lane is not None  # the next block's gather overlapped this one's work
    finally:
        dit.close()
        replicated.close()


def test_a_killed_worker_fails_the_forward_naming_its_rank_and_the_next_pool_is_exact(checkpoint, plain):
    _, path = checkpoint
    (x, t, ctx, kw), reference = plain
    dit = enable_sequence_parallel_workers(["cpu"] * 3, recipe(path), timeout_s=60)
    try:
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL
        victim = dit.pool.workers[1]  # rank 2
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.wait()
        start = time.monotonic()
        with pytest.raises(WorkerPoolError, match=r"rank 2 \(pid \d+\) was killed by signal 9"):
            dit(x, t, ctx, **kw)
        assert time.monotonic() - start < 20  # the closed connection, not the 60 s timeout
        assert victim.process.poll() is not None
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL  # a fresh pool
    finally:
        dit.close()


def test_a_recipe_that_cannot_be_followed_is_refused_on_every_rank(checkpoint):
    _, path = checkpoint
    bad = ModelRecipe("comfy.multidevice.workers.recipe", "no_such_builder", {"path": str(path)})
    pool = WorkerPool(["cpu"] * 2, bad)
    with pytest.raises(RecipeError, match=r"rank 0 on \S+ \(pid \d+\): RecipeError: model recipe "
                                          r".*no_such_builder cannot be found.*rank 1 on \S+(?: \[127\.0\.0\.1\])? \(pid \d+\): "
                                              r"RecipeError"):
        pool.start()
    assert all(w.process.poll() is not None for w in pool.workers) or not pool.workers


def test_a_fixed_rendezvous_port_is_the_door_and_a_taken_one_fails_before_any_process_starts(checkpoint, plain):
    """One port for a firewall to name (the door: workers, their store, join commands); a port
    in use fails naming it and the fix, before any worker process starts."""
    _, path = checkpoint
    (x, t, ctx, kw), reference = plain
    port = free_port()
    with WorkerPool(["cpu"] * 2, recipe(path), port=port, timeout_s=60) as pool:
        assert pool.rendezvous.port == port
        assert rel_diff(pool.forward(x, t, ctx, **kw), reference) <= FP32_TOL
    taken = free_port()
    with socket.create_server(("127.0.0.1", taken)):
        with pytest.raises(RendezvousError, match=rf"cannot serve the worker rendezvous on 127.0.0.1:{taken} "
                                                  r".*COMFYUI_MULTI_DEVICE_RENDEZVOUS"):
            WorkerPool(["cpu"] * 2, recipe(path), port=taken, timeout_s=60)


def test_bad_arguments_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"at least 2 ranks, got 1 device\(s\) and 0 remote"):
        WorkerPool(["cpu"], ModelRecipe("m", "f"))
    with pytest.raises(ValueError, match="bogus"):
        WorkerPool(["cpu"] * 2, ModelRecipe("m", "f"), sp_mode="bogus")


def test_a_hung_worker_fails_the_forward_within_the_timeout_and_is_killed(checkpoint, plain):
    _, path = checkpoint
    (x, t, ctx, kw), reference = plain
    dit = enable_sequence_parallel_workers(["cpu"] * 2, recipe(path), timeout_s=8)  # a start fits it when busy
    try:
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL
        hung = dit.pool.workers[0]
        os.kill(hung.process.pid, signal.SIGSTOP)  # alive, never answering
        start = time.monotonic()
        with pytest.raises(WorkerPoolError, match=r"Timed out .*rank 1 \(pid \d+\) still runs"):
            dit(x, t, ctx, **kw)
        assert time.monotonic() - start < 8 + 10
        assert hung.process.poll() is not None  # killed, not left holding its card
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL
    finally:
        dit.close()


def sharded_recipe(path) -> ModelRecipe:
    return ModelRecipe("comfy.multidevice.workers.recipe", "miniature_shard_from_shared_checkpoint",
                       {"path": str(path)}, sharded=True)


@pytest.mark.parametrize("dit_weights", ["replicate", "shard"])
def test_comfyuis_cancel_stops_every_rank_at_the_same_block_and_the_pool_stays_up(checkpoint, plain, monkeypatch,
                                                                                dit_weights):
    """A stand-in for ComfyUI's model_management: its Cancel flag goes up as block 1 starts.
    With shard, the block gathers prefetched on their own group stay paired across the cancel."""
    import types
    _, path = checkpoint
    (x, t, ctx, kw), reference = plain

    class Interrupted(Exception):
        pass

    checks = {"n": 0, "armed": False}
    fake = types.ModuleType("comfy.model_management")

    def processing_interrupted():
        checks["n"] += 1
        return checks["armed"] and checks["n"] == 2  # the check of block 1

    def throw_exception_if_processing_interrupted():
        if checks["armed"]:
            checks["armed"] = False
            raise Interrupted()

    fake.processing_interrupted = processing_interrupted
    fake.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    fake.InterruptProcessingException = Interrupted
    monkeypatch.setitem(sys.modules, "comfy.model_management", fake)
    made = sharded_recipe(path) if dit_weights == "shard" else recipe(path)
    dit = enable_sequence_parallel_workers(["cpu"] * 3, made, timeout_s=60)
    try:
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL
        pids = [w.process.pid for w in dit.pool.workers]
        checks.update(n=0, armed=True)
        with pytest.raises(Interrupted):
            dit(x, t, ctx, **kw)
        assert dit.pool.cancelled_at == [2]  # seen as block 1 starts, every rank stops as block 2 starts
        assert [w.process.pid for w in dit.pool.workers] == pids and all(
            w.process.poll() is None for w in dit.pool.workers)
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL  # the same pool, in step
    finally:
        dit.close()


@pytest.mark.parametrize("pressed_in", [0, 1])
def test_a_cancel_pressed_inside_a_block_keeps_the_pool(checkpoint, plain, monkeypatch, pressed_in):
    """ComfyUI's ops check the Cancel flag at every layer (comfy.ops.run_every_op): pressed while
    rank 0 is inside block 0 (after its exchange), it is not raised there (the workers would be
    left in a collective) but seen as block 1 starts; every rank stops as block 2 starts, the
    same workers serve the next forward, exact. Pressed inside block 1, it is seen as the last
    block (2) starts and every rank stops after it, at the forward's end (3). Stand-ins for
    ComfyUI's two modules."""
    _, path = checkpoint
    (x, t, ctx, kw), reference = plain
    state = comfy_cancel_stand_ins(monkeypatch)
    ops = sys.modules["comfy.ops"]
    ops_check = ops.run_every_op
    dit = enable_sequence_parallel_workers(["cpu"] * 3, recipe(path), timeout_s=60)
    try:
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL
        pids = [w.process.pid for w in dit.pool.workers]
        pressed = {"armed": True}

        def press_cancel_then_check(module, args):  # rank 0's block MLP: a layer like ComfyUI's ops
            if pressed.pop("armed", False):
                state["flag"] = True
            sys.modules["comfy.ops"].run_every_op()
        hook = dit.pool.model.blocks[pressed_in].mlp.register_forward_pre_hook(press_cancel_then_check)
        with pytest.raises(Interrupted):
            dit(x, t, ctx, **kw)
        assert dit.pool.cancelled_at == [pressed_in + 2] and not state["flag"]  # seen as the next block starts
        assert [w.process.pid for w in dit.pool.workers] == pids and all(
            w.process.poll() is None for w in dit.pool.workers)
        assert rel_diff(dit(x, t, ctx, **kw), reference) <= FP32_TOL  # the same pool, in step
        hook.remove()
    finally:
        dit.close()
    assert ops.run_every_op is ops_check  # ComfyUI's check is back


def test_a_new_pool_replaces_the_last_and_the_last_ones_owner_starts_afresh(checkpoint, plain):
    """One default process group per process: starting a pool closes the one before it (the node
    ran again); the older WorkersDiT then starts a fresh pool at its next call, exact."""
    _, path = checkpoint
    (x, t, ctx, kw), reference = plain
    first, second = (enable_sequence_parallel_workers(["cpu"] * 2, recipe(path)) for _ in range(2))
    try:
        assert rel_diff(first(x, t, ctx, **kw), reference) <= FP32_TOL
        old = first.pool
        assert rel_diff(second(x, t, ctx, **kw), reference) <= FP32_TOL
        assert not old.running and not old.workers  # closed: its workers stopped
        assert rel_diff(first(x, t, ctx, **kw), reference) <= FP32_TOL
    finally:
        first.close()
        second.close()


def slow_miniature(path: str, seconds: float, slow: str, rank0_pid: int, device="cpu"):
    """The miniature DiT after `seconds` of waiting in the workers (slow="workers") or in rank 0
    (slow="rank0"): a load that takes longer than the collective timeout."""
    from comfy.multidevice.workers.recipe import miniature_from_shared_checkpoint
    if (os.getpid() == rank0_pid) == (slow == "rank0"):
        time.sleep(seconds)
    return miniature_from_shared_checkpoint(path, device=device)


@pytest.mark.parametrize("slow", ["workers", "rank0"])
def test_a_load_longer_than_the_collective_timeout_starts_the_pool(checkpoint, plain, monkeypatch, slow):
    """Each worker says on its live link when its DiT is built and rank 0 waits for those lines
    (no collective is open meanwhile), then says go: a load of 3x the collective timeout on
    either side starts the pool, exact."""
    from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
    monkeypatch.setenv(TRUSTED_MODULES_ENV, __name__)  # the workers inherit it
    _, path = checkpoint
    (x, t, ctx, kw), reference = plain
    from comfy.multidevice.workers import pool as pool_module
    shown = []
    monkeypatch.setattr(pool_module, "executing_node_text", lambda: shown.append)  # the sampler node's text
    made = ModelRecipe(__name__, "slow_miniature", {"path": str(path), "seconds": 9.0, "slow": slow,
                                                    "rank0_pid": os.getpid()})
    pool = WorkerPool(["cpu"] * 3, made, timeout_s=3).start()
    try:
        assert pool.start_seconds >= 9.0
        assert rel_diff(pool.forward(x, t, ctx, **kw), reference) <= FP32_TOL
    finally:
        pool.close()
    assert shown[0] == "starting 2 worker(s) for the DiT: 0/2 loaded"
    assert [s.split(" (")[0] for s in shown[1:]] == [f"starting 2 worker(s) for the DiT: {k}/2 loaded" for k in (1, 2)]


def test_a_worker_that_dies_while_loading_fails_the_start_naming_it(checkpoint, monkeypatch):
    """No collective is open while the workers load: a worker killed then is seen by its exit
    (or its closed live link), not after a timeout, and named."""
    from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
    monkeypatch.setenv(TRUSTED_MODULES_ENV, __name__)
    _, path = checkpoint
    made = ModelRecipe(__name__, "slow_miniature", {"path": str(path), "seconds": 60.0, "slow": "workers",
                                                    "rank0_pid": os.getpid()})
    pool = WorkerPool(["cpu"] * 3, made, timeout_s=120)
    failed = {}

    def start():
        try:
            pool.start()
        except WorkerPoolError as exc:
            failed["error"] = str(exc)
    starting = __import__("threading").Thread(target=start, daemon=True)
    starting.start()
    deadline = time.monotonic() + 60
    while len(pool.workers) < 2 or pool.admission is None or pool.admission.missing():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.0)  # they load now
    victim = pool.workers[1].process.pid
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    starting.join(60)
    assert time.monotonic() - killed < 30  # not the 60 s load nor the 120 s timeout
    assert f"rank 2 (pid {victim})" in failed["error"] and not pool.running


def test_cancel_while_the_workers_load_stops_them_and_ends_the_prompt_interrupted(checkpoint, monkeypatch):
    import threading
    import types
    from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
    monkeypatch.setenv(TRUSTED_MODULES_ENV, __name__)
    _, path = checkpoint

    class Interrupted(BaseException):
        pass

    state = {"flag": False}
    mm = types.ModuleType("comfy.model_management")
    mm.processing_interrupted = lambda: state["flag"]

    def throw_exception_if_processing_interrupted():
        if state["flag"]:
            state["flag"] = False
            raise Interrupted()
    mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    mm.InterruptProcessingException = Interrupted
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    made = ModelRecipe(__name__, "slow_miniature", {"path": str(path), "seconds": 60.0, "slow": "workers",
                                                    "rank0_pid": os.getpid()})
    pool = WorkerPool(["cpu"] * 3, made, timeout_s=120)
    ended = {}

    def start():
        try:
            pool.start()
        except Interrupted:
            ended["interrupted"] = True
    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    deadline = time.monotonic() + 60
    while len(pool.workers) < 2 or pool.admission is None or pool.admission.missing():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    processes = [w.process for w in pool.workers]
    time.sleep(1.0)
    state["flag"] = True  # the user pressed Cancel while the workers load
    starting.join(30)
    assert ended == {"interrupted": True} and not state["flag"] and not pool.running
    assert all(p.poll() is not None for p in processes)  # stopped, not left loading


def test_the_live_pool_is_closed_the_ordinary_way_at_exit(monkeypatch):
    """ComfyUI's exit (Ctrl-C included) closes the live pool from an exit handler, before Python
    tears objects down in no particular order."""
    import types
    from comfy.multidevice.workers import pool as pool_module
    closed = []
    live = types.SimpleNamespace(running=True, close=lambda: closed.append(1))
    monkeypatch.setitem(pool_module._live, "pool", live)
    pool_module._close_at_exit()
    assert closed == [1] and "pool" not in pool_module._live
    pool_module._close_at_exit()  # nothing left: nothing to do
    assert closed == [1]


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
@pytest.mark.parametrize("world", [2, 4])
def test_int8_exchange_travels_to_the_workers_within_its_bound(tmp_path, world, mode):
    """exchange_precision=int8 rides the build message (an SPMode record): the workers' output is
    within the documented bound of the exact rank threads, and not equal to it (it was applied).
    4 heads, so ulysses is plain Ulysses (all-to-alls of q, k, v and the output) at W = 2 and 4."""
    model, path = build_miniature(FOUR_HEADS, seed=5), tmp_path / "four_heads.safetensors"
    save_miniature(model, path)
    x, t, ctx, kw = make_inputs("plain")
    exact, _, _ = run_sp(model, world, "peer", "plain", sp_mode=mode)
    dit = enable_sequence_parallel_workers(["cpu"] * world, recipe(path), SPMode(mode, exchange_precision="int8"))
    try:
        out = dit(x, t, ctx, **kw)
    finally:
        dit.close()
    error = frobenius_rel(out, exact)
    assert 0 < error <= STEP_REL_ERROR_BOUND["int8"], error
