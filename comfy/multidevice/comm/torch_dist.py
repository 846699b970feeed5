"""A torch.distributed communicator: one rank per process, on one machine or several.

`DistributedComm` has the per-rank interface of `comfy.multidevice.RankComm` (`rank`,
`world_size`, `device`, `exchange`, `all_to_all_v`, `all_reduce`, `barrier`,
`byte_counts`), so model code written against RankComm runs unchanged when each rank is
its own process, e.g. launched by `torchrun` across machines. The process-group backend
follows the device kind: hccl on Ascend NPUs, nccl on CUDA GPUs, gloo on CPU.

Exactness: no shard is ever padded. `exchange` first all-gathers every rank's shard shapes
(two tiny collectives, which also let every rank raise the same clear error when the shapes
disagree; with a shard plan only on the plan's first call), then moves each tensor into one
flat buffer of exactly the gathered size. On gloo (host memory) every part goes point to
point straight into its place, uneven or not; on nccl/hccl `all_gather_into_tensor` when all
shards are equally long, otherwise one broadcast per root rank into that root's slice
(issued asynchronously, then awaited). The transfers themselves: comm/torch_dist_transfers.py.

Failures: every collective has the process group's timeout (COMFYUI_MULTI_DEVICE_TIMEOUT_S);
a peer process that dies closes its connections, so the others fail at their next
collective with a `CollectiveError` that says so instead of hanging. In ComfyUI's process a
failed or timed-out nccl/hccl collective raises instead of ending the process
(comm/async_errors.py).
"""

from __future__ import annotations

import datetime
import logging
from typing import Sequence

import torch

from comfy.multidevice.comm.async_errors import set_collective_error_handling
from comfy.multidevice.comm.settings import check_timeout, read_torchrun_env, timeout_from_env, TorchrunEnvError
from comfy.multidevice.comm.checks import (all_to_all_arguments, check_all_reduce_metadata,
                                           check_all_to_all_metadata, check_all_to_all_plans,
                                           check_exchange_metadata, check_recv_splits, check_reduce_op,
                                           planned_metas)
from comfy.multidevice.comm.errors import CollectiveError
from comfy.multidevice.comm.layout import (alone_all_to_all, displacements, normalize_dims, numel,
                                           planned_chunk_shapes, received_chunk_shapes, scratch, sequence_major,
                                           ShardMeta, unflatten_gathered)
from comfy.multidevice.comm.torch_dist_transfers import (AllToAllTransfers, Gather, gather_point_to_point,
                                                        goes_point_to_point, issue_all_gather)
from comfy.multidevice.comm.traffic import (all_reduce_traffic, all_to_all_bytes, exchange_traffic,
                                            TrafficCounter)
from comfy.multidevice.devices import accelerator_api, ACCELERATOR_KINDS, resolve_device, set_thread_device

log = logging.getLogger(__name__)

DIST_BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}

# Stable codes for dtypes in the shape messages ranks exchange (index in this tuple).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
# Stable codes for the collective each rank entered (sent with the shapes), so ranks that
# call different collectives get one clear error instead of mismatched library calls.
_OPS = ("barrier", "exchange", "all_to_all_v", "all_reduce sum", "all_reduce max")


def default_device(local_rank: int) -> torch.device:
    """This process's device: NPU `local_rank`, else CUDA GPU `local_rank`, else the CPU."""
    for kind in ACCELERATOR_KINDS:  # NPUs first, as everywhere in the package
        api = accelerator_api(kind)
        count = api.device_count() if api is not None and api.is_available() else 0
        if count and local_rank >= count:
            raise TorchrunEnvError(
                f"LOCAL_RANK={local_rank} but this machine shows {count} {kind} device(s); start at "
                f"most {count} processes per machine (torchrun --nproc-per-node {count})")
        if count:
            return torch.device(kind, local_rank)
    return torch.device("cpu")


def dist_backend_for(device: torch.device) -> str:
    try:
        return DIST_BACKEND_FOR_DEVICE[device.type]
    except KeyError:
        raise ValueError(f"no torch.distributed backend for device {device}; use npu, cuda or cpu") from None


# ----------------------------------------------------------------------------- communicator

