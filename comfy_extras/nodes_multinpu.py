"""The `MultiNPUParallelConfig` node: MODEL, CLIP and two VAEs in, the same set up across the cards out.

One node on the canvas takes the loaded MODEL, CLIP, video VAE and audio VAE and returns the
same four objects set up to run across the cards (the role table: comfy/multidevice/roles/plan.py):

  * `configure_parallel(...)` validates the visible cards first (nothing is touched on an
    error), plans the roles, then applies them through `comfy.multidevice.roles.apply`;
  * `NODE_SCHEMA` is the node's interface as plain data (inputs, types, defaults, options,
    outputs in order), read by the tests and by tools/make_workflows.py without ComfyUI;
  * the V3 node class is built from that data on first use, so this module imports and its
    logic runs without ComfyUI installed.
"""

from __future__ import annotations

import logging

from comfy.multidevice.cards import DEVICE_KINDS, SUPPORTED_CARD_COUNTS
from comfy.multidevice.comm.compression import EXCHANGE_PRECISIONS
from comfy.multidevice.roles.communicator_memory import card_kind
from comfy.multidevice.roles.dit import DIT_RANKS, resolve_dit_ranks
from comfy.multidevice.roles.memory_plan import AUTO_PLAN_TOKENS, LONGEST_WORKFLOW_TOKENS, MAX_PLAN_TOKENS
from comfy.multidevice.roles.plan import plan_roles
from comfy.multidevice.sp.mode_choice import SP_MODE_CHOICES
from comfy.multidevice.progress import node_text
from comfy.multidevice.weights.block_shards import APPLIED_DIT_WEIGHT_MODES

log = logging.getLogger(__name__)

NODE_ID = "MultiNPUParallelConfig"
DISPLAY_NAME = "Multi-NPU Parallel Config"
CATEGORY = "advanced/multigpu"  # next to upstream's MultiGPU CFG Split / Select * Device nodes
DESCRIPTION = (
    "Spread MiniMax-H3 over several cards of this server: the DiT runs sequence parallel, the "
    "text encoder tensor parallel, the video VAE decodes its temporal chunks on all cards and "
    "the audio VAE gets its own card (see plan per card count in the README). Place it right "
    "after the loaders (and a LoRA loader), before every consumer of these four objects.")

# Backend choices: "default" keeps COMFYUI_MULTI_DEVICE_BACKEND (or auto when unset).
BACKEND_CHOICES = ("default", "auto", "hccl", "nccl", "peer")

