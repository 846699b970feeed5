"""Upstream's Fun ControlNet for ranks as processes: its described patches as wire records, the tower as data.

What every rank reads of a Fun ControlNet is described once for both rank engines
(sp/fun_controlnet.py `FunControl`, `FunBlockControl`); here those records get their wire form.
The tower travels with the first forward of a pool that uses it and is named by `tower_key`
after that: a worker holds the towers it rebuilt by that key. Everything else of the
transformer_options' block patches is a function of the ComfyUI process and is refused.

The tower as data: an allowed class, its constructor arguments, its weights.

The tower (`control_patch.model_patch.model`) is upstream's MiniMaxH3FunControl
(comfy/ldm/minimax/controlnet.py): a small DiT built from keyword arguments (widths, heads,
injection layers, eps, dtype, ComfyUI's operations class) that upstream's model-patch loader
derives from the checkpoint. Rank 0 reads those arguments back from the built module
(`_h3_fun_control_arguments`); a class of a module the worker's own environment trusts
(COMFYUI_MULTI_DEVICE_TRUSTED_MODULES: tests' stand-ins) is built without arguments; any other
class is refused. The receiver builds the class on the meta device, takes the sent tensors as
its weights (views of the message, no copy) and compares every submodule's class and plain
attributes (`structure`; other objects by their type) with rank 0's: a tower that does not come
out the same is refused, never run. Rank 0 makes the same build over its own tensors first,
so a tower that cannot travel is refused before any process is asked.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from itertools import chain

import torch

from comfy.multidevice.comm.settings import TRUSTED_MODULES_ENV
from comfy.multidevice.sp.fun_controlnet import described_fun_controls, FunBlockControl, FunControl
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.workers.recipe import is_trusted_module
from comfy.multidevice.workers.wire import check_sendable, wire_record, WireTypeError

H3_FUN_CONTROL = "comfy.ldm.minimax.controlnet:MiniMaxH3FunControl"
OPERATIONS = ("disable_weight_init", "manual_cast")  # comfy.ops classes an upstream tower may use
THREADS_FIX = "use ranks as threads for this workflow"
# What ComfyUI's ModelPatcher writes on a model and its layers as it loads them
# (comfy/model_patcher.py): rank 0's loading state, not the tower's; left out of `structure`
LOADING_STATE = frozenset({
    "device", "current_patcher", "current_weight_patches_uuid", "model_loaded_weight_memory", "model_lowvram",
    "model_offload_buffer_memory", "lowvram_patch_counter", "skip_injection", "dynamic_vbars", "dynamic_pins",
    "dynamic_patchers", "comfy_cast_weights", "prev_comfy_cast_weights", "comfy_force_cast_weights",
    "comfy_patched_weights", "weight_function", "bias_function", "seed_key"})


def _h3_fun_control_arguments(tower) -> dict:
    """MiniMaxH3FunControl's constructor arguments, read back from the module it built."""
    import comfy.ops  # lazy: ComfyUI is optional for this module
    linear = type(tower.control_proj_in)
    ops = next((name for name in OPERATIONS if getattr(comfy.ops, name).Linear is linear), None)
    if ops is None:
        raise SequenceParallelError(f"the Fun ControlNet tower's layers are {linear.__module__}.{linear.__qualname__}, "
                                    f"not those of comfy.ops {' or '.join(OPERATIONS)}: a worker cannot rebuild it; "
                                    f"{THREADS_FIX}")
    block = tower.control_blocks[0]
    return {"control_in_dim": tower.control_in_dim, "injection_layers": tuple(tower.injection_layers),
            "hidden_size": tower.control_proj_in.out_features, "num_attention_heads": block.attn.heads,
            "attention_head_dim": block.attn.head_dim, "ffn_hidden_size": block.mlp.fc2.in_features,
            "time_embed_dim": block.adaln_proj.linear.in_features, "patch_size": tuple(tower.patch_size),
            "norm_eps": block.norm1.eps, "qk_norm_eps": block.attn.q_norm.eps,
            "use_adaln_curves": not block.adaln_proj.apply_silu, "dtype": tower.dtype, "operations": ops}


