"""The fan-out: one forward of the DiT run on every rank at once.

`SequenceParallelFanOut` is a DIFFUSION_MODEL-style wrapper `fn(executor, *args, **kwargs)`.
The wrappers after it in the chain (step caches such as EasyCache, a ControlNet's set-up) run
once on the caller's thread, as on one card, whatever order they were added in; then the
model's own forward runs on every rank concurrently through a coordinator, with per-rank copies
of the inputs and of `transformer_options`, and rank 0's result is returned.

Per-rank code only uses the per-rank communicator interface (comm/protocol.py `Communicator`), so
it runs unchanged over the in-process coordinator or the torch.distributed communicator.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from comfy.multidevice.devices import copy_for_rank
from comfy.multidevice.sp.plan import SequenceParallelError

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- fan-out

def transformer_options_of(args: list, kwargs: dict, index: int = 3) -> dict:
    """The forward's transformer_options (a keyword, or positional argument `index`), put in
    place as a new dict when absent or None, so a rank can edit its own copy."""
    if "transformer_options" in kwargs:
        if kwargs["transformer_options"] is None:
            kwargs["transformer_options"] = {}
        return kwargs["transformer_options"]
    if len(args) > index:
        if args[index] is None:
            args[index] = {}
        return args[index]
    kwargs["transformer_options"] = {}
    return kwargs["transformer_options"]


def _forward_method(executor, model):
    """The method the executor finally calls (`original`, a bound method of `class_obj`), on `model`.

    Relies on ComfyUI's WrapperExecutor protocol (`original`, `class_obj`, `wrappers`, `idx`,
    classmethod `new_class_executor`).
    """
    try:
        if model is None or model is executor.class_obj:
            return executor.original
        return getattr(model, executor.original.__name__)
    except AttributeError as exc:
        raise SequenceParallelError(
            f"cannot run the forward on a model replica: the executor {type(executor).__name__} does "
            f"not follow ComfyUI's WrapperExecutor protocol ({exc})") from exc


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
        # resolve on the caller's thread: a bad replica fails here, before any rank starts
        rank_models = [self.resolve_model(m) if m is not None else None for m in self.models]
        methods = [_forward_method(executor, m) for m in rank_models]
        # The wrappers after this one (step caches, a ControlNet's set-up, ...) run once, here on
        # the caller's thread, exactly as on one card; only the model's own forward fans out.
        rest = type(executor).new_class_executor(
            lambda *a, **kw: self._on_ranks(methods, a, kw), executor.class_obj, executor.wrappers, executor.idx)
        return rest(*args, **kwargs)

    def _on_ranks(self, methods, args, kwargs):
        inputs = [copy_for_rank((list(args), dict(kwargs)), device) for device in self.coordinator.devices]

        def run_rank(rank, comm, rank_inputs):
            rank_args, rank_kwargs = rank_inputs
            options = self._transformer_options(rank_args, rank_kwargs)
            model = methods[rank].__self__
            if self.prepare_rank is not None:
                self.last_rank_states[rank] = self.prepare_rank(rank, comm, model, options)
            log.debug("rank %d: forward on %s", rank, comm.device)
            return methods[rank](*rank_args, **rank_kwargs)

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
        return transformer_options_of(args, kwargs, self.transformer_options_index)

    def bytes_received_last_forward(self) -> int:
        """Bytes all ranks together received from each other in the last forward."""
        return sum(t["received"] for t in self.last_traffic)