# The node's interface as plain data. "type" is ComfyUI's socket/widget type name.
NODE_SCHEMA = {
    "node_id": NODE_ID,
    "display_name": DISPLAY_NAME,
    "category": CATEGORY,
    "description": DESCRIPTION,
    "inputs": [
        {"name": "model", "type": "MODEL",
         "tooltip": "The MiniMax-H3 DiT (after any LoRA): runs sequence parallel on 4 or 8 cards."},
        {"name": "clip", "type": "CLIP",
         "tooltip": "The minimax text encoder: tensor parallel on 4 or 8 cards."},
        {"name": "video_vae", "type": "VAE",
         "tooltip": "The video VAE: decodes its temporal chunks on all cards, merged on card 0."},
        {"name": "audio_vae", "type": "VAE", "tooltip": "The audio VAE: placed on the last card."},
        {"name": "npu_count", "type": "COMBO", "options": list(SUPPORTED_CARD_COUNTS), "default": 4,
         "tooltip": "How many cards to use. The visible cards are checked before any weight moves."},
        {"name": "backend", "type": "COMBO", "options": list(BACKEND_CHOICES), "default": "default",
         "optional": True, "advanced": True,
         "tooltip": "Collective backend: default = COMFYUI_MULTI_DEVICE_BACKEND or auto; auto = "
                    "HCCL on NPUs / NCCL on GPUs with peer-copy fallback; hccl/nccl fail loudly; "
                    "peer = peer copies, on any cards."},
        {"name": "device_kind", "type": "COMBO", "options": list(DEVICE_KINDS), "default": "auto",
         "optional": True, "advanced": True,
         "tooltip": "auto = the one accelerator kind that is visible; npu / cuda insist on that kind; "
                    "cpu = npu_count CPU ranks on this machine (tests, a try without cards)."},
        {"name": "devices", "type": "STRING", "default": "", "optional": True, "advanced": True,
         "tooltip": "Explicit cards, e.g. 'npu:0,npu:2,npu:4,npu:6'. Empty = the first npu_count "
                    "visible cards."},
        {"name": "dit_weights", "type": "COMBO", "options": ["auto", *APPLIED_DIT_WEIGHT_MODES], "default": "auto",
         "optional": True,
         "tooltip": "DiT weights per card with 4 or 8 cards: replicate = a full DiT on every card; shard = "
                    "each card keeps 1/N of the block weights and gathers a block just before it runs "
                    "(exact; the BF16 DiT fits 4 x 64 GB only this way); auto = shard when a full "
                    "replica plus the activations does not fit a card."},
        {"name": "plan_tokens", "type": "INT", "default": AUTO_PLAN_TOKENS, "min": 0, "max": MAX_PLAN_TOKENS,
         "optional": True, "advanced": True,
         "tooltip": f"{AUTO_PLAN_TOKENS} = auto: the memory plan counts the workflow's largest H3 latent, and "
                    "every step's real sequence is checked before it runs. Else the longest packed sequence "
                    f"to plan for: {LONGEST_WORKFLOW_TOKENS} = 768p 15 s, 38592 = 768p 5 s."},
        {"name": "dit_ranks", "type": "COMBO", "options": list(DIT_RANKS), "default": "auto",
         "optional": True, "advanced": True,
         "tooltip": "How the DiT's cards run: auto = processes when other servers' ranks are set "
                    "(COMFYUI_MULTI_DEVICE_REMOTE_RANKS), else threads; threads = rank threads of this "
                    "ComfyUI process; processes = one worker process per other card, which a hang or "
                    "crash cannot take down with ComfyUI (killed, fresh workers at the next prompt; the "
                    "MODEL from a core loader), and the only way to add the cards of other servers. "
                    "Both run LoRAs, either dit_weights and the Fun ControlNet; a LoRA loader after this "
                    "node needs dit_weights replicate."},
        {"name": "sp_mode", "type": "COMBO", "options": list(SP_MODE_CHOICES), "default": "auto",
         "optional": True, "advanced": True,
         "tooltip": "How the DiT's cards share attention: allgather = each card gathers every card's K and V "
                    "(any card count); ulysses = cards swap rows for heads (moves 2/N of the all-gather's "
                    "bytes, holds less; the heads must divide by the card count: 56 by 2, 4, 7, 8); hybrid = "
                    "Ulysses in groups where the heads do not divide; auto = "
                    "what doctor --deep measured here, else allgather at 2 cards, else ulysses "
                    "where it moves fewer bytes. Same result within the sequence-parallel tolerance."},
        {"name": "exchange_precision", "type": "COMBO", "options": list(EXCHANGE_PRECISIONS), "default": "exact",
         "optional": True, "advanced": True,
         "tooltip": "What the DiT's cards send each other for attention: exact = the values as they are; "
                    "int8 = 8-bit with a scale per 128 values (about half the bytes; the result is close "
                    "to exact, not identical: see the README's bound); fp8 = 8-bit floats (where the "
                    "cards and torch have them). Helps when the link between cards sets the pace."},
        {"name": "split", "type": "STRING", "default": "even", "optional": True, "advanced": True,
         "tooltip": "How the DiT's rows are shared over its cards (mixed cards): even = the same on every card; "
                    "auto = each card times one block at the first step and takes rows in proportion to its "
                    "speed, within what its free memory holds; or one weight per card in the order of the "
                    "cards, e.g. 3,1. Exact for any split; an uneven split runs the all-gather (sp_mode "
                    "ulysses / hybrid are refused with it)."},
    ],
    "outputs": [
        {"name": "model", "type": "MODEL",
         "tooltip": "The DiT set up to run sequence parallel over the planned cards (or on card 0)."},
        {"name": "clip", "type": "CLIP",
         "tooltip": "The text encoder set up tensor parallel over the planned cards (or on card 0)."},
        {"name": "video_vae", "type": "VAE",
         "tooltip": "The video VAE, decoding its temporal chunks on the planned cards."},
        {"name": "audio_vae", "type": "VAE", "tooltip": "The audio VAE, on its planned card."},
    ],
    # What users type into the node search to find it (upstream's own H3 nodes declare these too).
    "search_aliases": ["multi gpu", "multi npu", "multigpu", "sequence parallel", "tensor parallel",
                       "ascend", "npu", "minimax h3 parallel"],
}


def widget_defaults() -> list:
    """Widget values in schema order, as a UI workflow stores them in `widgets_values`."""
    return [spec["default"] for spec in NODE_SCHEMA["inputs"] if "default" in spec]