def _h3_fun_control(cls, arguments: dict):
    import comfy.ops  # lazy: ComfyUI is optional for this module
    arguments = dict(arguments)
    ops = arguments.pop("operations", None)
    if ops not in OPERATIONS:
        raise SequenceParallelError(f"operations {ops!r} are not one of comfy.ops {OPERATIONS}")
    return cls(**arguments, operations=getattr(comfy.ops, ops))


# class -> (its constructor arguments read from a built tower, the build from them)
UPSTREAM_TOWERS = {H3_FUN_CONTROL: (_h3_fun_control_arguments, _h3_fun_control)}


def class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def tower_class(name: str) -> type:
    """The nn.Module class `name` ("module:qualname") names, if a worker may build it."""
    module, _, qualname = str(name).partition(":")
    if name not in UPSTREAM_TOWERS and not is_trusted_module(module):
        raise SequenceParallelError(
            f"the Fun ControlNet tower {name} is not a class a worker builds (upstream's {', '.join(UPSTREAM_TOWERS)}, "
            f"or one of a module in {TRUSTED_MODULES_ENV}); {THREADS_FIX}")
    found = importlib.import_module(module)
    for part in qualname.split("."):
        if not part.isidentifier() or part.startswith("__"):
            raise SequenceParallelError(f"the Fun ControlNet tower {name} is not a class of its module")
        found = getattr(found, part)
    if not (isinstance(found, type) and issubclass(found, torch.nn.Module)):
        raise SequenceParallelError(f"the Fun ControlNet tower {name} is not a torch module class")
    return found


def _plain(value):
    """An attribute as it is compared: plain values as they are, other objects by their type."""
    if value is None or type(value) in (bool, int, float, str, torch.dtype):
        return value
    if type(value) in (tuple, list):
        return type(value)(_plain(v) for v in value)
    if torch.is_tensor(value):
        raise SequenceParallelError("the Fun ControlNet tower keeps a tensor outside its state dict, which a worker "
                                    f"would not get; {THREADS_FIX}")
    return f"<{type(value).__qualname__}>"


def structure(module: torch.nn.Module) -> dict:
    """{submodule path: (its class, its plain attributes, its tensors' names)}: what, beside its
    weights, makes two towers compute the same."""
    return {path: (class_name(type(m)), {k: _plain(v) for k, v in vars(m).items()
                                         if not k.startswith("_") and k not in LOADING_STATE},
                   [n for n, _ in chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))])
            for path, m in module.named_modules()}


@wire_record("fun_tower")
@dataclass(frozen=True, eq=False)
class TowerData:
    cls: str  # "module:qualname", an allowed class
    arguments: dict  # its constructor's keyword arguments
    state: dict  # its state dict
    structure: dict  # rank 0's `structure` of it

    def build(self) -> torch.nn.Module:
        """The tower, its weights the sent tensors; SequenceParallelError if it differs from rank 0's."""
        cls = tower_class(self.cls)
        make = UPSTREAM_TOWERS[self.cls][1] if self.cls in UPSTREAM_TOWERS else lambda c, kw: c(**kw)
        try:
            with torch.device("meta"):  # the structure only: the weights are the state's tensors
                tower = make(cls, self.arguments)
            tower.load_state_dict(self.state, strict=True, assign=True)
        except (TypeError, ValueError, RuntimeError, KeyError) as exc:
            raise SequenceParallelError(f"the Fun ControlNet tower {self.cls} cannot be rebuilt from its arguments "
                                        f"and weights ({type(exc).__name__}: {str(exc)[:300]}); {THREADS_FIX}") from None
        left = [n for n, t in chain(tower.named_parameters(), tower.named_buffers()) if t.is_meta]
        if left:
            raise SequenceParallelError(f"the Fun ControlNet tower {self.cls} has tensors outside its state dict "
                                        f"({left[:3]}), which a worker would not get; {THREADS_FIX}")
        tower.requires_grad_(False)
        for path, module in tower.named_modules():  # train/eval as rank 0's
            module.training = self.structure.get(path, (None, {}, None))[1].get("training", module.training)
        built = structure(tower)
        differ = [f"{path or 'the tower'}: {self.structure.get(path)} on rank 0, {built.get(path)} rebuilt"
                  for path in sorted(set(built) | set(self.structure)) if built.get(path) != self.structure.get(path)]
        if differ:
            raise SequenceParallelError(f"the Fun ControlNet tower {self.cls} does not come out as rank 0's from its "
                                        f"arguments: {'; '.join(differ[:3])}; {THREADS_FIX}")
        return tower


