"""A step's tensors that the previous step sent travel as their digest (workers/repeats.py):
the conditioning once per prompt, the latents every step, and a worker never uses a stale or
missing tensor."""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.workers.repeats import ReceivedTensors, Repeat, SentTensors
from comfy.multidevice.workers.wire import decode, encode


def _step(latents, context, small):
    return [latents, torch.tensor([999.0]), context], {"transformer_options": {"ref": [context, small]}}


def test_the_conditioning_travels_once_and_every_step_arrives_whole():
    sent, received = SentTensors(min_bytes=1024), ReceivedTensors()
    context = torch.randn(64, 32)  # 8 KiB: held
    small = torch.randn(4)  # below min_bytes: always sent
    for step in range(3):
        latents = torch.randn(16, 64) + step  # new every step
        message = _step(latents, context.clone(), small)  # a new tensor of the same values, as ComfyUI's cat makes
        packed, new = sent.pack(message)
        wire = decode(encode((packed, new)), max_bytes=1 << 20, what="a step")
        got = received.unpack(*wire)
        assert torch.equal(got[0][0], latents) and torch.equal(got[0][2], context)
        assert torch.equal(got[1]["transformer_options"]["ref"][0], context)
        assert torch.equal(got[1]["transformer_options"]["ref"][1], small)
        sizes = sorted(t.numel() for t in new.values())
        assert sizes == ([16 * 64, 64 * 32] if step == 0 else [16 * 64])  # the context once, in step 0 only
        assert isinstance(packed[0][2], Repeat) and packed[0][2] == packed[1]["transformer_options"]["ref"][0]


def test_a_changed_conditioning_is_sent_again_and_a_missing_one_is_an_error():
    sent, received = SentTensors(min_bytes=1024), ReceivedTensors()
    first = torch.randn(64, 32)
    received.unpack(*sent.pack([first]))
    changed = first.clone()
    changed[0, 0] += 1  # one value differs: a new digest
    packed, new = sent.pack([changed])
    assert len(new) == 1 and torch.equal(received.unpack(packed, new)[0], changed)
    other = ReceivedTensors()  # a worker that did not get the first message
    with pytest.raises(RuntimeError, match="does not hold it; the pool is out of step"):
        other.unpack(*sent.pack([changed]))
