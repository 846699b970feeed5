"""comfy/multidevice/comm/torch_dist.py: one rank per process over torch.distributed (gloo on CPU).

Each test starts W real processes. Every process builds all ranks' shards from the same
seeds, so it can compute the single-process reference (torch.cat of the shards) itself
and compare its own exchange result with it; it sends back only plain verdicts. Exchanges
must be bit-exact. Gloo's all-reduce sums in its own order, so fp32 sums are compared with
the float64 sum at a tolerance of 1e-6 x the sum of magnitudes (a few fp32 roundings), and
the ranks' results must be bit-identical to each other; max is exact.

Hard limits: a pytest-timeout per test, plus the join timeout and kill of
tests/rank_processes.py.
"""

import hashlib
import time

import pytest
import torch

from comfy.multidevice.comm.settings import launched_by_torchrun, read_torchrun_env, TorchrunEnvError
from comfy.multidevice.comm.torch_dist import dist_backend_for
from tests.collective_cases import h3_layout_shards, make_shards
from tests.helpers import free_port
from tests.rank_processes import payloads, run_rank_processes

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_ranks(world, worker_name, tmp_path, **kwargs):
    return run_rank_processes(world, "tests.comm.test_torch_dist", worker_name, tmp_path, **kwargs)


# ----------------------------------------------------------------------------- workers

