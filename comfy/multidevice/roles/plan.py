"""The role plan: which card(s) each of DiT, text encoder, video VAE and audio VAE gets, in which mode.

  cards  DiT                     text encoder            video VAE                   audio VAE
  1      card 0                  card 0                  card 0                      card 0
  2      card 0                  card 0                  card 0                      card 1
  4, 8   all, sequence parallel  all, tensor parallel    chunks on all, merged on 0  last card

Pure data: nothing here touches a model or a device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from comfy.multidevice.cards import check_card_count, SUPPORTED_CARD_COUNTS

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- role plan

COMPONENTS = ("dit", "text_encoder", "video_vae", "audio_vae")
SINGLE = "single"
SEQUENCE_PARALLEL = "sequence_parallel"
TENSOR_PARALLEL = "tensor_parallel"
TEMPORAL_CHUNKS = "temporal_chunks"


@dataclass(frozen=True)
class Role:
    """Where one component runs: its cards (plan indices, 0-based) and its parallel mode."""

    component: str
    cards: tuple
    mode: str
    merge_card: int | None = None  # temporal_chunks: the card the decoded chunks are merged on

    def as_dict(self) -> dict:
        out = {"cards": list(self.cards), "mode": self.mode}
        if self.merge_card is not None:
            out["merge_card"] = self.merge_card
        return out


@dataclass(frozen=True)
class RolePlan:
    n_cards: int
    dit: Role
    text_encoder: Role
    video_vae: Role
    audio_vae: Role

    def roles(self) -> list[Role]:
        return [getattr(self, c) for c in COMPONENTS]

    def as_dict(self) -> dict:
        return {"n_cards": self.n_cards, **{r.component: r.as_dict() for r in self.roles()}}

    def describe(self) -> str:
        return "; ".join(f"{r.component} -> cards {list(r.cards)} ({r.mode})" for r in self.roles())

    def dit_world(self, remote_ranks: int = 0) -> int:
        """The DiT's ranks: its cards here plus other servers' ranks (1: the DiT on one card)."""
        return len(self.dit.cards) + remote_ranks if self.dit.mode == SEQUENCE_PARALLEL else 1


def plan_roles(n_cards: int, remote_ranks: int = 0) -> RolePlan:
    """Per component, the card(s) and the parallel mode for 1, 2, 4 or 8 cards (the table above).

    1: everything on card 0. 2: everything on card 0 but the audio VAE (card 1).
    4 and 8: DiT sequence parallel and text encoder tensor parallel on all cards, video VAE
    chunks decoded on all cards and merged on card 0, audio VAE on the last card.
    `remote_ranks` (DiT ranks of other servers, COMFYUI_MULTI_DEVICE_REMOTE_RANKS): at 2 cards
    the DiT is then sequence parallel over both, with those ranks.
    """
    n = check_card_count(n_cards)
    everyone = tuple(range(n))
    last = n - 1
    if n <= 2:
        dit_with_others = n == 2 and remote_ranks > 0
        return RolePlan(
            n_cards=n,
            dit=Role("dit", everyone, SEQUENCE_PARALLEL) if dit_with_others else Role("dit", (0,), SINGLE),
            text_encoder=Role("text_encoder", (0,), SINGLE),
            video_vae=Role("video_vae", (0,), SINGLE),
            audio_vae=Role("audio_vae", (last,), SINGLE),
        )
    return RolePlan(
        n_cards=n,
        dit=Role("dit", everyone, SEQUENCE_PARALLEL),
        text_encoder=Role("text_encoder", everyone, TENSOR_PARALLEL),
        video_vae=Role("video_vae", everyone, TEMPORAL_CHUNKS, merge_card=0),
        audio_vae=Role("audio_vae", (last,), SINGLE),
    )


def roles_table(counts=SUPPORTED_CARD_COUNTS) -> list[dict]:
    """The plan for every supported count, as rows (for the README and the tests)."""
    return [plan_roles(n).as_dict() for n in counts]


class RolePlanError(ValueError):
    """An input cannot take the role the plan gives it; the message names the input and the fix."""
