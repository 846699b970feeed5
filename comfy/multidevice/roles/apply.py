"""Apply a role plan (roles/plan.py) to MODEL, CLIP and the two VAEs.

Plain Python over duck-typed objects, so it runs in the tests without ComfyUI:

  MODEL  a ComfyUI ModelPatcher (has clone / add_wrapper_with_key; `.model.diffusion_model`
         is the DiT) or the DiT module itself (tests, the dry run);
  CLIP   a ComfyUI CLIP (cond_stage_model.<clip name>.transformer.model is the language model)
         or anything without that layout (then it stays on one card);
  VAE    an object with `first_stage_model` and `device` (ComfyUI's comfy.sd.VAE).

What each role becomes:
  DiT, sequence_parallel   the sequence-parallel adapter (comfy/multidevice/sp/minimax_h3.py)
                           over the planned cards; rank 0 runs the model itself on the first
                           card, rank r > 0 a replica on card r built from the shared checkpoint
                           base (comfy/multidevice/weights/; see DitReplicas).
  text encoder, tensor_parallel   comfy/multidevice/tp/ splits the language model.
  video VAE, temporal_chunks      comfy/multidevice/vae/chunked.py decodes the chunks on all planned cards.
  anything, single         placed on its card.

`check_inputs` runs every check that can fail before `apply_role_plan` starts anything, and
`apply_role_plan` never modifies the input objects: it returns clones / copies that share the
weights (ComfyUI's clone semantics) and carry the parallel set-up.
"""

from __future__ import annotations

import atexit
import copy
import logging
import threading
from typing import Sequence

import torch

from comfy.multidevice.comfy_objects import block_patches_of, dit_module, move_load_device
from comfy.multidevice.comm.compression import check_precision, EXACT
from comfy.multidevice.comm.group import lane_allowed, prefetch_lane, SequenceParallelCoordinator
from comfy.multidevice.comm.settings import backend_from_env, remote_ranks_from_env, rendezvous_from_env
from comfy.multidevice.devices import resolve_device
from comfy.multidevice.roles.dit import APPLIED_DIT_RANKS, place_dit, sequence_parallel_dit, workers_dit
from comfy.multidevice.roles.model_management import manage_decoder_copies, manage_tensor_parallel_shards
from comfy.multidevice.roles.plan import RolePlanError, SEQUENCE_PARALLEL, TEMPORAL_CHUNKS, TENSOR_PARALLEL
from comfy.multidevice.sp.fun_controlnet import unsupported_control_patches
from comfy.multidevice.sp.minimax_h3 import CHECKED_UPSTREAM, contract_problems, OLD_COMFYUI_PROBLEM
from comfy.multidevice.sp.strategies import SPMode
from comfy.multidevice.tp.clip import (check_tensor_parallel_clip, language_model_of, language_model_patches,
                                       tensor_parallel_clip)
from comfy.multidevice.tp.layers import QuantizedWeightsError, TensorParallelError
from comfy.multidevice.vae.chunked import H3ChunkInterface, with_parallel_decode
from comfy.multidevice.weights.block_shards import APPLIED_DIT_WEIGHT_MODES
from comfy.multidevice.workers.pool import stop_unused_pool

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- coordinators

_COORDINATORS: dict = {}
_COORDINATORS_LOCK = threading.Lock()
_CLOSE_AT_EXIT: list = []  # non-empty once close_shared_coordinators is registered with atexit


def shared_coordinator(devices: Sequence[torch.device], backend: str | None = None,
                       purpose: str = "roles") -> SequenceParallelCoordinator:
    """One coordinator (rank threads + backend) per device list, backend and purpose, kept for reuse.

    The DiT, the text encoder and the VAE decode of one plan share the "roles" one (they never
    run at the same time), and re-running the node with the same cards reuses it instead of
    starting more rank threads. Sharded DiT weights prefetch the next block on a second one,
    "block weights", since its gathers run while the first is busy with the block (peer-copy
    only: HCCL and NCCL allow no second communicator beside the first, `shared_prefetch_lane`).
    """
    name = backend_from_env(backend)
    return _kept((tuple(str(d) for d in devices), name, purpose),
                 lambda: SequenceParallelCoordinator(list(devices), backend=name))