def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def exactness_worker(comm):
    """Exchanges, all-to-all and all-reduce against references; returns verdicts."""
    W, r = comm.world_size, comm.rank
    verdicts = {}
    uneven = [11 * (k + 1) // W - 11 * k // W for k in range(W)]
    for dtype in DTYPES:
        for dim in (0, 1, -1):
            a = make_shards(W, uneven, dim % 3, dtype, seed=1)
            b = make_shards(W, [2 * n + 1 for n in uneven], 0, dtype, seed=2)
            c = make_shards(W, [4] * W, 2, dtype, seed=3)  # equal lengths: the all-gather path
            got = comm.exchange([a[r], b[r], c[r]], [dim, 0, 2])
            want = [torch.cat(a, dim), torch.cat(b, 0), torch.cat(c, 2)]
            verdicts[f"exchange {dtype} dim {dim}"] = all(
                g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))
    # H3's K/V layout with the shard plan: the shapes travel once, later calls move only data
    ks = h3_layout_shards(W, 11)
    sizes = [k.shape[2] for k in ks]
    rounds = []
    real_gather_metas = comm._gather_metas
    comm._gather_metas = lambda *a: (rounds.append(a[1]), real_gather_metas(*a))[1]
    try:
        got = [comm.exchange([ks[r], 2 * ks[r]], [2, 2], shard_sizes=sizes) for _ in range(3)]
    finally:
        comm._gather_metas = real_gather_metas
    verdicts["exchange with the shard plan equals cat"] = all(
        torch.equal(k, torch.cat(ks, 2)) and torch.equal(v, 2 * torch.cat(ks, 2)) for k, v in got)
    verdicts["exchange with the shard plan: one shape round in three calls"] = rounds == ["exchange"]
    empty = [torch.zeros(0, 4) if k == 0 else torch.full((k, 4), float(k)) for k in range(W)]
    verdicts["exchange with an empty shard"] = torch.equal(comm.exchange([empty[r]], 0)[0], torch.cat(empty))
    # all_to_all_v: rank i sends (i + j) % 3 rows to rank j.
    splits = [[(i + j) % 3 for j in range(W)] for i in range(W)]
    inputs = [torch.arange(sum(splits[i]) * 2, dtype=torch.float32).view(-1, 2) + 100 * i for i in range(W)]
    got = comm.all_to_all_v(inputs[r], splits[r], 0)
    want = torch.cat([torch.split(inputs[i], splits[i])[r] for i in range(W)])
    verdicts["all_to_all_v"] = torch.equal(got, want)
    # all_to_all_v across dims, as Ulysses uses it: sequence shards [1, H, S_r, D] (S = 11
    # uneven) -> head shards [1, H_j, S, D] (H = 5 uneven)
    heads = [5 * (k + 1) // W - 5 * k // W for k in range(W)]
    full = torch.randn(1, 5, 11, 3, generator=torch.Generator().manual_seed(9))
    by_head = comm.all_to_all_v(full.split(uneven, 2)[r], heads, 1, cat_dim=2)
    verdicts["all_to_all_v sequence -> heads"] = torch.equal(by_head, full.split(heads, 1)[r])
    planned = [comm.all_to_all_v(full.split(uneven, 2)[r], heads, 1, cat_dim=2, recv_splits=uneven)
               for _ in range(2)]
    verdicts["all_to_all_v sequence -> heads with recv_splits"] = all(
        torch.equal(p, full.split(heads, 1)[r]) for p in planned)
    # write_own: the chunk a rank keeps left unfilled (NaN) in what it sends, written by the
    # caller into its place in the result (once per tensor and call), along dim 0 and as Ulysses
    for name, (send, splits_r, split_dim, cat_dim, want) in {
            "rows": (inputs[r], splits[r], 0, 0, want),
            "sequence -> heads": (full.split(uneven, 2)[r], heads, 1, 2, full.split(heads, 1)[r])}.items():
        own = send.narrow(split_dim, sum(splits_r[:r]), splits_r[r])
        unfilled = send.clone()
        unfilled.narrow(split_dim, sum(splits_r[:r]), splits_r[r]).fill_(float("nan"))
        calls = []
        got = comm.all_to_all_v(unfilled, splits_r, split_dim, cat_dim=cat_dim,
                                write_own=lambda t, place: (calls.append(t), place.copy_(own)))
        verdicts[f"all_to_all_v write_own {name}"] = torch.equal(got, want) and calls == ([0] if splits_r[r] else [])
    # all_reduce
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(6, 9, generator=gen) for _ in range(W)]
    before = xs[r].clone()
    total = comm.all_reduce(xs[r], "sum")
    exact = sum(x.double() for x in xs)
    scale = float(sum(x.double().abs() for x in xs).max())
    verdicts["all_reduce sum fp32 within 1e-6 of scale"] = float((total.double() - exact).abs().max()) <= 1e-6 * scale
    verdicts["all_reduce max exact"] = torch.equal(comm.all_reduce(xs[r], "max"), torch.stack(xs).amax(0))
    hb = [torch.randn(32, generator=gen).to(torch.bfloat16) for _ in range(W)]
    hsum = comm.all_reduce(hb[r], "sum")
    hscale = float(sum(x.float().abs() for x in hb).max())
    # bf16: each partial sum may round once (W-1 adds), 2^-8 relative each.
    verdicts["all_reduce sum bf16 within rounding"] = (
        hsum.dtype == torch.bfloat16 and
        float((hsum.float() - sum(x.float() for x in hb)).abs().max()) <= (W - 1) * 2 ** -8 * hscale)
    verdicts["all_reduce leaves its input alone"] = torch.equal(xs[r], before)
    comm.barrier()
    counts = comm.byte_counts()
    verdicts["byte counts recorded"] = counts["calls"] > 0 and set(counts["by_op"]) == {"exchange", "all_to_all_v", "all_reduce"}
    return {"verdicts": verdicts, "sum_digest": digest(total), "bf16_digest": digest(hsum),
            "backend": comm.backend_name, "rank": comm.rank, "world": comm.world_size}


def mismatch_then_recover_worker(comm):
    """Shapes that cannot be concatenated: every rank raises the same clear error, and the
    group is still in step afterwards."""
    from comfy.multidevice.comm.errors import CollectiveError
    shard = torch.ones(2, 3 + comm.rank)  # differs outside the concat dim 0
    try:
        comm.exchange([shard], 0)
        message = None
    except CollectiveError as exc:
        message = str(exc)
    try:
        comm.exchange([shard, shard], 1) if comm.rank else comm.exchange([shard], 1)
        count_message = None
    except CollectiveError as exc:
        count_message = str(exc)
    after = comm.exchange([torch.full((1,), float(comm.rank))], 0)[0]
    return {"message": message, "count_message": count_message,
            "after_ok": torch.equal(after, torch.arange(float(comm.world_size)))}


