"""The memory plan: what each card will hold, against its free memory, before anything loads.

Per card and per stage (ComfyUI runs the text encoder, then the DiT, then the VAE decode, and
can evict one stage's models before the next loads):

  text encoder   tensor parallel: the rank's shard (its slices plus the tensors every rank
                 copies whole, counted before any shard exists: tp/shard.py planned_shard_bytes)
                 and, on the CLIP's load card (rank 0's), the CLIP's own module beside it (the
                 input embedding, a vision tower: all but the split layers); else all of it
  DiT            `replicate`: the whole DiT; `shard`: the non-block weights, the block tensors
                 the card owns (the exact whole-tensor split of weights/block_shards.py) and
                 two gathered blocks (the running one and the prefetch), whose quantized
                 tensors exist twice while bound (the gathered bytes and the tensors rebuilt
                 from copies of them); plus the activation estimate for the planned sequence
                 length (sp/cost_model.py): the node's plan_tokens, else the workflow's
                 largest latent (roles/prompt_size.py), else none until the first step,
                 where the real sequence is checked again (`MemoryPlan.for_tokens`)
  VAE decode     a video VAE copy on every chunk card, the audio VAE on its card
  every stage    the HCCL / NCCL communicators the card holds (roles/communicator_memory.py:
                 2 x HCCL_BUFFSIZE per HCCL communicator, NCCL's buffers per peer and channel)

Sizes are counted from the objects themselves (bytes of their tensors). Free memory is the
card's. CPU "cards" share the host's RAM: their DiT stage is checked together against the
host's available memory (weights once, as the ranks share the base; activations per rank; the
attention's score blocks, which sp/attention_budget.py holds to 1/FREE_SHARE of the free memory
for all ranks together). `auto` picks `shard` when sequence parallel is planned and a full
replica plus the activations does not fit on some card.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from comfy.multidevice.comfy_objects import dit_module
from comfy.multidevice.devices import available_memory_bytes, free_memory_bytes
from comfy.multidevice.roles.apply import has_chunk_interface, text_encoder_split_problem
from comfy.multidevice.roles.communicator_memory import card_communicators, card_kind
from comfy.multidevice.roles.plan import RolePlanError, SEQUENCE_PARALLEL, TEMPORAL_CHUNKS, TENSOR_PARALLEL
from comfy.multidevice.sp.attention_budget import FREE_SHARE, shares_host_memory
from comfy.multidevice.sp.cost_model import activation_bytes, DiTShape, row_bytes
from comfy.multidevice.tensor_bytes import module_bytes
from comfy.multidevice.tp.clip import language_model_of
from comfy.multidevice.tp.decoder import TensorParallelDecoder
from comfy.multidevice.tp.shard import planned_shard_bytes
from comfy.multidevice.weights.block_shards import block_tensors, BlockShardPlan, DIT_WEIGHT_MODES
from comfy.multidevice.tensor_bytes import is_flattenable, tensor_nbytes

log = logging.getLogger(__name__)

GIB = 2 ** 30
IN_FLIGHT_BLOCKS = 2  # the block running now and the next one's prefetch
LONGEST_WORKFLOW_TOKENS = 109_952  # MiniMax-H3 at 768p, 15 s: the longest official workflow
AUTO_PLAN_TOKENS = 0  # the node's plan_tokens default: plan for what the prompt samples
MAX_PLAN_TOKENS = 10_000_000   # the node input's maximum: ~90x the longest official workflow


class MemoryPlanError(RolePlanError):
    """A card cannot hold what the plan puts on it (the message names the card and the fixes;
    `table` is the whole plan, one line per card, for the log)."""

    def __init__(self, message: str, table: str = ""):
        super().__init__(message)
        self.table = table


def _clip_bytes(clip) -> int:
    patcher = getattr(clip, "patcher", None)
    size = getattr(patcher, "model_size", None)
    if callable(size):
        return int(size())
    return module_bytes(getattr(clip, "cond_stage_model", None))


def text_encoder_shares(clip, world: int) -> list[dict]:
    """Per tensor-parallel rank, {item: bytes} of the text encoder it will hold (rank 0's card is
    the CLIP's load card). The caller has checked that the CLIP splits over `world` ranks."""
    found = language_model_of(clip)
    decoder = found.source_decoder if isinstance(found, TensorParallelDecoder) else found
    # what ComfyUI loads for the CLIP once its language model is the fan-out module: everything
    # but the language model, plus the embedding the fan-out module keeps
    own = (module_bytes(clip.cond_stage_model) - module_bytes(found)
           + module_bytes(getattr(found, "embed_tokens", None)))
    shares = [{"shard": n} for n in planned_shard_bytes(decoder, world)]
    shares[0]["CLIP module"] = own
    return shares


def dit_shape_of(dit) -> DiTShape | None:
    """The sizes the activation estimate needs, read from the DiT's first block (H3 layout)."""
    try:
        block = dit.blocks[0]
        hidden = block.attn.qkv_proj.weight.shape[1]
        head_dim = block.attn.q_norm.weight.shape[0]
        heads = block.attn.qkv_proj.weight.shape[0] // 3 // head_dim
        ffn = block.mlp.fc2.weight.shape[1]
    except (AttributeError, IndexError, TypeError):
        return None
    return DiTShape(hidden=hidden, blocks=len(dit.blocks), heads=heads, head_dim=head_dim, ffn=ffn)


def _block_sizes(dit) -> list[dict]:
    return [{n: tensor_nbytes(t) for n, t in block_tensors(block).items()} for block in dit.blocks]


def _quantized_names(dit) -> list[set]:
    """Per block, its quantized tensors (tensor subclasses made of inner tensors)."""
    return [{n for n, t in block_tensors(block).items() if is_flattenable(t)} for block in dit.blocks]


def _quantized_copy_bytes(shard_plan: BlockShardPlan, quantized: list[set], rank: int) -> int:
    """A gathered quantized tensor is rebuilt from copies of its inner tensors while the gathered
    bytes stay held with the block (weights/block_shards.py), so the quantized tensors other
    ranks own exist twice on this card while their block is bound: per block in flight."""
    per_block = [sum(n for name, n in sizes.items() if name in names and owner[name] != rank)
                 for owner, sizes, names in zip(shard_plan.owner, shard_plan.nbytes, quantized)]
    return IN_FLIGHT_BLOCKS * max(per_block, default=0)


@dataclass
class CardMemory:
    device: object
    free: int | None  # bytes; None: not known (CPU), not checked
    stages: dict = field(default_factory=dict)  # stage -> {item: bytes}

    def stage_total(self, stage: str) -> int:
        return sum(self.stages.get(stage, {}).values())


@dataclass
class SharedHost:
    """The DiT stage of the CPU cards, which draw on one RAM: {item: bytes} for all of them."""
    cards: int
    items: dict
    free: int | None  # the host's available bytes; None: not known, not checked

    @property
    def need(self) -> int:
        return sum(self.items.values())


@dataclass
class MemoryPlan:
    dit_weights: str
    tokens: int | None  # the packed sequence the activations are counted for; None: not known yet
    cards: list
    host: SharedHost | None = None  # set when several DiT ranks run on the CPU
    tokens_from: str = "plan_tokens"  # "plan_tokens", "the workflow's latents", "this prompt"
    dit_shape: DiTShape | None = None  # what the activation estimate needs, to count it again
    dit_world: int = 1
    sp_mode: str = "allgather"  # the attention exchange the activations are counted for
    sp_degree: int | None = None  # its Ulysses group size (None: the hybrid rule)
    split_weights: tuple | None = None  # the DiT ranks' explicit row weights (None: even; the largest share counts)
    exchange_precision: str = "exact"  # int8 / fp8: the exchange's records are counted too

    def activations(self, tokens: int) -> int:
        if self.dit_shape is None:
            return 0
        return activation_bytes(self.dit_shape, tokens, self.dit_world, mode=self.sp_mode, degree=self.sp_degree,
                                weights=self.split_weights, precision=self.exchange_precision)

    def split_caps(self) -> tuple[float, ...] | None:
        """split auto: per DiT rank, the largest fraction of the planned tokens its card's free
        memory holds in the DiT stage (1.0 where the free memory is not known: a CPU card, another
        server's rank); None when the sequence is not known yet."""
        if self.dit_shape is None or not self.tokens:
            return None
        per_row = row_bytes(self.dit_shape)
        even_rows = -(-self.tokens // self.dit_world)
        caps = []
        for card in self.cards:
            if "DiT" not in card.stages:
                continue
            if card.free is None:
                caps.append(1.0)
                continue
            # the stage's need without the even share's own rows, then as many rows as the rest holds
            room = card.free - card.stage_total("DiT") + even_rows * per_row
            caps.append(min(1.0, max(room // per_row, 1) / self.tokens))
        caps += [1.0] * (self.dit_world - len(caps))
        return tuple(caps)

    def for_tokens(self, tokens: int, tokens_from: str = "this prompt") -> "MemoryPlan":
        """The same plan with the DiT's activations counted for `tokens` (the free memory
        stays the figure probed at plan time, before any of the plan was loaded)."""
        act = self.activations(tokens)
        cards = [CardMemory(c.device, c.free, {stage: dict(items) for stage, items in c.stages.items()})
                 for c in self.cards]
        for card in cards:
            if "activations" in card.stages.get("DiT", {}):
                card.stages["DiT"]["activations"] = act
        host = self.host
        if host is not None:
            host = SharedHost(host.cards, {**host.items, "activations": act * host.cards}, host.free)
        return replace(self, tokens=int(tokens), cards=cards, host=host, tokens_from=tokens_from)

    def _fewer_tokens(self) -> str:
        """How to sample less, in the words of where the token count came from."""
        if self.tokens_from == "plan_tokens":
            return f"sample fewer frames / a lower resolution and lower plan_tokens (now {self.tokens})"
        return f"sample fewer frames / a lower resolution ({self.tokens} tokens from {self.tokens_from})"

    def table(self) -> str:
        """One line per card: each stage's GiB and the free GiB."""
        sequence = ("activations not counted: the sequence is checked at the first step" if self.tokens is None
                    else f"{self.tokens} tokens from {self.tokens_from}")
        lines = [f"memory plan (dit_weights={self.dit_weights}, {sequence}):"]
        for c in self.cards:
            stages = ", ".join(
                f"{s} {c.stage_total(s) / GIB:.2f} GiB ({' + '.join(f'{k} {v / GIB:.2f}' for k, v in items.items() if v)})"
                for s, items in c.stages.items() if sum(items.values()))
            free = "free unknown (not checked)" if c.free is None else f"free {c.free / GIB:.2f} GiB"
            lines.append(f"  {c.device}: {stages or 'nothing'}; {free}")
        if self.host is not None:
            free = "unknown" if self.host.free is None else f"{self.host.free / GIB:.2f} GiB"
            lines.append(f"  the {self.host.cards} CPU cards share this machine's memory: DiT together "
                         f"{self.host.need / GIB:.2f} GiB ({_items(self.host.items)}); available {free}")
        return "\n".join(lines)

    def problems(self) -> list[tuple[CardMemory, str, int]]:
        """(card, stage, bytes needed) for every stage that does not fit its card's free memory."""
        out = []
        for c in self.cards:
            if c.free is None:
                continue
            for stage in c.stages:
                need = c.stage_total(stage)
                if need > c.free:
                    out.append((c, stage, need))
        return out

    def host_problem(self) -> bool:
        return self.host is not None and self.host.free is not None and self.host.need > self.host.free

    def _host_refusal(self) -> MemoryPlanError:
        host = self.host
        return MemoryPlanError(
            f"the {host.cards} CPU cards share this machine's memory: their DiT stage needs "
            f"{host.need / GIB:.2f} GiB together ({_items(host.items)}) and {host.free / GIB:.2f} GiB "
            f"is available: {self._fewer_tokens()}, lower npu_count, or free memory.", self.table())

    def check(self) -> None:
        """Raise MemoryPlanError naming the first card and stage that do not fit, and the fixes
        (one sentence; the table is logged by the caller and kept on the error)."""
        problems = self.problems()
        if not problems:
            if self.host_problem():  # every card fits (or has no figure), the shared RAM does not
                raise self._host_refusal()
            return
        card, stage, need = problems[0]
        more_cards = "raise npu_count" if len(self.cards) < 8 else "free the cards"
        fixes = {
            "DiT": ("load the INT8 DiT file"
                    + (", set dit_weights to shard" if self.dit_weights == "replicate" and len(self.cards) > 1
                       else "")
                    + f", {more_cards}, or {self._fewer_tokens()}"),
            "text encoder": f"load the NVFP4 text encoder file or {more_cards}",
            "VAE decode": "load the INT8 video VAE file or free the card",
        }
        raise MemoryPlanError(
            f"{card.device} cannot hold the {stage} stage: it needs {need / GIB:.2f} GiB "
            f"({_items(card.stages[stage])}) "
            f"and has {card.free / GIB:.2f} GiB free: {fixes.get(stage, 'free the card')}.", self.table())


def _items(items: dict) -> str:
    return ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in items.items() if v)


def _shared_host(cards, dit_cards, free) -> SharedHost | None:
    """The CPU DiT ranks' stage together: weights once (the ranks share the base), activations
    and gathered blocks per rank, and the attention's budget of the available memory."""
    on_host = [cards[c] for c in dit_cards
               if card_kind(cards[c].device) == "cpu" and shares_host_memory(cards[c].device)]
    if len(on_host) < 2:
        return None
    available = free["host"] if free is not None and "host" in free else available_memory_bytes()
    items = {}
    for card in on_host:
        for item, n in card.stages["DiT"].items():
            shared = item in ("weights", "non-block weights")
            items[item] = n if shared else items.get(item, 0) + n
    items["attention scores"] = 0 if available is None else available // FREE_SHARE
    return SharedHost(len(on_host), items, available)


def plan_memory(plan, devices, model, clip, video_vae, audio_vae, dit_weights: str = "auto",
                tokens: int | None = LONGEST_WORKFLOW_TOKENS, free: dict | None = None,
                remote_ranks: int = 0, backend: str | None = None,
                dit_ranks: str = "threads", tokens_from: str = "plan_tokens", sp_mode=None,
                split_weights=None, exchange_precision: str = "exact") -> MemoryPlan:
    """The per-card memory plan for a role plan; `auto` resolved. `free` overrides the probed
    free bytes per device name (tests). `remote_ranks`: DiT ranks of other servers that join a
    sequence-parallel DiT (ranks as processes): this server's cards then hold 1/W of the
    sequence and, with shard, of the blocks, W counting them too. `backend` (None: from the
    environment) and `dit_ranks` ("threads" / "processes") say which communicators the cards
    will hold. `tokens` None: the sequence is not known yet (no activations counted; the
    caller checks `for_tokens` at the first step); `tokens_from` names where it came from.
    `sp_mode`: the DiT's attention exchange (a ModeChoice of sp/mode_choice.py; None: allgather),
    whose buffers the activations count. `split_weights`: the DiT ranks' explicit row weights
    (mixed cards; None: even): every card is counted with the largest share. `exchange_precision`:
    int8 / fp8 count the exchange's byte records beside what they decode into."""
    if dit_weights not in DIT_WEIGHT_MODES:
        raise ValueError(f"dit_weights={dit_weights!r} is unknown: set dit_weights to one of "
                         f"{', '.join(DIT_WEIGHT_MODES)}.")
    unknown_allowed = tokens is None and tokens_from != "plan_tokens"  # auto, and no latent was readable
    if not unknown_allowed and (isinstance(tokens, bool) or not isinstance(tokens, int)
                                or not 1 <= tokens <= MAX_PLAN_TOKENS):
        raise MemoryPlanError(f"plan_tokens={tokens!r} is not a whole number from 1 to {MAX_PLAN_TOKENS}: "
                              f"set it to the longest packed sequence you will sample "
                              f"({LONGEST_WORKFLOW_TOKENS} = 768p 15 s), or to {AUTO_PLAN_TOKENS} (auto).")
    sequence_parallel = plan.dit.mode == SEQUENCE_PARALLEL
    if dit_weights == "shard" and not sequence_parallel:
        raise ValueError(f"dit_weights is shard, which splits the DiT over several cards, but npu_count "
                         f"{plan.n_cards} runs the DiT on one card: set npu_count to 4 or 8, or dit_weights "
                         f"to auto or replicate.")
    if dit_weights == "shard" and not hasattr(dit_module(model), "blocks"):
        raise ValueError("dit_weights is shard but the model input has no transformer blocks to split: "
                         "set dit_weights to replicate.")
    def build(weights: str) -> MemoryPlan:
        return _build(plan, devices, model, clip, video_vae, audio_vae, weights, tokens, free, remote_ranks,
                      backend, dit_ranks, tokens_from, sp_mode, split_weights, exchange_precision)

    if dit_weights == "auto":
        auto_shard = sequence_parallel and plan.n_cards > 1 and any(
            stage == "DiT" for _, stage, _ in build("replicate").problems())
        dit_weights = "shard" if auto_shard else "replicate"
    return build(dit_weights)


def _build(plan, devices, model, clip, video_vae, audio_vae, dit_weights, tokens, free, remote_ranks, backend,
           dit_ranks, tokens_from, sp_mode, split_weights, exchange_precision) -> MemoryPlan:
    cards = [CardMemory(d, free[str(d)] if free is not None and str(d) in free else free_memory_bytes(d))
             for d in devices]
    dit = dit_module(model)
    dit_bytes = module_bytes(dit)
    dit_cards = list(plan.dit.cards)
    mode, degree = (sp_mode.mode, sp_mode.degree) if sp_mode is not None else ("allgather", None)
    world = plan.dit_world(remote_ranks)
    out = MemoryPlan(dit_weights, tokens, cards, None, tokens_from, dit_shape_of(dit), world, mode, degree,
                     None if split_weights is None else tuple(split_weights), exchange_precision)
    act = 0 if tokens is None else out.activations(tokens)
    if dit_weights == "shard":
        sizes = _block_sizes(dit)
        shard_plan = BlockShardPlan.balanced(sizes, world)
        block_total = sum(shard_plan.block_bytes(i) for i in range(len(sizes)))
        gathered = IN_FLIGHT_BLOCKS * max(shard_plan.block_bytes(i) for i in range(len(sizes)))
        quantized = _quantized_names(dit)
        for rank, c in enumerate(dit_cards):
            cards[c].stages["DiT"] = {"non-block weights": dit_bytes - block_total,
                                      "own blocks": shard_plan.owned_bytes(rank),
                                      "gathered blocks": gathered,
                                      "quantized copies": _quantized_copy_bytes(shard_plan, quantized, rank),
                                      "activations": act}
    else:
        for c in dit_cards:
            cards[c].stages["DiT"] = {"weights": dit_bytes, "activations": act}

    te_cards = list(plan.text_encoder.cards)
    if plan.text_encoder.mode == TENSOR_PARALLEL and text_encoder_split_problem(clip, len(te_cards)) is None:
        for c, share in zip(te_cards, text_encoder_shares(clip, len(te_cards))):
            cards[c].stages["text encoder"] = share
    else:  # one card, or an encoder that stays on card 0 (apply.py says why in the log)
        cards[te_cards[0]].stages["text encoder"] = {"weights": _clip_bytes(clip)}
    video = module_bytes(getattr(video_vae, "first_stage_model", None))
    audio = module_bytes(getattr(audio_vae, "first_stage_model", None))
    video_cards = list(plan.video_vae.cards)
    if plan.video_vae.mode == TEMPORAL_CHUNKS and not has_chunk_interface(video_vae):
        video_cards = [plan.video_vae.merge_card or 0]  # it decodes on the merge card only
    for c in video_cards:
        cards[c].stages.setdefault("VAE decode", {})["video VAE"] = video
    for c in plan.audio_vae.cards:
        cards[c].stages.setdefault("VAE decode", {})["audio VAE"] = audio
    # the communicators live as long as the coordinator / the worker pool: in every stage
    held = card_communicators(plan, devices, backend, dit_ranks, dit_weights, world)
    for card, items in zip(cards, held):
        if items and not card.stages:
            card.stages["communicators"] = {}
        for stage in card.stages.values():
            stage.update(items)
    out.host = _shared_host(cards, dit_cards, free)
    return out
