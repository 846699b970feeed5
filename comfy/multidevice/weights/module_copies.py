"""Per-device copies of one module: `replica_on` and `ReplicaCache`, for stages that run a copy per card.

`replica_on(module, device)` copies a module with its parameters and buffers going straight
to `device` (no whole-module CPU copy on the way). `ReplicaCache` hands out one module per
device: the module itself on the device its weights live on, a cached copy on the others
(the video VAE's decoder, a Fun ControlNet's control stream).
"""

from __future__ import annotations

import copy
import logging

import torch

from comfy.multidevice.devices import module_device
from comfy.multidevice.tensor_bytes import module_bytes

log = logging.getLogger(__name__)


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

    def _at_home(self, device: torch.device) -> bool:
        home = module_device(self.module)
        return home is None or home == device

    def get(self, device) -> torch.nn.Module:
        device = torch.device(device)
        if self._at_home(device):
            return self.module
        key = str(device)
        if key not in self._copies:
            log.info("%s: building a replica on %s", self.what, device)
            self._copies[key] = replica_on(self.module, device)
        return self._copies[key]

    def holds(self, device) -> bool:
        """Whether get(device) returns without building anything."""
        device = torch.device(device)
        return self._at_home(device) or str(device) in self._copies

    def copy_bytes(self, device) -> int:
        """Bytes a copy on `device` takes (0 where the module itself serves)."""
        return 0 if self._at_home(torch.device(device)) else module_bytes(self.module)

    def drop(self, device) -> int:
        """Forget the copy on `device` (rebuilt by the next get); return its bytes."""
        return module_bytes(self._copies.pop(str(torch.device(device)), None))
