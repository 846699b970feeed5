"""Apply a role plan (comfy_extras/nodes_multinpu.plan_roles) to MODEL, CLIP and the two VAEs.

Plain Python over duck-typed objects, so it runs in the tests without ComfyUI:

  MODEL  a ComfyUI ModelPatcher (has clone / add_wrapper_with_key; `.model.diffusion_model`
         is the DiT) or the DiT module itself (tests, the dry run);
  CLIP   a ComfyUI CLIP (cond_stage_model.<clip name>.transformer.model is the language model)
         or anything without that layout (then it stays on one card);
  VAE    an object with `first_stage_model` and `device` (ComfyUI's comfy.sd.VAE).

What each role becomes:
  DiT, sequence_parallel   the sequence-parallel adapter (comfy/ldm/minimax/sequence_parallel.py)
                           over the planned cards; rank r > 0 runs a replica of the DiT on card r
                           (see DitReplica), rank 0 the model itself on the first card.
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
from types import SimpleNamespace
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
        if coordinator is None or coordinator._closed:
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
    from comfy.tensor_parallel import TensorParallelError, _locate_language_model
    try:
        return _locate_language_model(clip)[1]
    except TensorParallelError:
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
    if plan.text_encoder.mode == TENSOR_PARALLEL and _language_model(clip) is not None:
        from comfy.tensor_parallel import _checked_source
        # head/width split and CLIP-LoRA checks of tensor_parallel_clip, for W cards
        _checked_source(clip, SimpleNamespace(world_size=len(plan.text_encoder.cards)))


# ----------------------------------------------------------------------------- DiT

class DitReplica:
    """Rank r's DiT for the patcher path: the primary's current weights, copied to card r.

    The copy is made at the first forward (when ComfyUI has loaded the primary and applied
    its weight patches, e.g. a Turbo LoRA), and made again when the patches on the shared
    weights change or the module is replaced. On the primary's own device the primary
    module itself is used. The SP adapter reads `.diffusion_model` at every forward.
    """

    def __init__(self, primary, device):
        self.primary = primary
        self.device = torch.device(device)
        self._module = None
        self._version = None

    @property
    def diffusion_model(self):
        source = dit_module(self.primary)
        if module_device(source) in (None, self.device):
            return source
        # ComfyUI records on the model which patch set its weights carry right now
        # (ModelPatcher sets model.current_weight_patches_uuid when it patches them); a LoRA
        # loader placed after this node changes it, so the copy follows the weights in use.
        applied = getattr(getattr(self.primary, "model", None), "current_weight_patches_uuid", None)
        version = (id(source), applied if applied is not None else getattr(self.primary, "patches_uuid", None))
        if self._module is None or self._version != version:
            _refuse_partially_loaded(source)
            log.info("DiT replica: copying the primary's weights to %s", self.device)
            self._module = None  # free the stale copy first
            self._module = replica_on(source, self.device)
            self._version = version
        return self._module

    def release(self) -> None:
        self._module = None
        self._version = None


def _refuse_partially_loaded(module) -> None:
    # ComfyUI's low-VRAM mode keeps some weights off the card and applies their patches at
    # compute time (per-layer weight_function lists); a copy of that state is not the model.
    lazy = sum(1 for m in module.modules() if getattr(m, "weight_function", None) or getattr(m, "bias_function", None))
    if lazy:
        raise RolePlanError(
            f"the DiT is only partially loaded on its first card ({lazy} layers patched at compute "
            f"time); sequence parallel copies the loaded weights to the other cards, so the DiT must "
            f"fit on one card: use the INT8 DiT, or free memory (--disable-smart-memory off, fewer "
            f"models resident)")


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


def _sequence_parallel_dit(model, devices, coordinator):
    from comfy.ldm.minimax.sequence_parallel import enable_sequence_parallel, enable_sequence_parallel_on_patcher

    if is_model_patcher(model):
        primary = model.clone()
        if getattr(primary, "load_device", devices[0]) != devices[0]:
            log.info("DiT: load device %s -> %s (rank 0)", primary.load_device, devices[0])
            primary.load_device = devices[0]
        replicas = [None] + [DitReplica(primary, d) for d in devices[1:]]
        enable_sequence_parallel_on_patcher(primary, coordinator, replicas)
        return primary
    # a plain DiT module: replicas now, one per card (the module itself where it already is)
    replicas = [model if module_device(model) in (None, d) else replica_on(model, d) for d in devices]
    return enable_sequence_parallel(replicas, coordinator)


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

    if _language_model(clip) is None:
        log.warning("text encoder: %s has no Llama/Qwen language model layout, so it is not split; "
                    "it runs on %s", type(clip).__name__, devices[0])
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
