"""The node's split (mixed cards) through upstream's own sampling: uneven rows equal one card.

Upstream's tiny H3 file, loaded by `comfy.sd.load_diffusion_model` and sampled by
`comfy.sample.sample`, its DiT set up by the node itself (`configure_parallel`, 4 CPU rank
threads; the other three inputs are the CPU suite's small stand-ins) and by the node's processes
path (workers/pool_runner.py `workers_on_patcher`, the split resolved as the node resolves it),
against the same sampling on one card (fp32, 1e-5 of max |reference|, test_h3_dit.py says why).
"""

from __future__ import annotations

import pytest

from comfy.multidevice.sp.minimax_h3 import WRAPPER_KEY
from comfy.multidevice.sp.plan import is_even, shard_sizes
from comfy.multidevice.sp.split import parse_split
from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL
from tests.upstream.test_sampling import sample
# the refusal skip and one card's sampling of this module's (conftest's) tiny file
from tests.upstream.test_sp_modes import _needs_the_hook, one_card  # noqa: F401 - fixtures
from tests.upstream.test_workers import trusted_stand_ins, workers  # noqa: F401 - a fixture

pytestmark = pytest.mark.timeout(300)  # the worker cases start processes


@pytest.mark.parametrize("split", ["auto", "3,1,2,1.5"])
def test_split_through_the_node_on_rank_threads_equals_one_card(patcher, one_card, split, caplog):
    from comfy_extras.nodes_multinpu import configure_parallel
    from tests.node_cases import inputs
    caplog.set_level("INFO")
    _, clip, video_vae, audio_vae = inputs()
    parallel = configure_parallel(patcher, clip, video_vae, audio_vae, npu_count=4, device_kind="cpu",
                                  dit_ranks="threads", sp_mode="auto", split=split)[0]
    out = sample(parallel)
    assert rel_diff(out, one_card) <= FP32_TOL
    states = parallel.wrappers["diffusion_model"][WRAPPER_KEY][0].runner.last_rank_states
    assert {s.strategy.name for s in states} == {"allgather"}
    sizes = states[0].plan.sizes
    assert len(set(sizes)) > 1 or split == "auto", sizes  # explicit weights: uneven rows for sure
    if split != "auto":
        assert sizes == shard_sizes(sum(sizes), 4, (3, 1, 2, 1.5))
    else:
        assert caplog.text.count("split auto: rank") == 4


@pytest.mark.parametrize("world, split", [(2, "auto"), (3, "1,2.5,1")])
def test_split_with_ranks_as_processes_equals_one_card(patcher, one_card, world, split):
    rows = parse_split(split, world)
    parallel, fan_out = workers(patcher, world, sp_mode="allgather", split=rows)
    try:
        assert rel_diff(sample(parallel), one_card) <= FP32_TOL
        setup = fan_out.runner.pool.setup
        assert setup.weights is not None and len(setup.weights) == world
        assert split == "auto" or not is_even(setup.weights)
    finally:
        fan_out.close()
