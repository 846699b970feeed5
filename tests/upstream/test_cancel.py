"""ComfyUI's Cancel stops the ranks: upstream's own interrupt flag
(`comfy.model_management.interrupt_current_processing`), pressed while the ranks run, ends
`coordinator.run` with upstream's InterruptProcessingException (what ComfyUI reports as
"interrupted"), clears the flag as upstream's sampler does, and leaves the coordinator usable.
"""

from __future__ import annotations

import tempfile
import threading
import time

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator

WORLD = 3


def _press_cancel_after(seconds):
    import comfy.model_management
    timer = threading.Timer(seconds, comfy.model_management.interrupt_current_processing, (True,))
    timer.start()
    return timer


def _check_cancelled_and_usable(coord, job, blocks_done):
    import comfy.model_management
    comfy.model_management.interrupt_current_processing(False)
    timer = _press_cancel_after(0.3)
    start = time.monotonic()
    with pytest.raises(comfy.model_management.InterruptProcessingException):
        coord.run(job)
    elapsed = time.monotonic() - start
    timer.join()
    assert elapsed < 0.3 + 2.0, elapsed
    assert not comfy.model_management.processing_interrupted()
    assert max(blocks_done) - min(blocks_done) <= 1 and max(blocks_done) < 100_000
    assert not coord.closed
    out = coord.run(lambda rank, comm: comm.exchange([torch.full((1,), float(rank))], 0)[0])
    assert all(torch.equal(o, torch.arange(float(WORLD))) for o in out)


def test_cancel_through_the_real_flag_stops_ranks_at_their_next_exchange(upstream):
    blocks_done = [0] * WORLD

    def job(rank, comm):
        for _ in range(100_000):
            time.sleep(0.005)  # one block's compute, in no upstream op
            comm.exchange([torch.ones(2)], 0)
            blocks_done[rank] += 1

    with SequenceParallelCoordinator(["cpu"] * WORLD, backend="peer", timeout_s=30) as coord:
        _check_cancelled_and_usable(coord, job, blocks_done)


def test_cancel_seen_by_upstream_ops_on_a_rank_thread_stops_the_others(upstream):
    # upstream's layers check the flag themselves (and clear it) on whichever rank runs first
    import comfy.ops
    layer = comfy.ops.disable_weight_init.Linear(8, 8)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    blocks_done = [0] * WORLD

    def job(rank, comm):
        h = torch.ones(1, 8)
        for _ in range(100_000):
            time.sleep(0.005)
            h = torch.tanh(layer(h))
            comm.exchange([h], 0)
            blocks_done[rank] += 1

    with torch.inference_mode(), \
            SequenceParallelCoordinator(["cpu"] * WORLD, backend="peer", timeout_s=30) as coord:
        _check_cancelled_and_usable(coord, job, blocks_done)


def test_cancel_during_sp_sampling_of_the_real_dit_interrupts_and_the_next_prompt_matches(upstream):
    """Cancel pressed after the first step of upstream's sampler (the node's DiT on 2 CPU
    ranks): the sampling ends with upstream's InterruptProcessingException, and a second
    sampling on the same coordinator still equals one card (tolerance as in test_sampling)."""
    if not upstream.has_attention_hook:
        pytest.skip("refused on this ComfyUI (test_sampling checks that)")
    import comfy.model_management
    import comfy.sample
    import comfy.sd
    import safetensors.torch
    from tests.sp_cases import rel_diff
    from tests.upstream.test_h3_dit import FP32_TOL, tiny_state_dict
    from tests.upstream.test_sampling import latent_and_conditioning, node_dit, sample

    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/tiny_minimax_h3.safetensors"
        safetensors.torch.save_file(tiny_state_dict(upstream), path)
        patcher = comfy.sd.load_diffusion_model(path)
        reference = sample(patcher)
        coord, parallel = node_dit(patcher, 2)
        with coord:
            latent, positive = latent_and_conditioning(0)
            noise = comfy.sample.prepare_noise(latent, 0)
            steps_seen = []

            def press_cancel_after_the_first_step(step, *rest):
                steps_seen.append(step)
                comfy.model_management.interrupt_current_processing(True)

            raised_by_run = []
            real_run = coord.run

            def recording_run(*args, **kwargs):  # to see that the ranks' run ended the sampling
                try:
                    return real_run(*args, **kwargs)
                except BaseException as exc:
                    raised_by_run.append(type(exc))
                    raise
            coord.run = recording_run
            comfy.model_management.interrupt_current_processing(False)
            with torch.inference_mode(), \
                    pytest.raises(comfy.model_management.InterruptProcessingException):
                comfy.sample.sample(parallel, noise, 3, 1.0, "euler", "simple", positive, positive, latent,
                                    seed=0, disable_pbar=True, callback=press_cancel_after_the_first_step)
            assert steps_seen == [0]  # stopped in the second step's forward, on the ranks
            assert raised_by_run == [comfy.model_management.InterruptProcessingException]
            assert not comfy.model_management.processing_interrupted() and not coord.closed
            out = sample(parallel)
    assert rel_diff(out, reference) <= FP32_TOL


def test_a_pools_forward_leaves_upstreams_per_layer_cancel_to_the_block_starts(upstream):
    """The fact comfy_cancel.py stands on: upstream's layers check the Cancel flag through
    comfy.ops.run_every_op, looked up at every call. Inside checks_at_block_starts a set flag
    is left set (the pool's block-start check takes it); outside, the layer raises as usual."""
    import comfy.model_management
    import comfy.ops
    from comfy.multidevice.comfy_cancel import checks_at_block_starts
    if getattr(comfy.ops, "run_every_op", None) is None:
        pytest.skip("this ComfyUI's layers do not check the Cancel flag (nothing to defer)")
    layer = comfy.ops.disable_weight_init.Linear(4, 4)
    torch.nn.init.ones_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    x = torch.ones(1, 4)
    comfy.model_management.interrupt_current_processing(True)
    try:
        with checks_at_block_starts():
            assert torch.equal(layer(x), torch.full((1, 4), 4.0))
        assert comfy.model_management.processing_interrupted()
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            layer(x)
        assert not comfy.model_management.processing_interrupted()
    finally:
        comfy.model_management.interrupt_current_processing(False)