class DistributedComm:
    """The per-rank communicator of this process over a torch.distributed process group."""

    def __init__(self, device: torch.device | str, group=None, owns_group: bool = False):
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; use init_from_env() or "
                               "init_process_group() from comfy.multidevice.comm.torch_dist")
        self.dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = resolve_device(device)
        self.backend_name = str(dist.get_backend(group))
        self._owns_group = owns_group
        self._traffic = TrafficCounter()
        self._verified_plans: set = set()  # exchange plans whose shapes every rank confirmed
        # gloo moves CPU tensors only; nccl/hccl move tensors of this rank's device.
        self.wire_device = torch.device("cpu") if self.backend_name == "gloo" else self.device
        # Equal-size all-gather into one tensor; renamed all_gather_single in torch 2.13.
        self.all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def __repr__(self):
        return (f"DistributedComm(rank={self.rank}/{self.world_size}, device={self.device}, "
                f"backend={self.backend_name})")

    # -- the RankComm interface
    def exchange(self, tensors: Sequence[torch.Tensor], cat_dims,
                 shard_sizes: Sequence[int] | None = None, workspace: dict | None = None) -> list[torch.Tensor]:
        """All-gather-V: per tensor, the concat of every rank's shard along its cat dim (a view
        of the sequence-major buffer it was gathered into).

        `shard_sizes`: every rank's length along the cat dims, from a shard plan every rank
        shares. The first call with a plan exchanges the shapes and checks them against it;
        later calls with the same plan and shapes exchange none (no tiny collectives and no
        device-to-host read per call). `workspace`: see `Communicator.exchange`."""
        tensors = list(tensors)
        dims = normalize_dims(tensors, cat_dims)
        if self.world_size == 1:
            return tensors
        metas = self._exchange_metas(tensors, dims, shard_sizes)
        gathers = []
        for i, dim in enumerate(dims):
            shard_metas = [m[i] for m in metas]
            counts = [numel(m.shape) for m in shard_metas]
            tensor = tensors[i].detach().to(self.wire_device)
            flat = scratch(workspace, ("recv", i), sum(counts), tensor.dtype, self.wire_device)
            gathers.append(Gather(tensor, dim, flat, shard_metas, counts, displacements(counts)))
        # Every tensor's transfers are issued before any is awaited (K and V back to back).
        if goes_point_to_point(self.wire_device):
            works = gather_point_to_point(self, gathers)
        else:
            works = [issue_all_gather(self, sequence_major(g.tensor, g.dim, workspace, ("send", i)), g.flat,
                                      g.counts, g.displs) for i, g in enumerate(gathers)]
        out = []
        for g, tensor_works in zip(gathers, works):
            for work in tensor_works:
                self.call("exchange", work.wait)
            out.append(unflatten_gathered(g.flat, g.metas, g.dim).to(self.device))
        sent, received = exchange_traffic(metas, self.rank)
        self._traffic.add("exchange", sent, received)
        return out

    def _exchange_metas(self, tensors, dims, shard_sizes):
        """Every rank's shard metadata of an exchange: gathered, or known from a verified plan."""
        plan = None if shard_sizes is None else tuple(int(n) for n in shard_sizes)
        if plan is not None:
            planned = planned_metas(tensors, dims, plan, self.rank)  # ValueError before anything
            key = (tuple(planned[self.rank]), tuple(dims), plan)
            if key in self._verified_plans:
                return planned
        # The plan travels with the shapes, so every rank sees every rank's plan.
        gathered = self._gather_metas(tensors, "exchange", plan or ())
        metas = [m for m, _ in gathered]
        check_exchange_metadata(metas, dims)
        if plan is None:
            return metas
        if any(tuple(p) != plan for _, p in gathered) or metas != planned:
            raise CollectiveError(
                f"rank {self.rank}/{self.world_size}: exchange shard_sizes disagree between the ranks "
                f"({[list(p) for _, p in gathered]}) or with the shapes they passed "
                f"({[tuple(m[0].shape) for m in metas]}); every rank must pass the same shard plan")
        self._verified_plans.add(key)
        return planned

    def all_to_all_v(self, tensors, send_splits: Sequence[int], split_dim: int, cat_dim: int | None = None,
                     workspace: dict | None = None, recv_splits: Sequence[int] | None = None,
                     write_own=None):
        """As `Communicator.all_to_all_v`, straight into the result (see `AllToAllTransfers`);
        every tensor's transfers start before any is awaited. With `recv_splits` the shapes are
        exchanged on a plan's first call only."""
        single, tensors, split_dim, cat_dim, splits = all_to_all_arguments(
            tensors, send_splits, split_dim, cat_dim, self.world_size)
        if self.world_size == 1:
            out = alone_all_to_all(tensors, write_own)
            return out[0] if single else out
        received = self._all_to_all_shapes(tensors, splits, split_dim, cat_dim,
                                           check_recv_splits(recv_splits, self.world_size))
        transfers = AllToAllTransfers(self, workspace, write_own)
        wires = [tensor.detach().to(self.wire_device) for tensor in tensors]
        posted = [transfers.receive(t, wire, cat_dim, received[t]) for t, wire in enumerate(wires)]
        for t, (wire, (_, places)) in enumerate(zip(wires, posted)):
            transfers.send(t, wire, splits, split_dim, places)
        transfers.finish()
        sent, got = all_to_all_bytes([ShardMeta(tuple(t.shape), t.dtype) for t in tensors], splits, received,
                                     split_dim, self.rank)
        self._traffic.add("all_to_all_v", sent, got)
        out = [result.to(self.device) for result, _ in posted]
        return out[0] if single else out

    def _all_to_all_shapes(self, tensors, splits, split_dim, cat_dim, recv_splits):
        """Per tensor, per source: the chunk shapes this rank receives; gathered and checked on
        every rank, or known from a plan (`recv_splits`) every rank confirmed before."""
        key = None
        if recv_splits is not None:
            key = (tuple((tuple(t.shape), t.dtype) for t in tensors), splits, recv_splits, split_dim, cat_dim)
            if key in self._verified_plans:
                return planned_chunk_shapes([t.shape for t in tensors], splits, recv_splits, split_dim,
                                            cat_dim, self.rank)
        world = self.world_size
        # The plan travels with the shapes (-1: none), so every rank checks every rank's.
        gathered = self._gather_metas(tensors, "all_to_all_v", [*splits, *(recv_splits or [-1] * world)])
        metas = [m for m, _ in gathered]
        all_splits = [s[:world] for _, s in gathered]
        plans = [None if s[world] < 0 else s[world:] for _, s in gathered]
        check_all_to_all_metadata(metas, all_splits, split_dim, cat_dim)
        check_all_to_all_plans(metas, all_splits, plans, split_dim, cat_dim)
        if key is not None:
            self._verified_plans.add(key)
        return received_chunk_shapes(metas, all_splits, split_dim, self.rank)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        check_reduce_op(op)
        if self.world_size == 1:
            return tensor.clone()
        metas = self._gather_metas([tensor], f"all_reduce {op}")
        check_all_reduce_metadata([m[0] for m, _ in metas])
        work = tensor.detach().to(self.wire_device, copy=True).contiguous()
        reduce_op = self.dist.ReduceOp.SUM if op == "sum" else self.dist.ReduceOp.MAX
        self.call("all_reduce", self.dist.all_reduce, work, op=reduce_op, group=self.group)
        moved = all_reduce_traffic(tensor, self.world_size)
        self._traffic.add("all_reduce", moved, moved)
        return work.to(self.device)

    def barrier(self) -> None:
        # The tiny header all-gather of every collective instead of dist.barrier(): the same
        # on gloo, nccl and hccl, and it notices a rank that entered another collective.
        if self.world_size > 1:
            self._gather_metas([], "barrier")

    def byte_counts(self) -> dict:
        """{"sent", "received", "calls", "by_op": {...}}: logical bytes to/from other ranks."""
        return self._traffic.summary()

    # -- lifetime
    def close(self) -> None:
        """Leave the process group (if this communicator made it). Peers still inside a
        collective then see the connection close and fail instead of waiting."""
        if self._owns_group and self.dist.is_initialized():
            self._owns_group = False
            self.dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- library calls (call and global_rank also serve comm/torch_dist_transfers.py)
    def call(self, what: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), a library's RuntimeError turned into a CollectiveError naming `what`."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
            raise CollectiveError(
                f"rank {self.rank}/{self.world_size}: {what} failed ({type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no message'}); "
                "another process probably failed or exited, or timed out; see its log") from exc

    def _gather_metas(self, tensors, what: str, splits: Sequence[int] = ()):
        """Every rank's [(ShardMeta per tensor), splits]: sizes first, then the shapes."""
        code = []
        for t in tensors:
            if t.dtype not in _DTYPES:
                raise ValueError(f"{what}: dtype {t.dtype} cannot be exchanged between processes; "
                                 f"supported: {', '.join(str(d) for d in _DTYPES)}")
            code += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        code += list(splits)
        header = torch.tensor([_OPS.index(what), len(tensors), len(code)], dtype=torch.int64,
                              device=self.wire_device)
        headers = torch.empty(self.world_size * 3, dtype=torch.int64, device=self.wire_device)
        self.call(what, self.all_gather_equal, headers, header, group=self.group)
        headers = headers.view(self.world_size, 3).tolist()
        ops = [h[0] for h in headers]
        if any(o != ops[0] for o in ops):
            raise CollectiveError(
                "ranks entered different collectives ("
                + ", ".join(f"rank {r}: {_OPS[o] if 0 <= o < len(_OPS) else o}" for r, o in enumerate(ops))
                + "); every rank must call the same collectives in the same order")
        headers = [h[1:] for h in headers]
        if any(h != headers[0] for h in headers):
            raise CollectiveError(
                f"{what}: ranks disagree on the number or ranks of the tensors: "
                + ", ".join(f"rank {r}: {n} tensor(s), {k} shape entries" for r, (n, k) in enumerate(headers)))
        length = headers[0][1]
        if not length:  # nothing to describe (a barrier, or no tensors): the header was the sync
            return [([], ())] * self.world_size
        mine = torch.tensor(code, dtype=torch.int64, device=self.wire_device)
        everyone = torch.empty(self.world_size * length, dtype=torch.int64, device=self.wire_device)
        self.call(what, self.all_gather_equal, everyone, mine, group=self.group)
        rows = everyone.view(self.world_size, length).tolist()
        return [_decode_metas(row, len(tensors), len(splits)) for row in rows]

    def global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return self.dist.get_global_rank(self.group, group_rank)