def tower_data(tower: torch.nn.Module) -> TowerData:
    """Rank 0: `tower` as data, after rebuilding it here over its own tensors (refused,
    SequenceParallelError naming why, when a worker could not)."""
    name = class_name(type(tower))
    if tower_class(name) is not type(tower):
        raise SequenceParallelError(f"the Fun ControlNet tower's class {name} is not the one its module names; "
                                    f"{THREADS_FIX}")
    try:
        arguments = UPSTREAM_TOWERS[name][0](tower) if name in UPSTREAM_TOWERS else {}
    except AttributeError as exc:  # an upstream version whose tower this project does not know yet
        raise SequenceParallelError(f"the Fun ControlNet tower {name}'s constructor arguments cannot be read back "
                                    f"from it ({exc}); {THREADS_FIX}") from None
    data = TowerData(name, arguments, dict(tower.state_dict()), structure(tower))
    try:
        check_sendable(data, name="the Fun ControlNet tower")
    except WireTypeError as exc:
        raise SequenceParallelError(f"{exc}; {THREADS_FIX}") from None
    data.build()  # as a worker will: refused here, before any process is asked
    return data


# ----------------------------------------------------------------------------- the described patches

_held_towers: dict = {}  # a worker's towers, by rank 0's tower key (one pool per process)


def _received_control(key: int, active: bool, strength: float, control_latent, tower_key: int, tower):
    if type(key) is not int or type(active) is not bool or type(strength) is not float or type(tower_key) is not int:
        raise TypeError(f"a control patch is (key: int, active: bool, strength: float, latent, tower_key: int, "
                        f"tower), not ({type(key).__name__}, {type(active).__name__}, {type(strength).__name__}, "
                        f"..., {type(tower_key).__name__}, ...)")
    if tower is not None:
        if not isinstance(tower, TowerData):
            raise TypeError(f"a control patch's tower is sent as TowerData, not {type(tower).__name__}")
        _held_towers[tower_key] = tower.build()
    held = _held_towers.get(tower_key)
    if held is None:
        raise RuntimeError(f"the Fun ControlNet tower {tower_key} never reached this worker; the pool "
                           "is out of step with rank 0, run the prompt again")
    return FunControl(key, active, strength, control_latent, tower_key, held)


def _received_block(control, block_index: int, previous):
    if not isinstance(control, FunControl) or type(block_index) is not int or previous is not None:
        raise TypeError("a Fun ControlNet block patch is (FunControl, block index: int, None)")
    return FunBlockControl(control, block_index)


wire_record("fun_control", make=_received_control)(FunControl)
wire_record("fun_block_patch", make=_received_block)(FunBlockControl)


def travelling_dit_patches(dit: dict, sent_towers: dict) -> dict:
    """patches_replace["dit"] as a worker gets it: every entry an upstream Fun ControlNet block
    patch, described (sp/fun_controlnet.py), its tower as TowerData the first time this pool
    sends it and by key after that; anything else refused (SequenceParallelError naming it).
    `sent_towers` (key -> tower): the towers this pool's workers already have; a tower sent now is added."""
    described = described_fun_controls(dit)
    others = [key for key in dit if not (isinstance(key, tuple) and key[0] == "double_block" and key[1] in described)]
    if others:
        raise SequenceParallelError(
            f"ranks as processes cannot carry the block patches {others} of this forward (functions of the "
            f"ComfyUI process; only upstream's Fun ControlNet travels to the workers): {THREADS_FIX}")
    out, sent = {}, {}
    for index, block in described.items():
        if block.previous is not None:
            raise SequenceParallelError(
                f"ranks as processes cannot carry what the Fun ControlNet at block {index} chains "
                f"({type(block.previous).__name__}, a function of the ComfyUI process): use ranks as threads")
        control = block.control
        if control.key not in sent:
            # held in sent_towers for the pool's life: the key (an id) is not reused meanwhile
            data = None if control.tower_key in sent_towers else tower_data(control.tower)  # refused here
            sent_towers[control.tower_key] = control.tower
            sent[control.key] = FunControl(control.key, control.active, control.strength, control.control_latent,
                                           control.tower_key, data)
        out[("double_block", index)] = FunBlockControl(sent[control.key], index)
    return out