def different_collectives_worker(comm):
    """Rank 0 exchanges, rank 1 all-reduces, rank 2 waits at a barrier; then sum against max.
    Every rank must raise the same clear error, and the group is still in step afterwards."""
    from comfy.multidevice.comm.errors import CollectiveError
    x = torch.ones(2, 3)
    messages = []
    for calls in (("exchange", "all_reduce", "barrier"), ("sum", "max", "sum")):
        what = calls[comm.rank]
        try:
            if what == "exchange":
                comm.exchange([x], 0)
            elif what == "barrier":
                comm.barrier()
            else:
                comm.all_reduce(x, "sum" if what == "all_reduce" else what)
            messages.append(None)
        except CollectiveError as exc:
            messages.append(str(exc))
    comm.barrier()
    after = comm.exchange([torch.full((1,), float(comm.rank))], 0)[0]
    return {"messages": messages, "after_ok": torch.equal(after, torch.arange(float(comm.world_size)))}


def failing_rank_worker(comm):
    """Rank 1 raises after two exchanges; the others are already waiting in the third."""
    for _ in range(2):
        comm.exchange([torch.ones(comm.rank + 1, 2)], 0)
    if comm.rank == 1:
        raise ValueError("rank one could not continue")
    return _wait_in_exchange(comm)


def stuck_rank_worker(comm):
    """Rank 1 stops taking part without exiting (a hung process): the others must give up
    after the process group's timeout."""
    comm.exchange([torch.ones(1)], 0)
    if comm.rank == 1:
        time.sleep(3.5)  # longer than the 2 s collective timeout
        return {"error_type": None}
    return _wait_in_exchange(comm)


def stuck_rank_all_to_all_worker(comm):
    """As stuck_rank_worker, inside all_to_all_v (its point-to-point receives) with a known plan."""
    W = comm.world_size
    x = torch.ones(W, 2)
    comm.all_to_all_v(x, [1] * W, 0, recv_splits=[1] * W)  # the plan's shapes travel here
    if comm.rank == 1:
        time.sleep(3.5)  # longer than the 2 s collective timeout
        return {"error_type": None}
    start = time.monotonic()
    try:
        comm.all_to_all_v(x, [1] * W, 0, recv_splits=[1] * W)
    except Exception as exc:  # noqa: BLE001 - the type and text are the point of the test
        return {"error_type": type(exc).__name__, "error": str(exc), "after_s": time.monotonic() - start}
    return {"error_type": None}


def diverging_after_plans_worker(comm):
    """Once a plan is verified no shapes travel. Rank 0 then exchanges while the others run an
    all-to-all whose messages have the very same sizes: nobody may take the other
    collective's data for its own; every rank fails with a CollectiveError instead."""
    W = comm.world_size
    shard, chunks = torch.full((2, 4), float(comm.rank)), torch.full((2 * W, 4), float(comm.rank))
    for _ in range(2):  # the plans' shapes travel on the first call only
        comm.exchange([shard], 0, shard_sizes=[2] * W)
        comm.all_to_all_v(chunks, [2] * W, 0, recv_splits=[2] * W)
    start = time.monotonic()
    try:
        if comm.rank == 0:
            got = comm.exchange([shard], 0, shard_sizes=[2] * W)[0]
        else:
            got = comm.all_to_all_v(chunks, [2] * W, 0, recv_splits=[2] * W)
    except Exception as exc:  # noqa: BLE001 - the type and text are the point of the test
        return {"error_type": type(exc).__name__, "error": str(exc), "after_s": time.monotonic() - start}
    return {"error_type": None, "got": got.tolist()}


def _wait_in_exchange(comm):
    start = time.monotonic()
    try:
        comm.exchange([torch.ones(2, 2)], 0)
    except Exception as exc:  # noqa: BLE001 - the type and text are the point of the test
        return {"error_type": type(exc).__name__, "error": str(exc), "after_s": time.monotonic() - start}
    return {"error_type": None}