def shared_prefetch_lane(coordinator: SequenceParallelCoordinator) -> SequenceParallelCoordinator | None:
    """The kept "block weights" coordinator beside `coordinator` (comm/group.py `prefetch_lane`);
    None with a card library backend, which allows no second communicator beside the first."""
    if not lane_allowed(coordinator):
        return None
    return _kept((tuple(str(d) for d in coordinator.devices), coordinator.backend_name, "block weights"),
                 lambda: prefetch_lane(coordinator))


def _kept(key, make) -> SequenceParallelCoordinator:
    with _COORDINATORS_LOCK:
        coordinator = _COORDINATORS.get(key)
        if coordinator is None or coordinator.closed:
            coordinator = _COORDINATORS[key] = make()
            if not _CLOSE_AT_EXIT and any(d.split(":")[0] in ("npu", "cuda") for d in key[0]):
                # torch_npu's own atexit shutdown resets the devices; exit handlers run last
                # registered first, and torch_npu was imported before this coordinator was
                # made, so registering now destroys the communicators before that reset
                atexit.register(close_shared_coordinators)
                _CLOSE_AT_EXIT.append(True)
        return coordinator


def close_shared_coordinators() -> None:
    with _COORDINATORS_LOCK:
        for coordinator in _COORDINATORS.values():
            coordinator.close()
        _COORDINATORS.clear()


def _language_model(clip):
    """The CLIP's language model, or None when the CLIP has another layout."""
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
    if _language_model(clip) is None:
        return f"{type(clip).__name__} has no Llama/Qwen language model layout"
    try:
        check_tensor_parallel_clip(clip, world_size)
    except QuantizedWeightsError as exc:
        return f"its weights cannot be sliced ({exc})"
    return None


def has_chunk_interface(vae) -> bool:
    """Whether the VAE's first-stage model exposes what H3's temporal-chunk decode needs."""
    return H3ChunkInterface.supports(getattr(vae, "first_stage_model", None))


# ----------------------------------------------------------------------------- checks

def check_inputs(plan, model, clip, video_vae, audio_vae) -> None:
    """Every check that can fail, before anything is cloned, moved or started."""
    for name, value in (("model", model), ("clip", clip), ("video_vae", video_vae), ("audio_vae", audio_vae)):
        if value is None:
            raise RolePlanError(f"the {name} input is not connected: connect the loader's output to it.")
    for name, vae in (("video_vae", video_vae), ("audio_vae", audio_vae)):
        if getattr(vae, "first_stage_model", None) is None:
            raise RolePlanError(f"the {name} input is not a VAE: connect the output of a Load VAE node "
                                f"(VAELoader) to it.")
    if video_vae is audio_vae:
        raise RolePlanError("video_vae and audio_vae are the same VAE: connect the video VAE loader to "
                            "video_vae and the audio VAE loader to audio_vae.")
    if plan.dit.mode == SEQUENCE_PARALLEL:
        problems = contract_problems(dit_module(model))
        blocked = unsupported_control_patches(block_patches_of(model))
        if blocked:
            raise RolePlanError(
                f"the model input carries a ControlNet-style patch that needs the whole sequence on "
                f"one card ({', '.join(blocked)}), which this version cannot split over "
                f"{plan.n_cards} cards: set npu_count to 1 or 2 (the DiT on one card), or remove "
                f"that patch from the workflow.")
        if problems == [OLD_COMFYUI_PROBLEM]:
            raise RolePlanError(
                f"this ComfyUI is too old for the model input to run on {plan.n_cards} cards (its "
                f"MiniMax-H3 blocks lack the attention hook that sequence parallel needs, added "
                f"after ComfyUI v0.33.0): update ComfyUI (git pull in the ComfyUI folder; this version "
                f"is checked with upstream commit {CHECKED_UPSTREAM[:8]}), or set npu_count to 1 or 2 "
                f"to run the DiT on one card.")
        if problems:
            log.info("model input (%s) cannot run sequence parallel: %s", type(dit_module(model)).__name__,
                     "; ".join(problems))
            raise RolePlanError(
                f"the model input is not a MiniMax-H3 DiT that this node can split over {plan.n_cards} "
                f"cards: connect the output of the UNETLoader that loads a MiniMax-H3 file (or of its "
                f"LoRA loader), or set npu_count to 1 or 2.")
    if plan.text_encoder.mode == TENSOR_PARALLEL:
        _check_text_encoder_split(clip, len(plan.text_encoder.cards))


