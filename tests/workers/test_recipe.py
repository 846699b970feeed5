"""A worker builds its DiT only with what this project registered or its own environment trusts
(comfy/multidevice/workers/recipe.py): a recipe that names anything else is refused, naming it
and the fix, without importing it; a recipe's kwargs are data, refused naming the key."""

from __future__ import annotations

import sys

import pytest
import torch

from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
from comfy.multidevice.workers import comfy_dit
from comfy.multidevice.workers.recipe import (miniature_from_shared_checkpoint, ModelRecipe, RECIPE_BUILDERS,
                                              RecipeError, trusted_function)

PROBE = '''
import pathlib, torch
pathlib.Path({marker!r}).touch()  # importing this module leaves a mark
def build(device="cpu"):
    return torch.nn.Linear(2, 2)
'''


@pytest.fixture
def probe(tmp_path, monkeypatch):
    """A module that marks a file when imported, on the import path (and gone from it after)."""
    marker = tmp_path / "imported"
    (tmp_path / "recipe_probe.py").write_text(PROBE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "recipe_probe", raising=False)
    monkeypatch.delenv(TRUSTED_MODULES_ENV, raising=False)
    yield marker
    sys.modules.pop("recipe_probe", None)


def test_the_registered_builders_are_ours_and_resolve():
    assert set(RECIPE_BUILDERS) == {
        "comfy.multidevice.workers.recipe:miniature_from_shared_checkpoint",
        "comfy.multidevice.workers.recipe:miniature_shard_from_shared_checkpoint",
        "comfy.multidevice.workers.comfy_dit:build_comfy_dit",
        "comfy.multidevice.workers.comfy_dit:build_comfy_dit_shard"}
    assert trusted_function("comfy.multidevice.workers.recipe", "miniature_from_shared_checkpoint", "x") \
        is miniature_from_shared_checkpoint
    assert trusted_function(comfy_dit.__name__, "build_comfy_dit", "x") is comfy_dit.build_comfy_dit


@pytest.mark.parametrize("module, function", [("recipe_probe", "build"), ("os", "system"), ("builtins", "eval"),
                                              ("comfy.multidevice.workers.recipe", "trusted_function")])
def test_a_recipe_naming_anything_else_is_refused_without_importing_it(probe, module, function):
    with pytest.raises(RecipeError, match=rf"model recipe {module}:{function} cannot be found: a worker calls only "
                                          rf"the recipe builders .*\({TRUSTED_MODULES_ENV}=''\); register the function "
                                          rf"with @recipe_builder, or add its module to {TRUSTED_MODULES_ENV}"):
        ModelRecipe(module, function).build("cpu")
    assert not probe.exists() and "recipe_probe" not in sys.modules


def test_a_module_the_environment_trusts_may_build(probe, monkeypatch):
    monkeypatch.setenv(TRUSTED_MODULES_ENV, "recipe_probe")
    model, weights = ModelRecipe("recipe_probe", "build").build("cpu")
    assert isinstance(model, torch.nn.Linear) and weights is None and probe.exists()
    with pytest.raises(RecipeError, match="'no_such' .*cannot be found|cannot be found .*no_such"):
        ModelRecipe("recipe_probe", "no_such").build("cpu")
    monkeypatch.setenv(TRUSTED_MODULES_ENV, "recipe")  # a prefix of the name is not its package
    with pytest.raises(RecipeError, match="cannot be found"):
        ModelRecipe("recipe_probe", "build").build("cpu")


def test_recipe_kwargs_are_data_refused_naming_the_key():
    with pytest.raises(RecipeError, match=r"the kwargs of model recipe m:f\['options'\]\['hook'\]: a function .* "
                                          r"cannot travel to another process: give the recipe data"):
        ModelRecipe("m", "f", {"path": "x.safetensors", "options": {"hook": print}})
    with pytest.raises(RecipeError, match=r"a model recipe is \(module: str, function: str, kwargs: dict, sharded: "
                                          r"bool\), not \(str, str, list, bool\)"):
        ModelRecipe("m", "f", [])