def _ulysses_case(world, rank, heads, dtype, seq=11, dim=8):
    """This rank's q/k/v as H3's attention hands them over ([1, H, S_r, D] views of its fused
    qkv rows; S = 11 is uneven for W = 2, 3, 4) and its rows of the single-process result of
    `_exact_attention` (exact ops only, so the result must be bit-identical)."""
    gen = torch.Generator().manual_seed(heads * 100 + world)
    qkv = torch.randn(seq, 3 * heads * dim, generator=gen).to(dtype)  # the same on every rank
    sizes = [seq * (r + 1) // world - seq * r // world for r in range(world)]
    a = sum(sizes[:rank])
    mine = qkv[a:a + sizes[rank]]
    q, k, v = (mine[:, i * heads * dim:(i + 1) * heads * dim].view(sizes[rank], heads, dim).transpose(0, 1)
               .unsqueeze(0) for i in range(3))
    full = [qkv[:, i * heads * dim:(i + 1) * heads * dim].view(seq, heads, dim) for i in range(3)]
    q_full, k_full, v_full = full  # [S, H, D]
    want = q_full[a:a + sizes[rank]] + k_full.amax(0) - v_full.amin(0) + k_full[-1] * v_full[0]
    return (q, k, v), sizes, want  # want: [S_r, H, D]


def _exact_attention(q, k, v, heads, skip_reshape=False, **kwargs):
    """Query rows x all K/V rows per head like attention, but exact in any layout and tiling
    (max, min, elementwise): q + max_s k - min_s v + k[last row] * v[first row]."""
    assert skip_reshape  # Ulysses hands over [B, h, S, D]
    o = q + k.amax(2, keepdim=True) - v.amin(2, keepdim=True) + k[:, :, -1:] * v[:, :, :1]
    return o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1)  # [B, S, h * D]


def ulysses_worker(comm):
    """UlyssesKV over DistributedComm against the single-process result, bit for bit: plain
    Ulysses and the hybrid (6 heads at W = 4: 2 groups of 2; 4 heads at W = 3: degree 1), with
    and without the shard plan, with head chunks, both output layouts, fp32 and bf16. With the
    plan, the shapes travel on the first block of a forward only (counted)."""
    from comfy.multidevice.sp.ulysses import UlyssesKV
    W, r = comm.world_size, comm.rank
    verdicts, rounds = {}, []
    real_gather_metas = comm._gather_metas
    comm._gather_metas = lambda *a: (rounds.append(a[1]), real_gather_metas(*a))[1]
    try:
        for heads in (4, 6):
            for dtype in (torch.float32, torch.bfloat16):
                (q, k, v), sizes, want = _ulysses_case(W, r, heads, dtype)
                for chunks in (1, 2):
                    for plan in (None, sizes):
                        for heads_first in (False, True):
                            strategy = UlyssesKV(overlap_chunks=chunks)
                            strategy.begin_forward()  # the forward's buffers, as the SP adapter keeps them
                            kwargs = {"skip_output_reshape": True} if heads_first else {}
                            per_block = []
                            for _ in range(3):  # three blocks of one forward
                                before = len(rounds)
                                out = strategy.attend(comm, _exact_attention, q, k, v, heads,
                                                      skip_reshape=True, shard_sizes=plan, **kwargs)
                                per_block.append(len(rounds) - before)
                                got = out[0].transpose(0, 1) if heads_first else out[0].view(want.shape)
                                name = f"H={heads} {dtype} chunks={chunks} plan={plan is not None} heads_first={heads_first}"
                                verdicts[name] = verdicts.get(name, True) and got.dtype == want.dtype and \
                                    torch.equal(got, want)
                            strategy.end_forward()
                            if plan is not None:  # a plan's shapes travel once (the first block
                                # that uses it; the communicator remembers it), later blocks send none
                                verdicts[name + ": shape rounds"] = per_block[1:] == [0, 0] and \
                                    per_block[0] <= 2 * chunks
                            else:  # without the rows of every rank, the inbound shapes travel each time
                                verdicts[name + ": shape rounds"] = min(per_block) >= 1
    finally:
        comm._gather_metas = real_gather_metas
    return {"verdicts": verdicts, "rank": r}


