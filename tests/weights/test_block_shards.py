"""Sharded DiT block weights (`dit_weights="shard"`) against full replicas of the same model.

Tolerance: none. `shard` runs the same sequence-parallel computation as `replicate` with the
same tensors (gathered byte for byte from their owners) on equally aligned operands: here every
rank's weights are allocator blocks or a base packed on 64-byte lines, and a gathered tensor
sits in a 64-byte-aligned slot of the block's buffer (asserted: `all_on_64_byte_lines`). So the
same kernels run on the same layouts and the outputs must be bit-identical (`torch.equal`),
at W 2/3/4, fp32 and bf16, with and without prefetch, and with a LoRA, on any CPU. (Where the
two modes' operands sit at other alignments, e.g. views of a file whose tensors are not on
64-byte lines, some CPU kernels round differently: tests/upstream/test_dit_shards.py.)
"""

from __future__ import annotations

import contextlib
import logging
import threading

import pytest
import torch

from comfy.multidevice.comm import group
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.weights.block_shards import BlockShardError, BlockShardPlan, ShardedBlockWeights
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.replicas import RankReplicas
from tests.sp_cases import make_inputs, replicas, tiny_model


def run(models, world, dit_weights, cases=("plain", "masked", "tiny"), prefetch=True, backend="peer",
        forwards=2):
    outs = []
    with SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=30) as coord:
        sp = enable_sequence_parallel(models, coord, dit_weights=dit_weights, prefetch=prefetch)
        try:
            with torch.inference_mode():
                for case in cases:
                    x, t, ctx, kw = make_inputs(case)
                    outs.extend(sp(x, t, ctx, **kw) for _ in range(forwards))
        finally:
            sp.close()
    return outs, sp


