"""A ComfyUI MODEL's DiT rebuilt in a worker process, with the same weights as rank 0's.

Rank 0 (`comfy_dit_recipe`) sends how the MODEL was made, not its weights: the loader's own
factory and arguments (ComfyUI records them on the patcher as `cached_patcher_init`, the same
record its multi-GPU clone re-runs), the patcher's weight patches (LoRAs: small tensors)
pickled once and named by their SHA-256, and ComfyUI's command-line settings. The worker
(`build_comfy_dit`) sets those settings, re-runs the loader (the file is mapped: on one
server the page cache holds it once), checks the patches against their hash, and builds its
replica as the rank threads do (weights/comfy_replicas.py: ComfyUI's own patch math), or
with dit_weights="shard" only its rank's shard of it (weights/shard_layout.py). A MODEL whose
patch set changes gets a new recipe (`patches_digest` differs) and a new pool.
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
from typing import Any, Sequence

import torch

from comfy.multidevice.weights.block_shards import BlockShardPlan
from comfy.multidevice.weights.comfy_replicas import checkpoint_path_of, comfy_diffusion_model_replicas
from comfy.multidevice.weights.shard_layout import rank_shard, RankShard
from comfy.multidevice.workers.recipe import ModelRecipe, RecipeError


def patches_digest(model_patcher: Any) -> tuple[bytes, str]:
    """The patcher's weight patches pickled, and their SHA-256 (hex)."""
    try:
        blob = pickle.dumps(dict(getattr(model_patcher, "patches", None) or {}), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise RecipeError(f"the MODEL's weight patches cannot be sent to a worker process ({exc}); "
                          "use ranks as threads for this MODEL") from None
    return blob, hashlib.sha256(blob).hexdigest()


def _comfy_settings() -> dict:
    """ComfyUI's parsed command-line settings (a worker parses no command line of ComfyUI's)."""
    import comfy.cli_args  # lazy: ComfyUI is optional for this module
    settings = {}
    for name, value in vars(comfy.cli_args.args).items():
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - a setting that cannot travel stays the worker's default
            continue
        settings[name] = value
    return settings


def comfy_dit_recipe(model_patcher: Any, prelude: Sequence[tuple[str, str]] = ()) -> ModelRecipe:
    """Rank 0: the recipe a worker rebuilds `model_patcher`'s DiT from. `prelude`: functions
    (module, name) a worker calls first (e.g. stand-ins a test installs)."""
    init = getattr(model_patcher, "cached_patcher_init", None)
    if not (isinstance(init, tuple) and len(init) >= 2 and callable(init[0])):
        raise RecipeError("this MODEL does not record how it was loaded (cached_patcher_init), so a "
                          "worker process cannot load it; load it with a core loader (e.g. Load "
                          "Diffusion Model) or use ranks as threads")
    try:  # unpickled by the worker only once ComfyUI's settings are set: it imports ComfyUI
        loader = pickle.dumps((init[0], tuple(init[1]), init[2] if len(init) > 2 else None))
    except Exception as exc:
        raise RecipeError(f"the MODEL's loader {getattr(init[0], '__name__', init[0])!r} cannot be named to a "
                          f"worker process ({exc}); use ranks as threads") from None
    blob, digest = patches_digest(model_patcher)
    return ModelRecipe(__name__, "build_comfy_dit", {
        "loader": loader, "patches": blob, "digest": digest, "path": checkpoint_path_of(model_patcher),
        "settings": _comfy_settings(), "prelude": tuple(prelude)})


def sharded_recipe(recipe: ModelRecipe, plan: BlockShardPlan) -> ModelRecipe:
    """`comfy_dit_recipe`'s recipe for dit_weights="shard": each worker builds its own rank's
    shard only, laid out as rank 0's `plan`."""
    return ModelRecipe(__name__, "build_comfy_dit_shard", {**recipe.kwargs, "plan": plan}, sharded=True)


def build_comfy_dit(device: torch.device | str, loader: bytes, patches: bytes, digest: str,
                    path: str | None, settings: dict, prelude: tuple = ()) -> torch.nn.Module:
    """A worker: the DiT of the recipe on `device`, patched as rank 0's."""
    patcher = _rebuilt_patcher(loader, patches, digest, settings, prelude)
    return comfy_diffusion_model_replicas(patcher, [device], base=path, load=True)[0].module


def build_comfy_dit_shard(device: torch.device | str, rank: int, world_size: int, plan: BlockShardPlan,
                          loader: bytes, patches: bytes, digest: str, path: str | None, settings: dict,
                          prelude: tuple = ()) -> RankShard:
    """A worker: rank `rank`'s shard of the recipe's DiT on `device`, patched as rank 0's and
    laid out as rank 0's `plan` (refused otherwise)."""
    patcher = _rebuilt_patcher(loader, patches, digest, settings, prelude)
    replica = comfy_diffusion_model_replicas(patcher, [device], base=path, load=False)[0]
    return rank_shard(replica, rank, world_size, plan)


def _rebuilt_patcher(loader: bytes, patches: bytes, digest: str, settings: dict, prelude: tuple):
    """The MODEL as rank 0's loader made it, with rank 0's weight patches (checked by hash)."""
    for module, name in prelude:
        getattr(importlib.import_module(module), name)()
    import comfy.cli_args  # lazy: ComfyUI is optional for this module
    for name, value in settings.items():  # before model_management reads them
        setattr(comfy.cli_args.args, name, value)
    import comfy.model_management  # noqa: F401 - it picks its device from those settings
    if hashlib.sha256(patches).hexdigest() != digest:
        raise RecipeError(f"the weight patches arrived with SHA-256 {hashlib.sha256(patches).hexdigest()[:16]}..., "
                          f"not {digest[:16]}... as sent; the pool is not started")
    factory, factory_args, index = pickle.loads(loader)
    patcher = factory(*factory_args, disable_dynamic=True)
    if index is not None:
        patcher = patcher[index]
    patcher.patches = pickle.loads(patches)
    return patcher
