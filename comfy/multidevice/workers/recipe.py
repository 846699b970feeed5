"""How a worker process builds its own copy of the DiT: a recipe, sent once per pool.

A module object cannot travel to another process cheaply (its weights would be copied into
the message), so rank 0 sends the recipe instead: a function's name and its keyword arguments
(data, workers/wire.py). Every rank calls it with its own device; a recipe over a checkpoint
file maps that file, so on one server the page cache holds the weights once for all the
processes. A worker calls only what this project registered as a recipe builder
(`recipe_builder`), or a function of a module its own environment trusts
(COMFYUI_MULTI_DEVICE_TRUSTED_MODULES: tests' stand-ins): a message cannot make it import or
call anything else.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV, trusted_modules_from_env
from comfy.multidevice.miniature.h3 import miniature_template
from comfy.multidevice.sp.split import RowSplit
from comfy.multidevice.sp.strategies import SPMode
from comfy.multidevice.weights.block_shards import BlockShardPlan
from comfy.multidevice.weights.checkpoint import SharedCheckpoint
from comfy.multidevice.weights.replicas import RankReplica, RankReplicas
from comfy.multidevice.weights.shard_layout import ProcessShard, rank_shard
from comfy.multidevice.workers.wire import check_sendable, register_record, wire_record, WireTypeError

RECIPE_BUILDERS: dict[str, Callable] = {}  # "module:function" -> a function a worker may build with

register_record(BlockShardPlan, "block_shard_plan")  # a sharded recipe's plan (plain data)
register_record(SPMode, "sp_mode")  # the build message's mode with its options (exchange_precision)
register_record(RowSplit, "sp_split")  # how the rows are shared, in the build message (plain data)


class RecipeError(ValueError):
    """A recipe that cannot be followed (unknown module or function, a build that raised)."""


def recipe_builder(function: Callable) -> Callable:
    """Register `function` as one a worker may build its DiT with, named `module:function`."""
    RECIPE_BUILDERS[f"{function.__module__}:{function.__qualname__}"] = function
    return function


def is_trusted_module(module: str) -> bool:
    """Whether this process's environment trusts `module` (itself or a package above it)."""
    return any(module == name or module.startswith(name + ".") for name in trusted_modules_from_env())


def trusted_function(module: str, function: str, what: str) -> Callable:
    """A registered recipe builder, or `function` of a module this process trusts; RecipeError
    naming `what` (e.g. "model recipe m:f") otherwise: nothing else is imported or called."""
    name = f"{module}:{function}"
    if name in RECIPE_BUILDERS:
        return RECIPE_BUILDERS[name]
    if not (isinstance(module, str) and isinstance(function, str) and is_trusted_module(module)):
        raise RecipeError(
            f"{what} cannot be found: a worker calls only the recipe builders this project registered "
            f"({', '.join(sorted(RECIPE_BUILDERS))}) and functions of the modules its own environment trusts "
            f"({TRUSTED_MODULES_ENV}={','.join(trusted_modules_from_env())!r}); register the function with "
            f"@recipe_builder, or add its module to {TRUSTED_MODULES_ENV} on every server")
    if not function.isidentifier():
        raise RecipeError(f"{what} cannot be found: {function!r} is not the name of a function")
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise RecipeError(f"{what} cannot be found ({exc}); name an importable module and a function in it") from None


@wire_record("model_recipe")
@dataclass(frozen=True)
class ModelRecipe:
    """`module:function(device=..., **kwargs)` returns one rank's DiT on that device; a
    `sharded` recipe's function is also given the rank and world size and returns that rank's
    shard (weights/shard_layout.py `ProcessShard`: dit_weights="shard"). The kwargs are data that
    can travel (workers/wire.py), refused here naming the key otherwise."""

    module: str
    function: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    sharded: bool = False

    def __post_init__(self):
        if not (isinstance(self.module, str) and isinstance(self.function, str) and isinstance(self.sharded, bool)
                and isinstance(self.kwargs, dict)):
            raise RecipeError(f"a model recipe is (module: str, function: str, kwargs: dict, sharded: bool), not "
                              f"({type(self.module).__name__}, {type(self.function).__name__}, "
                              f"{type(self.kwargs).__name__}, {type(self.sharded).__name__})")
        try:
            check_sendable(self.kwargs, name=f"the kwargs of model recipe {self.describe()}")
        except WireTypeError as exc:
            raise RecipeError(f"{exc}: give the recipe data (paths, numbers, strings, tensors, dtypes)") from None

    def describe(self) -> str:
        return f"{self.module}:{self.function}"

    def build(self, device: torch.device | str, rank: int = 0, world_size: int = 1):
        """(the rank's DiT module, its block-weights handle or None when it holds every weight)."""
        make = trusted_function(self.module, self.function, f"model recipe {self.describe()}")
        if self.sharded:
            shard = make(device=device, rank=rank, world_size=world_size, **self.kwargs)
            if not isinstance(shard, ProcessShard):
                raise RecipeError(f"sharded model recipe {self.describe()} returned {type(shard).__name__}, "
                                  "not a ProcessShard")
            return shard.module, shard.weights
        model = make(device=device, **self.kwargs)
        if not isinstance(model, torch.nn.Module):
            raise RecipeError(f"model recipe {self.describe()} returned {type(model).__name__}, "
                              "not a torch module")
        return model, None


@recipe_builder
def miniature_from_shared_checkpoint(path: str, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The miniature H3 DiT of a checkpoint file through the shared read-only base (a CPU rank's
    weights are views of the mapped file; a card's are copied from it)."""
    return RankReplicas(SharedCheckpoint.open(path), [device], template=miniature_template(path), load=True)[0].module


@recipe_builder
def miniature_shard_from_shared_checkpoint(path: str, device: torch.device | str = "cpu", rank: int = 0,
                                           world_size: int = 1, plan=None) -> ProcessShard:
    """Rank `rank`'s shard of the miniature H3 DiT of a checkpoint file (its block tensors and
    the non-block weights; `plan`: rank 0's, checked)."""
    replica = RankReplica(SharedCheckpoint.open(path), device, rank=rank, template=miniature_template(path))
    return rank_shard(replica, rank, world_size, plan)
