"""Card memory the collective libraries reserve for their communicators, for the memory plan.

Per communicator, from the libraries' own references, read from their variables:

  HCCL  2 x HCCL_BUFFSIZE MB, one buffer to send and one to receive (CANN, HCCL_BUFFSIZE: "each
        communicator occupies 2 x HCCL_BUFFSIZE"; default 200, so 400 MB). A MB is counted as
        1024 x 1024 bytes, the larger reading.
  NCCL  NCCL_BUFFSIZE (default 4 MiB, NCCL's environment-variable reference) is the buffer of one
        connection on one channel. NCCL opens up to 32 channels (fewer when NCCL_MAX_NCHANNELS
        says so) and a connection per peer it talks to, and its LL/LL128 protocols keep buffers
        of about the same size again. The plan's figure, an upper estimate rather than a
        measurement: 2 x NCCL_BUFFSIZE x channels x (W - 1), e.g. 768 MiB at W = 4 with the
        defaults.

Which communicators a card holds, counted from what the code makes:
- the coordinator of the plan's cards (roles/apply.py starts one whenever a role runs on
  several cards): one communicator per card from HcclCommInitAll / ncclCommInitAll, with the
  hccl or nccl backend (the node's backend input, else COMFYUI_MULTI_DEVICE_BACKEND); none
  with peer;
- ranks as processes: on each DiT card, the process group's communicator (hccl on NPUs, nccl on
  GPUs); with dit_weights=shard the block gathers use that same group on a card (no second
  group beside it: one collective at a time per card, workers/worker.py `block_gather_lane`).
CPU cards hold none (gloo and the test libraries use host memory the plan does not count).
They live as long as the coordinator or the worker pool, so they count in every stage.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from comfy.multidevice.comm.settings import backend_from_env
from comfy.multidevice.roles.plan import SEQUENCE_PARALLEL

log = logging.getLogger(__name__)

MIB = 2 ** 20
HCCL_BUFFSIZE_ENV = "HCCL_BUFFSIZE"
HCCL_DEFAULT_BUFFSIZE_MB = 200
NCCL_BUFFSIZE_ENV = "NCCL_BUFFSIZE"
NCCL_DEFAULT_BUFFSIZE = 4 * MIB
NCCL_MAX_NCHANNELS_ENV = "NCCL_MAX_NCHANNELS"
NCCL_ASSUMED_CHANNELS = 32
LIBRARY_OF_KIND = {"npu": "hccl", "cuda": "nccl"}


def card_kind(device) -> str:
    """"npu" of "npu:0" or of a torch.device (read from the text: the plan runs before a device
    kind of a package not imported yet could be made into a torch.device)."""
    return str(device).split(":", 1)[0]


def _positive_int(environ: Mapping, name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return default
    text = raw.strip()
    if text.isascii() and text.isdigit() and int(text) > 0:
        return int(text)
    log.warning("memory plan: %s=%r is not a whole number above 0; planning with its default %d",
                name, raw, default)
    return default


def communicator_bytes(library: str, world: int, environ: Mapping | None = None) -> int:
    """Card bytes one `library` ("hccl" / "nccl") communicator of `world` ranks reserves."""
    environ = os.environ if environ is None else environ
    if library == "hccl":
        return 2 * _positive_int(environ, HCCL_BUFFSIZE_ENV, HCCL_DEFAULT_BUFFSIZE_MB) * MIB
    if library == "nccl":
        buffer = _positive_int(environ, NCCL_BUFFSIZE_ENV, NCCL_DEFAULT_BUFFSIZE)
        channels = _positive_int(environ, NCCL_MAX_NCHANNELS_ENV, NCCL_ASSUMED_CHANNELS)
        return 2 * buffer * channels * max(world - 1, 0)
    return 0


def coordinator_library(kind: str, backend: str | None) -> str | None:
    """The library of the cards' coordinator: `backend` (None: COMFYUI_MULTI_DEVICE_BACKEND) on
    cards of `kind`; None for peer copies and CPU cards."""
    chosen = backend_from_env(backend)
    if chosen == "peer" or kind not in LIBRARY_OF_KIND:
        return None
    return LIBRARY_OF_KIND[kind]  # auto, and a forced library (which fails on other cards)


def card_communicators(plan, devices, backend: str | None, dit_ranks: str, dit_weights: str,
                       world: int, environ: Mapping | None = None) -> list[dict]:
    """Per plan card, {item name: bytes} of the communicators it will hold (see above)."""
    out: list[dict] = [{} for _ in devices]

    def add(card: int, library: str | None, ranks: int, count: int = 1) -> None:
        if library is not None and count:
            name = f"{library.upper()} communicators"
            out[card][name] = out[card].get(name, 0) + count * communicator_bytes(library, ranks, environ)

    if any(len(role.cards) > 1 for role in plan.roles()):
        for card, device in enumerate(devices):
            add(card, coordinator_library(card_kind(device), backend), len(devices))
    if dit_ranks == "processes" and plan.dit.mode == SEQUENCE_PARALLEL:
        for card in plan.dit.cards:
            library = LIBRARY_OF_KIND.get(card_kind(devices[card]))  # the process group's own
            add(card, library, world)
    return out
