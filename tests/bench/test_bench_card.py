"""bench/bench_card.py on the CPU: the small `--cpu` run the suite can afford, and every path a
card takes with fakes standing in for the card (its runtime API: streams, peak memory; torch_npu's
fused attention), so that the one run on a lent card needs no second try."""

import json
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from bench import bench_card
from comfy.multidevice.cards import DeviceInventory
from comfy.multidevice.sp.cost_model import attention_traffic
from tests.comfyui_server import REPO

FAKE_PEAK = 10 ** 9


class FakeCardApi:
    """What bench_card asks of torch.cuda / torch.npu, on CPU tensors; counts the syncs."""

    def __init__(self):
        self.syncs = 0
        self.peak_resets = 0

    def current_stream(self, device):
        return types.SimpleNamespace(synchronize=self._sync)

    def _sync(self):
        self.syncs += 1

    def empty_cache(self):
        pass

    def reset_peak_memory_stats(self, device):
        self.peak_resets += 1

    def max_memory_allocated(self, device):
        return FAKE_PEAK

    def get_device_name(self, device):
        return "Ascend910B3 (fake)"

    def set_device(self, device):
        pass


@pytest.fixture
def fake_torch_npu(monkeypatch):
    """torch_npu with only npu_fusion_attention: SDPA in BNSD, checking how it is called."""
    calls = []

    def npu_fusion_attention(q, k, v, head_num, input_layout, scale=1.0, keep_prob=1.0, **kwargs):
        assert input_layout == "BNSD" and head_num == q.shape[1] and keep_prob == 1.0
        assert all(t.is_contiguous() for t in (q, k, v))
        calls.append((tuple(q.shape), tuple(k.shape)))
        out = F.scaled_dot_product_attention(q, k, v, scale=scale)
        return out, None, None, None, 0, 0, 0

    module = types.ModuleType("torch_npu")
    module.npu_fusion_attention = npu_fusion_attention
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    return calls


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny block: OpenMP threads on a shared CPU only wait
    yield
    torch.set_num_threads(before)


def fake_npu_card():
    return bench_card.Card("npu:0", torch.device("cpu"), FakeCardApi(), "npu_fusion", "Ascend910B3 (fake)")


def run_fake(card, names=("768p_5s",), worlds=(1, 8), warmup=1, repeats=2, mode="quick"):
    return bench_card.run(card, bench_card.CPU_DIMS, names, worlds, bench_card.CPU_TOKEN_DIVISOR, warmup, repeats,
                          mode, log=lambda line: None)


def key_tree(value):
    """The keys of a JSON value, nested (lists by the union of their items' keys)."""
    if isinstance(value, dict):
        return {k: key_tree(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], dict):
        trees = [key_tree(v) for v in value]
        assert all(t == trees[0] for t in trees), "the items of a list differ in their keys"
        return [trees[0]]
    return None


