"""A ComfyUI MODEL's DiT rebuilt in a worker process, with the same weights as rank 0's.

Rank 0 (`comfy_dit_recipe`) describes how the MODEL was made, as data (workers/wire.py), never
its weights or a pickle: the loader ComfyUI recorded on the patcher (`cached_patcher_init`, the
record its multi-GPU clone re-runs) as one of ComfyUI's own loader functions, by name, with its
arguments (paths, model options); the patcher's weight patches (LoRAs: tensors, tuples such as
("diff", (tensor,)), ComfyUI's weight adapters by class name, loaded keys and weights), encoded
once and named by their SHA-256; and ComfyUI's command-line settings that are data. The worker
(`build_comfy_dit`) sets those settings, runs the named loader (only one of `LOADERS`; the file
is mapped: on one server the page cache holds it once), checks the patches against their hash,
and builds its replica as the rank threads do (weights/comfy_replicas.py: ComfyUI's own patch
math), or with dit_weights="shard" only its rank's shard of it (weights/shard_layout.py). What
cannot be described (another loader, a patch with a function) is refused at rank 0, naming it.
A MODEL whose patch set changes gets a new recipe (`patches_digest` differs) and a new pool.
"""

from __future__ import annotations

import hashlib
import importlib
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from comfy.multidevice.weights.block_shards import BlockShardPlan
from comfy.multidevice.weights.comfy_replicas import checkpoint_path_of, comfy_diffusion_model_replicas
from comfy.multidevice.weights.shard_layout import ProcessShard, rank_shard
from comfy.multidevice.workers.recipe import ModelRecipe, recipe_builder, RecipeError, trusted_function
from comfy.multidevice.workers.wire import check_sendable, decode, encode, wire_record, WireError, WireTypeError

# ComfyUI's loaders that record themselves as a DiT's cached_patcher_init (comfy/sd.py of both
# supported trees): the only functions a worker runs to load a MODEL
LOADERS = frozenset({("comfy.sd", "load_diffusion_model"), ("comfy.sd", "load_checkpoint_guess_config")})
LOADER_NAMES = ", ".join(sorted(f"{module}.{function}" for module, function in LOADERS))
# comfy.weight_adapter's patch classes: each is (loaded_keys, weights) and nothing more
ADAPTERS = frozenset({"LoRAAdapter", "LoHaAdapter", "LoKrAdapter", "GLoRAAdapter", "OFTAdapter", "BOFTAdapter"})
THREADS_FIX = "use ranks as threads for this MODEL"


@wire_record("comfy_loader_call")
@dataclass(frozen=True)
class LoaderCall:
    """`module.function(*args, disable_dynamic=True)[index]`: how ComfyUI loaded the MODEL."""

    module: str
    function: str
    args: tuple
    index: int | None = None

    def describe(self) -> str:
        return f"{self.module}.{self.function}"

    def run(self):
        """A worker: the ModelPatcher the loader makes (only a loader of `LOADERS`)."""
        if (self.module, self.function) not in LOADERS:
            raise RecipeError(f"rank 0 named the loader {self.describe()}, not one of ComfyUI's loaders a worker "
                              f"runs ({LOADER_NAMES}); {THREADS_FIX}")
        if not (isinstance(self.args, tuple) and (self.index is None or type(self.index) is int)):
            raise RecipeError(f"the loader call {self.describe()} has arguments {type(self.args).__name__} and index "
                              f"{self.index!r}, not a tuple and an int or None")
        patcher = getattr(importlib.import_module(self.module), self.function)(*self.args, disable_dynamic=True)
        return patcher if self.index is None else patcher[self.index]


@wire_record("comfy_weight_adapter")
@dataclass(frozen=True)
class AdapterPatch:
    """One of comfy.weight_adapter's patch objects as data: its class name and its contents."""

    kind: str
    loaded_keys: tuple
    weights: Any

    def rebuilt(self):
        """A worker: the adapter object ComfyUI's patch math expects."""
        import comfy.weight_adapter  # lazy: ComfyUI is optional for this module
        if self.kind not in ADAPTERS:
            raise RecipeError(f"rank 0 sent a weight patch of kind {self.kind!r}, not one of {sorted(ADAPTERS)}")
        return getattr(comfy.weight_adapter, self.kind)(set(self.loaded_keys), self.weights)