def _collective_path(worker):
    """`worker` with all_to_all_v on the path nccl/hccl take (one all_to_all_single per tensor)."""
    def run(comm):
        from comfy.multidevice.comm import torch_dist_transfers
        torch_dist_transfers.POINT_TO_POINT_WIRES = ()  # this process only
        return worker(comm)
    return run


def all_to_all_plan_worker(comm):
    """recv_splits: a gather to one rank (the others receive nothing but send) with and without
    them; a plan that disagrees with what is sent, and one that only some ranks pass: the same
    clear error on every rank, and the group still in step afterwards."""
    from comfy.multidevice.comm.errors import CollectiveError
    W, r = comm.world_size, comm.rank
    out = {}
    rows = torch.full((r + 1, 3), float(r))
    to_root = [r + 1 if j == 0 else 0 for j in range(W)]
    plan = [j + 1 for j in range(W)] if r == 0 else [0] * W
    want = torch.cat([torch.full((j + 1, 3), float(j)) for j in range(W)]) if r == 0 else torch.zeros(0, 3)
    for name, kwargs in (("gather to root", {}), ("gather to root with recv_splits", {"recv_splits": plan})):
        got = [comm.all_to_all_v(rows, to_root, 0, **kwargs) for _ in range(2)]
        out[name] = all(g.shape == want.shape and torch.equal(g, want) for g in got)
    messages = []
    x = torch.arange(2.0 * W).view(W, 2) + 10 * r
    for bad in ([2] * W if r == 0 else [1] * W,  # rank 0 expects 2 rows from every rank, gets 1
                [1] * W if r == 0 else None):    # only rank 0 passes a plan
        try:
            comm.all_to_all_v(x, [1] * W, 0, recv_splits=bad)
            messages.append(None)
        except CollectiveError as exc:
            messages.append(str(exc))
    out["messages"] = messages
    after = comm.all_to_all_v(x, [1] * W, 0, recv_splits=[1] * W)
    out["after_ok"] = torch.equal(after, torch.stack([torch.tensor([2.0 * r, 2.0 * r + 1]) + 10 * j for j in range(W)]))
    return out


