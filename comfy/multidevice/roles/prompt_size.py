"""The memory plan follows the prompt: the sequence length the DiT's activations are counted for.

The node's `plan_tokens` is `auto` (0) by default. Then
  * at node time the plan counts the workflow's largest MiniMax-H3 latent, read from the
    prompt's latent nodes (`workflow_tokens`), or no activations when none is readable;
  * at every step that samples a longer sequence than was checked, `PromptSizeCheck` (the
    first DIFFUSION_MODEL wrapper of the MODEL output, so before any rank starts) counts the
    step's real rows and checks the plan again, refusing only what this prompt cannot fit.
An explicit `plan_tokens` is planned as given and the steps are still checked.

Row counts follow the H3 layout (UPSTREAM_H3.md): video patch (1, 2, 2) over a latent of 1/16
the width and height and 5k + 2 frames for 17k + 5 frames; audio 40 latent frames a second at
24 fps, two rows each; the text's rows as the text encoder gives them.
"""

from __future__ import annotations

import logging
import math

log = logging.getLogger(__name__)

WRAPPER_KEY = "multinpu_prompt_size"
DIFFUSION_MODEL_WRAPPERS = "diffusion_model"  # ComfyUI's WrappersMP.DIFFUSION_MODEL
# The nodes that make an H3 latent from width / height / length widgets (upstream's names)
LATENT_NODES = ("EmptyMiniMaxH3LatentAV", "MiniMaxH3ImageToVideo", "MiniMaxH3ReferenceToVideo")
TEXT_ROWS_ESTIMATE = 1024  # a prompt's text rows before it is encoded (the 5 s workflow: 882)
FPS = 24
AUDIO_LATENT_PER_S = 40


def latent_tokens(width: int, height: int, length: int, text_rows: int = TEXT_ROWS_ESTIMATE) -> int:
    """The packed sequence of one H3 latent: video, audio and text rows."""
    latent_frames = 5 * math.ceil(max(length - 5, 0) / 17) + 2
    video = latent_frames * math.ceil(height / 32) * math.ceil(width / 32)
    audio = 2 * math.ceil(length / FPS * AUDIO_LATENT_PER_S)
    return video + audio + text_rows


def workflow_tokens(prompt) -> int | None:
    """The largest sequence the prompt's latent nodes will make, or None when none has all
    three sizes as plain numbers (a size wired from another node is not known here)."""
    found = []
    for node in (prompt or {}).values() if isinstance(prompt, dict) else ():
        if not isinstance(node, dict) or node.get("class_type") not in LATENT_NODES:
            continue
        inputs = node.get("inputs") or {}
        sizes = [inputs.get(name) for name in ("width", "height", "length")]
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes):
            found.append(latent_tokens(*sizes))
    return max(found, default=None)


def step_tokens(args: tuple, kwargs: dict) -> int | None:
    """The packed rows of one DiT step from its inputs: x = [video [1, C, T, H, W],
    audio [1, C, 2, Ta]] and the text states [1, L, D]; None for another layout."""
    x = args[0] if args else kwargs.get("x")
    context = args[2] if len(args) > 2 else kwargs.get("context")
    if not isinstance(x, (list, tuple)) or len(x) != 2:
        return None
    video, audio = x
    if getattr(video, "ndim", 0) != 5 or getattr(audio, "ndim", 0) != 4:
        return None
    _, _, frames, height, width = video.shape
    rows = frames * math.ceil(height / 2) * math.ceil(width / 2) + audio.shape[2] * audio.shape[3]
    if getattr(context, "ndim", 0) == 3:
        rows += context.shape[1]
    return int(rows)


class PromptSizeCheck:
    """A DIFFUSION_MODEL wrapper: checks the memory plan against each step's real sequence
    (once per longer sequence) before calling on; a MemoryPlanError names what to change."""

    def __init__(self, plan):
        self.plan = plan
        self.checked = plan.tokens or 0

    def __call__(self, executor, *args, **kwargs):
        tokens = step_tokens(args, kwargs)
        if tokens is not None and tokens > self.checked:
            self.check(tokens)
        return executor(*args, **kwargs)

    def check(self, tokens: int) -> None:
        plan = self.plan.for_tokens(tokens)
        log.info("this prompt samples %d tokens (planned: %s): the memory plan again\n%s", tokens,
                 self.plan.tokens if self.plan.tokens is not None else "not known", plan.table())
        plan.check()
        self.checked = tokens


def install_prompt_size_check(model_patcher, plan) -> PromptSizeCheck | None:
    """Put the check first among the MODEL's DIFFUSION_MODEL wrappers (ComfyUI calls them in
    order, so it runs before the fan-out starts any rank); None for a bare module."""
    wrappers = getattr(model_patcher, "wrappers", None)
    if not isinstance(wrappers, dict) or plan.dit_shape is None:
        return None
    check = PromptSizeCheck(plan)
    others = {k: v for k, v in wrappers.get(DIFFUSION_MODEL_WRAPPERS, {}).items() if k != WRAPPER_KEY}
    wrappers[DIFFUSION_MODEL_WRAPPERS] = {WRAPPER_KEY: [check], **others}
    return check
