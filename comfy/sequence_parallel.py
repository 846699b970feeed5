"""Model-agnostic sequence parallelism: W ranks each compute 1/W of one packed token sequence.

The pieces, each usable on its own:

- `ShardPlan`: rank r owns rows [S*r//W, S*(r+1)//W) of the sequence (exact, never padded;
  lengths differ by at most one row).
- Slicing helpers: `take_rows` (e.g. the rows of a RoPE table), `slice_mod_segments` (a
  modulation table of (start, stop, row) spans, row an int or a per-token index tensor, clipped
  to the rank's rows and re-based to 0), `gather_rows` (all-gather-V of the rows back).
- The exchanging attention: `ExchangingAttention` is an attention override for
  `transformer_options["optimized_attention_override"]`. Inside its SP region it hands the
  call to a K/V exchange strategy (`AllGatherKV`: gather K and V from every rank, attend the
  local Q to the full K/V); outside (e.g. a text refiner) it passes the call through.
- The fan-out: `SequenceParallelFanOut` is a DIFFUSION_MODEL-style wrapper
  `fn(executor, *args, **kwargs)` that runs the forward on every rank concurrently through a
  `SequenceParallelCoordinator`, with per-rank copies of the inputs and of
  `transformer_options`, and returns rank 0's result.

Per-rank code only uses the per-rank communicator interface (`comm.exchange`,
`comm.all_reduce`, `comm.rank`, `comm.world_size`, `comm.device`), so it runs unchanged over
the in-process coordinator (`comfy.multidevice.RankComm`) or a torch.distributed one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)


class SequenceParallelError(RuntimeError):
    """Sequence parallelism cannot run as asked (misconfiguration or a broken model contract)."""


# ----------------------------------------------------------------------------- shard plan

@dataclass(frozen=True)
class ShardPlan:
    """Which rows of a packed sequence of `seq_len` rows rank `rank` of `world_size` owns."""

    seq_len: int
    world_size: int
    rank: int

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside 0..{self.world_size - 1}")
        if self.seq_len < self.world_size:
            raise ValueError(
                f"a sequence of {self.seq_len} rows cannot be split over {self.world_size} ranks "
                f"(every rank needs at least one row); use at most {self.seq_len} ranks")

    @staticmethod
    def edges(seq_len: int, world_size: int) -> list[tuple[int, int]]:
        return [(seq_len * r // world_size, seq_len * (r + 1) // world_size) for r in range(world_size)]

    @property
    def start(self) -> int:
        return self.seq_len * self.rank // self.world_size

    @property
    def stop(self) -> int:
        return self.seq_len * (self.rank + 1) // self.world_size

    @property
    def length(self) -> int:
        return self.stop - self.start


def take_rows(tensor: torch.Tensor | None, plan: ShardPlan, dim: int = 0) -> torch.Tensor | None:
    """The rank's rows of `tensor` along `dim` (a view). None passes through (no RoPE table)."""
    if tensor is None:
        return None
    if tensor.shape[dim] != plan.seq_len:
        raise SequenceParallelError(
            f"expected {plan.seq_len} sequence rows along dim {dim}, got shape {tuple(tensor.shape)}")
    return tensor.narrow(dim, plan.start, plan.length)


def slice_mod_segments(segments: Sequence[tuple[int, int, Any]], plan: ShardPlan) -> list[tuple[int, int, Any]]:
    """Clip a modulation table [(start, stop, row)] to the rank's rows and re-base it to 0.

    `row` is an int (one modulation row for the whole span) or a 1-D index tensor with one
    entry per token of the span; a span cut by a shard edge keeps only its local entries.
    """
    out = []
    for a, b, row in segments:
        if not 0 <= a <= b <= plan.seq_len:
            raise SequenceParallelError(f"modulation span ({a}, {b}) lies outside 0..{plan.seq_len}")
        per_token = torch.is_tensor(row) and row.dim() > 0
        if per_token and row.shape[0] != b - a:
            raise SequenceParallelError(
                f"modulation span ({a}, {b}) has {row.shape[0]} per-token rows for {b - a} tokens")
        lo, hi = max(a, plan.start), min(b, plan.stop)
        if lo >= hi:
            continue
        if per_token:
            row = row[lo - a:hi - a]
        out.append((lo - plan.start, hi - plan.start, row))
    return out