def loader_call(model_patcher: Any) -> LoaderCall:
    """Rank 0: the MODEL's recorded loader as data; RecipeError naming the fix otherwise."""
    init = getattr(model_patcher, "cached_patcher_init", None)
    if not (isinstance(init, tuple) and len(init) >= 2 and callable(init[0])):
        raise RecipeError("this MODEL does not record how it was loaded (cached_patcher_init), so a "
                          "worker process cannot load it; load it with a core loader (e.g. Load "
                          f"Diffusion Model) or {THREADS_FIX}")
    factory = init[0]
    named = (getattr(factory, "__module__", None), getattr(factory, "__qualname__", None))
    if named not in LOADERS or getattr(sys.modules.get(named[0]), named[1], None) is not factory:
        raise RecipeError(f"the MODEL was loaded by {named[0]}.{named[1]}, which a worker process does not run (it "
                          f"runs ComfyUI's {LOADER_NAMES}); {THREADS_FIX}")
    call = LoaderCall(named[0], named[1], tuple(init[1]), init[2] if len(init) > 2 else None)
    try:
        check_sendable(call, name=f"the loader call {call.describe()}")
    except WireTypeError as exc:
        raise RecipeError(f"{exc}, so a worker process cannot load this MODEL; {THREADS_FIX}") from None
    return call


def _described_patch(data, where: str):
    """A weight patch's data as wire data: an adapter object as an AdapterPatch, else as it is."""
    cls = type(data)
    if cls.__module__.startswith("comfy.weight_adapter") and cls.__name__ in ADAPTERS:
        if set(vars(data)) - {"loaded_keys", "weights"}:
            raise RecipeError(f"{where}: a {cls.__name__} with state beyond its loaded keys and weights "
                              f"({sorted(set(vars(data)) - {'loaded_keys', 'weights'})}); {THREADS_FIX}")
        return AdapterPatch(cls.__name__, tuple(sorted(data.loaded_keys)), data.weights)
    return data


def described_patches(patches: dict) -> dict:
    """Rank 0: {key: [(strength_patch, data, strength_model, offset, None), ...]} as data; a
    patch with a function, or data that cannot travel, is refused (RecipeError naming it)."""
    out = {}
    for key, entries in patches.items():
        out[key] = []
        for i, entry in enumerate(entries):
            where = f"the weight patch {i} of {key!r}"
            strength_patch, data, strength_model, offset, function = entry
            if function is not None:
                raise RecipeError(f"{where} applies a function ({getattr(function, '__qualname__', function)}), "
                                  f"which cannot be sent to a worker process; {THREADS_FIX}")
            out[key].append((strength_patch, _described_patch(data, where), strength_model, offset, None))
    return out


def _rebuilt_patches(described: dict) -> dict:
    return {key: [(s, data.rebuilt() if isinstance(data, AdapterPatch) else data, m, offset, None)
                  for s, data, m, offset, _ in entries] for key, entries in described.items()}


def patches_digest(model_patcher: Any) -> tuple[torch.Tensor, str]:
    """The patcher's weight patches encoded (a uint8 tensor: it travels in the recipe without a
    copy) and the SHA-256 (hex) of those bytes; deterministic for one patch set."""
    try:
        blob = encode(described_patches(dict(getattr(model_patcher, "patches", None) or {})),
                      name="the MODEL's weight patches")
    except WireTypeError as exc:
        raise RecipeError(f"{exc}, so a worker process cannot apply it; {THREADS_FIX}") from None
    return torch.frombuffer(blob, dtype=torch.uint8), hashlib.sha256(blob).hexdigest()


def _comfy_settings() -> dict:
    """ComfyUI's parsed command-line settings that are data (a worker parses no command line of
    ComfyUI's); the others stay the worker's defaults."""
    import comfy.cli_args  # lazy: ComfyUI is optional for this module
    settings = {}
    for name, value in vars(comfy.cli_args.args).items():
        try:
            check_sendable(value)
        except WireTypeError:
            continue
        settings[name] = value
    return settings


