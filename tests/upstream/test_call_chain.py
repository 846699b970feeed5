"""How many Python calls one step passes from our DIFFUSION_MODEL wrapper to the attention
kernel, on upstream's real H3 DiT sampled by `comfy.sample.sample` with the DiT the node sets up
(tests/upstream/call_chain.py counts them; docs/ARCHITECTURE.md, "From the sampler to the
attention kernel", has the table). The bounds are the counts measured after the seam refactor
(issue "One seam"; before it: 13, 11 and 8 of ours): a change may lower them, never raise them.
"""

from __future__ import annotations

import pytest

from tests.upstream.call_chain import hops, KernelStacks
from tests.upstream.test_sampling import node_dit, sample

# measured on the newest H3 tree (ranks as threads, W = 2, allgather): 22 frames, 10 ours, 8
# upstream's, 4 torch's (before the seam refactor: 25, 13 ours). Upstream's frames are printed,
# not bounded: they are upstream's to change.
MAX_OURS = 10
MAX_SWITCHES_IN_BLOCK = 2


def test_frames_from_the_fan_out_to_the_kernel(upstream, patcher):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    with KernelStacks(upstream.tree) as stacks:  # before the coordinator starts its rank threads
        coord, parallel = node_dit(patcher, 2)
        with coord:
            sample(parallel, steps=1)
    found = hops(stacks)
    print(f"\nranks as threads:\n{found.summary()}")
    assert found.count("ours") <= MAX_OURS
    assert found.switches_in_block() <= MAX_SWITCHES_IN_BLOCK


# ranks as processes: rank 0 runs the whole chain on the caller's thread, a worker from its
# serve loop (measured: 20 frames, 8 ours, for rank 0; 16, 6 ours, for a worker; before the
# seam refactor 23, 11 ours and 18, 8 ours)
MAX_OURS_RANK0_PROCESSES = 8
MAX_OURS_WORKER = 6


def test_frames_with_ranks_as_processes(upstream, patcher, tmp_path, monkeypatch):
    if not upstream.has_attention_hook:
        pytest.skip("this ComfyUI refuses sequence parallel (test_h3_dit.py checks that)")
    from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
    from comfy.multidevice.workers.pool_runner import workers_on_patcher
    from tests.upstream import call_chain
    from tests.upstream.test_workers import PRELUDE
    monkeypatch.setenv(TRUSTED_MODULES_ENV, f"{PRELUDE[0][0]},{call_chain.__name__}")
    monkeypatch.setenv(call_chain.CHAIN_DIR_ENV, str(tmp_path))
    parallel = patcher.clone()
    fan_out = workers_on_patcher(parallel, ["cpu"] * 2, timeout_s=120,
                                 prelude=(*PRELUDE, (call_chain.__name__, call_chain.record_in_worker.__name__)))
    try:
        with KernelStacks(upstream.tree, this_thread=True) as stacks:
            sample(parallel, steps=1)
    finally:
        fan_out.close()
    rank0 = call_chain.one_thread_hops(stacks.rank, call_chain.PROCESS_FAN_OUT_ENTRY)
    workers = [call_chain.one_thread_hops(frames, call_chain.WORKER_LOOP)
               for frames in call_chain.read_worker_chains(tmp_path)]
    assert len(workers) == 1, "the worker wrote no chain"
    for what, found in (("rank 0", rank0), ("worker", workers[0])):
        print(f"\nranks as processes, {what}:\n{found.summary()}")
    assert rank0.count("ours") <= MAX_OURS_RANK0_PROCESSES
    assert workers[0].count("ours") <= MAX_OURS_WORKER
    assert max(rank0.switches_in_block(), workers[0].switches_in_block()) <= MAX_SWITCHES_IN_BLOCK
