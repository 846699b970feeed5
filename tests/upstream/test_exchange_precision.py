"""exchange_precision int8 through upstream's own sampling: within the documented bound of exact.

The 12-head tiny H3 file of test_sp_modes.py, loaded by `comfy.sd.load_diffusion_model` and
sampled by `comfy.sample.sample`; the DiT set up by the node's DiT role (roles/dit.py, what
apply_role_plan calls with the node's exchange_precision as an SPMode) on rank threads and as
worker processes, allgather and ulysses. The relative error against the exact sampling on one
card (||out - exact|| / ||exact||) stays under comm/compression.py STEP_REL_ERROR_BOUND, and is
above zero: the exchange was compressed.
"""

from __future__ import annotations

import pytest

from comfy.multidevice.comm.compression import STEP_REL_ERROR_BOUND
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.sp.minimax_h3 import WRAPPER_KEY
from comfy.multidevice.sp.strategies import SPMode
from tests.sp_cases import frobenius_rel
from tests.upstream.test_sampling import sample
from tests.upstream.test_sp_modes import H12, one_card, tiny_file, _needs_the_hook  # noqa: F401 - fixtures
from tests.upstream.test_workers import trusted_stand_ins, workers  # noqa: F401 - an autouse fixture

pytestmark = pytest.mark.timeout(300)  # the worker cases start processes


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
@pytest.mark.parametrize("world", [2, 4])
def test_int8_on_rank_threads_within_the_bound(patcher, one_card, world, mode):
    from comfy.multidevice.roles.dit import sequence_parallel_dit
    with SequenceParallelCoordinator(["cpu"] * world, backend="peer", timeout_s=60) as coord:
        parallel = sequence_parallel_dit(patcher, coord.devices, coord, "replicate",
                                         sp_mode=SPMode(mode, exchange_precision="int8"))
        out = sample(parallel)
    fan_out = parallel.wrappers["diffusion_model"][WRAPPER_KEY][0]
    strategies = [state.strategy for state in fan_out.runner.last_rank_states]
    assert {(s.name, s.precision) for s in strategies} == {(mode, "int8")}
    assert 0 < frobenius_rel(out, one_card) <= STEP_REL_ERROR_BOUND["int8"]


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
def test_int8_through_the_node_within_the_bound(patcher, one_card, mode):
    """The node's own input (configure_parallel, 4 CPU cards, rank threads): every rank's
    strategy compressed, the sampling within the bound of one card's exact one."""
    from comfy_extras.nodes_multinpu import configure_parallel
    from tests.node_cases import inputs
    _, clip, video_vae, audio_vae = inputs()
    parallel = configure_parallel(patcher, clip, video_vae, audio_vae, npu_count=4, device_kind="cpu",
                                  dit_ranks="threads", sp_mode=mode, exchange_precision="int8")[0]
    out = sample(parallel)
    states = parallel.wrappers["diffusion_model"][WRAPPER_KEY][0].runner.last_rank_states
    assert {(s.strategy.name, s.strategy.precision) for s in states} == {(mode, "int8")}
    assert 0 < frobenius_rel(out, one_card) <= STEP_REL_ERROR_BOUND["int8"]


@pytest.mark.parametrize("mode", ["allgather", "ulysses"])
def test_int8_with_ranks_as_processes_within_the_bound(patcher, one_card, mode):
    parallel, fan_out = workers(patcher, 2, sp_mode=SPMode(mode, exchange_precision="int8"))
    try:
        out = sample(parallel)
        setup = fan_out.runner.pool.setup
        assert (setup.strategy.name, setup.strategy.precision) == (mode, "int8")
    finally:
        fan_out.close()
    assert 0 < frobenius_rel(out, one_card) <= STEP_REL_ERROR_BOUND["int8"]