def identical(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def all_on_64_byte_lines(models) -> bool:
    """Every weight of every rank's module starts on a 64-byte line (the bit-identity premise)."""
    return all(t.numel() == 0 or t.data_ptr() % 64 == 0 for m in models for t in m.state_dict().values())


def gathered_on_64_byte_lines(sp, rank=0, index=0) -> bool:
    family = sp.block_weights
    with SequenceParallelCoordinator(["cpu"] * family.world_size, backend="peer", timeout_s=30) as coord:
        gathered = coord.run(lambda r, comm: family.gather(r, comm, index)[0])[rank]
    return bool(gathered) and all(t.data_ptr() % 64 == 0 for t in gathered.values())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_shard_is_bit_identical_to_replicate(world, dtype):
    model = tiny_model(dtype, seed=2)
    ranks = replicas(model, world)
    assert all_on_64_byte_lines(ranks)
    ref, _ = run(ranks, world, "replicate")
    for prefetch in (True, False):
        out, sp = run(replicas(model, world), world, "shard", prefetch=prefetch)
        assert identical(out, ref), f"W={world} {dtype} prefetch={prefetch}"
        family = sp.block_weights
        total = sum(family.plan.block_bytes(i) for i in range(family.num_blocks))
        # every rank received exactly the block bytes it does not own, in every forward
        forwards = 3 * 2
        assert family.gathered_bytes == [forwards * (total - family.resident_bytes(r)) for r in range(world)]
        assert gathered_on_64_byte_lines(sp)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("kind", ["hccl", "nccl"])
def test_shard_over_a_card_library_gathers_on_the_rank_communicator(kind, world, request, monkeypatch, caplog):
    """HCCL and NCCL allow one collective per card at a time across all communicators: no
    prefetch lane (said once in the log), each block gathered on the rank's own communicator,
    exact, and the fake library saw no overlap (it would fail or record it; conftest.py)."""
    request.getfixturevalue(f"use_fake_{kind}")
    monkeypatch.setattr(group, "_no_lane_logged", set())
    model = tiny_model(seed=4)
    ref, _ = run(replicas(model, world), world, "replicate", cases=("plain",), backend=kind)
    with caplog.at_level(logging.INFO, logger=group.__name__):
        out, sp = run(replicas(model, world), world, "shard", cases=("plain",), backend=kind)
        run(replicas(model, world), world, "shard", cases=("plain",), backend=kind, forwards=1)
    assert identical(out, ref)
    assert sp.block_weights.lane is None
    said = [r.getMessage() for r in caplog.records if "no prefetch" in r.getMessage()]
    assert len(said) == 1 and f"with the {kind} backend" in said[0]


def test_peer_copy_keeps_its_prefetch_lane():
    """Peer-copy moves tensors with plain copies, no card library: the lane stays (and overlaps)."""
    model = tiny_model(seed=4)
    _, sp = run(replicas(model, 2), 2, "shard", cases=("plain",), forwards=1)
    assert isinstance(sp.block_weights.lane, SequenceParallelCoordinator)
    assert sp.block_weights.lane.backend_name == "peer"


@pytest.mark.parametrize("world", [2, 4])
def test_shard_with_a_lora_on_replicas_from_the_base(world):
    """LoRA deltas applied by the replica family on every rank, then sharded: owners send the
    patched weights, so `shard` equals `replicate` with the same LoRA (and differs from no LoRA)."""
    model = tiny_model(seed=5)
    base = SharedCheckpoint.from_state_dict(model.state_dict(), copy=True, label="tiny DiT")
    g = torch.Generator().manual_seed(9)
    targets = [n for n in model.state_dict() if n.startswith("blocks.") and n.endswith(("qkv_proj.weight", "fc2.weight"))]
    deltas = {}
    for name in targets:
        out_f, in_f = model.state_dict()[name].shape
        deltas[name] = torch.randn(out_f, 2, generator=g) @ torch.randn(2, in_f, generator=g) * 0.05

    def family(lora: bool):
        reps = RankReplicas(base, ["cpu"] * world, template=model, load=False)
        if lora:
            reps.add_patches(deltas, strength=0.8)
        reps.load()
        modules = [r.module for r in reps]
        assert all_on_64_byte_lines(modules)
        return modules

    plain, _ = run(family(False), world, "replicate", cases=("plain",))
    ref, _ = run(family(True), world, "replicate", cases=("plain",))
    out, _ = run(family(True), world, "shard", cases=("plain",))
    assert not identical(plain, ref)  # the LoRA changes the result
    assert identical(out, ref)


def test_resident_block_bytes_are_balanced_and_every_tensor_has_one_owner():
    model = tiny_model(seed=0)
    world = 4
    models = replicas(model, world)
    family = ShardedBlockWeights(models, lambda m: m.blocks, [torch.device("cpu")] * world)
    total = sum(family.plan.block_bytes(i) for i in range(family.num_blocks))
    largest = max(n for nb in family.plan.nbytes for n in nb.values())
    assert sum(family.resident_bytes(r) for r in range(world)) == total
    assert max(family.resident_bytes(r) for r in range(world)) <= total / world + largest
    for r, m in enumerate(models):
        for i, block in enumerate(m.blocks):
            for name, t in block.state_dict().items():
                owned = family.plan.owner[i][name] == r
                assert (t.numel() > 0) == owned or model.blocks[i].state_dict()[name].numel() == 0
                if owned:
                    assert torch.equal(t, model.blocks[i].state_dict()[name])
    # the non-block weights stay on every rank
    for m in models:
        assert torch.equal(m.final_layer.video_out.weight, model.final_layer.video_out.weight)


def test_gathered_weights_are_dropped_after_each_block():
    model = tiny_model(seed=1)
    models = replicas(model, 3)
    seen = []
    _, sp = run(models, 3, "shard", cases=("plain",), forwards=1)
    family = sp.block_weights
    for r, m in enumerate(models):
        for i, block in enumerate(m.blocks):
            for name, t in block.state_dict().items():
                if family.plan.owner[i][name] != r:
                    seen.append(t.numel())
    assert seen and all(n == 0 for n in seen)
    assert family._pending == {}


def test_balanced_plan_is_deterministic_and_spreads_whole_tensors():
    blocks = [{"a": 100, "b": 60, "c": 40}, {"a": 100, "b": 60, "c": 40}]
    plan = BlockShardPlan.balanced(blocks, 3)
    assert plan == BlockShardPlan.balanced(blocks, 3)
    # largest first to the least loaded: a, a -> ranks 0, 1; b, b -> rank 2; c, c -> ranks 0, 1
    assert [plan.owned_bytes(r) for r in range(3)] == [140, 140, 120]
    assert plan.names_of(0, plan.owner[0]["a"]) == [n for n in ("a", "b", "c") if plan.owner[0][n] == plan.owner[0]["a"]]
    with pytest.raises(ValueError, match="world_size"):
        BlockShardPlan.balanced(blocks, 0)


def test_tensors_that_go_together_get_one_owner():
    """A quantized layer's weight and bias are one unit (its loader rebuilds them as one)."""
    blocks = [{"w": 100, "bias": 10, "norm": 95}]
    alone = BlockShardPlan.balanced(blocks, 2)  # w -> 0, norm -> 1, bias -> 1 (the lighter)
    assert alone.owner[0]["w"] != alone.owner[0]["bias"]
    plan = BlockShardPlan.balanced(blocks, 2, together=[{"w": "lin", "bias": "lin"}])
    assert plan.owner[0]["w"] == plan.owner[0]["bias"] != plan.owner[0]["norm"]
    assert [plan.owned_bytes(r) for r in range(2)] == [110, 95]


class _Block(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.norm = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)


class _Tower(torch.nn.Module):
    def __init__(self, weights):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(w) for w in weights)