# ----------------------------------------------------------------------------- configure

def configure_parallel(model, clip, video_vae, audio_vae, npu_count=4, backend="default",
                       device_kind="auto", devices="", inventory=None, dit_weights="auto",
                       plan_tokens=AUTO_PLAN_TOKENS, free_memory=None, dit_ranks="auto", prompt=None,
                       tell=None, sp_mode="auto", exchange_precision="exact", split="even"):
    """Validate, plan, apply. Returns (model, clip, video_vae, audio_vae), all new objects.

    Every check (card count, device kind, visible cards, backend name, the four inputs'
    shape, the memory plan of every card) runs before anything is cloned, moved or started;
    the inputs are never modified. `free_memory` overrides the probed free bytes per device
    name (tests). `prompt`: the workflow as ComfyUI queued it, read for its latents' sizes
    when plan_tokens is auto. `tell(text)`: shows a line on the node in the page. `sp_mode`: the
    DiT's attention exchange (comfy/multidevice/sp/mode_choice.py resolves auto).
    `exchange_precision`: exact, int8 or fp8 for what that exchange sends (comm/compression.py).
    `split`: how the DiT's rows are shared over its cards (comfy/multidevice/sp/split.py).
    """
    from comfy.multidevice.comm.errors import BackendUnavailable
    from comfy.multidevice.cards import select_devices
    from comfy.multidevice.comm.compression import check_device_support
    from comfy.multidevice.roles import apply as roles_apply
    from comfy.multidevice.roles.memory_plan import plan_memory
    from comfy.multidevice.roles.prompt_size import install_prompt_size_check, workflow_tokens

    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend={backend!r} is unknown: set backend to one of {', '.join(BACKEND_CHOICES)}.")
    remote_ranks = remote_ranks_of_environment()
    dit_ranks = resolve_dit_ranks(dit_ranks, remote_ranks)  # refuses an unknown one by name
    selected = select_devices(npu_count, kind=device_kind, devices=devices, inventory=inventory)
    joining = remote_ranks if dit_ranks == "processes" else 0  # other servers' DiT ranks
    plan = plan_roles(npu_count, joining)
    if any(len(role.cards) > 1 for role in plan.roles()):  # rank threads and a backend will start
        check_multi_device_environment(backend)
    roles_apply.check_inputs(plan, model, clip, video_vae, audio_vae)
    rows = dit_split(split, plan, joining)
    mode = dit_sp_mode(sp_mode, plan, selected, model, joining, backend, rows)
    exchange_precision = check_device_support(exchange_precision, selected[0])  # refused before anything is made
    if type(plan_tokens) is int and plan_tokens == AUTO_PLAN_TOKENS:
        tokens, tokens_from = workflow_tokens(prompt), "the workflow's latents"
    else:  # a number is planned as given; anything else is refused by name in plan_memory
        tokens, tokens_from = plan_tokens, "plan_tokens"
    memory = plan_memory(plan, selected, model, clip, video_vae, audio_vae, dit_weights=dit_weights,
                         tokens=tokens, free=free_memory, remote_ranks=joining,
                         backend=None if backend == "default" else backend, dit_ranks=dit_ranks,
                         tokens_from=tokens_from, sp_mode=mode,
                         split_weights=rows.weights if rows.kind == "weights" else None,
                         exchange_precision=exchange_precision)
    log.info("%s: %d card(s) %s; %s\n%s", NODE_ID, npu_count, ", ".join(map(str, selected)),
             plan.describe() + (f"; DiT {mode.describe()}" if mode.world > 1 else ""), memory.table())
    memory.check()
    rows = logged_split(rows, memory, selected, joining)
    try:
        outputs = roles_apply.apply_role_plan(
            plan, selected, model, clip, video_vae, audio_vae,
            backend=None if backend == "default" else backend, dit_weights=memory.dit_weights,
            dit_ranks=dit_ranks, tell=tell, sp_mode=mode, exchange_precision=exchange_precision, split=rows)
    except BackendUnavailable as exc:  # a forced backend (the input or the variable) did not start
        from comfy.multidevice.comm.settings import BACKEND_ENV, backend_from_env
        asked = f"backend is {backend}" if backend != "default" else \
            f"backend is default and {BACKEND_ENV} asks for {backend_from_env(None)}"
        raise BackendUnavailable(
            f"{asked}, which cannot start on the {len(selected)} {card_kind(selected[0])} cards "
            f"({exc}): set backend to auto (it falls back to peer copies between the cards), or fix what stops it.") from exc
    if outputs[0] is not model:  # the input MODEL is never modified
        install_prompt_size_check(outputs[0], memory)
    return outputs