@pytest.fixture(scope="module")
def cpu_run():
    run = subprocess.run([sys.executable, str(REPO / "bench" / "bench_card.py"), "--cpu"],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 1, "stdout is the JSON alone: `> card.json` must give project_h3.py a clean file"
    return json.loads(lines[0]), run.stderr


def test_cpu_run_measures_every_point_and_projects_from_them(cpu_run):
    result, stderr = cpu_run
    assert result["mode"] == "cpu" and result["card"]["kind"] == "cpu" and result["card"]["dtype"] == "bfloat16"
    assert "miniature" in result["card"]["block"]  # no COMFYUI_DIR here
    points = result["points"]
    assert [(p["workload"], p["world"]) for p in points] == [(w, n) for w in ("768p_5s", "768p_15s")
                                                              for n in (1, 2, 4, 8)]
    dims = result["dims"]
    for p in points:
        assert p["error"] is None and p["block_s"] > 0 and len(p["block_s_all"]) == result["repeats"]
        assert p["rows"] == bench_card.shard_sizes(p["tokens"], p["world"])[0]  # rank 0 of the shard plan
        assert p["exchange_bytes"] == attention_traffic("allgather", p["tokens"], p["world"], 0, dims["heads"],
                                                        dims["head_dim"], 2).received
        assert (p["exchange_copy_s"] == 0.0) == (p["world"] == 1)
        # exchange_precision=int8's side: its record bytes and its coding time
        per_row = dims["head_dim"] + 2 * -(-dims["head_dim"] // 128)  # a bf16 scale per <= 128 values
        assert p["int8_exchange_bytes"] == round(p["exchange_bytes"] * per_row / (2 * dims["head_dim"]))
        assert (p["int8_code_s"] == 0.0) == (p["world"] == 1) and p["int8_code_s"] >= 0
        assert p["peak_bytes"] is None  # the CPU cannot say; a card does (see the fake card below)
        step = result["projection"][p["workload"]][str(p["world"])]
        assert step["step_s"] == pytest.approx(dims["blocks"] * (p["block_s"] + p["exchange_copy_s"]))
        assert step["run_50_steps_s"] == pytest.approx(50 * step["step_s"])
    seed, sglang = result["anchors"]["seed"], result["anchors"]["sglang"]
    assert (seed["workload"], seed["cards"], seed["steps"], seed["anchor_s"]) == ("768p_15s", 4, 8, 347.4)
    assert (sglang["workload"], sglang["cards"], sglang["steps"], sglang["anchor_s"]) == ("768p_5s", 8, 50, 39.67)
    assert seed["projected_dit_s"] == pytest.approx(8 * result["projection"]["768p_15s"]["4"]["step_s"])
    assert seed["ratio_projected_to_anchor"] == pytest.approx(seed["projected_dit_s"] / 347.4)
    assert "W=8" in stderr and "small dims" in stderr


def test_a_card_run_and_the_cpu_run_have_the_same_keys(cpu_run, fake_torch_npu, one_thread):
    card_result = json.loads(json.dumps(run_fake(fake_npu_card())))  # as it is printed
    assert key_tree(card_result) == key_tree(cpu_run[0])


def test_a_card_is_synchronised_around_every_timed_call_and_its_peak_is_read(fake_torch_npu, one_thread):
    card = fake_npu_card()
    result = run_fake(card, warmup=1, repeats=2)
    # per timed series: one sync after the warm-up, then one before and one after each call;
    # W=1 times the block only, W=8 the block, the exchange copy and the int8 coding
    assert card.api.syncs == (1 + 2 * 2) + 3 * (1 + 2 * 2)
    assert card.api.peak_resets >= 2 * len(result["points"])
    for p in result["points"]:
        assert p["peak_bytes"] == FAKE_PEAK
        assert p["activation_bytes"] == FAKE_PEAK - p["weights_bytes"] - p["gathered_kv_bytes"]
        assert p["measured_vs_plan"] == round(FAKE_PEAK / p["plan_block_bytes"], 4)
        assert (p["gathered_kv_bytes"] == 0) == (p["world"] == 1)
    # on Ascend the fused attention takes every call, on one card too; at W=8 against all keys
    seq = bench_card.workloads(bench_card.CPU_TOKEN_DIVISOR)["768p_5s"]["tokens"]
    heads, dim = bench_card.CPU_DIMS.heads, bench_card.CPU_DIMS.head_dim
    assert fake_torch_npu == [((1, heads, seq, dim), (1, heads, seq, dim))] * 3 + \
        [((1, heads, seq // 8, dim), (1, heads, seq, dim))] * 3


@pytest.mark.parametrize("skip_reshape", [True, False])
@pytest.mark.parametrize("skip_output_reshape", [True, False])
def test_the_fused_attention_follows_comfyuis_calling_convention(fake_torch_npu, skip_reshape, skip_output_reshape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, n, 16, generator=g) for n in (5, 9, 9))
    want = F.scaled_dot_product_attention(q, k, v)
    args = (q, k, v) if skip_reshape else tuple(t.transpose(1, 2).reshape(1, t.shape[2], 48) for t in (q, k, v))
    out = bench_card.npu_fusion_attention(*args, 3, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                                          transformer_options={})
    torch.testing.assert_close(out, want if skip_output_reshape else want.transpose(1, 2).reshape(1, 5, 48))
    with pytest.raises(ValueError, match="mask=None"):
        bench_card.npu_fusion_attention(q, k, v, 3, mask=torch.ones(5, 9), skip_reshape=True)


def test_one_rank_of_w_gathers_into_the_exchanges_layout_and_keeps_the_peers_rows():
    world, seq, heads, dim = 4, 10, 2, 8
    comm = bench_card.OneRankOfW(world, torch.device("cpu"))
    sizes = bench_card.shard_sizes(seq, world)
    qkv = torch.randn(sizes[0], 3, heads, dim)  # a fused qkv projection of rank 0's rows
    _, k, v = (t.transpose(0, 1).unsqueeze(0) for t in qkv.unbind(1))  # [1, heads, rows, dim] views
    workspace = {}
    k_full, v_full = comm.exchange([k, v], [2, 2], shard_sizes=sizes, workspace=workspace)
    assert k_full.shape == v_full.shape == (1, heads, seq, dim)
    assert torch.equal(k_full[:, :, :sizes[0]], k) and torch.equal(v_full[:, :, :sizes[0]], v)
    peers = k_full[:, :, sizes[0]:].clone()
    k2, _ = comm.exchange([k * 2, v], [2, 2], shard_sizes=sizes, workspace=workspace)
    assert k2.data_ptr() == k_full.data_ptr()  # one buffer for every block, as a forward's blocks share
    assert torch.equal(k2[:, :, sizes[0]:], peers) and torch.equal(k2[:, :, :sizes[0]], k * 2)


def test_a_point_that_does_not_fit_is_reported_and_the_run_goes_on(monkeypatch, one_thread):
    real = bench_card.block_inputs

    def inputs(dims, workload, world, *args, **kwargs):
        if world == 8:
            raise torch.OutOfMemoryError("NPU out of memory. Tried to allocate 3.00 GiB")
        return real(dims, workload, world, *args, **kwargs)

    monkeypatch.setattr(bench_card, "block_inputs", inputs)
    result = run_fake(bench_card.find_card(cpu=True))
    failed = [p for p in result["points"] if p["error"]]
    assert [p["world"] for p in failed] == [8] and failed[0]["error"].startswith("out of memory")
    assert result["projection"]["768p_5s"]["8"]["step_s"] is None
    assert result["projection"]["768p_5s"]["1"]["step_s"] > 0
    assert result["anchors"]["sglang"]["projected_dit_s"] is None  # its 8 cards were not measured


@pytest.fixture
def fake_cards(monkeypatch, fake_torch_npu):
    def with_inventory(**counts):
        monkeypatch.setattr(bench_card, "probe_devices", lambda: DeviceInventory(counts=counts))
        monkeypatch.setattr(bench_card, "accelerator_api", lambda kind: FakeCardApi())
        monkeypatch.setattr(bench_card, "set_thread_device", lambda device: None)
        # an 'npu' torch.device exists only once the real torch_npu has registered it
        monkeypatch.setattr(bench_card, "resolve_device", lambda name: torch.device("cpu"))
    return with_inventory


def test_the_card_is_found_by_the_projects_device_rules(fake_cards):
    fake_cards(npu=2, cuda=1)
    card = bench_card.find_card()
    assert (card.name, card.attention, card.label) == ("npu:0", "npu_fusion", "Ascend910B3 (fake)")
    fake_cards(cuda=2)
    assert (bench_card.find_card().name, bench_card.find_card().attention) == ("cuda:0", "block")
    assert bench_card.find_card("cuda:1").name == "cuda:1"
    with pytest.raises(SystemExit, match="cuda:5 is not a visible card.*cuda:0, cuda:1"):
        bench_card.find_card("cuda:5")
    fake_cards()
    with pytest.raises(SystemExit, match="no NPU or CUDA card.*--cpu"):
        bench_card.find_card()