class _Lane:
    """A coordinator over the ranks used as the prefetch lane."""

    def __init__(self, world, backend="peer"):
        self.coordinator = SequenceParallelCoordinator(["cpu"] * world, backend=backend, timeout_s=30)

    def run(self, fn):
        return self.coordinator.run(fn)

    def close(self):
        self.coordinator.close()


def _two_tensor_blocks(two_tensor, world: int):
    """Three blocks whose weight is a TwoTensor (a flattenable subclass, as upstream's
    QuantizedTensor), one tower per rank, sharded: (originals, towers, family, rank views)."""
    g = torch.Generator().manual_seed(0)
    originals = [two_tensor.TwoTensor(torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g))
                 for _ in range(3)]
    towers = [_Tower([t.clone() for t in originals]) for _ in range(world)]
    family = ShardedBlockWeights(towers, lambda m: m.blocks, [torch.device("cpu")] * world, lane=_Lane(world))
    return originals, towers, family, [family.rank_view(r) for r in range(world)]


def _hold_rank_1(backend, method: str, call: int, until) -> None:
    """Rank 1's `call`-th library call of `backend`'s `method` waits for `until()` first (after
    the coordinator's own barrier, so rank 0's call is inside the library meanwhile)."""
    real, calls = getattr(backend, method), [0]

    def held(rank, *args):
        if rank == 1:
            calls[0] += 1
            if calls[0] == call:
                wait_for(until)
        return real(rank, *args)
    setattr(backend, method, held)


def wait_for(condition, limit_s: float = 30.0) -> None:
    import time
    deadline = time.monotonic() + limit_s
    while not condition():  # the threads it waits for are blocked inside the library
        assert time.monotonic() < deadline, "the two collectives never met on device 0"
        time.sleep(0.002)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["hccl", "nccl"])
def test_a_second_coordinator_as_lane_trips_the_fake_card_library(kind, request):
    """What the prefetch lane did with HCCL / NCCL before it was turned off for them: block 1's
    gather on the lane coordinator runs while the main one runs block 0's K/V exchange, both on
    device 0. Lined up so they meet inside the library: the fake HCCL fails the call, the fake
    NCCL records the violation (real NCCL would hang or corrupt)."""
    from comfy.multidevice.comm.hccl import HcclError
    from tests.fakes.violations import in_flight, take_nccl_violations
    path = request.getfixturevalue(f"use_fake_{kind}")
    counter = "fakeHcclInFlight" if kind == "hccl" else "fakeNcclInFlight"
    met = threading.Event()  # latched: once one held rank goes on, the count may drop again

    def both_on_device_0():
        if in_flight(path, counter, 0) == 2:
            met.set()
        return met.is_set()
    world = 2
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3, 5, generator=g) for _ in range(2)]
    towers = [_Tower([w.clone() for w in weights]) for _ in range(world)]
    lane = _Lane(world, backend=kind)
    family = ShardedBlockWeights(towers, lambda m: m.blocks, [torch.device("cpu")] * world, lane=lane)
    _hold_rank_1(lane.coordinator.backend, "_all_gather_v_flat", 2, both_on_device_0)  # block 1's gather
    with SequenceParallelCoordinator(["cpu"] * world, backend=kind, timeout_s=30) as coord:
        _hold_rank_1(coord.backend, "_all_reduce_flat", 1, both_on_device_0)  # block 0's "exchange"

        def forward(rank, comm):
            view = family.rank_view(rank)
            view.begin_forward()
            for i in range(2):
                view.bind(i, comm)  # binding block 0 sends block 1's gather to the lane
                comm.all_reduce(torch.ones(4))  # the block's collective on the main communicator
                view.release(i)
        if kind == "hccl":
            with pytest.raises(HcclError, match="two collectives overlap on one device"):
                coord.run(forward)
        else:
            coord.run(forward)
            assert any(v.startswith("device 0:") for v in take_nccl_violations(path))
    family.close()


