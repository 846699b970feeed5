"""Upstream's Fun ControlNet with ranks as processes: its block patches as data a worker runs.

A Fun ControlNet block patch (sp/fun_controlnet.py says which of its parts the adapter reads)
lives in the ComfyUI process: it holds the control tower (a small DiT) and the step's control
latent, which its own wrapper sets on rank 0 before every forward. A worker gets the same
facts as data (workers/wire.py records), per forward: for each control patch its `active`,
`strength` and control latent (a tensor: after the first step held by digest,
workers/repeats.py) and the tower (its class, constructor arguments and weights:
workers/towers.py), sent with the first forward of a pool that uses it and named by a key after
that; for each block its index. Every rank then drives the control stream as the rank threads do
(`RankFunControl`: the stream over the whole sequence, each rank adding its own rows), exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from comfy.multidevice.sp.fun_controlnet import fun_control_patches
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.workers.towers import tower_data, TowerData
from comfy.multidevice.workers.wire import wire_record

_held_towers: dict = {}  # a worker's towers, by rank 0's key (one pool per process)


@dataclass(eq=False)  # one object per control patch, shared by its block patches
class TravellingControl:
    """What a rank reads of one control patch. Received, it rebuilds the tower sent with it
    (workers/towers.py) and holds it under its key for the later forwards that name only the key."""

    key: int
    active: bool
    strength: float
    control_latent: object
    tower: TowerData | None = None  # only in the first forward of a pool that uses it

    @classmethod
    def received(cls, key: int, active: bool, strength: float, control_latent, tower: TowerData | None):
        if type(key) is not int or type(active) is not bool or type(strength) is not float:
            raise TypeError(f"a control patch is (key: int, active: bool, strength: float, ...), not "
                            f"({type(key).__name__}, {type(active).__name__}, {type(strength).__name__}, ...)")
        if tower is not None:
            if not isinstance(tower, TowerData):
                raise TypeError(f"a control patch's tower is sent as TowerData, not {type(tower).__name__}")
            _held_towers[key] = tower.build()
        return cls(key, active, strength, control_latent)

    @property
    def model_patch(self):
        tower = _held_towers.get(self.key)
        if tower is None:
            raise RuntimeError(f"the Fun ControlNet tower {self.key} never reached this worker; the pool "
                               "is out of step with rank 0, run the prompt again")
        return SimpleNamespace(model=tower)


wire_record("fun_control", make=TravellingControl.received)(TravellingControl)


@wire_record("fun_block_patch")
@dataclass(eq=False)
class TravellingFunPatch:
    """A block's Fun ControlNet patch as a worker sees it; the adapter drives it (never called)."""

    control_patch: TravellingControl
    block_index: int
    previous = None  # what a block patch chains: never anything here (refused at rank 0)

    def __call__(self, args, extra):
        raise SequenceParallelError("a travelling Fun ControlNet patch runs only through the sequence-parallel "
                                    "adapter (sp/minimax_h3.py)")


def travelling_dit_patches(dit: dict, sent_towers: dict) -> dict:
    """patches_replace["dit"] as a worker gets it: every entry an upstream Fun ControlNet block
    patch, as `TravellingFunPatch`; anything else is refused (SequenceParallelError naming it),
    since it is a function of this process. `sent_towers` (key -> tower): the towers this pool's
    workers already have; a tower sent now is added."""
    fun = fun_control_patches(dit)
    others = [key for key, patch in dit.items() if not (isinstance(key, tuple) and fun.get(key[1]) is patch)]
    if others:
        raise SequenceParallelError(
            f"ranks as processes cannot carry the block patches {others} of this forward (functions of the "
            "ComfyUI process; only upstream's Fun ControlNet travels to the workers): use ranks as threads "
            "for this workflow")
    controls: dict[int, TravellingControl] = {}
    out = {}
    for index, patch in fun.items():
        if patch.previous is not None:
            raise SequenceParallelError(
                f"ranks as processes cannot carry what the Fun ControlNet at block {index} chains "
                f"({type(patch.previous).__name__}, a function of the ComfyUI process): use ranks as threads")
        control = patch.control_patch
        travelling = controls.get(id(control))
        if travelling is None:
            tower = control.model_patch.model
            key = id(tower)  # held in sent_towers for the pool's life: the id is not reused meanwhile
            sent = None if key in sent_towers else tower_data(tower)  # refused here when it cannot travel
            sent_towers[key] = tower
            travelling = controls[id(control)] = TravellingControl(
                key, bool(control.active), float(control.strength), getattr(control, "control_latent", None),
                tower=sent)
        out[("double_block", index)] = TravellingFunPatch(travelling, index)
    return out
