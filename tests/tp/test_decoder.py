"""The tensor-parallel fan-out (comfy/multidevice/tp/decoder.py): inputs copied per rank, outputs
handed back, a dropped shard freed, a failing rank or a generation call refused without a hang."""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.comm.errors import CollectiveAborted
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.tp.decoder import build_tensor_parallel_decoder
from comfy.multidevice.tp.layers import TensorParallelError
from tests.qwen_decoder import build_miniature_decoder
from tests.tp.tp_cases import LAYOUTS, coordinator, inputs


def test_a_dropped_shard_is_freed_at_once():
    # No reference cycle through the embedding placeholder: dropping frees the card's memory
    # without waiting for the garbage collector.
    import gc
    import weakref
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg, seed=5)
    embeds, _ = inputs(cfg)
    with coordinator(2) as coord:
        tp = build_tensor_parallel_decoder(model, coord)
        tp(embeds=embeds)  # as ComfyUI calls it: the placeholders stay in the shards
        shards = [weakref.ref(s) for s in tp.shards]
        gc.disable()
        try:
            tp.drop_shard(1)
            assert shards[1]() is None and shards[0]() is tp.shards[0]
        finally:
            gc.enable()


def test_callers_inputs_are_not_overwritten():
    # The blocks write into their input buffer (as upstream's do); the fan-out gives each
    # rank its own copy, so the caller's tensor and the ranks never alias.
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg, seed=6)
    embeds, _ = inputs(cfg)
    before = embeds.clone()
    with coordinator(2) as coord:
        build_tensor_parallel_decoder(model, coord)(embeds=embeds)
    assert torch.equal(embeds, before)


def test_output_is_writable_under_no_grad_and_inference_mode_is_mirrored():
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg, seed=7)
    embeds, _ = inputs(cfg)
    with coordinator(2) as coord:
        tp = build_tensor_parallel_decoder(model, coord)
        with torch.no_grad():
            out, _ = tp(embeds=embeds)
            out[0, 0] = 1.0  # upstream's token weighting edits the output in place
        assert not out.is_inference()
        with torch.inference_mode():
            out, _ = tp(embeds=embeds)
        assert out.is_inference()


def test_a_failing_rank_does_not_hang_the_others():
    cfg = LAYOUTS["separate"]
    model = build_miniature_decoder(cfg)
    embeds, _ = inputs(cfg)
    with SequenceParallelCoordinator(["cpu"] * 2, backend="peer", timeout_s=20) as coord:
        tp = build_tensor_parallel_decoder(model, coord)

        def broken(x):
            raise RuntimeError("rank 1 MLP exploded")

        tp.shards[1].layers[0].mlp.forward = broken
        with pytest.raises(RuntimeError, match="exploded") as info:
            tp(embeds=embeds)
        assert not isinstance(info.value, CollectiveAborted)


def test_generation_is_refused():
    model = build_miniature_decoder(LAYOUTS["separate"])
    with coordinator(2) as coord:
        tp = build_tensor_parallel_decoder(model, coord)
        with pytest.raises(TensorParallelError, match="generation"):
            tp(embeds=torch.zeros(1, 2, 64), past_key_values=[])