def collective_buffers_worker(comm):
    """On the nccl/hccl path: the all_to_all_single call sends straight from the tensor when
    its chunks lie back to back, and receives straight into the result when the places do;
    the values are those of the reference concat either way."""
    import torch.distributed as dist
    W, r = comm.world_size, comm.rank
    calls = []
    real = dist.all_to_all_single

    def spy(output, input, *args, **kwargs):
        calls.append((output.data_ptr(), input.data_ptr()))
        return real(output, input, *args, **kwargs)

    def held(src, split_dim):  # what rank `src` holds: chunk j along split_dim is for rank j
        shape = [W * 2, 3, 4] if split_dim == 0 else [2, W * 3, 4]
        return torch.arange(float(2 * 3 * 4 * W)).view(shape) + 1000 * src

    verdicts = {}
    dist.all_to_all_single = spy
    try:
        for name, split_dim, cat_dim in (("rows to rows", 0, 0), ("heads to rows", 1, 0), ("rows to heads", 0, 1)):
            x = held(r, split_dim)
            splits = [x.shape[split_dim] // W] * W
            got = comm.all_to_all_v(x, splits, split_dim, cat_dim=cat_dim)
            want = torch.cat([held(j, split_dim).split(splits, split_dim)[r] for j in range(W)], dim=cat_dim)
            out_ptr, in_ptr = calls[-1]
            verdicts[name + ": exact"] = torch.equal(got, want)
            verdicts[name + ": sent from the tensor"] = (in_ptr == x.data_ptr()) == (split_dim == 0)
            verdicts[name + ": received into the result"] = (out_ptr == got.data_ptr()) == (cat_dim == 0)
    finally:
        dist.all_to_all_single = real
    return {"verdicts": verdicts, "rank": r}


ulysses_collective_worker = _collective_path(ulysses_worker)
collective_buffers_collective_worker = _collective_path(collective_buffers_worker)
all_to_all_plan_collective_worker = _collective_path(all_to_all_plan_worker)
exactness_collective_worker = _collective_path(exactness_worker)


# ----------------------------------------------------------------------------- tests

def check_exactness(results, world):
    first = results[0]
    for res in results:
        assert res["backend"] == "gloo" and res["world"] == world
        failed = [name for name, ok in res["verdicts"].items() if not ok]
        assert not failed, f"rank {res['rank']}: {failed}"
        assert len(res["verdicts"]) == 3 * 3 + 13
        # Every rank holds the same all-reduce bits.
        assert res["sum_digest"] == first["sum_digest"] and res["bf16_digest"] == first["bf16_digest"]


@pytest.mark.timeout(120)
def test_two_processes_from_torchrun_environment_over_loopback(tmp_path):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    check_exactness(payloads(run_ranks(2, "exactness_worker", tmp_path, init="env", env=env)), 2)


@pytest.mark.timeout(120)
def test_three_processes_exact_and_bad_shapes_fail_everywhere(tmp_path):
    out = payloads(run_ranks(3, "exactness_worker", tmp_path))
    check_exactness(out, 3)
    (tmp_path / "second").mkdir()
    out = payloads(run_ranks(3, "mismatch_then_recover_worker", tmp_path / "second"))
    for res in out:
        assert "differ outside the concat dim 0" in res["message"]
        assert "disagree on the number" in res["count_message"]
        assert res["after_ok"]
    assert len({res["message"] for res in out}) == 1  # the same error on every rank


@pytest.mark.timeout(120)
def test_ranks_in_different_collectives_fail_clearly_everywhere(tmp_path):
    out = payloads(run_ranks(3, "different_collectives_worker", tmp_path, dist_timeout_s=30))
    first, second = out[0]["messages"]
    assert "rank 0: exchange, rank 1: all_reduce sum, rank 2: barrier" in first
    assert "rank 0: all_reduce sum, rank 1: all_reduce max, rank 2: all_reduce sum" in second
    for res in out:
        assert res["messages"] == [first, second]  # the same error on every rank
        assert res["after_ok"]


@pytest.mark.timeout(120)
def test_four_processes_exact(tmp_path):
    check_exactness(payloads(run_ranks(4, "exactness_worker", tmp_path)), 4)


@pytest.mark.timeout(120)
def test_three_processes_exact_on_the_collective_path_of_nccl_and_hccl(tmp_path):
    check_exactness(payloads(run_ranks(3, "exactness_collective_worker", tmp_path)), 3)


@pytest.mark.timeout(120)
def test_a_raising_process_makes_the_others_fail_instead_of_hanging(tmp_path):
    start = time.monotonic()
    out = run_ranks(3, "failing_rank_worker", tmp_path, dist_timeout_s=60)
    elapsed = time.monotonic() - start
    status, text = out[1]
    assert status == "error" and "rank one could not continue" in text
    for rank in (0, 2):
        status, res = out[rank]
        assert status == "ok", res
        assert res["error_type"] == "CollectiveError", res
        assert f"rank {rank}/3: exchange failed" in res["error"]
        assert "another process probably failed" in res["error"]
        assert res["after_s"] < 30  # the peer's exit, not the 60 s collective timeout, ended it
    assert elapsed < 60


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["point_to_point", "collective"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_over_processes_is_bit_identical_and_sends_shapes_once_per_plan(tmp_path, world, path):
    worker = "ulysses_worker" if path == "point_to_point" else "ulysses_collective_worker"
    for res in payloads(run_ranks(world, worker, tmp_path)):
        failed = [name for name, ok in res["verdicts"].items() if not ok]
        assert not failed, f"rank {res['rank']}: {failed}"
        assert len(res["verdicts"]) == 2 * 2 * 2 * 2 * 2 * 2


@pytest.mark.timeout(120)
def test_the_collective_path_sends_from_the_tensor_and_receives_into_the_result_where_it_can(tmp_path):
    for res in payloads(run_ranks(3, "collective_buffers_collective_worker", tmp_path)):
        failed = [name for name, ok in res["verdicts"].items() if not ok]
        assert not failed, f"rank {res['rank']}: {failed}"
        assert len(res["verdicts"]) == 9


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker", ["all_to_all_plan_worker", "all_to_all_plan_collective_worker"])
def test_all_to_all_plans_are_checked_on_their_first_call_everywhere(tmp_path, worker):
    out = payloads(run_ranks(3, worker, tmp_path))
    first, second = out[0]["messages"]
    assert "rank 0's recv_splits [2, 2, 2] give chunks" in first and "the ranks send it" in first
    assert "ranks [0] passed recv_splits and the others did not" in second
    for res in out:
        assert res["gather to root"] and res["gather to root with recv_splits"]
        assert res["messages"] == [first, second]  # the same error on every rank
        assert res["after_ok"]


# ----------------------------------------------------------------------------- environment

def test_torchrun_environment_is_read_and_checked():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.5",
           "MASTER_PORT": "29500"}
    parsed = read_torchrun_env(env)
    assert (parsed.rank, parsed.world_size, parsed.local_rank, parsed.master_addr, parsed.master_port) == \
        (1, 2, 0, "10.0.0.5", 29500)
    assert launched_by_torchrun(env) and not launched_by_torchrun({})
    with pytest.raises(TorchrunEnvError, match="MASTER_ADDR, MASTER_PORT not set.*torchrun"):
        read_torchrun_env({k: v for k, v in env.items() if not k.startswith("MASTER")})
    with pytest.raises(TorchrunEnvError, match=r"RANK=2 must be in \[0, WORLD_SIZE=2\)"):
        read_torchrun_env({**env, "RANK": "2"})
    with pytest.raises(TorchrunEnvError, match="WORLD_SIZE='two' is not an integer"):
        read_torchrun_env({**env, "WORLD_SIZE": "two"})
    with pytest.raises(TorchrunEnvError, match="MASTER_PORT=70000 is not a TCP port"):
        read_torchrun_env({**env, "MASTER_PORT": "70000"})


def test_backend_follows_the_device_kind():
    assert dist_backend_for(torch.device("cpu")) == "gloo"
    assert dist_backend_for(torch.device("cuda", 1)) == "nccl"
    with pytest.raises(ValueError, match="no torch.distributed backend for device meta"):
        dist_backend_for(torch.device("meta"))


def test_communicator_needs_an_initialized_group():
    from comfy.multidevice.comm.torch_dist import DistributedComm
    with pytest.raises(RuntimeError, match="init_from_env"):
        DistributedComm("cpu")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("worker, op", [("stuck_rank_worker", "exchange"),
                                        ("stuck_rank_all_to_all_worker", "all_to_all_v")])
def test_a_stuck_process_makes_the_others_time_out(tmp_path, worker, op):
    out = run_ranks(3, worker, tmp_path, dist_timeout_s=2)
    for rank in (0, 2):
        status, res = out[rank]
        assert status == "ok", res
        assert res["error_type"] == "CollectiveError", res
        assert f"rank {rank}/3: {op} failed" in res["error"]
        assert 1.5 < res["after_s"] < 20, res


@pytest.mark.timeout(120)
def test_ranks_that_diverge_after_a_verified_plan_fail_instead_of_mixing_collectives(tmp_path):
    out = run_ranks(2, "diverging_after_plans_worker", tmp_path, dist_timeout_s=2)
    for rank, op in ((0, "exchange"), (1, "all_to_all_v")):
        status, res = out[rank]
        assert status == "ok", res
        assert res["error_type"] == "CollectiveError", res
        assert f"rank {rank}/2: {op} failed" in res["error"]


def test_torchrun_variables_take_ascii_digits_only_and_read_as_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.5",
           "MASTER_PORT": "29500"}
    for name, value in (("RANK", "\u0661"), ("WORLD_SIZE", "\uff12"), ("LOCAL_RANK", "-1"),
                        ("MASTER_PORT", "29_500")):
        with pytest.raises(TorchrunEnvError) as info:
            read_torchrun_env({**env, name: value})
        assert str(info.value).startswith(f"environment variable {name}={value!r} is not an integer")
