"""Which thread touches which card in a threads-mode run: none without having made it current.

torch_npu gives a thread that touches the NPU without `set_device` card 0 (CARDS.md): a
context and streams there that no plan counts. The stand-in card API of tests/fake_cards.py
serves CPU "cards" (`cpu:0`, `cpu:1`, ...) and notes every such touch, over the coordinator's
start (backend, peer access), its rank threads, the sharded weights' prefetch lane and the
Ulysses exchange's helper threads.
"""

from __future__ import annotations

import threading

import pytest
import torch

from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.devices import synchronize
from comfy.multidevice.sp import minimax_h3
from comfy.multidevice.sp.minimax_h3 import enable_sequence_parallel
from comfy.multidevice.sp.strategies import SPMode
from tests import fake_cards
from tests.sp_cases import make_inputs, replicas, tiny_model


def test_the_fake_notes_a_thread_that_touches_a_card_it_did_not_make_current(monkeypatch):
    api = fake_cards.install(monkeypatch)
    helper = threading.Thread(target=lambda: synchronize(torch.device("cpu:1")), name="stray-helper")
    helper.start()
    helper.join(10)
    assert api.strays == [("stray-helper", "cpu:1", "current_stream"), ("stray-helper", "cpu:1", "Stream.synchronize")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,sp_mode,world", [
    ("peer", "allgather", 3), ("hccl", "allgather", 3), ("peer", SPMode("ulysses", overlap_chunks=2), 2)])
def test_no_thread_touches_a_card_it_did_not_make_current(monkeypatch, request, backend, sp_mode, world):
    if backend == "hccl":
        request.getfixturevalue("use_fake_hccl")
    model = tiny_model(seed=5)
    x, t, ctx, kw = make_inputs("plain")
    with torch.inference_mode():
        want = model(x, t, ctx, **kw)
    api = fake_cards.install(monkeypatch)
    # CPU tensors carry no index: a replica on "cpu" is where rank r's "cpu:r" is
    monkeypatch.setattr(minimax_h3, "module_device", lambda module: None)
    cards = [f"cpu:{r}" for r in range(world)]
    with SequenceParallelCoordinator(cards, backend=backend, timeout_s=30) as coord:
        sp = enable_sequence_parallel(replicas(model, world), coord, sp_mode=sp_mode, dit_weights="shard",
                                      prefetch=True)
        try:
            with torch.inference_mode():
                got = [sp(x, t, ctx, **kw) for _ in range(2)]
        finally:
            sp.close()
    assert api.calls > 0 and api.strays == []
    for out in got:
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(out, want))
