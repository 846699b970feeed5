"""The worker-pool runner: a ComfyUI MODEL's DiT forward run on rank 0 here and on worker processes.

`PoolRunner` is the processes engine's side of sp/fan_out.py's `RankRunner` seam (the rank
threads are the other): the fan-out runs the wrappers after it once here on rank 0, then the
model's own forward runs on rank 0 (the MODEL's DiT) while each worker runs the same forward
method of its rebuilt DiT on what rank 0 sends: the forward's arguments with
transformer_options reduced to data (upstream's Fun ControlNet as described by the SP adapter:
workers/towers.py). What only lives in this process (wrappers, callbacks, other patch
functions) cannot travel: a forward that carries patches the workers could not apply is
refused, naming them, before anything is sent. The pool starts on the first forward and again
when the weight patches of the MODEL that samples changed (a new patch set, or a clone with a
LoRA loaded after the node) or after a forward that lost a rank.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

from comfy.multidevice.comm.settings import timeout_from_env
from comfy.multidevice.sp.fan_out import SequenceParallelFanOut, transformer_options_of
from comfy.multidevice.sp.minimax_h3 import WRAPPER_KEY
from comfy.multidevice.sp.plan import SequenceParallelError
from comfy.multidevice.sp.split import RowSplit
from comfy.multidevice.workers.admission import cluster_secret, SECRET_FILE_ENV
from comfy.multidevice.workers.comfy_dit import comfy_dit_recipe, patches_digest
from comfy.multidevice.workers.dit_file import DitFile
from comfy.multidevice.workers.door import format_address
from comfy.multidevice.workers.join import join_command
from comfy.multidevice.workers.pool import WorkerPool, WorkerPoolError
from comfy.multidevice.workers.recipe import ModelRecipe
from comfy.multidevice.workers.towers import travelling_dit_patches
from comfy.multidevice.workers.wire import check_sendable, WireTypeError

log = logging.getLogger(__name__)

RANK0_ONLY = ("wrappers", "callbacks")  # run here on rank 0 (or not at all inside a forward)
PATCH_KEYS = ("patches", "patches_replace")  # functions of this process: refused when present
# Caches a worker's DiT rebuilds from the rest of its input: upstream's prebuilt PackedLayout
# (an object of the ComfyUI process; the DiT makes the same layout from the payload's data)
REBUILT_BY_THE_WORKER = {"minimax_payload": ("layout",)}


def travelling_options(options: dict, sent_towers: dict | None = None) -> dict:
    """transformer_options as a worker gets them: rank 0's runtime hooks left out, upstream's
    Fun ControlNet block patches as data (workers/towers.py; `sent_towers`: the towers the
    pool's workers have); refused (SequenceParallelError naming the key) when they hold other
    patches or objects that cannot be sent."""
    out = {}
    for key, value in options.items():
        if key in RANK0_ONLY:
            continue
        if key == "patches_replace" and isinstance(value, dict) and value.get("dit"):
            value = {**value, "dit": travelling_dit_patches(value["dit"], {} if sent_towers is None else sent_towers)}
        if key in PATCH_KEYS and _holds_functions(key, value):
            raise SequenceParallelError(
                f"ranks as processes cannot carry the transformer_options {key!r} of this forward "
                f"({sorted(value) if isinstance(value, dict) else type(value).__name__}): they are functions "
                "of the ComfyUI process; use ranks as threads for this workflow")
        _check_sendable(value, f"transformer_options[{key!r}]")
        out[key] = value
    return out


def travelling_kwargs(kwargs: dict) -> dict:
    """A forward's keyword inputs as a worker gets them: the caches it rebuilds left out."""
    out = dict(kwargs)
    for name, caches in REBUILT_BY_THE_WORKER.items():
        if isinstance(out.get(name), dict):
            out[name] = {k: v for k, v in out[name].items() if k not in caches}
    return out


def _check_sendable(value, name: str) -> None:
    try:
        check_sendable(value, name=name)
    except WireTypeError as exc:  # names the path inside the value
        raise SequenceParallelError(f"ranks as processes: {exc}; use ranks as threads for this workflow") from None


def _holds_functions(key: str, value) -> bool:
    """Patches of this process's functions: every patch but the Fun ControlNet's (made data above)."""
    if not isinstance(value, dict):
        return bool(value)
    return any(v for name, v in value.items() if not (key == "patches_replace" and name == "dit"))


class PoolRunner:
    """The RankRunner of ranks as processes: rank 0 here, the workers of a pool it (re)starts."""

    def __init__(self, make_pool: Callable[[Any], WorkerPool], digest_of: Callable[[], str], world_size: int):
        """`make_pool(rank0_dit)`: a new, unstarted pool; `digest_of()`: the MODEL's weight
        patches now (a new digest makes a new pool)."""
        self.make_pool = make_pool
        self.digest_of = digest_of
        self.world_size = world_size
        self._held: dict = {"pool": None}  # what the finalizer closes: no reference to self
        self._digest = None
        self._sent_towers: dict = {}  # Fun ControlNet towers the current pool's workers hold
        # a MODEL dropped (the node ran again, the server exits) takes its worker processes along
        weakref.finalize(self, _close_held, self._held)

    @property
    def pool(self) -> WorkerPool | None:
        return self._held["pool"]

    @pool.setter
    def pool(self, value: WorkerPool | None) -> None:
        self._held["pool"] = value

    def forward(self, model, method, position: int | None, *args, **kwargs):
        args = list(args)
        sent_args, sent_kwargs = list(args), travelling_kwargs(kwargs)
        options = transformer_options_of(sent_args, sent_kwargs, position)
        digest = self.digest_of()
        # a new pool when there is none, a newer pool of this process replaced it, or the
        # MODEL's weight patches changed; started only once this forward is known to travel
        renew = self.pool is None or not self.pool.running or digest != self._digest
        # the towers the workers will hold once this forward is sent (fresh workers hold none)
        towers = {} if renew else dict(self._sent_towers)
        travelling = travelling_options(options, towers)  # refused here, before any process is asked
        if position is not None and len(sent_args) > position and sent_args[position] is options:
            sent_args[position] = travelling
        else:
            sent_kwargs["transformer_options"] = travelling
        _check_sendable(sent_args, "the forward's arguments")  # before any process is asked
        _check_sendable(sent_kwargs, "the forward's keyword arguments")
        if renew:
            if self.pool is not None and self.pool.running:
                log.info("ranks as processes: the MODEL's weight patches changed; starting a new worker pool")
                self.close()
            self.pool, self._digest = self.make_pool(model).start(), digest
        self._sent_towers = towers
        try:
            return self.pool.forward_method(method.__name__, method, args, kwargs, sent=(sent_args, sent_kwargs),
                                            options_at=position)
        except WorkerPoolError:
            self.pool = None  # the next forward starts a fresh pool
            raise

    def close(self):
        _close_held(self._held)


def _close_held(held: dict) -> None:
    pool, held["pool"] = held["pool"], None
    if pool is not None:
        pool.close()


def workers_on_patcher(model_patcher, devices: Sequence, sp_mode: str | None = "allgather",
                       timeout_s: float | None = None, prelude: Sequence[tuple[str, str]] = (),
                       remote: int = 0, address: str = "127.0.0.1", port: int = 0,
                       recipe: ModelRecipe | None = None, rank0_weights=None,
                       split: RowSplit | None = None) -> SequenceParallelFanOut:
    """ComfyUI entry point, ranks as processes: `model_patcher`'s DiT forward runs on rank 0
    (this process, devices[0]), on one worker process per other device, and on `remote` ranks
    of other servers (their join command logged here; `address`:`port` the rendezvous), each
    rebuilding the DiT from the MODEL's loader and weight patches (workers/comfy_dit.py).
    Installs the wrapper under sp/minimax_h3.py's WRAPPER_KEY and returns it; refuses a MODEL
    it cannot rebuild (RecipeError) before changing the patcher. `recipe`, `rank0_weights`:
    for dit_weights="shard", the sharded recipe made from the MODEL before its patches went
    into the shards, and rank 0's block-weights handle (roles/dit.py `workers_dit`). `split`:
    how the rows are shared (sp/split.py; None: even)."""
    from comfy.patcher_extension import WrappersMP  # lazy: ComfyUI is optional for this module

    if remote:  # refused now, naming how to make and place it, not at the first step
        cluster_secret(required=True)
    # refused here when it cannot be made; its DiT file as it is now, when the node runs (the
    # workers check theirs against it: a file replaced later is refused, not loaded)
    dit_file = DitFile.of_recipe(recipe if recipe is not None else comfy_dit_recipe(model_patcher, prelude))

    def sampling_patcher():
        # ComfyUI sets BaseModel.current_patcher to the patcher that samples as it starts: this
        # one, or a clone of it with more weight patches (a LoRA loader placed after the node)
        current = getattr(model_patcher.model, "current_patcher", None)
        return current if current is not None and current.model is model_patcher.model else model_patcher

    def make_pool(rank0_dit):
        made = recipe if recipe is not None else comfy_dit_recipe(sampling_patcher(), prelude)
        return WorkerPool(devices, made, sp_mode, timeout_s, rank0_model=rank0_dit, remote=remote,
                          address=address, port=port, rank0_weights=rank0_weights, dit_file=dit_file,
                          split=split)

    def patch_set():
        if recipe is None:  # the workers load the sampling patcher's own patches: a new set, a new pool
            current = sampling_patcher()
            return getattr(current, "patches_uuid", None) or patches_digest(current)[1]
        # rank 0's shard carries the patches the node had; ComfyUI records which patch set the
        # shared model's weights carry, and another one was added after the node
        applied = getattr(model_patcher.model, "current_weight_patches_uuid", None)
        mine = getattr(model_patcher, "patches_uuid", None)
        if applied is not None and mine is not None and applied != mine:
            raise SequenceParallelError(
                "the MODEL's weights carry patches added after the MultiNPUParallelConfig node (e.g. a "
                "LoRA loader placed after it); with dit_weights=shard they would reach card 0's shard only: place the "
                "LoRA loader before the node, or use dit_weights=replicate")
        return mine

    fan_out = SequenceParallelFanOut(PoolRunner(make_pool, patch_set, len(devices) + remote))
    model_patcher.remove_wrappers_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY)
    model_patcher.add_wrapper_with_key(WrappersMP.DIFFUSION_MODEL, WRAPPER_KEY, fan_out)
    log.info("ranks as processes (%s) on %d ranks: %s%s", sp_mode or "allgather", len(devices) + remote,
             ", ".join(map(str, devices)), f" and {remote} on other servers" if remote else "")
    if remote:
        log.info("ranks %d-%d run on other servers: start them there once, e.g. for one server with "
                 "all of them (%s naming a copy of this server's secret file): %s", len(devices),
                 len(devices) + remote - 1, SECRET_FILE_ENV,
                 join_command(format_address(address, port), len(devices), ["<card>"] * remote,
                              timeout_from_env() if timeout_s is None else timeout_s))
    return fan_out