def dit_split(split, plan, joining: int):
    """The node's split for the DiT's ranks (sp/split.py), refused by name before anything is made;
    even when the DiT runs on one card."""
    from comfy.multidevice.sp.split import EVEN, parse_split
    world = plan.dit_world(joining)
    return EVEN if world <= 1 else parse_split(split, world)


def logged_split(rows, memory, selected, joining: int):
    """The split as it runs: auto with each card's memory cap from the plan; each card's share logged."""
    from comfy.multidevice.sp.split import RowSplit
    if rows.kind == "even":
        return rows
    cards = [str(d) for d in selected[:memory.dit_world - joining]] + [f"remote rank {r}" for r in range(joining)]
    if rows.kind == "auto":
        rows = RowSplit("auto", caps=memory.split_caps())
        caps = rows.caps or [1.0] * len(cards)
        for card, cap in zip(cards, caps):
            log.info("%s: split auto: %s's rows follow its speed, timed at the first step, capped at %.1f%% by its "
                     "free memory", NODE_ID, card, 100 * cap)
        return rows
    total = sum(rows.weights)
    for card, weight in zip(cards, rows.weights):
        log.info("%s: %s: %s takes %.1f%% of the rows (asked)", NODE_ID, rows.describe(), card, 100 * weight / total)
    return rows


def dit_sp_mode(sp_mode, plan, selected, model, joining: int, backend: str = "default", split=None):
    """The node's sp_mode resolved for the DiT's ranks (sp/mode_choice.py), refused by name before
    anything is made: W counts other servers' ranks, the heads come from the DiT's first block; a
    measurement counts when it was taken with the backend the node names (any, for default/auto).
    `split`: the DiT's split (sp/split.py); an uneven one runs the all-gather."""
    from comfy.multidevice.comfy_objects import dit_module
    from comfy.multidevice.roles.memory_plan import dit_shape_of
    from comfy.multidevice.sp.mode_choice import choose_sp_mode, measurement_for

    world = plan.dit_world(joining)
    shape = dit_shape_of(dit_module(model)) if world > 1 else None
    kind = card_kind(selected[0])
    named = None if backend in ("default", "auto") else backend
    return choose_sp_mode(sp_mode, world, shape.heads if shape else None, shape.head_dim if shape else 128,
                          other_servers=joining > 0,
                          measured=measurement_for(kind, world, backend=named) if world > 1 else None,
                          uneven_rows=split is not None and split.uneven)


def remote_ranks_of_environment() -> int:
    """COMFYUI_MULTI_DEVICE_REMOTE_RANKS, refused in the node's words."""
    from comfy.multidevice.comm.settings import remote_ranks_from_env, SettingError
    try:
        return remote_ranks_from_env()
    except SettingError as exc:
        raise SettingError(f"{exc}, then restart ComfyUI.") from None


def check_multi_device_environment(backend: str = "default") -> None:
    """The variables the cards' coordinator will read (comm/settings.py), checked before anything
    starts, in the node's words: the backend variable only counts while backend is default."""
    from comfy.multidevice.comm.settings import BACKEND_ENV, backend_from_env, check_environment, SettingError

    try:
        check_environment(backend=False)  # the timeouts and the weight base
    except SettingError as exc:
        raise SettingError(f"{exc}, then restart ComfyUI.") from None
    if backend == "default":
        try:
            backend_from_env(None)
        except SettingError as exc:
            raise SettingError(f"{exc} (then restart ComfyUI), or set this node's backend input to auto, "
                               f"hccl, nccl or peer, so that {BACKEND_ENV} is not read.") from None


def shown_error(exc: Exception) -> Exception | None:
    """What ComfyUI shows for an error of configure_parallel: ComfyUI puts str(error) and the
    error's qualified class name in its execution_error, so this package's own error types
    ("comfy.multidevice.cards.TooFewDevices") become a plain ValueError / RuntimeError with
    the same one-sentence message. None: not ours (a Cancel, torch's own errors), raise as is."""
    module = type(exc).__module__ or ""
    if not (module == "comfy.multidevice" or module.startswith("comfy.multidevice.") or module == __name__):
        return None
    for plain in (ValueError, RuntimeError):
        if isinstance(exc, plain):
            return plain(str(exc))
    return None


# ----------------------------------------------------------------------------- ComfyUI node

_NODE_CLASS = None


