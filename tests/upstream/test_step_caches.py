"""Upstream's step caches (EasyCache, LazyCache from comfy_extras/nodes_easycache.py) with the
node's DiT role, applied before and after it, against the same cache on one card (fp32, 1e-5
of max |reference|). The caches decide per step from the model's inputs and outputs, so they
must run once per step on the caller's thread, not once per rank."""

from __future__ import annotations

import pytest

from tests.sp_cases import rel_diff
from tests.upstream.test_h3_dit import FP32_TOL
from tests.upstream.test_sampling import node_dit, sample

STEPS = 8


def sample_steps(model):
    return sample(model, steps=STEPS)


def with_cache(model, name):
    from comfy_extras import nodes_easycache
    node = {"EasyCache": nodes_easycache.EasyCacheNode, "LazyCache": nodes_easycache.LazyCacheNode}[name]
    return node.execute(model, 3.0, 0.0, 1.0, False).args[0]  # a high threshold: steps get skipped


@pytest.mark.parametrize("name", ["EasyCache", "LazyCache"])
def test_the_cache_skips_steps_on_one_card(hook, patcher, name):
    assert rel_diff(sample_steps(with_cache(patcher, name)), sample_steps(patcher)) > 1e-4


@pytest.mark.parametrize("order", ["cache before the node", "cache after the node"])
@pytest.mark.parametrize("name", ["EasyCache", "LazyCache"])
def test_step_cache_under_sp_equals_one_card(hook, patcher, name, order):
    reference = sample_steps(with_cache(patcher, name))
    if order == "cache before the node":
        coord, parallel = node_dit(with_cache(patcher, name), 3)
    else:
        coord, parallel = node_dit(patcher, 3)
        parallel = with_cache(parallel, name)
    with coord:
        out = sample_steps(parallel)
    assert rel_diff(out, reference) <= FP32_TOL
