"""The node's sp_mode through upstream's own sampling: every exchange it can pick equals one card.

A tiny H3 file with 12 heads (head_dim 16) is loaded by `comfy.sd.load_diffusion_model` and
sampled by `comfy.sample.sample`, with the DiT set up by the node's DiT role on W CPU ranks and
its sp_mode resolved by sp/mode_choice.py `choose_sp_mode` from the heads the node reads
(memory_plan.dit_shape_of): 12 heads divide by W = 2, 3, 4 (plain Ulysses) and not by 8 (the
hybrid: Ulysses in 2 groups of 4, K/V gathered across the groups). Each result is compared with
the same sampling on one card (fp32, 1e-5 of max |reference|, test_h3_dit.py says why), beside
a LoRA, a quantized file, upstream's Fun ControlNet, a step cache, sharded weights and ranks as
processes, as the all-gather is in the files those come from.
"""

from __future__ import annotations

import pytest

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.minimax_h3 import WRAPPER_KEY
from comfy.multidevice.sp.mode_choice import choose_sp_mode, SPModeError
from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL, TINY, tiny_state_dict
from tests.upstream.test_lora import lora, with_lora  # noqa: F401 - lora is a fixture
from tests.upstream.test_sampling import sample
from tests.upstream.test_workers import PRELUDE, trusted_stand_ins, workers  # noqa: F401 - a fixture

H12 = dict(TINY, num_attention_heads=12)  # 12 x 16 = 192 wide attention over a 32 wide hidden state
MODE_FOR_OTHER_PATHS = "ulysses"  # shards, LoRA, quantized, Fun, cache, processes (W = 4: 3 heads per rank)
pytestmark = pytest.mark.timeout(300)  # the worker cases start processes


@pytest.fixture(scope="module", autouse=True)
def _needs_the_hook(upstream):
    """`hook` for the whole module, before its module fixtures load or sample anything."""
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")


@pytest.fixture(scope="module")
def tiny_file(upstream, tmp_path_factory):
    """conftest's fixture of that name, here for the 12-head file: conftest's `patcher` and
    test_lora's `lora` build on it."""
    import safetensors.torch
    path = tmp_path_factory.mktemp("models") / "tiny_minimax_h3_12_heads.safetensors"
    safetensors.torch.save_file(tiny_state_dict(upstream, config=H12), str(path))
    return path


@pytest.fixture(scope="module")
def one_card(patcher):
    return sample(patcher)


@pytest.fixture
def ulysses_degrees(monkeypatch):
    """The Ulysses group size of every attention call in this process (rank threads; rank 0 of
    a worker pool): W for plain Ulysses, a divisor of W for the hybrid."""
    from comfy.multidevice.sp.ulysses import UlyssesKV
    seen, layout_of = [], UlyssesKV._layout

    def recording(self, comm, heads, q):
        layout = layout_of(self, comm, heads, q)
        seen.append(layout.degree)
        return layout
    monkeypatch.setattr(UlyssesKV, "_layout", recording)
    return seen


def resolved(model, sp_mode, world):
    """The node's sp_mode for `world` CPU ranks of `model`'s DiT (nodes_multinpu.dit_sp_mode's way)."""
    from comfy.multidevice.comfy_objects import dit_module
    from comfy.multidevice.roles.memory_plan import dit_shape_of
    shape = dit_shape_of(dit_module(model))
    return choose_sp_mode(sp_mode, world, shape.heads, shape.head_dim)


def node_dit(model, world, sp_mode, dit_weights="replicate"):
    """The node's DiT role on `world` rank threads (roles/apply.py: a sharded DiT prefetches on
    the kept lane beside the coordinator); returns the coordinator, the MODEL and the lane."""
    from comfy.multidevice.roles.apply import shared_prefetch_lane
    from comfy.multidevice.roles.dit import sequence_parallel_dit
    coord = SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60)
    lane = shared_prefetch_lane(coord) if dit_weights == "shard" else None
    parallel = sequence_parallel_dit(model, coord.devices, coord, dit_weights, lane=lane,
                                     sp_mode=resolved(model, sp_mode, world).mode)
    return coord, parallel, lane


def strategies_that_ran(parallel) -> set[str]:
    fan_out = parallel.wrappers["diffusion_model"][WRAPPER_KEY][0]
    return {state.strategy.name for state in fan_out.runner.last_rank_states}


# ----------------------------------------------------------------------------- the matrix

# (W, sp_mode, the strategy every rank runs, its Ulysses group size, the node's name for it)
MATRIX = [(2, "allgather", "allgather", None, "allgather"), (2, "ulysses", "ulysses", 2, "ulysses"),
          (3, "allgather", "allgather", None, "allgather"), (3, "ulysses", "ulysses", 3, "ulysses"),
          (4, "allgather", "allgather", None, "allgather"), (4, "ulysses", "ulysses", 4, "ulysses"),
          (8, "allgather", "allgather", None, "allgather"),
          (8, "hybrid", "ulysses", 4, "hybrid (2 groups of 4)")]


@pytest.mark.parametrize("world, sp_mode, strategy, degree, name", MATRIX)
def test_each_sp_mode_on_rank_threads_equals_one_card(patcher, one_card, ulysses_degrees,
                                                      world, sp_mode, strategy, degree, name):
    assert resolved(patcher, sp_mode, world).name == name
    coord, parallel, _ = node_dit(patcher, world, sp_mode)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, one_card) <= FP32_TOL
    assert strategies_that_ran(parallel) == {strategy}
    assert set(ulysses_degrees) == ({degree} if degree else set())


