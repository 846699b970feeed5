"""Apply a role plan (comfy_extras/nodes_multinpu.plan_roles) to MODEL, CLIP and the two VAEs.

Plain Python over duck-typed objects, so it runs in the tests without ComfyUI:

  MODEL  a ComfyUI ModelPatcher (has clone / add_wrapper_with_key; `.model.diffusion_model`
         is the DiT) or the DiT module itself (tests, the dry run);
  CLIP   a ComfyUI CLIP (cond_stage_model.<clip name>.transformer.model is the language model)
         or anything without that layout (then it stays on one card);
  VAE    an object with `first_stage_model` and `device` (ComfyUI's comfy.sd.VAE).

What each role becomes:
  DiT, sequence_parallel   the sequence-parallel adapter (comfy/ldm/minimax/sequence_parallel.py)
                           over the planned cards; rank 0 runs the model itself on the first
                           card, rank r > 0 a replica on card r built from the shared checkpoint
                           base (comfy/shared_checkpoint.py; see DitReplicas).
  text encoder, tensor_parallel   comfy/tensor_parallel.py splits the language model.
  video VAE, temporal_chunks      comfy/vae_parallel.py decodes the chunks on all planned cards.
  anything, single         placed on its card.

`check_inputs` runs every check that can fail before `apply_role_plan` starts anything, and
`apply_role_plan` never modifies the input objects: it returns clones / copies that share the
weights (ComfyUI's clone semantics) and carry the parallel set-up.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Sequence

import torch

from comfy.device_replicas import module_device, replica_on
from comfy.multidevice import SequenceParallelCoordinator, backend_from_env, resolve_device

log = logging.getLogger(__name__)

SEQUENCE_PARALLEL = "sequence_parallel"
TENSOR_PARALLEL = "tensor_parallel"
TEMPORAL_CHUNKS = "temporal_chunks"


class RolePlanError(ValueError):
    """An input cannot take the role the plan gives it; the message names the input and the fix."""


# ----------------------------------------------------------------------------- coordinators

_COORDINATORS: dict = {}
_COORDINATORS_LOCK = threading.Lock()


def shared_coordinator(devices: Sequence[torch.device], backend: str | None = None) -> SequenceParallelCoordinator:
    """One coordinator (rank threads + backend) per device list and backend, kept for reuse.

    The DiT, the text encoder and the VAE decode of one plan share it (they never run at the
    same time), and re-running the node with the same cards reuses it instead of starting
    more rank threads.
    """
    name = backend_from_env(backend)
    key = (tuple(str(d) for d in devices), name)
    with _COORDINATORS_LOCK:
        coordinator = _COORDINATORS.get(key)
        if coordinator is None or coordinator.closed:
            coordinator = SequenceParallelCoordinator(list(devices), backend=name)
            _COORDINATORS[key] = coordinator
        return coordinator


def close_shared_coordinators() -> None:
    with _COORDINATORS_LOCK:
        for coordinator in _COORDINATORS.values():
            coordinator.close()
        _COORDINATORS.clear()


# ----------------------------------------------------------------------------- duck typing

def is_model_patcher(model) -> bool:
    return callable(getattr(model, "clone", None)) and callable(getattr(model, "add_wrapper_with_key", None))


def dit_module(model):
    """The DiT module behind a MODEL input (ModelPatcher -> BaseModel -> diffusion_model)."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "diffusion_model"):
        return inner.diffusion_model
    return getattr(model, "diffusion_model", model)


def _language_model(clip):
    """The CLIP's language model, or None when the CLIP has another layout."""
    from comfy.tensor_parallel import TensorParallelError, language_model_of
    try:
        return language_model_of(clip)
    except TensorParallelError:
        return None


def text_encoder_split_problem(clip, world_size: int) -> str | None:
    """Why the CLIP stays on one card instead of tensor parallel (None: it can be split).

    A CLIP of another layout, or with quantized weights (the NVFP4 encoder file: small enough
    for one card), stays on one card; any other obstacle (a CLIP LoRA, heads that cannot be
    split) is raised, since it needs the user's decision.
    """
    from comfy.tensor_parallel import QuantizedWeightsError, check_tensor_parallel_clip

    if _language_model(clip) is None:
        return f"{type(clip).__name__} has no Llama/Qwen language model layout"
    try:
        check_tensor_parallel_clip(clip, world_size)
    except QuantizedWeightsError as exc:
        return f"its weights cannot be sliced ({exc})"
    return None