def test_flattenable_tensor_subclasses_travel_as_their_inner_tensors():
    """Upstream's QuantizedTensor follows torch's __tensor_flatten__ protocol; so does TwoTensor."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    world = 2
    originals, towers, family, views = _two_tensor_blocks(two_tensor, world)
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        def forward(rank, comm):
            views[rank].begin_forward()
            got = []
            for i in range(3):
                views[rank].bind(i, comm)
                w = towers[rank].blocks[i].weight
                got.append((type(w.data), w.a.clone(), w.b.clone(), towers[rank].blocks[i].norm.clone()))
                views[rank].release(i)
            return got
        results = coord.run(forward)
    family.close()
    for got in results:
        for i, (cls, a, b, norm) in enumerate(got):
            assert cls is two_tensor.TwoTensor
            assert torch.equal(a, originals[i].a) and torch.equal(b, originals[i].b)
            assert torch.equal(norm, torch.arange(4.0))


def test_every_tensor_made_on_the_prefetch_stream_is_kept_for_the_compute_stream(monkeypatch):
    """On a card the gather runs on a side stream and release() drops the tensors while block i
    may still run: the flat buffer and the clones a quantized weight's rebuild made of its
    inner tensors must all be record_stream-ed on the compute stream, or the allocator hands
    their memory to block i + 2's prefetch (CARDS.md). Seen here through a stand-in card API."""
    from comfy.multidevice.weights import block_shards
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    recorded: list[tuple[int, str]] = []

    class Card:  # torch.cuda / torch.npu as bind() and the side-stream gather use them
        class Stream:
            def __init__(self, device):
                pass

            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        @staticmethod
        def stream(stream):
            return contextlib.nullcontext()

        @staticmethod
        def current_stream(device):
            return "compute"

    monkeypatch.setattr(block_shards, "accelerator_api", lambda kind: Card)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: recorded.append((self.untyped_storage().data_ptr(), stream)))
    world = 2
    _, towers, family, views = _two_tensor_blocks(two_tensor, world)
    unrecorded = []
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        def forward(rank, comm):
            views[rank].begin_forward()
            for i in range(3):
                views[rank].bind(i, comm)
                w = towers[rank].blocks[i].weight
                if family.plan.owner[i]["weight"] != rank:  # gathered: inner tensors are clones
                    unrecorded.extend(leaf for leaf in (w.a, w.b)
                                      if (leaf.untyped_storage().data_ptr(), "compute") not in recorded)
                views[rank].release(i)
        coord.run(forward)
    family.close()
    assert recorded and not unrecorded


