"""Per-device copies of a module for multi-device stages that run one replica per card.

`replica_on(module, device)` copies a module with its parameters and buffers going straight
to `device` (no whole-module CPU copy on the way). `ReplicaCache` hands out one module per
device: the module itself on the device its weights live on, a cached copy on the others.
"""

from __future__ import annotations

import copy
import logging

import torch

log = logging.getLogger(__name__)


def module_device(module) -> torch.device | None:
    """The device of the module's first parameter (or buffer); None for a tensor-less object."""
    if not isinstance(module, torch.nn.Module):
        return None
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def replica_on(module: torch.nn.Module, device) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers live on `device` (frozen parameters).

    deepcopy is told up front what every tensor becomes, so each tensor is copied once,
    source -> device, and everything else (structure, plain attributes) is copied as usual.
    """
    device = torch.device(device)
    memo = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to(device, copy=True), requires_grad=False)
    for b in module.buffers():
        memo[id(b)] = b.detach().to(device, copy=True)
    return copy.deepcopy(module, memo)


class ReplicaCache:
    """One module per device: the module itself where its weights are, a cached copy elsewhere."""

    def __init__(self, module, what: str = "module"):
        self.module = module
        self.what = what
        self._copies: dict = {}

    def get(self, device) -> torch.nn.Module:
        device = torch.device(device)
        home = module_device(self.module)
        if home is None or home == device:
            return self.module
        key = str(device)
        if key not in self._copies:
            log.info("%s: building a replica on %s", self.what, device)
            self._copies[key] = replica_on(self.module, device)
        return self._copies[key]

    def clear(self) -> None:
        self._copies.clear()