def _check_text_encoder_split(clip, n: int) -> None:
    """text_encoder_split_problem's refusals in the node's words (the same exception types)."""
    if _language_model(clip) is not None and language_model_patches(clip):
        raise TensorParallelError(
            f"the clip input carries a CLIP LoRA ({len(language_model_patches(clip))} patched "
            f"weight(s) of its language model), which tensor parallel over {n} cards cannot apply: "
            f"remove the CLIP LoRA (a LoRA on the model input only is fine), or set npu_count to 1 "
            f"or 2 to keep the text encoder on one card.")
    try:
        text_encoder_split_problem(clip, n)
    except TensorParallelError as exc:
        raise type(exc)(f"the clip input's text encoder cannot be split over {n} cards ({exc}): set "
                        f"npu_count to 1 or 2 to keep it on one card.") from None


# ----------------------------------------------------------------------------- text encoder

def _place_clip(clip, device):
    out = clip.clone() if callable(getattr(clip, "clone", None)) else copy.copy(clip)
    patcher = getattr(out, "patcher", None)
    if patcher is not None and getattr(patcher, "load_device", device) != device:
        if callable(getattr(patcher, "clone", None)):
            out.patcher = patcher = patcher.clone()
        move_load_device(patcher, device, "text encoder")
    return out


def tensor_parallel_text_encoder(clip, devices, coordinator):
    """The text encoder's role on several cards: a new CLIP whose decoder is split over `devices`."""
    problem = text_encoder_split_problem(clip, len(devices))
    if problem is not None:
        log.warning("text encoder: not tensor parallel, it runs on %s only: %s", devices[0], problem)
        return _place_clip(clip, devices[0])
    out = tensor_parallel_clip(clip, coordinator)  # a new CLIP: the input's encoder is untouched
    # the clone's patcher still loads the embeddings and the vision tower: on rank 0's card
    move_load_device(getattr(out, "patcher", None), devices[0], "text encoder")
    manage_tensor_parallel_shards(out)  # out has a patcher of its own (a clone's)
    log.info("text encoder: tensor parallel over %s", ", ".join(map(str, devices)))
    return out


# ----------------------------------------------------------------------------- VAEs

def place_vae(vae, device, what):
    """A VAE on one card: a shallow copy whose device is `device` (`what` names it in the log)."""
    out = copy.copy(vae)
    if getattr(out, "device", device) != device:
        patcher = getattr(out, "patcher", None)
        if patcher is not None and callable(getattr(patcher, "clone", None)):
            out.patcher = patcher.clone()
            out.patcher.load_device = device
        log.info("%s: device %s -> %s", what, out.device, device)
        out.device = device
    return out


def chunked_video_vae(vae, devices, merge_device, coordinator):
    """The video VAE's role on several cards: a copy whose decode runs in chunks on `devices`
    and merges on `merge_device` (one card when the VAE has no chunk interface)."""
    if not has_chunk_interface(vae):
        log.warning("video VAE: %s has no temporal chunk interface; it decodes on %s only",
                    type(vae.first_stage_model).__name__, merge_device)
        return place_vae(vae, merge_device, "video VAE")
    out = place_vae(vae, merge_device, "video VAE")
    runner = coordinator if list(coordinator.devices) == list(devices) else None
    out.first_stage_model = with_parallel_decode(vae.first_stage_model, devices, runner=runner,
                                                 merge_device=merge_device)
    try:
        manage_decoder_copies(out.first_stage_model.parallel_decode)
    except ImportError:  # no ComfyUI (tests, the dry run): nothing to register with
        pass
    log.info("video VAE: temporal chunks decoded on %s, merged on %s",
             ", ".join(map(str, devices)), merge_device)
    return out


# ----------------------------------------------------------------------------- apply