def gather_rows(comm, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """All-gather-V the ranks' rows back into the full sequence (rank order)."""
    return comm.exchange([tensor], [dim])[0]


# ----------------------------------------------------------------------------- K/V exchange

class AllGatherKV:
    """K/V exchange strategy "allgather": every rank gathers the full K and V, keeps its Q.

    Each rank's attention then covers its own query rows against all key rows, so the output
    rows equal the single-device rows exactly (no softmax merging). Traffic per call and rank:
    (W-1)/W of K and V.
    """

    name = "allgather"

    def attend(self, comm, attention_fn: Callable, q, k, v, heads, *args, **kwargs):
        if kwargs.get("mask") is not None:
            raise SequenceParallelError(
                "sequence-parallel attention got an attention mask; the all-gather exchange only "
                "supports full self-attention (mask=None)")
        # [B, heads, S, head_dim] with skip_reshape (H3's layout), else [B, S, heads*head_dim]
        seq_dim = 2 if kwargs.get("skip_reshape", False) else 1
        k_full, v_full = comm.exchange([k, v], [seq_dim, seq_dim])
        return attention_fn(q, k_full, v_full, heads, *args, **kwargs)


def _ulysses_kv():
    from comfy.ulysses import UlyssesKV  # comfy/ulysses.py: all-to-all and hybrid exchanges
    return UlyssesKV()


def _auto_kv():
    from comfy.ulysses import AutoKV  # picks allgather or ulysses by the byte model
    return AutoKV()


KV_STRATEGIES: dict[str, Callable] = {"allgather": AllGatherKV, "ulysses": _ulysses_kv, "auto": _auto_kv}
DEFAULT_SP_MODE = "allgather"


def make_kv_strategy(sp_mode=None):
    """The K/V exchange strategy for an `sp_mode` string (None -> the default), or for a
    configured mode object with a `make_kv_strategy()` method (comfy.ulysses.SPMode)."""
    if hasattr(sp_mode, "make_kv_strategy"):
        return sp_mode.make_kv_strategy()
    name = (sp_mode or DEFAULT_SP_MODE).strip().lower()
    if name not in KV_STRATEGIES:
        raise ValueError(f"unknown sequence-parallel mode {sp_mode!r}; valid modes: "
                         f"{', '.join(KV_STRATEGIES)}")
    return KV_STRATEGIES[name]()


class ExchangingAttention:
    """Attention override (ComfyUI's `override(func, *args, **kwargs)` convention) for one rank.

    Outside `region()` it is a pass-through to any override it replaced, else to `func`. Inside,
    the strategy exchanges K/V between ranks before the attention runs. Leaving a region in which
    no attention call came through raises: the model bypassed the override, and a rank would
    have attended to its own rows only (a silently wrong result).
    """

    def __init__(self, comm, strategy, previous_override: Callable | None = None):
        self.comm = comm
        self.strategy = strategy
        self.previous_override = previous_override
        self._region_calls: int | None = None  # None: outside any region

    def __call__(self, func, *args, **kwargs):
        inner = func if self.previous_override is None else functools.partial(self.previous_override, func)
        if self._region_calls is None:
            return inner(*args, **kwargs)
        self._region_calls += 1
        return self.strategy.attend(self.comm, inner, *args, **kwargs)

    @contextlib.contextmanager
    def region(self, what: str = "attention"):
        if self._region_calls is not None:
            raise SequenceParallelError("sequence-parallel attention regions cannot nest")
        self._region_calls = 0
        try:
            yield self
            if self._region_calls == 0:
                raise SequenceParallelError(
                    f"rank {self.comm.rank}: {what} did not call the attention override in "
                    "transformer_options['optimized_attention_override']; sequence parallelism needs "
                    "every attention of the SP region to go through it")
        finally:
            self._region_calls = None


def install_exchanging_attention(transformer_options: dict, comm, strategy) -> ExchangingAttention:
    """Put an ExchangingAttention for this rank into transformer_options (chaining any override)."""
    previous = transformer_options.get("optimized_attention_override")
    while isinstance(previous, ExchangingAttention):  # a stale copy from an earlier forward
        previous = previous.previous_override
    exchanging = ExchangingAttention(comm, strategy, previous)
    transformer_options["optimized_attention_override"] = exchanging
    return exchanging


# ----------------------------------------------------------------------------- fan-out

def copy_for_rank(obj: Any, device: torch.device) -> Any:
    """A per-rank copy of forward inputs: containers copied, tensors moved to `device`.

    dicts, lists and tuples are rebuilt (a rank may add keys, e.g. its block replacements or
    `block_index`, without the others seeing them); tensors go to the rank's device; every
    other object (callables, modules, layouts) is shared. Not copy.deepcopy: transformer_options
    carry wrappers that hold the coordinator and the model replicas.
    """
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: copy_for_rank(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_for_rank(v, device) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(copy_for_rank(v, device) for v in obj)
    return obj


def executor_for_model(executor, model):
    """The wrapper executor continued on `model` instead of `executor.class_obj`.

    Relies on ComfyUI's WrapperExecutor protocol (`original` is a bound method of `class_obj`,
    `wrappers`, `idx`, classmethod `new_class_executor`): the rebound executor runs the same
    remaining wrappers, then the same method of the replica.
    """
    if model is None or model is getattr(executor, "class_obj", None):
        return executor
    try:
        method = getattr(model, executor.original.__name__)
        return type(executor).new_class_executor(method, model, executor.wrappers, executor.idx)
    except AttributeError as exc:
        raise SequenceParallelError(
            f"cannot run the forward on a model replica: the executor {type(executor).__name__} does "
            f"not follow ComfyUI's WrapperExecutor protocol ({exc})") from exc


def _run_with_grad_mode(fn, grad_enabled: bool, inference: bool):
    # Autograd modes are thread-local: rank threads must use the caller's (e.g. inference_mode).
    if inference:
        with torch.inference_mode():
            return fn()
    with torch.set_grad_enabled(grad_enabled):
        return fn()


class SequenceParallelFanOut:
    """A DIFFUSION_MODEL wrapper that runs the wrapped forward on every rank at once.

    models[r] is the replica rank r runs (on coordinator.devices[r]); an entry may be None
    (rank 0: the model the executor belongs to), a module, or anything `resolve_model` turns
    into one (e.g. a ComfyUI ModelPatcher). Before each rank's forward,
    `prepare_rank(rank, comm, model, transformer_options)` edits that rank's own
    transformer_options (the model adapter installs block replacements and the exchanging
    attention there) and may return a per-rank state, kept in `last_rank_states`.
    """

    def __init__(self, coordinator, models: Sequence[Any],
                 prepare_rank: Callable[[int, Any, Any, dict], Any] | None = None,
                 resolve_model: Callable[[Any], Any] | None = None,
                 transformer_options_index: int = 3):
        if len(models) != coordinator.world_size:
            raise ValueError(f"sequence parallel needs one model replica per rank: got {len(models)} "
                             f"replicas for {coordinator.world_size} ranks")
        self.coordinator = coordinator
        self.models = list(models)
        self.prepare_rank = prepare_rank
        self.resolve_model = resolve_model or (lambda m: m)
        # ComfyUI's diffusion models take (x, timestep, context, transformer_options, ...)
        self.transformer_options_index = transformer_options_index
        self.last_rank_states: list[Any] = [None] * coordinator.world_size
        # per rank: {"received": bytes, "calls": collectives} of the last forward
        self.last_traffic: list[dict] = [{"received": 0, "calls": 0}] * coordinator.world_size

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def __call__(self, executor, *args, **kwargs):
        devices = self.coordinator.devices
        inputs = [copy_for_rank((list(args), dict(kwargs)), device) for device in devices]
        grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        # resolve on the caller's thread: a bad replica fails here, before any rank starts
        rank_models = [self.resolve_model(m) if m is not None else None for m in self.models]
        executors = [executor_for_model(executor, m) for m in rank_models]

        def run_rank(rank, comm, rank_inputs):
            rank_args, rank_kwargs = rank_inputs
            options = self._transformer_options(rank_args, rank_kwargs)
            model = executors[rank].class_obj
            if self.prepare_rank is not None:
                self.last_rank_states[rank] = self.prepare_rank(rank, comm, model, options)
            log.debug("rank %d: forward on %s", rank, comm.device)
            return _run_with_grad_mode(lambda: executors[rank](*rank_args, **rank_kwargs),
                                       grad_enabled, inference)

        before = self._traffic_counts()
        results = self.coordinator.run(run_rank, inputs)
        after = self._traffic_counts()
        self.last_traffic = [{"received": a["received"] - b["received"], "calls": a["calls"] - b["calls"]}
                             for a, b in zip(after, before)]
        return results[0]

    def _traffic_counts(self) -> list[dict]:
        counts = getattr(self.coordinator, "byte_counts", None)
        return counts() if counts is not None else [{"received": 0, "calls": 0}] * self.world_size

    def _transformer_options(self, args: list, kwargs: dict) -> dict:
        if "transformer_options" in kwargs:
            if kwargs["transformer_options"] is None:
                kwargs["transformer_options"] = {}
            return kwargs["transformer_options"]
        i = self.transformer_options_index
        if len(args) > i:
            if args[i] is None:
                args[i] = {}
            return args[i]
        kwargs["transformer_options"] = {}
        return kwargs["transformer_options"]

    def bytes_received_last_forward(self) -> int:
        """Bytes all ranks together received from each other in the last forward."""
        return sum(t["received"] for t in self.last_traffic)