def _has_chunk_interface(vae) -> bool:
    from comfy.vae_parallel import H3ChunkInterface
    return H3ChunkInterface.supports(getattr(vae, "first_stage_model", None))


# ----------------------------------------------------------------------------- checks

def check_inputs(plan, model, clip, video_vae, audio_vae) -> None:
    """Every check that can fail, before anything is cloned, moved or started."""
    for name, value in (("model", model), ("clip", clip), ("video_vae", video_vae), ("audio_vae", audio_vae)):
        if value is None:
            raise RolePlanError(f"the {name} input is not connected: connect the loader's output to it")
    for name, vae in (("video_vae", video_vae), ("audio_vae", audio_vae)):
        if getattr(vae, "first_stage_model", None) is None:
            raise RolePlanError(f"the {name} input ({type(vae).__name__}) is not a VAE (no first_stage_model): "
                                f"connect a VAELoader output")
    if video_vae is audio_vae:
        raise RolePlanError("video_vae and audio_vae are the same VAE: connect the video VAE loader to "
                            "video_vae and the audio VAE loader to audio_vae")
    if plan.dit.mode == SEQUENCE_PARALLEL:
        from comfy.ldm.minimax.sequence_parallel import contract_problems
        problems = contract_problems(dit_module(model))
        if problems:
            raise RolePlanError(
                f"the model input ({type(dit_module(model)).__name__}) cannot run sequence parallel: "
                f"{'; '.join(problems)}. Connect the MiniMax-H3 UNETLoader (or its LoRA loader) output, "
                f"or set npu_count to 1 or 2")
    if plan.text_encoder.mode == TENSOR_PARALLEL:
        text_encoder_split_problem(clip, len(plan.text_encoder.cards))


# ----------------------------------------------------------------------------- DiT

class DitReplicas:
    """The DiT of ranks 1..W-1 on the patcher path, one entry per rank for the SP adapter.

    From the shared checkpoint base when it can be built (comfy/shared_checkpoint.py: the
    loader's file read once per process, or the model's own CPU weights zero-copy; the MODEL's
    weight patches, e.g. a Turbo LoRA loaded before this node, applied identically on every
    rank): made resident on the first forward, dropped again by `unload()`.

    ComfyUI records on the shared model which patch set its weights carry right now
    (ModelPatcher sets model.current_weight_patches_uuid when it patches them). When that is
    another set than the MODEL this node received had (a LoRA loader placed *after* the
    node), replicas built from the base would miss it; then, and when no base can be built,
    the primary's loaded weights are copied to the other cards instead (device to device),
    and copied again when the patch set changes.
    """

    def __init__(self, primary, devices: Sequence[torch.device]):
        self.primary = primary
        self.devices = list(devices)
        self.base_replicas = None
        self.base_problem: str | None = None
        self.armed = False  # until the adapter is installed, entries only serve its checks
        self._copies: dict = {}
        self._copy_version = None
        try:
            from comfy.shared_checkpoint import comfy_diffusion_model_replicas
            self.base_replicas = comfy_diffusion_model_replicas(primary, self.devices, load=False)
        except Exception as exc:  # any reason the base cannot serve: the copy path always can
            self.base_problem = f"{type(exc).__name__}: {exc}"
            log.warning("DiT replicas: no shared checkpoint base (%s); the loaded weights will be "
                        "copied to %s at the first step", self.base_problem, ", ".join(map(str, self.devices)))

    def entries(self) -> list:
        return [_RankDit(self, i) for i in range(len(self.devices))]

    def _applied_patches(self):
        return getattr(getattr(self.primary, "model", None), "current_weight_patches_uuid", None)

    def uses_base(self) -> bool:
        applied = self._applied_patches()
        return self.base_replicas is not None and (
            applied is None or applied == getattr(self.primary, "patches_uuid", None))

    def module(self, index: int):
        if self.uses_base():
            replica = self.base_replicas[index]
            return replica.load().module if self.armed else replica.module
        source = dit_module(self.primary)
        device = self.devices[index]
        if not self.armed or module_device(source) in (None, device):
            return source
        version = (id(source), self._applied_patches())
        if version != self._copy_version:
            _refuse_partially_loaded(source)
            self._copies.clear()  # stale copies go before new ones are made
            self._copy_version = version
            if self.base_replicas is not None:
                log.info("DiT replicas: the weights carry patches added after this node (e.g. a LoRA "
                         "loader placed after it); copying the loaded weights to the other cards")
        if index not in self._copies:
            self._copies[index] = replica_on(source, device)
        return self._copies[index]

    def unload(self) -> int:
        """Drop the replicas' device residency (the base stays in RAM); return the bytes dropped."""
        dropped = self.base_replicas.unload() if self.base_replicas is not None else 0
        self._copies.clear()
        self._copy_version = None
        return dropped