def test_ulysses_where_the_heads_do_not_divide_is_refused_naming_the_hybrid(patcher):
    with pytest.raises(SPModeError, match=r"12 does not divide by 8: set sp_mode to hybrid \(Ulysses in groups "
                                          r"of 4\), allgather or auto"):
        resolved(patcher, "ulysses", 8)


# ----------------------------------------------------------------------------- beside the other paths

def test_sharded_weights_prefetch_beside_the_all_to_alls(patcher, one_card, ulysses_degrees):
    """dit_weights=shard: block i+1's weights gather on the lane while block i's all-to-alls
    run on the coordinator."""
    coord, parallel, lane = node_dit(patcher, 4, MODE_FOR_OTHER_PATHS, dit_weights="shard")
    try:
        with coord:
            out = sample(parallel)
            parallel.multinpu_dit_shards.family.close()
            on_lane, on_ranks = lane.byte_counts(), coord.byte_counts()
    finally:
        lane.close()
    assert rel_diff(out, one_card) <= FP32_TOL
    assert strategies_that_ran(parallel) == {"ulysses"} and set(ulysses_degrees) == {4}
    # the weights came over the lane, the attention's all-to-alls over the ranks' own coordinator
    assert all(c["received"] > 0 and "all_to_all_v" not in c["by_op"] for c in on_lane), on_lane
    assert all(c["by_op"].get("all_to_all_v", {}).get("calls", 0) >= 2 * H12["num_layers"] for c in on_ranks)


@pytest.mark.parametrize("order", ["LoRA before the node", "LoRA after the node"])
def test_a_lora_with_ulysses_equals_one_card(patcher, one_card, lora, order):
    reference = sample(with_lora(patcher, lora))
    assert rel_diff(reference, one_card) > 1e-3  # the LoRA acts
    if order == "LoRA before the node":
        coord, parallel, _ = node_dit(with_lora(patcher, lora), 4, MODE_FOR_OTHER_PATHS)
    else:
        coord, parallel, _ = node_dit(patcher, 4, MODE_FOR_OTHER_PATHS)
    with coord:
        out = sample(parallel if order == "LoRA before the node" else with_lora(parallel, lora))
    assert rel_diff(out, reference) <= FP32_TOL
    assert strategies_that_ran(parallel) == {"ulysses"}


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8_tensorwise"])
def test_a_quantized_file_with_ulysses_equals_one_card(upstream, tmp_path, fmt):
    from tests.upstream.test_quantized_files import load, quantized_state_dict
    model = load(upstream, quantized_state_dict(upstream, fmt, config=H12), tmp_path, fmt)
    assert type(model.model.diffusion_model.blocks[0].attn.qkv_proj.weight).__name__ == "QuantizedTensor"
    reference = sample(model)
    coord, parallel, _ = node_dit(model, 4, MODE_FOR_OTHER_PATHS)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL
    assert strategies_that_ran(parallel) == {"ulysses"}
    assert parallel.multinpu_dit_replicas.uses_base(), parallel.multinpu_dit_replicas.base_problem


def test_the_fun_controlnet_with_ulysses_equals_one_card(upstream, patcher, one_card):
    from tests.upstream.test_fun_controlnet import with_fun_control
    controlled = with_fun_control(upstream, patcher, config=H12)
    reference = sample(controlled)
    assert rel_diff(reference, one_card) > 1e-3  # the control acts
    coord, parallel, _ = node_dit(controlled, 4, MODE_FOR_OTHER_PATHS)
    with coord:
        out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL
    assert strategies_that_ran(parallel) == {"ulysses"}


@pytest.mark.parametrize("order", ["cache before the node", "cache after the node"])
def test_a_step_cache_with_ulysses_equals_one_card(patcher, order):
    from tests.upstream.test_step_caches import sample_steps, with_cache
    reference = sample_steps(with_cache(patcher, "EasyCache"))
    assert rel_diff(reference, sample_steps(patcher)) > 1e-4  # steps were skipped
    if order == "cache before the node":
        coord, parallel, _ = node_dit(with_cache(patcher, "EasyCache"), 4, MODE_FOR_OTHER_PATHS)
    else:
        coord, parallel, _ = node_dit(patcher, 4, MODE_FOR_OTHER_PATHS)
        parallel = with_cache(parallel, "EasyCache")
    with coord:
        out = sample_steps(parallel)
    assert rel_diff(out, reference) <= FP32_TOL
    assert strategies_that_ran(parallel) == {"ulysses"}


# ----------------------------------------------------------------------------- ranks as processes

@pytest.mark.parametrize("world, dit_weights", [(2, "replicate"), (3, "replicate"), (2, "shard")])
def test_ulysses_with_ranks_as_processes_equals_one_card(patcher, one_card, ulysses_degrees,
                                                         world, dit_weights):
    from comfy.multidevice.roles.dit import workers_dit
    sp_mode = resolved(patcher, MODE_FOR_OTHER_PATHS, world).mode
    if dit_weights == "replicate":
        parallel, fan_out = workers(patcher, world, sp_mode=sp_mode)
    else:
        parallel = workers_dit(patcher, ["cpu"] * world, dit_weights="shard", prelude=PRELUDE, sp_mode=sp_mode)
        fan_out = parallel.multinpu_workers
    try:
        assert rel_diff(sample(parallel), one_card) <= FP32_TOL
        pool = fan_out.runner.pool
        assert pool.world_size == world and pool.setup.strategy.name == "ulysses"
        assert dit_weights == "replicate" or sum(pool.rank0_weights.family.gathered_bytes) > 0
    finally:
        fan_out.close()
    assert set(ulysses_degrees) == {world}  # rank 0, in this process
