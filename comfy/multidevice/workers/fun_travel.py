"""Upstream's Fun ControlNet with ranks as processes: its block patches as data a worker runs.

A Fun ControlNet block patch (sp/fun_controlnet.py says which of its parts the adapter reads)
lives in the ComfyUI process: it holds the control tower (a small DiT) and the step's control
latent, which its own wrapper sets on rank 0 before every forward. A worker gets the same
facts as data, per forward: for each control patch its `active`, `strength` and control
latent (a tensor: after the first step held by digest, workers/repeats.py) and the tower,
sent with the first forward of a pool that uses it and named by a key after that; for each
block its index. Every rank then drives the control stream as the rank threads do
(`RankFunControl`: the stream over the whole sequence, each rank adding its own rows), exact.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from comfy.multidevice.sp.fun_controlnet import fun_control_patches
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.weights.module_copies import replica_on

_held_towers: dict[int, torch.nn.Module] = {}  # a worker's towers, by rank 0's key (one pool per process)


class TravellingControl:
    """What a rank reads of one control patch; unpickled in a worker, it holds the tower sent
    with it under its key for the later forwards that name only the key."""

    def __init__(self, key: int, active: bool, strength: float, control_latent, tower=None):
        self.key = key
        self.active = active
        self.strength = strength
        self.control_latent = control_latent
        self.tower = tower  # only in the first forward of a pool that uses it

    def __setstate__(self, state):
        tower = state.pop("tower", None)
        if tower is not None:
            _held_towers[state["key"]] = tower
        self.__dict__.update(state, tower=None)

    @property
    def model_patch(self):
        tower = self.tower if self.tower is not None else _held_towers.get(self.key)
        if tower is None:
            raise RuntimeError(f"the Fun ControlNet tower {self.key} never reached this worker; the pool "
                               "is out of step with rank 0, run the prompt again")
        return SimpleNamespace(model=tower)


class TravellingFunPatch:
    """A block's Fun ControlNet patch as a worker sees it; the adapter drives it (never called)."""

    def __init__(self, control_patch: TravellingControl, block_index: int):
        self.control_patch = control_patch
        self.block_index = block_index
        self.previous = None

    def __call__(self, args, extra):
        raise SequenceParallelError("a travelling Fun ControlNet patch runs only through the sequence-parallel "
                                    "adapter (sp/minimax_h3.py)")


def _on_cpu(module: torch.nn.Module) -> torch.nn.Module:
    """The module with its tensors on the CPU (itself when they are there already), to pickle."""
    if all(t.device.type == "cpu" for t in (*module.parameters(), *module.buffers())):
        return module
    return replica_on(module, "cpu")


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
            first = key not in sent_towers
            if first:
                sent_towers[key] = tower
            travelling = controls[id(control)] = TravellingControl(
                key, bool(control.active), float(control.strength), getattr(control, "control_latent", None),
                tower=_on_cpu(tower) if first else None)
        out[("double_block", index)] = TravellingFunPatch(travelling, index)
    return out
