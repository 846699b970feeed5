"""A Fun ControlNet tower as data (comfy/multidevice/workers/towers.py): an allowed class, its
constructor arguments and its weights, rebuilt on arrival around the sent tensors and checked
against rank 0's; a class nobody allowed, or a tower that would not come out the same, is
refused at rank 0 naming why. The stand-in tower of tests/sp/test_fun_controlnet.py (upstream's
own: tests/upstream/test_workers.py)."""

from __future__ import annotations

import pytest
import torch

from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.workers.towers import tower_data, TowerData
from comfy.multidevice.workers.wire import decode, encode
from tests.sp.test_fun_controlnet import _ControlTowerStandIn

STAND_INS = "tests.sp.test_fun_controlnet"


class _TowerHere(torch.nn.Module):
    """A tower class of this test module (trusted only when the test says so)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3, 3)
        self.mode = "dense"


class _TowerOfAWidth(torch.nn.Module):
    def __init__(self, width: int):  # an argument nothing reads back: a trusted class is built without any
        super().__init__()
        self.proj = torch.nn.Linear(width, width)


class _TowerWithACache(_TowerHere):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.ones(2), persistent=False)  # made here, never in a state dict


def test_a_trusted_tower_arrives_with_the_sent_weights_as_views(monkeypatch):
    monkeypatch.setenv(TRUSTED_MODULES_ENV, STAND_INS)
    tower = _ControlTowerStandIn()
    tower.scale.data.fill_(0.25)
    data = tower_data(tower)
    assert data.cls == f"{STAND_INS}:_ControlTowerStandIn" and data.arguments == {}
    buffer = torch.frombuffer(encode(data), dtype=torch.uint8).clone()
    arrived = decode(buffer.numpy(), max_bytes=buffer.numel(), what="a tower")
    built = arrived.build()
    assert type(built) is _ControlTowerStandIn and float(built.scale) == 0.25 and not built.scale.requires_grad
    assert buffer.data_ptr() <= built.scale.data_ptr() < buffer.data_ptr() + buffer.numel()  # no copy


def test_a_tower_class_nobody_allowed_is_refused_at_rank0(monkeypatch):
    monkeypatch.delenv(TRUSTED_MODULES_ENV, raising=False)
    with pytest.raises(SequenceParallelError, match=rf"tower {STAND_INS}:_ControlTowerStandIn is not a class a worker "
                                                    rf"builds \(upstream's comfy.ldm.minimax.controlnet:"
                                                    rf"MiniMaxH3FunControl, or one of a module in {TRUSTED_MODULES_ENV}\); "
                                                    "use ranks as threads"):
        tower_data(_ControlTowerStandIn())
    forged = TowerData("os:system", {}, {}, {})
    with pytest.raises(SequenceParallelError, match="tower os:system is not a class a worker builds"):
        forged.build()


def test_a_tower_that_would_not_come_out_the_same_is_refused_at_rank0(monkeypatch):
    monkeypatch.setenv(TRUSTED_MODULES_ENV, __name__)
    tower = _TowerHere()
    assert type(tower_data(tower).build()) is _TowerHere
    tower.mode = "sparse"  # set after construction: a worker's build would say "dense"
    with pytest.raises(SequenceParallelError, match=r"does not come out as rank 0's from its arguments: the tower: "
                                                    r".*'mode': 'sparse'.* on rank 0, .*'mode': 'dense'.* rebuilt"):
        tower_data(tower)
    tower.mode = "dense"
    tower.table = torch.ones(2)  # a tensor outside the state dict
    with pytest.raises(SequenceParallelError, match="keeps a tensor outside its state dict"):
        tower_data(tower)
    del tower.table
    tower.proj.register_buffer("cache", torch.ones(2), persistent=False)  # a tensor the rebuilt tower lacks
    with pytest.raises(SequenceParallelError, match=r"proj: .*\['weight', 'bias', 'cache'\]\) on rank 0, .*"
                                                    r"\['weight', 'bias'\]\) rebuilt"):
        tower_data(tower)
    with pytest.raises(SequenceParallelError, match=r"has tensors outside its state dict \(\['cache'\]\)"):
        tower_data(_TowerWithACache())
    with pytest.raises(SequenceParallelError, match=r"_TowerOfAWidth cannot be rebuilt from its arguments and "
                                                    r"weights \(TypeError: .*width"):
        tower_data(_TowerOfAWidth(4))
