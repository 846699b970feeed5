"""Stage unload and offload: drop the device residency of per-rank replicas, keep the base in RAM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from comfy.multidevice.devices import accelerator_api
from comfy.multidevice.weights.replicas import RankReplica, RankReplicas

log = logging.getLogger(__name__)


def _replicas_of(stage: Any) -> list[RankReplica]:
    if isinstance(stage, RankReplica):
        return [stage]
    if isinstance(stage, RankReplicas):
        return list(stage.replicas)
    if isinstance(stage, Iterable) and not isinstance(stage, (str, bytes, Mapping, torch.nn.Module)):
        return [r for item in stage for r in _replicas_of(item)]
    raise ValueError(f"offload_components takes RankReplica or RankReplicas objects "
                     f"(or lists of them), got {type(stage).__name__}")


def release_cached_device_memory(device_types: Iterable[str]) -> list[str]:
    """Empty the caching allocator of each device type present (npu, cuda); return those emptied."""
    emptied = []
    for kind in sorted(set(device_types)):
        # only a kind whose runtime is already loaded can hold cached memory
        module = accelerator_api(kind) if kind == "cuda" or hasattr(torch, kind) else None
        if module is None or not hasattr(module, "empty_cache"):
            continue
        if kind == "cuda" and not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            continue
        module.empty_cache()
        emptied.append(kind)
    return emptied


def offload_components(*components: Any) -> int:
    """Unload every replica of the given families (per-rank clones of each component) and
    release the allocators' cached device memory; return the bytes dropped."""
    replicas = [r for c in components for r in _replicas_of(c)]
    dropped = sum(r.unload() for r in replicas)
    emptied = release_cached_device_memory(r.device.type for r in replicas)
    log.info("offloaded %d replica(s): %d bytes dropped, allocator cache emptied for %s",
             len(replicas), dropped, ", ".join(emptied) or "no device type")
    return dropped
