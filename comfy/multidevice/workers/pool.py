"""Ranks as processes: this process is rank 0, one worker process per other card.

Beside the rank threads of comm/group.py: each worker has its own interpreter, so a hung or
crashed rank can be killed (its card memory freed) and never takes the others' GIL or their
process down. torch.distributed is the engine: a process group over the cards (gloo on CPU
ranks, nccl / hccl on cards) carries the K/V exchange, a gloo group carries control
(workers/control.py).

Per forward rank 0 sends only what a forward reads (latents, timestep, the model's keyword
inputs; the tensors the previous forward carried, such as the conditioning, as their digest:
workers/repeats.py) and computes its own share; the workers compute theirs and keep
their results (only rank 0's rows are assembled). A worker that dies fails the forward on
rank 0 at once (gloo sees the closed connection), one that hangs within the collective
timeout; either way every worker here is then killed, the error names the rank, its server,
its process and the last line it wrote (its live connection to the door tells which one
ended), and the next forward starts a fresh pool. ComfyUI's Cancel stops every rank as one
block starts, as with rank threads (comfy_cancel.py `BlockCancel`), and the pool stays up.
Between forwards the workers wait on the door for rank 0's "go", not in a collective: an idle
pool outlives any pause.

The ranks meet at this process's door (workers/door.py, workers/rendezvous.py), each pool a
new generation with its own key: a rank takes part only once it proved that key; ranks on
other servers are started once by their users with the command `join_command` gives, and
join every later pool. Nothing a rank receives is unpickled (workers/wire.py).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import subprocess
import threading
import time
from typing import Sequence

import torch

from comfy.multidevice.comfy_cancel import cancel_requested, CancelledAtBlock, checks_at_block_starts, raise_cancel
from comfy.multidevice.comm.settings import timeout_from_env
from comfy.multidevice.comm.torch_dist import init_process_group
from comfy.multidevice.devices import copy_for_rank, resolve_device
from comfy.multidevice.progress import executing_node_text
from comfy.multidevice.sp.fan_out import transformer_options_of
from comfy.multidevice.sp.minimax_h3 import H3RankSetup
from comfy.multidevice.sp.split import check_mode_for_split, EVEN, parse_split, RowSplit
from comfy.multidevice.workers.admission import SECRET_FILE_ENV
from comfy.multidevice.workers.control import BlockFlag, BUILD, ControlChannel, FORWARD
from comfy.multidevice.workers.join import join_command
from comfy.multidevice.workers.dit_file import DitFile
from comfy.multidevice.workers.door import PoolAdmission, WorkerIdentity
from comfy.multidevice.workers.process import WorkerProcess, worker_arguments, worker_env
from comfy.multidevice.workers.recipe import ModelRecipe, RecipeError
from comfy.multidevice.workers.rendezvous import gloo_interface, gloo_interface_for, rendezvous_at
from comfy.multidevice.workers.repeats import SentTensors
from comfy.multidevice.workers.worker import block_gather_lane, control_group

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # a stopped worker's time to exit before it is killed
BUILD_WAIT_S = 1800.0  # a worker's DiT load (a 66 GB file from a slow disk takes minutes)
START_GRACE_S = 60.0  # at least this long for the ranks to reach the door: a process starting
# (importing torch and the card's runtime) is not a collective, and a local one that dies is seen at once


_live: dict = {}  # "pool": the pool that holds this process's default process group
_live_lock = threading.Lock()


def _close_at_exit() -> None:
    """At this process's exit (ComfyUI stopped, Ctrl-C included) the live pool is closed the
    ordinary way: its workers are told to stop and the process group is left before Python
    tears its objects down in no particular order (seen once: an exit held for the collective
    timeout without this)."""
    with _live_lock:
        pool = _live.pop("pool", None)
    if pool is not None and pool.running:
        pool.close()


def stop_unused_pool(why: str) -> str | None:
    """Stop this process's running pool, if any, because the prompt about to run will not use
    it (`why`): its workers hold a DiT each that another mode may need the memory of. The MODEL
    it served starts a fresh pool if it is ever sampled again. Returns the line it logged (for
    the UI), None when no pool ran."""
    with _live_lock:
        pool = _live.pop("pool", None)
    if pool is None or not pool.running:
        return None
    said = f"stopped the worker pool's {pool.world_size - 1} rank(s) in other processes: {why}"
    pool.close()
    log.info("%s", said)
    return said


class WorkerPoolError(RuntimeError):
    """A pool that could not start or lost a rank; the message names the rank and the fix."""


class WorkerPool:
    """Rank 0 in this process on devices[0], workers on devices[1:] of this server, and
    `remote` ranks on other servers (started by their users with `join_command`); one DiT from
    `recipe` each."""

    def __init__(self, devices: Sequence, recipe: ModelRecipe, sp_mode: str | None = None,
                 timeout_s: float | None = None, rank0_model: torch.nn.Module | None = None,
                 remote: int = 0, address: str = "127.0.0.1", port: int = 0, rank0_weights=None,
                 dit_file: "DitFile | None" = None, split: RowSplit | None = None):
        """`rank0_model`: rank 0's DiT when this process has it already (a ComfyUI MODEL's),
        with `rank0_weights`, its block-weights handle when it is rank 0's shard of a sharded
        recipe (weights/shard_layout.py); else rank 0 builds it from the recipe too.
        `address`, `port`: this process's
        door, where its workers and the other servers reach this one (port 0: the system
        picks it; ranks on other servers need a fixed one, and the cluster secret).
        `dit_file`: the DiT file rank 0's weights came from and its identity, which every
        worker checks its own file against before it loads (default: the recipe's `path`
        as it is now). `split`: how the rows are shared (sp/split.py; None: even), sent to the
        workers in the build message."""
        if len(devices) + remote < 2:
            raise ValueError(f"a worker pool needs at least 2 ranks, got {len(devices)} device(s) and "
                             f"{remote} remote rank(s); one card runs without one")
        if remote < 0:
            raise ValueError(f"remote={remote} ranks: give 0 or more")
        self.split = EVEN if split is None else split
        # a bad mode, or ulysses with an uneven split, fails here, before any process starts
        check_mode_for_split(sp_mode, self.split)
        self.devices = [resolve_device(d) for d in devices]
        self.remote = remote
        self.address = address
        self.recipe = recipe
        self.dit_file = dit_file if dit_file is not None else DitFile.of_recipe(recipe)
        self.sp_mode = sp_mode
        self.timeout_s = timeout_from_env() if timeout_s is None else timeout_s
        # nothing needs to be reachable from another machine without remote ranks: loopback
        door_host = address if remote else "127.0.0.1"
        self.rendezvous = rendezvous_at(door_host, port, self.timeout_s, remote)  # a port in use fails here
        self.requested_port = port  # what a renewed pool asks for again (0 stays the system's pick)
        self.generation: int | None = None  # this pool's, once started
        self.workers: list[WorkerProcess] = []
        self.rank0_model = rank0_model
        self.rank0_weights = rank0_weights
        if recipe.sharded and rank0_model is not None and rank0_weights is None:
            raise ValueError("a sharded recipe's rank 0 model needs its block weights (rank0_weights)")
        self.model = None
        self.setup = None
        self.control = None
        self.cancel_flag: BlockFlag | None = None
        self.sent_tensors: SentTensors | None = None
        self.comm = None
        self.admission: PoolAdmission | None = None  # this pool at the door, once started
        self.identities: list[WorkerIdentity] = []  # every rank's server and pid, once started
        self.start_seconds = None
        self.bytes_sent_per_forward: list[int] = []
        self.control_seconds_per_forward: list[float] = []  # rank 0's sends and Cancel flags
        self.cancelled_at: list[int] = []  # the block each cancelled forward stopped at

    @property
    def world_size(self) -> int:
        return len(self.devices) + self.remote

    @property
    def running(self) -> bool:
        """Started and not closed (by its owner, a failure, or a newer pool)."""
        return self.comm is not None

    def _rank_threads(self) -> int | None:
        """CPU ranks on one server share its cores: each takes its part."""
        if self.devices[0].type != "cpu":
            return None
        return max(1, (os.cpu_count() or 1) // len(self.devices))

    def join_command(self, first_rank: int | None = None, devices: Sequence[str] | None = None,
                     threads: int | None = None) -> str:
        """What a user runs once on another server for its ranks `first_rank`, ... on `devices`
        (default: every remote rank, on cards the user names; a server with this repository
        and the same model files at the same paths). It joins this pool and every later one."""
        first = len(self.devices) if first_rank is None else first_rank
        devices = ["<card>"] * self.remote if devices is None else devices
        return join_command(self.rendezvous.address, first, devices, self.timeout_s, threads)

    def start(self) -> "WorkerPool":
        started = time.perf_counter()
        # torch.distributed has one default process group per process: one pool at a time. A
        # newer one (the node ran again, another MODEL) replaces the last; its owner starts a
        # fresh pool at its next forward.
        with _live_lock:
            previous = _live.get("pool")
            _live["pool"] = self
            if not _live.get("closes_at_exit"):
                atexit.register(_close_at_exit)
                _live["closes_at_exit"] = True
        if previous is not None and previous is not self and previous.running:
            log.info("worker pool: closing the previous pool (%d ranks) for a new one", previous.world_size)
            previous.close()
        self.admission = pool = self.rendezvous.open_pool(self.world_size, len(self.devices))
        self.generation = pool.generation
        ifname = gloo_interface_for(self.rendezvous.host)  # loopback's without remote ranks
        threads = self._rank_threads()
        for rank in range(1, len(self.devices)):
            self.workers.append(WorkerProcess(rank, worker_arguments(
                rank, self.world_size, self.rendezvous.address, self.generation, self.devices[rank],
                self.timeout_s, threads), pool.key, env=worker_env(ifname)))
        if self.remote:
            log.info("worker pool: waiting for ranks %d-%d from other servers at %s (started there with: %s, "
                     "%s naming a copy of this server's secret file)", len(self.devices), self.world_size - 1,
                     self.rendezvous.address, self.join_command(), SECRET_FILE_ENV)
        try:
            try:
                self._wait_admitted()
                pool.go()  # the admitted ranks meet now, in the collective timeout from here on
                with gloo_interface(ifname):
                    self.comm = self._join(self.rendezvous.store_of(pool))
                    group = control_group(self.devices[0])
                    self.control = ControlChannel(group)
                    self.cancel_flag = BlockFlag(group)
                    self.sent_tensors = SentTensors()  # the workers start with nothing held
                    self._send((BUILD, self.recipe, self.sp_mode,
                                None if self.dit_file is None else self.dit_file.to_data(), self.split))
                    lane = block_gather_lane(self.devices[0], self.timeout_s) if self.recipe.sharded else None
            finally:
                self.rendezvous.close_pool(pool)  # a rank coming later waits for the next pool
            problem = None
            try:
                if self.rank0_model is not None:
                    self.model = self.rank0_model
                else:
                    if self.dit_file is not None:  # rank 0 builds from the file too: the same check
                        self.dit_file.check(f"rank 0 on {socket.gethostname()} now")
                    self.model, self.rank0_weights = self.recipe.build(self.devices[0], 0, self.world_size)
                if self.rank0_weights is not None:  # this pool's lane (rank 0's shard outlives pools)
                    self.rank0_weights.family.use_lane(lane, self.timeout_s)
            except Exception as exc:
                problem = f"{type(exc).__name__}: {exc}"
            self._wait_built(started)
            pool.go()  # every rank is built: the statuses' collective meets at once
            statuses = self.control.statuses((problem, socket.gethostname(), os.getpid()))
            # a worker's own host name, with the address it connected from
            self.identities = [(pool.identity(r) if r else None) or WorkerIdentity(r, server, pid)
                               for r, (_, server, pid) in enumerate(statuses)]
        except Exception as exc:
            self._fail(exc, "starting the pool")
        bad = [(r, p) for r, (p, _, _) in enumerate(statuses) if p]
        if bad:
            self.close()
            raise RecipeError("the model recipe " + self.recipe.describe() + " failed on " +
                              "; ".join(f"{self.identities[r].describe()}: {p}" for r, p in bad))
        self.setup = H3RankSetup(self.comm, self.sp_mode, self.rank0_weights, self.cancel_flag, self.split)
        self.start_seconds = time.perf_counter() - started
        log.info("worker pool: %d ranks started in %.1f s: %s", self.world_size, self.start_seconds,
                 ", ".join(f"{i.describe()} {self._device_of(i.rank)}" for i in self.identities))
        return self

    def _wait_built(self, started: float):
        """Until every worker said its DiT is built: however long the loads take (minutes for a
        large file on cards; no collective waits meanwhile, so no collective timeout), shown on
        the running node and in the log as each one comes; a worker that ends first fails the
        start, and ComfyUI's Cancel stops it. BUILD_WAIT_S bounds a worker that hangs."""
        waiting = set(range(1, self.world_size))
        show = executing_node_text()
        total = len(waiting)
        show(f"starting {total} worker(s) for the DiT: 0/{total} loaded")
        deadline = time.monotonic() + max(self.timeout_s, BUILD_WAIT_S)
        while waiting:
            for rank in sorted(waiting):
                line = self.admission.members[rank].line()  # AdmissionError: it ended
                if line is not None and line.get("built"):
                    waiting.discard(rank)
                    done = total - len(waiting)
                    log.info("worker pool: rank %d built its DiT (%d/%d, %.1f s)", rank, done, total,
                             time.perf_counter() - started)
                    show(f"starting {total} worker(s) for the DiT: {done}/{total} loaded "
                         f"({time.perf_counter() - started:.0f} s)")
            if not waiting:
                return
            dead = [w for w in self.workers if w.ended()]
            if dead:
                raise WorkerPoolError(f"a worker ended while loading its DiT: {dead[0].describe()}")
            cancel = cancel_requested()
            if cancel is not None:  # the prompt ends as interrupted, the workers with it
                log.info("worker pool: ComfyUI's Cancel stopped the start; stopping the workers")
                self._teardown()
                raise_cancel(cancel)
            if time.monotonic() > deadline:
                raise WorkerPoolError(f"ranks {sorted(waiting)} did not build their DiT within "
                                      f"{max(self.timeout_s, BUILD_WAIT_S):.0f} s")
            time.sleep(0.05)

    def _device_of(self, rank: int) -> str:
        return f"on {self.devices[rank]}" if rank < len(self.devices) else "(remote)"

    def _wait_admitted(self):
        """Until every rank proved the pool's key at the door; a local worker that ends first
        fails the start at once, a rank missing at the timeout is named with who should
        have brought it."""
        wait_s = max(self.timeout_s, START_GRACE_S)
        deadline = time.monotonic() + wait_s
        while missing := self.admission.missing():
            dead = [w for w in self.workers if w.ended()]
            if dead:
                raise WorkerPoolError(f"a worker ended before the pool started: {dead[0].describe()}")
            if time.monotonic() > deadline:
                local = [r for r in missing if r < len(self.devices)]
                remote = [r for r in missing if r >= len(self.devices)]
                named = [f"rank {r} (pid {self.workers[r - 1].process.pid}, on this server) did not reach the "
                         "door" for r in local]
                named += [f"rank {r} from another server: {self.rendezvous.covering(r)}" for r in remote]
                refused = self.rendezvous.refusals[-3:]
                raise WorkerPoolError(f"ranks {missing} did not join within {wait_s:.0f} s: "
                                      + "; ".join(named)
                                      + (f". Refused at the door: {'; '.join(refused)}" if refused else ""))
            time.sleep(0.05)

    def _send(self, message) -> int:
        """A control message to every worker: a "go" on each live connection wakes them
        from their idle wait, then the message itself over the control group."""
        self.admission.go()
        return self.control.send(message)

    def _join(self, store):
        """Meet the admitted workers in this pool's `store` as rank 0; a worker that dies
        first fails the start at once (the meeting itself would wait for it until the timeout)."""
        joined: dict = {}

        def join():
            try:
                joined["comm"] = init_process_group(0, self.world_size, self.devices[0], store=store,
                                                    timeout_s=self.timeout_s, server_process=True)
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                joined["error"] = exc

        thread = threading.Thread(target=join, name="worker-pool-rendezvous", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s
        while thread.is_alive():
            thread.join(0.1)
            dead = [w for w in self.workers if w.ended()]
            if dead and thread.is_alive():
                raise WorkerPoolError(f"a worker ended before the pool started: {dead[0].describe()}")
            if time.monotonic() > deadline:
                raise WorkerPoolError(f"the workers did not join within {self.timeout_s:.0f} s: "
                                      + "; ".join(w.describe() for w in self.workers))
        if "error" in joined:
            raise joined["error"]
        return joined["comm"]

    def forward(self, x, timestep, context, transformer_options: dict | None = None, **kwargs):
        """One DiT forward over every rank; rank 0's result (the whole output)."""
        kwargs["transformer_options"] = dict(transformer_options or {})
        return self.forward_method(None, self.model, [x, timestep, context], kwargs)

    def forward_method(self, method: str | None, rank0_forward, args: list, kwargs: dict,
                       sent: tuple[list, dict] | None = None, options_at: int | None = None):
        """`rank0_forward(*args, **kwargs)` here and the forward `method` of each worker's DiT
        (None: the DiT itself) on what rank 0 sends: `sent` (args, kwargs), default the same
        inputs. Each rank's transformer_options (positional argument `options_at`, or the
        keyword) get its sequence-parallel set-up."""
        if not self.running:
            raise WorkerPoolError("the worker pool is closed; start a new one")
        threads = torch.get_num_threads()
        try:
            rank_threads = self._rank_threads()
            if rank_threads:
                torch.set_num_threads(rank_threads)
            sent_args, sent_kwargs = sent if sent is not None else (args, kwargs)
            control_before = self.control.seconds + self.cancel_flag.seconds
            (packed_args, packed_kwargs), new = self.sent_tensors.pack((sent_args, sent_kwargs))
            self.bytes_sent_per_forward.append(self._send((FORWARD, method, packed_args, packed_kwargs, new)))
            args, kwargs = copy_for_rank((list(args), dict(kwargs)), self.devices[0])  # its own options
            self.setup.install(getattr(rank0_forward, "__self__", rank0_forward), transformer_options_of(args, kwargs, options_at))
            with torch.inference_mode(), checks_at_block_starts():  # a Cancel stops every rank together
                out = rank0_forward(*args, **kwargs)
            self.control_seconds_per_forward.append(self.control.seconds + self.cancel_flag.seconds - control_before)
            return out
        except CancelledAtBlock as cancelled:
            cancel = cancelled  # every rank stopped at this block; the pool stays up
        except Exception as exc:
            self._fail(exc, "a forward")
        except BaseException:
            # an interrupt that did not wait for a block start (ComfyUI's per-layer Cancel check
            # is deferred to them: comfy_cancel.py; a KeyboardInterrupt is not) left this
            # rank mid-block while the workers wait in a collective: they cannot be brought
            # back in step, so they are stopped; the next forward starts afresh
            log.info("worker pool: the forward was interrupted inside a block; stopping its %d "
                     "worker(s), the next forward starts a fresh pool", len(self.workers))
            self._teardown()
            raise
        finally:
            torch.set_num_threads(threads)
        log.info("worker pool: the forward was cancelled from ComfyUI at block %d on every rank", cancel.block)
        self.cancelled_at.append(cancel.block)
        raise_cancel(cancel.module)

    def _fail(self, exc: BaseException, during: str):
        """Kill every worker here, leave the process group, raise what happened naming the
        ranks that ended (a worker of another server: by its closed live connection)."""
        time.sleep(0.2)  # a dying worker's last line, exit status and closed connection
        gone = [w.describe() for w in self.workers if w.ended()]
        local = {w.rank for w in self.workers}
        ended = self.admission.ended() if self.admission is not None else []
        gone += [f"{i.describe()} ended (its connection closed)" for i in ended if i.rank not in local]
        named = "; ".join(gone or [w.describe() for w in self.workers] or ["no worker ended"])
        self._teardown()
        raise WorkerPoolError(
            f"the worker pool failed during {during}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}; "
            f"{named}. Every worker was stopped; the next run starts a fresh pool.") from exc

    def _teardown(self):
        for worker in self.workers:
            worker.kill()
        self.workers = []
        if self.admission is not None:  # closes the live connections: a remote worker then ends
            self.rendezvous.close_pool(self.admission, drop=True)
        self._leave_group()

    def _leave_group(self):
        import torch.distributed as dist
        if self.rank0_weights is not None:
            self.rank0_weights.family.use_lane(None)  # its group goes with this pool's
        # gloo closes a group's connections only when its last reference goes: drop ours
        # first, so a worker blocked on one fails now instead of at its timeout
        self.control = self.cancel_flag = self.setup = None
        if self.comm is not None and dist.is_initialized():
            dist.destroy_process_group()
        self.comm = None

    def close(self):
        """Tell the workers to stop, give them STOP_GRACE_S, then kill what is left."""
        if self.admission is not None:
            self.admission.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in self.workers:
            try:
                worker.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker pool: %s; killing it", worker.describe())
        self._teardown()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()


class WorkersDiT:
    """Calls like the DiT; each forward runs over a worker pool, started on the first call and
    again after one that lost a rank."""

    def __init__(self, devices: Sequence, recipe: ModelRecipe, sp_mode: str | None = None,
                 timeout_s: float | None = None, split: RowSplit | None = None):
        self.pool = WorkerPool(devices, recipe, sp_mode, timeout_s, split=split)  # checks the arguments now
        self._started = False

    def __call__(self, x, timestep, context, transformer_options: dict | None = None, **kwargs):
        if self._started and not self.pool.running:  # closed by a newer pool of this process
            self._renew()
        if not self._started:
            self.pool.start()
            self._started = True
        try:
            return self.pool.forward(x, timestep, context, transformer_options, **kwargs)
        except WorkerPoolError:
            self._renew()
            raise

    def _renew(self):
        old = self.pool
        self.pool = WorkerPool(old.devices, old.recipe, old.sp_mode, old.timeout_s, remote=old.remote,
                               address=old.address, port=old.requested_port, dit_file=old.dit_file,
                               split=old.split)
        self._started = False

    def close(self):
        if self._started:
            self.pool.close()
            self._started = False


def enable_sequence_parallel_workers(devices: Sequence, recipe: ModelRecipe, sp_mode: str | None = "allgather",
                                     timeout_s: float | None = None, split=None) -> WorkersDiT:
    """Plain-module entry point with ranks as processes: rank 0 here on devices[0], one worker
    process per other device, each with the DiT `recipe` builds on its device. Returns a
    callable with the DiT's forward signature whose result equals the single-device forward.
    `split`: how the rows are shared, a `RowSplit` or the node's text (sp/split.py); None: even."""
    return WorkersDiT(devices, recipe, sp_mode, timeout_s, parse_split(split, len(devices)))