def apply_role_plan(plan, devices: Sequence[torch.device], model, clip, video_vae, audio_vae,
                    backend: str | None = None, coordinator=None, dit_weights: str = "replicate",
                    dit_ranks: str = "threads", tell=None, sp_mode=None, exchange_precision: str = "exact",
                    split=None):
    """Return (model, clip, video_vae, audio_vae) set up per `plan` on `devices`.

    devices[i] is plan card i. `backend` picks the collective backend (None: from the
    environment). `coordinator` may be given (tests); otherwise the shared one for the
    planned cards is used (started here when the plan needs more than one card).
    `dit_weights`: "replicate" or "shard" for a sequence-parallel DiT (roles/memory_plan.py
    resolves the node's "auto"). `dit_ranks`: the DiT's ranks as "threads" of this process or
    as worker "processes" (roles/dit.py `workers_dit`, either weight mode), these joined by the
    ranks of other servers COMFYUI_MULTI_DEVICE_REMOTE_RANKS counts. `tell(text)`: shows what
    the user should know beside the log (the node's text in ComfyUI's page). `sp_mode`: the DiT's
    attention exchange, a strategy name or a ModeChoice (sp/mode_choice.py; None: allgather).
    `exchange_precision`: exact, or int8 / fp8 for what that exchange sends (comm/compression.py).
    `split`: how the DiT's rows are shared over its ranks (a RowSplit of sp/split.py; None: even).
    """
    sp_mode = getattr(sp_mode, "mode", sp_mode) or "allgather"
    if check_precision(exchange_precision) != EXACT:  # exact keeps the plain mode name
        sp_mode = SPMode(sp_mode, exchange_precision=exchange_precision)
    if dit_weights not in APPLIED_DIT_WEIGHT_MODES:
        raise RolePlanError(f"dit_weights={dit_weights!r}: apply_role_plan takes 'replicate' or 'shard'")
    if dit_ranks not in APPLIED_DIT_RANKS:
        raise RolePlanError(f"dit_ranks={dit_ranks!r}: apply_role_plan takes "
                            f"{' or '.join(map(repr, APPLIED_DIT_RANKS))}")
    remote_ranks = remote_ranks_from_env() if dit_ranks == "processes" else 0
    if remote_ranks and plan.dit.mode != SEQUENCE_PARALLEL:
        log.warning("COMFYUI_MULTI_DEVICE_REMOTE_RANKS=%d is not used by this node: at %d card(s) the DiT "
                    "runs on one card; give the node 2 or more cards of this server to add the other "
                    "servers' ranks", remote_ranks, plan.n_cards)
        remote_ranks = 0
    devices = [resolve_device(d) for d in devices]  # 'npu:i' needs torch_npu: imported here
    if len(devices) != plan.n_cards:
        raise RolePlanError(f"the plan is for {plan.n_cards} cards but {len(devices)} devices were given")
    check_inputs(plan, model, clip, video_vae, audio_vae)
    # the node ran again: a worker pool of an earlier run serves a MODEL this prompt replaces
    # (a processes run starts its own pool at its first step)
    said = stop_unused_pool(f"the MultiNPUParallelConfig node ran again (the DiT on {len(plan.dit.cards)} card(s)"
                            + (f", ranks as {dit_ranks})" if len(plan.dit.cards) > 1 else ")"))
    if said and tell is not None:
        tell(said)

    def cards(role):
        return [devices[c] for c in role.cards]

    parallel = [r for r in plan.roles() if len(r.cards) > 1]
    if parallel and coordinator is None:
        # one coordinator over all cards; every parallel role of the seed table uses all of them
        coordinator = shared_coordinator(devices, backend)
    if coordinator is not None and parallel and [str(d) for d in coordinator.devices] != [str(d) for d in devices]:
        raise RolePlanError(f"the coordinator runs on {coordinator.devices}, the plan on {devices}")

    if plan.dit.mode == SEQUENCE_PARALLEL and dit_ranks == "processes":
        out_model = workers_dit(model, cards(plan.dit), remote_ranks, rendezvous_from_env(), dit_weights,
                                sp_mode=sp_mode, split=split)
    elif plan.dit.mode == SEQUENCE_PARALLEL:
        lane = shared_prefetch_lane(coordinator) if dit_weights == "shard" else None
        out_model = sequence_parallel_dit(model, cards(plan.dit), coordinator, dit_weights, lane=lane,
                                          sp_mode=sp_mode, split=split)
    else:
        out_model = place_dit(model, cards(plan.dit)[0])

    if plan.video_vae.mode == TEMPORAL_CHUNKS:
        merge = devices[plan.video_vae.merge_card or 0]
        out_video = chunked_video_vae(video_vae, cards(plan.video_vae), merge, coordinator)
    else:
        out_video = place_vae(video_vae, cards(plan.video_vae)[0], "video VAE")
    out_audio = place_vae(audio_vae, cards(plan.audio_vae)[0], "audio VAE")

    if plan.text_encoder.mode == TENSOR_PARALLEL:
        out_clip = tensor_parallel_text_encoder(clip, cards(plan.text_encoder), coordinator)
    else:
        out_clip = _place_clip(clip, cards(plan.text_encoder)[0])
    return out_model, out_clip, out_video, out_audio