class _RankDit:
    """What the SP adapter resolves each forward: `.diffusion_model` of one rank."""

    def __init__(self, replicas: DitReplicas, index: int):
        self.replicas = replicas
        self.index = index

    @property
    def diffusion_model(self):
        return self.replicas.module(self.index)


def _refuse_partially_loaded(module) -> None:
    # ComfyUI's low-VRAM mode keeps some weights off the card and applies their patches at
    # compute time (per-layer weight_function lists); a copy of that state is not the model.
    lazy = sum(1 for m in module.modules() if getattr(m, "weight_function", None) or getattr(m, "bias_function", None))
    if lazy:
        raise RolePlanError(
            f"the DiT is only partially loaded on its first card ({lazy} layers patched at compute "
            f"time); sequence parallel copies the loaded weights to the other cards, so the DiT must "
            f"fit on one card: use the INT8 DiT or keep fewer models resident, or place "
            f"MultiNPUParallelConfig after the LoRA loader so replicas come from the checkpoint base")


def _place_dit(model, device, what="DiT"):
    """Single-card DiT: a clone whose load device is `device` (patcher) / the module on it."""
    if is_model_patcher(model):
        out = model.clone()
        if getattr(out, "load_device", device) != device:
            log.info("%s: load device %s -> %s", what, out.load_device, device)
            out.load_device = device
        return out
    if isinstance(model, torch.nn.Module) and module_device(model) not in (None, device):
        return replica_on(model, device)
    return model


def _module_replicas(model: torch.nn.Module, devices: Sequence[torch.device]) -> list:
    """Rank replicas of a plain DiT module from a shared base over its own weights (zero-copy)."""
    from comfy.shared_checkpoint import RankReplicas, SharedCheckpoint

    home = module_device(model)
    if home is not None and home.type != "cpu":  # a base lives in CPU memory
        return [model if d == home else replica_on(model, d) for d in devices]
    base = SharedCheckpoint.from_state_dict(model.state_dict(), copy=False,
                                            label=f"{type(model).__name__} weights")
    others = RankReplicas(base, devices[1:], template=model, load=True) if len(devices) > 1 else []
    first = model if home in (None, devices[0]) else replica_on(model, devices[0])
    return [first] + [r.module for r in others]


def _sequence_parallel_dit(model, devices, coordinator):
    from comfy.ldm.minimax.sequence_parallel import enable_sequence_parallel, enable_sequence_parallel_on_patcher

    if not is_model_patcher(model):  # a plain DiT module (tests, the dry run)
        return enable_sequence_parallel(_module_replicas(model, devices), coordinator)
    primary = model.clone()
    if getattr(primary, "load_device", devices[0]) != devices[0]:
        log.info("DiT: load device %s -> %s (rank 0)", primary.load_device, devices[0])
        primary.load_device = devices[0]
    replicas = DitReplicas(primary, devices[1:])
    enable_sequence_parallel_on_patcher(primary, coordinator, [None] + replicas.entries())
    replicas.armed = True
    primary.multinpu_dit_replicas = replicas  # for unload / inspection
    return primary


# ----------------------------------------------------------------------------- text encoder

def _clone(obj):
    return obj.clone() if callable(getattr(obj, "clone", None)) else copy.copy(obj)


def _place_clip(clip, device):
    out = _clone(clip)
    patcher = getattr(out, "patcher", None)
    if patcher is not None and getattr(patcher, "load_device", device) != device:
        if callable(getattr(patcher, "clone", None)):
            out.patcher = patcher = patcher.clone()
        log.info("text encoder: load device %s -> %s", patcher.load_device, device)
        patcher.load_device = device
    return out


