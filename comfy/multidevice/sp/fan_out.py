"""The fan-out: one forward of the DiT run on every rank at once, over either rank engine.

`SequenceParallelFanOut` is the one DIFFUSION_MODEL-style wrapper `fn(executor, *args, **kwargs)`
of both engines. The wrappers after it in the chain (step caches such as EasyCache, a
ControlNet's set-up) run once on the caller's thread, as on one card, whatever order they were
added in; then the model's own forward runs on every rank through a `RankRunner` and rank 0's
result is returned. Two runners implement the seam: `RankThreads` here (one thread per card in
this process, over a coordinator) and the worker pool's (workers/pool_runner.py: one process
per card, its inputs sent as data). What every rank needs to know of the forward beyond its
tensors (upstream's Fun ControlNet) is described once, by the SP adapter, for both.

Per-rank code only uses the per-rank communicator interface (comm/protocol.py `Communicator`), so
it runs unchanged over the in-process coordinator or the torch.distributed communicator.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Protocol, Sequence

from comfy.multidevice.comfy_cancel import checks_at_block_starts
from comfy.multidevice.devices import copy_for_rank
from comfy.multidevice.sp.plan import SequenceParallelError

log = logging.getLogger(__name__)

OPTIONS = "transformer_options"


def options_position(forward: Callable) -> int | None:
    """Where `forward` takes transformer_options as a positional argument, read from its
    signature by name (ComfyUI's DiTs take it 4th, after x, timestep, context); None: by keyword only."""
    try:
        parameters = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the keyword is all we know
        return None
    positional = [p.name for p in parameters
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return positional.index(OPTIONS) if OPTIONS in positional else None


def transformer_options_of(args: list, kwargs: dict, position: int | None) -> dict:
    """The forward's transformer_options (a keyword, or positional argument `position`), put in
    place as a new dict when absent or None, so a rank can edit its own copy."""
    if OPTIONS not in kwargs and position is not None and len(args) > position:
        if args[position] is None:
            args[position] = {}
        return args[position]
    if kwargs.get(OPTIONS) is None:
        kwargs[OPTIONS] = {}
    return kwargs[OPTIONS]


class RankRunner(Protocol):
    """Runs one DiT forward on every rank of an engine.

    `forward(model, method, position, *args, **kwargs)`: `method` (a bound forward of `model`,
    the DiT of rank 0) runs here on rank 0's inputs, and the same-named method of every other
    rank's DiT on its own copy of them; each rank's transformer_options (at `position` or by
    keyword) get that rank's sequence-parallel set-up first. Returns rank 0's output.
    Failure semantics: a rank that fails stops the others (none waits on it forever) and its
    error is raised here, naming the rank; ComfyUI's Cancel stops every rank together as a block
    starts (comfy_cancel.py `BlockCancel`, the same in both runners) and raises ComfyUI's
    interrupt, the ranks staying usable. `close()` releases the ranks (idempotent).
    """

    world_size: int

    def forward(self, model, method: Callable, position: int | None, *args, **kwargs) -> Any: ...

    def close(self) -> None: ...


class SequenceParallelFanOut:
    """The DIFFUSION_MODEL wrapper that runs the wrapped forward on every rank of `runner`."""

    def __init__(self, runner: RankRunner):
        self.runner = runner

    @property
    def world_size(self) -> int:
        return self.runner.world_size

    def __call__(self, executor, *args, **kwargs):
        # Relies on ComfyUI's WrapperExecutor protocol (`original`, `class_obj`, `wrappers`,
        # `idx`, classmethod `new_class_executor`).
        try:
            model, method, position = executor.class_obj, executor.original, options_position(executor.original)
            chain = (executor.class_obj, executor.wrappers, executor.idx)
        except AttributeError as exc:
            raise SequenceParallelError(
                f"cannot run the forward on the ranks: the executor {type(executor).__name__} does not "
                f"follow ComfyUI's WrapperExecutor protocol ({exc})") from exc
        # The wrappers after this one (step caches, a ControlNet's set-up, ...) run once, here on
        # the caller's thread, exactly as on one card; only the model's own forward fans out.
        # (a partial, not a lambda: one Python frame fewer on every step's path)
        rest = type(executor).new_class_executor(functools.partial(self.runner.forward, model, method, position), *chain)
        return rest(*args, **kwargs)

    def close(self) -> None:
        self.runner.close()


def _rank_method(method: Callable, rank0_model, model):
    """`method` of rank 0's model, as the same-named method of another rank's `model`."""
    if model is None or model is rank0_model:
        return method
    try:
        return getattr(model, method.__name__)
    except AttributeError as exc:
        raise SequenceParallelError(f"cannot run the forward on a model replica: {exc}") from exc


class RankThreads:
    """The rank-threads runner: every rank a thread of this process over `coordinator`.

    models[r] is the replica rank r runs (on coordinator.devices[r]); an entry may be None
    (rank 0: the model the executor belongs to), a module, or anything `resolve_model` turns
    into one (e.g. a ComfyUI ModelPatcher). Before each rank's forward,
    `prepare_rank(rank, comm, model, transformer_options)` edits that rank's own
    transformer_options (the model adapter installs block replacements and the exchanging
    attention there, and its Cancel at block starts over `comm.block_flag()`) and may return a
    per-rank state, kept in `last_rank_states`. Failure: comm/group.py `SequenceParallelCoordinator.run`.
    """

    def __init__(self, coordinator, models: Sequence[Any],
                 prepare_rank: Callable[[int, Any, Any, dict], Any] | None = None,
                 resolve_model: Callable[[Any], Any] | None = None):
        if len(models) != coordinator.world_size:
            raise ValueError(f"sequence parallel needs one model replica per rank: got {len(models)} "
                             f"replicas for {coordinator.world_size} ranks")
        self.coordinator = coordinator
        self.models = list(models)
        self.prepare_rank = prepare_rank
        self.resolve_model = resolve_model or (lambda m: m)
        self.last_rank_states: list[Any] = [None] * coordinator.world_size
        # per rank: {"received": bytes, "calls": collectives} of the last forward
        self.last_traffic: list[dict] = [{"received": 0, "calls": 0}] * coordinator.world_size

    @property
    def world_size(self) -> int:
        return self.coordinator.world_size

    def forward(self, model, method, position: int | None, *args, **kwargs):
        # resolved on the caller's thread: a bad replica fails here, before any rank starts
        methods = [_rank_method(method, model, self.resolve_model(m) if m is not None else None)
                   for m in self.models]
        inputs = [copy_for_rank((list(args), kwargs), device) for device in self.coordinator.devices]

        def run_rank(rank, comm, rank_inputs):
            rank_args, rank_kwargs = rank_inputs
            options = transformer_options_of(rank_args, rank_kwargs, position)
            if self.prepare_rank is not None:
                self.last_rank_states[rank] = self.prepare_rank(rank, comm, methods[rank].__self__, options)
            log.debug("rank %d: forward on %s", rank, comm.device)
            return methods[rank](*rank_args, **rank_kwargs)

        before = self._traffic_counts()
        with checks_at_block_starts():  # ComfyUI's per-layer check leaves a Cancel to the block starts
            results = self.coordinator.run(run_rank, inputs, cancel_at_block_starts=True)
        self.last_traffic = [{"received": a["received"] - b["received"], "calls": a["calls"] - b["calls"]}
                             for a, b in zip(self._traffic_counts(), before)]
        return results[0]

    def _traffic_counts(self) -> list[dict]:
        counts = getattr(self.coordinator, "byte_counts", None)  # a stand-in coordinator may count nothing
        return counts() if counts is not None else [{"received": 0, "calls": 0}] * self.world_size

    def bytes_received_last_forward(self) -> int:
        """Bytes all ranks together received from each other in the last forward."""
        return sum(t["received"] for t in self.last_traffic)

    def close(self) -> None:
        """The coordinator belongs to whoever made it (the node's plan closes it)."""