def test_a_prefetch_stream_waits_for_the_compute_stream_before_each_gather(monkeypatch):
    """The side stream's gather reads the owners' tensors, which the compute stream may still be
    writing (a patched or moved weight): it must wait for that stream first. Stand-in card API."""
    from comfy.multidevice.weights import block_shards
    events: list[tuple[int, str]] = []

    class Card:
        class Stream:
            def __init__(self, device):
                pass

            def wait_stream(self, other):
                events.append((threading.get_ident(), f"wait {other}"))

            def synchronize(self):
                pass

        @staticmethod
        def stream(stream):
            return contextlib.nullcontext()

        @staticmethod
        def current_stream(device):
            return "compute"

    monkeypatch.setattr(block_shards, "accelerator_api", lambda kind: Card)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    real_gather = ShardedBlockWeights.gather
    monkeypatch.setattr(ShardedBlockWeights, "gather",
                        lambda self, rank, comm, index: (events.append((threading.get_ident(), "gather")),
                                                         real_gather(self, rank, comm, index))[1])
    world = 2
    towers = [_Tower([torch.full((3, 5), float(i)) for i in range(3)]) for _ in range(world)]
    lane = _Lane(world, backend="peer")
    family = ShardedBlockWeights(towers, lambda m: m.blocks, [torch.device("cpu")] * world, lane=lane)
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        def forward(rank, comm):
            view = family.rank_view(rank)
            view.begin_forward()
            for i in range(3):
                view.bind(i, comm)
                view.release(i)
        coord.run(forward)
    family.close()
    per_thread: dict = {}  # the lane's rank threads gather side by side: each in its own order
    for thread, event in events:
        per_thread.setdefault(thread, []).append(event)
    assert per_thread and all(seq == ["wait compute", "gather"] * (len(seq) // 2) for seq in per_thread.values()), events


def test_the_processes_lane_sets_its_device_in_the_thread_that_gathers(monkeypatch):
    """Ranks as processes gather the next block from the family's helper thread: that thread
    must make the rank's card current first (torch_npu opens card 0 for a thread that did not)."""
    from types import SimpleNamespace

    from comfy.multidevice.weights import block_shards
    calls = []
    monkeypatch.setattr(block_shards, "set_thread_device", lambda device: calls.append((device, threading.get_ident())))
    comm = SimpleNamespace(device=torch.device("cpu"), rank=1, world_size=3)
    lane = block_shards.OwnRankLane(comm)
    seen = {}

    def gather(rank, got):
        seen.update(rank=rank, thread=threading.get_ident(), calls=list(calls))
        return "block"
    helper = threading.Thread(target=lambda: seen.update(out=lane.run(gather)))
    helper.start()
    helper.join(10)
    assert seen["out"] == [None, "block", None] and seen["rank"] == 1
    assert seen["calls"] == [(comm.device, seen["thread"])]  # set before the gather, in its thread


def test_a_weight_whose_layout_changed_is_an_error_naming_it():
    towers = [_Tower([torch.randn(3, 5) for _ in range(2)]) for _ in range(2)]
    family = ShardedBlockWeights(towers, lambda m: m.blocks, [torch.device("cpu")] * 2)
    owner = family.plan.owner[0]["weight"]
    towers[owner].blocks[0].weight = torch.nn.Parameter(torch.randn(3, 6), requires_grad=False)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        with pytest.raises(BlockShardError, match="'weight' changed its layout"):
            coord.run(lambda rank, comm: family.rank_view(rank).bind(0, comm))


@pytest.mark.timeout(60)
def test_a_failing_gather_on_one_rank_does_not_hang_the_others(monkeypatch):
    model = tiny_model(seed=3)
    models = replicas(model, 4)
    x, t, ctx, kw = make_inputs("plain")
    with SequenceParallelCoordinator(["cpu"] * 4, backend="peer", timeout_s=20) as coord:
        sp = enable_sequence_parallel(models, coord, dit_weights="shard")
        real_pack = sp.block_weights._pack

        def pack(rank, index):
            if rank == 2 and index == 1:
                raise RuntimeError("rank 2 lost its card")
            return real_pack(rank, index)

        monkeypatch.setattr(sp.block_weights, "_pack", pack)
        with pytest.raises(RuntimeError, match="rank 2 lost its card"):
            with torch.inference_mode():
                sp(x, t, ctx, **kw)
        monkeypatch.setattr(sp.block_weights, "_pack", real_pack)
        with torch.inference_mode():  # the next forward works again
            again = sp(x, t, ctx, **kw)
        sp.close()
    ref, _ = run(replicas(model, 4), 4, "replicate", cases=("plain",), forwards=1)
    assert identical([again], ref)


def test_dit_weights_and_model_mismatch_are_clear_errors():
    model = tiny_model(seed=0)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=30) as coord:
        with pytest.raises(ValueError, match="dit_weights='halves'.*'replicate'.*'shard'"):
            enable_sequence_parallel(replicas(model, 2), coord, dit_weights="halves")
        sp = enable_sequence_parallel(replicas(model, 2), coord, dit_weights="shard")
        sp.fan_out.runner.models[1] = tiny_model(seed=0)  # not the module the shards were made from
        x, t, ctx, kw = make_inputs("plain")
        with pytest.raises(SequenceParallelError, match="another DiT than the one its block weights"):
            with torch.inference_mode():
                sp(x, t, ctx, **kw)
        sp.close()


def test_the_next_blocks_gather_runs_on_the_lane_while_a_block_computes(monkeypatch):
    """One lane gather per block (not per rank), issued when block i's weights are taken and
    before any rank needs block i+1, on the lane's threads rather than the rank threads."""
    model = tiny_model(seed=7)
    world = 3
    x, t, ctx, kw = make_inputs("plain")
    events, lock = [], threading.Lock()
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model, world), coord, dit_weights="shard")
        family = sp.block_weights
        real_submit, real_take, real_gather = family._submit, family.take, family.gather

        def log(*event):
            with lock:
                events.append(event)

        def submit(key):
            log("submit", key[1], threading.get_ident())
            return real_submit(key)

        def take(rank, comm, index):
            log("take", index, threading.get_ident())
            return real_take(rank, comm, index)

        def gather(rank, comm, index):
            log("gather", index, threading.get_ident())
            return real_gather(rank, comm, index)

        monkeypatch.setattr(family, "_submit", submit)
        monkeypatch.setattr(family, "take", take)
        monkeypatch.setattr(family, "gather", gather)
        with torch.inference_mode():
            sp(x, t, ctx, **kw)
        sp.close()
    n = family.num_blocks
    submits = [e[1] for e in events if e[0] == "submit"]
    assert submits == list(range(n))  # each block gathered once for all ranks, in order
    kinds = [e[:2] for e in events]
    for i in range(1, n):
        submitted = kinds.index(("submit", i))
        # issued while block i-1 was running (after its weights were taken) and before any
        # rank asked for block i's (a take without a prefetch would submit after its entry)
        assert kinds.index(("take", i - 1)) < submitted < kinds.index(("take", i))
    rank_threads = {e[2] for e in events if e[0] == "take"}
    lane_threads = {e[2] for e in events if e[0] == "gather"}
    assert len(rank_threads) == world and len(lane_threads) == world and not rank_threads & lane_threads


