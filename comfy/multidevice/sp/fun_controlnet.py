"""Upstream's MiniMax-H3 Fun ControlNet under sequence parallel: exact, by a replicated control stream.

Upstream's `MiniMaxH3FunControlNetApply` patches the blocks at its injection layers with an
object whose `control_patch` runs a second, small DiT (the control tower) beside the base:
at the first injection layer it builds a control stream from the *full* hidden state before
that block, each injection layer advances the stream by one control block (full self-attention
over the stream) and adds `strength * after_proj(stream)` to the base block's output, audio rows
zeroed. The stream never reads the base hidden state again, so every rank can compute it over
the whole sequence and add just its own rows: the result equals one card. What this costs:
every rank runs the control blocks on the full sequence (5 blocks against the base's 50).

Facts relied on (upstream `comfy_extras/nodes_minimax_h3.py` and `comfy/ldm/minimax/controlnet.py`,
the newest stored versions, 13a83ce7 and 7ffa5d85):
  block patch   .control_patch, .block_index, .previous (the replacement it chained, or None)
  control_patch .model_patch.model (MiniMaxH3FunControl: .injection_layers, .init_stream(h,
                latent, layout, t_emb), .step(i, stream, t_emb, mod_segments, rope_freqs,
                transformer_options) -> (stream, skip)), .active (set per step by its own
                DIFFUSION_MODEL wrapper, which the fan-out runs once on the caller's thread),
                .control_latent (prepared by that wrapper), .strength
  layout        .audio_pos: the full-sequence rows of the target audio
Per rank state (the stream, a copy of the control tower on the rank's device) lives here, never
in the shared patch object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from comfy.multidevice.sp.plan import ShardPlan, take_rows
from comfy.multidevice.weights.module_copies import ReplicaCache


def _has_control_api(patch) -> bool:
    control = patch.control_patch
    tower = getattr(getattr(control, "model_patch", None), "model", None)
    return (hasattr(patch, "previous") and hasattr(control, "active") and hasattr(control, "strength")
            and all(callable(getattr(tower, name, None)) for name in ("init_stream", "step"))
            and hasattr(tower, "injection_layers"))


@dataclass(eq=False)  # one object per control patch, shared by its blocks
class FunControl:
    """What every rank reads of one control patch in one forward, in both rank engines: rank 0
    describes it from upstream's object (`described_fun_controls`); ranks as processes receive
    it as data (workers/towers.py: the tower travels once per pool, then by `tower_key`)."""

    key: int  # the control patch, within one forward
    active: bool
    strength: float
    control_latent: Any
    tower_key: int
    tower: Any  # the control tower module (received: what the worker rebuilt or holds)


@dataclass(eq=False)
class FunBlockControl:
    """A Fun ControlNet's patch of one block; `previous`: the replacement upstream's patch chained."""

    control: FunControl
    block_index: int
    previous: Any = None


def described_fun_controls(block_patches: dict) -> dict[int, FunBlockControl]:
    """{block index: FunBlockControl} for the Fun ControlNet patches among patches_replace["dit"]:
    upstream's block patches that follow the API above (others are refused by
    `unsupported_control_patches`), and ones already described (what a worker receives)."""
    described: dict[int, FunControl] = {}  # id(upstream control patch) -> its description
    out = {}
    for key, patch in block_patches.items():
        if not (isinstance(key, tuple) and key[0] == "double_block"):
            continue
        if isinstance(patch, FunBlockControl):
            out[key[1]] = patch
        elif getattr(patch, "control_patch", None) is not None and _has_control_api(patch):
            control = patch.control_patch
            if id(control) not in described:
                tower = control.model_patch.model
                described[id(control)] = FunControl(id(control), bool(control.active), float(control.strength),
                                                    getattr(control, "control_latent", None), id(tower), tower)
            out[key[1]] = FunBlockControl(described[id(control)], key[1], patch.previous)
    return out


def unsupported_control_patches(block_patches: dict) -> list[str]:
    """Block patches that carry a full-sequence control stream this module cannot drive."""
    return [f"{type(patch).__name__} ({key[1] if isinstance(key, tuple) else key})"
            for key, patch in block_patches.items()
            if getattr(patch, "control_patch", None) is not None and not _has_control_api(patch)]


class RankFunControl:
    """One rank's side of every Fun ControlNet of a forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self._towers: dict[int, ReplicaCache] = {}   # tower key -> copies per device
        self._streams: dict[int, torch.Tensor] = {}  # control key -> this forward's stream
        self._pristine: torch.Tensor | None = None   # the full hidden state before block 0

    def start_forward(self, full_h_before_block_0: torch.Tensor, patches: dict[int, FunBlockControl]) -> None:
        self._streams = {}
        self._pristine = full_h_before_block_0.clone() if patches else None

    def _tower(self, control: FunControl):
        cache = self._towers.get(control.tower_key)
        if cache is None or cache.module is not control.tower:
            cache = self._towers[control.tower_key] = ReplicaCache(control.tower, "Fun ControlNet tower")
        return cache.get(self.device)

    def add_control(self, index: int, block: FunBlockControl, full_args: dict, local_out: torch.Tensor,
                    plan: ShardPlan) -> torch.Tensor:
        """local_out plus this rank's rows of the control patch's contribution at block `index`."""
        control = block.control
        if not control.active:
            return local_out
        tower = self._tower(control)
        step = tower.injection_layers.index(index)
        if step == 0:
            latent = control.control_latent.to(self.device)
            stream = tower.init_stream(self._pristine, latent, full_args["layout"], full_args["t_emb"])
        else:
            stream = self._streams[control.key]
        stream, skip = tower.step(step, stream, full_args["t_emb"], full_args["mod_segments"],
                                  full_args["rope_freqs"], transformer_options=full_args["transformer_options"])
        self._streams[control.key] = stream
        skip[full_args["layout"].audio_pos.to(skip.device)] = 0
        return local_out.add_(take_rows(skip, plan), alpha=control.strength)
