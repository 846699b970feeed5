"""How a worker process builds its own copy of the DiT: a recipe, sent once per pool.

A module object cannot travel to another process cheaply (its weights would be copied into
the message), so rank 0 sends the recipe instead: an importable function and its keyword
arguments. Every rank calls it with its own device; a recipe over a checkpoint file maps that
file, so on one server the page cache holds the weights once for all the processes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch

from comfy.multidevice.miniature.h3 import MiniatureH3Model, read_miniature_config
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.replicas import RankReplica, RankReplicas
from comfy.multidevice.weights.shard_layout import rank_shard, RankShard


class RecipeError(ValueError):
    """A recipe that cannot be followed (unknown module or function, a build that raised)."""


@dataclass(frozen=True)
class ModelRecipe:
    """`module:function(device=..., **kwargs)` returns one rank's DiT on that device; a
    `sharded` recipe's function is also given the rank and world size and returns that rank's
    shard (weights/shard_layout.py `RankShard`: dit_weights="shard")."""

    module: str
    function: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    sharded: bool = False

    def describe(self) -> str:
        return f"{self.module}:{self.function}"

    def build(self, device: torch.device | str, rank: int = 0, world_size: int = 1):
        """(the rank's DiT module, its block-weights handle or None when it holds every weight)."""
        try:
            make = getattr(importlib.import_module(self.module), self.function)
        except (ImportError, AttributeError) as exc:
            raise RecipeError(f"model recipe {self.describe()} cannot be found ({exc}); name an "
                              "importable module and a function in it") from None
        if self.sharded:
            shard = make(device=device, rank=rank, world_size=world_size, **self.kwargs)
            if not isinstance(shard, RankShard):
                raise RecipeError(f"sharded model recipe {self.describe()} returned {type(shard).__name__}, "
                                  "not a RankShard")
            return shard.module, shard.weights
        model = make(device=device, **self.kwargs)
        if not isinstance(model, torch.nn.Module):
            raise RecipeError(f"model recipe {self.describe()} returned {type(model).__name__}, "
                              "not a torch module")
        return model, None


def _miniature_template(path: str) -> torch.nn.Module:
    config, dtype = read_miniature_config(path)
    with torch.device("meta"):  # the template only lends its structure
        return MiniatureH3Model(config, dtype=dtype)


def miniature_from_shared_checkpoint(path: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The miniature H3 DiT of a checkpoint file through the shared read-only base (a CPU rank's
    weights are views of the mapped file; a card's are copied from it)."""
    return RankReplicas(SharedCheckpoint.open(path), [device], template=_miniature_template(path), load=True)[0].module


def miniature_shard_from_shared_checkpoint(path: str, device: torch.device | str = "cpu", rank: int = 0,
                                           world_size: int = 1, plan=None) -> RankShard:
    """Rank `rank`'s shard of the miniature H3 DiT of a checkpoint file (its block tensors and
    the non-block weights; `plan`: rank 0's, checked)."""
    replica = RankReplica(SharedCheckpoint.open(path), device, rank=rank, template=_miniature_template(path))
    return rank_shard(replica, rank, world_size, plan)