# ----------------------------------------------------------------------------- quantized-layer patches

class _PackedLinear(torch.nn.Module):
    """A stand-in for upstream's quantized layer: it holds one tensor subclass (a TwoTensor)
    that is stored as two plain tensors, 'weight' and 'weight_scale', and put together only by
    its own loader."""

    def __init__(self, a, b):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor
        self.weight = torch.nn.Parameter(TwoTensor(a, b), requires_grad=False)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        if self.weight is None:  # not loaded yet (a copy of the structure only)
            return
        destination[prefix + "weight"] = self.weight.a
        destination[prefix + "weight_scale"] = self.weight.b

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        from torch.testing._internal.two_tensor import TwoTensor
        # copies: a TwoTensor needs its two parts at equal storage offsets, the base's views are not
        a, b = state_dict[prefix + "weight"].clone(), state_dict[prefix + "weight_scale"].clone()
        self.weight = torch.nn.Parameter(TwoTensor(a, b), requires_grad=False)


class _PackedBlock(torch.nn.Module):
    def __init__(self, g):
        super().__init__()
        self.lin = _PackedLinear(torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g))
        self.norm = torch.nn.Parameter(torch.randn(5, generator=g), requires_grad=False)


class _PackedTower(torch.nn.Module):
    def __init__(self, blocks=4, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList(_PackedBlock(g) for _ in range(blocks))


def _requantizing_patch(calls):
    """A layer patch in the shape of ComfyUI's for a quantized weight: read the layer as its
    loader rebuilt it, change it, round with a generator seeded by the name (same bits on
    every rank), return a new tensor of the layer's own kind."""
    from torch.testing._internal.two_tensor import TwoTensor

    def patch(name, module, device):
        calls.append(name)
        weight = module.get_submodule(name.rpartition(".")[0]).weight
        g = torch.Generator(device=device).manual_seed(sum(map(ord, name)))
        noise = torch.rand(weight.a.shape, generator=g, device=device)
        return TwoTensor(weight.a + 0.25, (weight.b * 4 + noise).floor())
    return patch


def test_a_quantized_layer_patch_runs_once_on_its_owner_and_the_gather_is_exact():
    """Layer patches (weights/replicas.py) on a sharded family: each patched tensor is computed
    once, by the rank that keeps it, and every rank's gathered block equals a full replica's
    patched block bit for bit; the base stays unpatched; an unload drops the patched copies
    without patching anything again."""
    pytest.importorskip("torch.testing._internal.two_tensor")
    from comfy.multidevice.tensor_bytes import tensor_nbytes
    from comfy.multidevice.weights.block_shards import block_tensors
    world, template = 3, _PackedTower()
    state = {n: t.clone() for n, t in template.state_dict().items()}
    base = SharedCheckpoint.from_state_dict(state, copy=True, label="packed tower")
    names = [f"blocks.{i}.lin.weight" for i in range(len(template.blocks))]

    def family(calls):
        reps = RankReplicas(base, ["cpu"] * world, template=template, load=False)
        reps.add_layer_patch(names, _requantizing_patch(calls))
        return reps

    full_calls, shard_calls = [], []
    full = family(full_calls).load()
    assert sorted(full_calls) == sorted(names * world)  # replicate: every rank patches everything
    sharded = family(shard_calls)
    sizes = [{n: tensor_nbytes(t) for n, t in block_tensors(b).items()} for b in sharded[0].module.blocks]
    plan = BlockShardPlan.balanced(sizes, world)
    for r, replica in enumerate(sharded):  # as roles/dit_shards.py loads each card's shard
        replica.load([f"blocks.{i}.{n}" for i in range(len(sizes)) for n in plan.names_of(i, r)], only=True)
    assert sorted(shard_calls) == sorted(names)  # shard: once each, on the owner
    for r, replica in enumerate(sharded):
        owned = [i for i in range(len(sizes)) if plan.owner[i]["lin.weight"] == r]
        assert replica.resident_bytes == sum(sizes[i]["lin.weight"] for i in owned)
    weights = ShardedBlockWeights([r.module for r in sharded], lambda m: m.blocks, [torch.device("cpu")] * world,
                                  plan=plan)
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=30) as coord:
        def gather_all(rank, comm):
            view, got = weights.rank_view(rank), []
            view.begin_forward()
            for i, block in enumerate(sharded[rank].module.blocks):
                view.bind(i, comm)
                got.append((block.lin.weight.a.clone(), block.lin.weight.b.clone(), block.norm.clone()))
                view.release(i)
            return got
        results = coord.run(gather_all)
    weights.close()
    for got in results:
        for (a, b, norm), block in zip(got, full[0].module.blocks):
            assert torch.equal(a, block.lin.weight.a) and torch.equal(b, block.lin.weight.b)
            assert torch.equal(norm, block.norm)
    assert not torch.equal(full[0].module.blocks[0].lin.weight.a, state["blocks.0.lin.weight"])  # it acts
    assert all(torch.equal(base[n], t) for n, t in state.items())
    assert sharded.unload() == sum(sizes[i]["lin.weight"] for i in range(len(sizes)))
    assert sorted(shard_calls) == sorted(names) and sharded[0].resident_bytes == 0


def test_quantized_layer_tensors_take_layer_patches_only():
    pytest.importorskip("torch.testing._internal.two_tensor")
    from comfy.multidevice.weights.patches import QuantizedPatchError
    template = _PackedTower(blocks=1)
    base = SharedCheckpoint.from_state_dict(template.state_dict(), copy=True, label="packed tower")
    reps = RankReplicas(base, ["cpu"], template=template, load=False)
    with pytest.raises(QuantizedPatchError, match="'blocks.0.lin.weight' of a quantized layer.*add_layer_patch"):
        reps.add_patches({"blocks.0.lin.weight": torch.zeros(3, 5)})
    with pytest.raises(ValueError, match="'blocks.0.norm' is not a tensor of a quantized layer.*add_patches"):
        reps.add_layer_patch(["blocks.0.norm"], _requantizing_patch([]))
    with pytest.raises(ValueError, match="'blocks.0.lin.weight_scale' is stored inside.*patch the layer's weight"):
        reps.add_layer_patch(["blocks.0.lin.weight_scale"], _requantizing_patch([]))
    assert reps.patches.names() == []  # nothing was added by the refused calls