def comfy_dit_recipe(model_patcher: Any, prelude: Sequence[tuple[str, str]] = ()) -> ModelRecipe:
    """Rank 0: the recipe a worker rebuilds `model_patcher`'s DiT from. `prelude`: functions
    (module, name) a worker calls first, from modules its environment trusts (tests' stand-ins)."""
    call = loader_call(model_patcher)
    blob, digest = patches_digest(model_patcher)
    return ModelRecipe(__name__, "build_comfy_dit", {
        "loader": call, "patches": blob, "digest": digest, "path": checkpoint_path_of(model_patcher),
        "settings": _comfy_settings(), "prelude": tuple(tuple(p) for p in prelude)})


def sharded_recipe(recipe: ModelRecipe, plan: BlockShardPlan) -> ModelRecipe:
    """`comfy_dit_recipe`'s recipe for dit_weights="shard": each worker builds its own rank's
    shard only, laid out as rank 0's `plan`."""
    return ModelRecipe(__name__, "build_comfy_dit_shard", {**recipe.kwargs, "plan": plan}, sharded=True)


@recipe_builder
def build_comfy_dit(device: torch.device | str, loader: LoaderCall, patches: torch.Tensor, digest: str,
                    path: str | None, settings: dict, prelude: tuple = ()) -> torch.nn.Module:
    """A worker: the DiT of the recipe on `device`, patched as rank 0's."""
    patcher = _rebuilt_patcher(loader, patches, digest, settings, prelude)
    return comfy_diffusion_model_replicas(patcher, [device], base=path, load=True)[0].module


@recipe_builder
def build_comfy_dit_shard(device: torch.device | str, rank: int, world_size: int, plan: BlockShardPlan,
                          loader: LoaderCall, patches: torch.Tensor, digest: str, path: str | None, settings: dict,
                          prelude: tuple = ()) -> ProcessShard:
    """A worker: rank `rank`'s shard of the recipe's DiT on `device`, patched as rank 0's and
    laid out as rank 0's `plan` (refused otherwise)."""
    patcher = _rebuilt_patcher(loader, patches, digest, settings, prelude)
    replica = comfy_diffusion_model_replicas(patcher, [device], base=path, load=False)[0]
    return rank_shard(replica, rank, world_size, plan)


def _rebuilt_patcher(loader: LoaderCall, patches: torch.Tensor, digest: str, settings: dict, prelude: tuple):
    """The MODEL as rank 0's loader made it, with rank 0's weight patches (checked by hash)."""
    if not (isinstance(loader, LoaderCall) and isinstance(patches, torch.Tensor) and patches.dtype == torch.uint8
            and isinstance(settings, dict)):
        raise RecipeError("the comfy DiT recipe needs a LoaderCall, the encoded patches (uint8) and a settings "
                          f"dict, not {type(loader).__name__}, {type(patches).__name__}, {type(settings).__name__}")
    for module, name in prelude:
        trusted_function(module, name, f"the prelude function {module}:{name}")()
    import comfy.cli_args  # lazy: ComfyUI is optional for this module
    for name, value in settings.items():  # before model_management reads them; only settings it has
        if hasattr(comfy.cli_args.args, name):
            setattr(comfy.cli_args.args, name, value)
    import comfy.model_management  # noqa: F401 - it picks its device from those settings
    raw = patches.numpy()
    arrived = hashlib.sha256(raw).hexdigest()
    if arrived != digest:
        raise RecipeError(f"the weight patches arrived with SHA-256 {arrived[:16]}..., "
                          f"not {str(digest)[:16]}... as sent; the pool is not started")
    try:
        described = decode(raw, max_bytes=raw.nbytes, what="the MODEL's weight patches")
    except WireError as exc:
        raise RecipeError(str(exc)) from None
    patcher = loader.run()
    patcher.patches = _rebuilt_patches(described)
    return patcher