def _supported(fn, kwargs: dict, optional: tuple) -> dict:
    """`kwargs` less the `optional` ones that `fn` does not take: an older ComfyUI's comfy_api
    lacks some (advanced inputs, output tooltips, search_aliases), and the node still loads."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {k: v for k, v in kwargs.items() if k not in optional}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k not in optional or k in params}


# socket/widget type name -> comfy_api io class name
_IO_KINDS = {"MODEL": "Model", "CLIP": "Clip", "VAE": "Vae", "COMBO": "Combo", "STRING": "String",
             "INT": "Int"}


def _io_input(io, spec: dict):
    """One plain-data input spec -> the matching comfy_api io Input."""
    cls = getattr(io, _IO_KINDS[spec["type"]]).Input
    kwargs = {k: spec[k] for k in ("default", "options", "optional", "tooltip", "advanced", "min", "max")
              if k in spec}
    return cls(spec["name"], **_supported(cls.__init__, kwargs, optional=("advanced",)))


def _io_output(io, spec: dict):
    cls = getattr(io, _IO_KINDS[spec["type"]]).Output
    kwargs = {"display_name": spec["name"], "tooltip": spec["tooltip"]}
    return cls(**_supported(cls.__init__, kwargs, optional=("tooltip",)))


def _schema_extras(io) -> dict:
    """What a newer comfy_api takes beyond the basics: search aliases, and the queued workflow
    (its latents' sizes, for plan_tokens auto)."""
    extras = {"search_aliases": NODE_SCHEMA["search_aliases"]}
    if hasattr(io, "Hidden"):
        extras["hidden"] = [io.Hidden.prompt, io.Hidden.unique_id]
    return extras


def _hidden(node_cls, name: str):
    """What ComfyUI hands a node that asks for it (the queued workflow, the node's id), None on a
    ComfyUI without it."""
    hidden = getattr(node_cls, "hidden", None)
    return getattr(hidden, name, None) if hidden is not None else None


def node_class():
    """The V3 node class (built once, on first use: it needs ComfyUI's comfy_api)."""
    global _NODE_CLASS
    if _NODE_CLASS is not None:
        return _NODE_CLASS
    from comfy_api.latest import io

    class MultiNPUParallelConfig(io.ComfyNode):
        @classmethod
        def define_schema(cls):
            return io.Schema(
                node_id=NODE_SCHEMA["node_id"],
                display_name=NODE_SCHEMA["display_name"],
                category=NODE_SCHEMA["category"],
                description=NODE_SCHEMA["description"],
                inputs=[_io_input(io, s) for s in NODE_SCHEMA["inputs"]],
                outputs=[_io_output(io, s) for s in NODE_SCHEMA["outputs"]],
                **_supported(io.Schema, _schema_extras(io), optional=("search_aliases", "hidden")),
            )

        @classmethod
        def fingerprint_inputs(cls, **inputs):
            # Outputs stay cached as usual, except after a stuck rank closed a coordinator:
            # they would still point at it, so the node runs again and builds a fresh one.
            from comfy.multidevice.comm.group import abandoned_coordinator_count
            return abandoned_coordinator_count()

        @classmethod
        def execute(cls, model, clip, video_vae, audio_vae, **options) -> io.NodeOutput:
            try:
                # the schema's defaults for the inputs not sent; the rest passed as they came:
                # ComfyUI sends ints, and anything else (4.5, "4", True, None) is refused by name
                # instead of being cast
                defaults = {s["name"]: s["default"] for s in NODE_SCHEMA["inputs"] if "default" in s}
                outputs = configure_parallel(model, clip, video_vae, audio_vae, **{**defaults, **options},
                                             prompt=_hidden(cls, "prompt"),
                                             tell=node_text(_hidden(cls, "unique_id")))
            except Exception as exc:
                shown = shown_error(exc)
                if shown is None:
                    raise
                # the internal type stays in the server log (and as the shown error's cause)
                log.info("%s refused the inputs (%s.%s)", NODE_ID, type(exc).__module__, type(exc).__qualname__)
                raise shown from exc
            return io.NodeOutput(*outputs)

    _NODE_CLASS = MultiNPUParallelConfig
    return _NODE_CLASS


async def comfy_entrypoint():
    """ComfyUI's V3 extension hook: registers MultiNPUParallelConfig."""
    from comfy_api.latest import ComfyExtension

    class MultiNPUExtension(ComfyExtension):
        async def get_node_list(self):
            return [node_class()]

    return MultiNPUExtension()