def _tensor_parallel_text_encoder(clip, devices, coordinator):
    from comfy.tensor_parallel import tensor_parallel_clip

    problem = text_encoder_split_problem(clip, len(devices))
    if problem is not None:
        log.warning("text encoder: not tensor parallel, it runs on %s only: %s", devices[0], problem)
        return _place_clip(clip, devices[0])
    out = tensor_parallel_clip(clip, coordinator)  # a new CLIP: the input's encoder is untouched
    patcher = getattr(out, "patcher", None)
    if patcher is not None and getattr(patcher, "load_device", devices[0]) != devices[0]:
        # the clone's patcher still loads the embeddings and the vision tower: on rank 0's card
        log.info("text encoder: load device %s -> %s", patcher.load_device, devices[0])
        patcher.load_device = devices[0]
    log.info("text encoder: tensor parallel over %s", ", ".join(map(str, devices)))
    return out


# ----------------------------------------------------------------------------- VAEs

def _place_vae(vae, device, what):
    out = copy.copy(vae)
    if getattr(out, "device", device) != device:
        patcher = getattr(out, "patcher", None)
        if patcher is not None and callable(getattr(patcher, "clone", None)):
            out.patcher = patcher.clone()
            out.patcher.load_device = device
        log.info("%s: device %s -> %s", what, out.device, device)
        out.device = device
    return out


def _chunked_video_vae(vae, devices, merge_device, coordinator):
    from comfy.vae_parallel import with_parallel_decode

    if not _has_chunk_interface(vae):
        log.warning("video VAE: %s has no temporal chunk interface; it decodes on %s only",
                    type(vae.first_stage_model).__name__, merge_device)
        return _place_vae(vae, merge_device, "video VAE")
    out = _place_vae(vae, merge_device, "video VAE")
    runner = coordinator if list(coordinator.devices) == list(devices) else None
    out.first_stage_model = with_parallel_decode(vae.first_stage_model, devices, runner=runner,
                                                 merge_device=merge_device)
    log.info("video VAE: temporal chunks decoded on %s, merged on %s",
             ", ".join(map(str, devices)), merge_device)
    return out


# ----------------------------------------------------------------------------- apply

def apply_role_plan(plan, devices: Sequence[torch.device], model, clip, video_vae, audio_vae,
                    backend: str | None = None, coordinator=None):
    """Return (model, clip, video_vae, audio_vae) set up per `plan` on `devices`.

    devices[i] is plan card i. `backend` picks the collective backend (None: from the
    environment). `coordinator` may be given (tests); otherwise the shared one for the
    planned cards is used (started here when the plan needs more than one card).
    """
    devices = [resolve_device(d) for d in devices]  # 'npu:i' needs torch_npu: imported here
    if len(devices) != plan.n_cards:
        raise RolePlanError(f"the plan is for {plan.n_cards} cards but {len(devices)} devices were given")
    check_inputs(plan, model, clip, video_vae, audio_vae)

    def cards(role):
        return [devices[c] for c in role.cards]

    parallel = [r for r in plan.roles() if len(r.cards) > 1]
    if parallel and coordinator is None:
        # one coordinator over all cards; every parallel role of the seed table uses all of them
        coordinator = shared_coordinator(devices, backend)
    if coordinator is not None and parallel and [str(d) for d in coordinator.devices] != [str(d) for d in devices]:
        raise RolePlanError(f"the coordinator runs on {coordinator.devices}, the plan on {devices}")

    if plan.dit.mode == SEQUENCE_PARALLEL:
        out_model = _sequence_parallel_dit(model, cards(plan.dit), coordinator)
    else:
        out_model = _place_dit(model, cards(plan.dit)[0])

    if plan.video_vae.mode == TEMPORAL_CHUNKS:
        merge = devices[plan.video_vae.merge_card or 0]
        out_video = _chunked_video_vae(video_vae, cards(plan.video_vae), merge, coordinator)
    else:
        out_video = _place_vae(video_vae, cards(plan.video_vae)[0], "video VAE")
    out_audio = _place_vae(audio_vae, cards(plan.audio_vae)[0], "audio VAE")

    if plan.text_encoder.mode == TENSOR_PARALLEL:
        out_clip = _tensor_parallel_text_encoder(clip, cards(plan.text_encoder), coordinator)
    else:
        out_clip = _place_clip(clip, cards(plan.text_encoder)[0])
    return out_model, out_clip, out_video, out_audio