def _decode_metas(row: list[int], n_tensors: int, n_splits: int):
    metas, pos = [], 0
    for _ in range(n_tensors):
        dtype, ndim = _DTYPES[row[pos]], row[pos + 1]
        metas.append(ShardMeta(tuple(row[pos + 2:pos + 2 + ndim]), dtype))
        pos += 2 + ndim
    return metas, tuple(row[pos:pos + n_splits])


# ----------------------------------------------------------------------------- set-up

def init_process_group(rank: int, world_size: int, device: torch.device | str | None = None,
                       init_method: str = "env://", backend: str | None = None,
                       timeout_s: float | None = None, store=None,
                       server_process: bool = False) -> DistributedComm:
    """Join (create) the default process group and return this process's communicator.

    `device` defaults to the CPU; the backend defaults to the one for the device kind
    (gloo / nccl / hccl); `timeout_s` to COMFYUI_MULTI_DEVICE_TIMEOUT_S (600 s). `store`: a
    torch.distributed store to meet in instead of `init_method` (a worker pool's generation).
    `server_process`: this is ComfyUI's process, which a failed collective must not end
    (comm/async_errors.py sets the libraries' error handling before the group is made).
    """
    import torch.distributed as dist

    device = resolve_device(device if device is not None else "cpu")
    backend = backend or dist_backend_for(device)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
    timeout_s = timeout_from_env() if timeout_s is None else check_timeout(timeout_s)
    set_thread_device(device)  # nccl/hccl bind the communicator to the current device
    set_collective_error_handling(backend, timeout_s, server_process)  # read when the group is made
    log.info("rank %d/%d: joining the %s process group via %s on %s", rank, world_size, backend,
             "a store" if store is not None else init_method, device)
    meet = {"store": store} if store is not None else {"init_method": init_method}
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **meet)
    return DistributedComm(device, owns_group=True)


def init_from_env(device: torch.device | str | None = None, backend: str | None = None,
                  timeout_s: float | None = None) -> DistributedComm:
    """The communicator of a process started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); the device defaults to accelerator LOCAL_RANK, else the CPU.

    Joins through env:// so that under torchrun the workers use the store its agent
    already serves on MASTER_ADDR:MASTER_PORT instead of trying to open that port again.
    """
    env = read_torchrun_env()
    device = resolve_device(device) if device is not None else default_device(env.local_rank)
    return init_process_group(env.rank, env.world_size, device, init_method="env://",
                              backend=backend, timeout_s=timeout_s)
