"""A torch.distributed communicator: one rank per process, on one machine or several.

Over 500 lines because each collective needs its gloo and its nccl/hccl path side by side
(the same metadata exchange and checks, two transfer plans); split, they would share private state.

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
(issued asynchronously, then awaited).

Failures: every collective has the process group's timeout (COMFYUI_MULTI_DEVICE_TIMEOUT_S);
a peer process that dies closes its connections, so the others fail at their next
collective with a `CollectiveError` that says so instead of hanging. In ComfyUI's process a
failed or timed-out nccl/hccl collective raises instead of ending the process
(comm/async_errors.py).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from comfy.multidevice.comm.async_errors import set_collective_error_handling
from comfy.multidevice.comm.settings import check_timeout, read_torchrun_env, timeout_from_env, TorchrunEnvError
from comfy.multidevice.comm.checks import (all_to_all_arguments, check_all_reduce_metadata,
                                           check_all_to_all_metadata, check_all_to_all_plans,
                                           check_exchange_metadata, check_recv_splits, planned_metas)
from comfy.multidevice.comm.errors import CollectiveError
from comfy.multidevice.comm.layout import (alone_all_to_all, chunk_shape, chunks_back_to_back, displacements,
                                           normalize_dims, numel, pack_chunks, pack_peer_chunks,
                                           planned_chunk_shapes, received_chunk_shapes, scratch, sequence_major,
                                           ShardMeta, unflatten_gathered)
from comfy.multidevice.comm.protocol import VALID_REDUCE_OPS
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
        if api is not None and api.is_available() and api.device_count() > 0:
            return _indexed(kind, local_rank, api.device_count())
    return torch.device("cpu")


def _indexed(kind: str, local_rank: int, count: int) -> torch.device:
    if local_rank >= count:
        raise TorchrunEnvError(
            f"LOCAL_RANK={local_rank} but this machine shows {count} {kind} device(s); start at "
            f"most {count} processes per machine (torchrun --nproc-per-node {count})")
    return torch.device(kind, local_rank)


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
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = resolve_device(device)
        self.backend_name = str(dist.get_backend(group))
        self._owns_group = owns_group
        self._traffic = TrafficCounter()
        self._verified_plans: set = set()  # exchange plans whose shapes every rank confirmed
        # gloo moves CPU tensors only; nccl/hccl move tensors of this rank's device.
        self._wire_device = torch.device("cpu") if self.backend_name == "gloo" else self.device
        # Equal-size all-gather into one tensor; renamed all_gather_single in torch 2.13.
        self._all_gather_equal = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

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
            tensor = tensors[i].detach().to(self._wire_device)
            flat = scratch(workspace, ("recv", i), sum(counts), tensor.dtype, self._wire_device)
            gathers.append(_Gather(tensor, dim, flat, shard_metas, counts, displacements(counts)))
        # Every tensor's transfers are issued before any is awaited (K and V back to back).
        if self._wire_device.type in _POINT_TO_POINT_WIRES:
            works = self._gather_point_to_point(gathers)
        else:
            works = [self._issue_all_gather(sequence_major(g.tensor, g.dim, workspace, ("send", i)), g.flat,
                                            g.counts, g.displs) for i, g in enumerate(gathers)]
        out = []
        for g, tensor_works in zip(gathers, works):
            for work in tensor_works:
                self._call("exchange", work.wait)
            out.append(unflatten_gathered(g.flat, g.metas, g.counts, g.displs, g.dim).to(self.device))
        sent, received = exchange_traffic(metas, self.rank)
        self._count("exchange", sent=sent, received=received)
        return out

    def _exchange_metas(self, tensors, dims, shard_sizes):
        """Every rank's shard metadata of an exchange: gathered, or known from a verified plan."""
        if shard_sizes is None:
            metas = [m for m, _ in self._gather_metas(tensors, "exchange")]
            check_exchange_metadata(metas, dims)
            return metas
        planned = planned_metas(tensors, dims, shard_sizes, self.rank)  # ValueError before anything
        key = (tuple(planned[self.rank]), tuple(dims), tuple(int(n) for n in shard_sizes))
        if key in self._verified_plans:
            return planned
        # The plan travels with the shapes, so every rank sees every rank's plan.
        gathered = self._gather_metas(tensors, "exchange", [int(n) for n in shard_sizes])
        metas = [m for m, _ in gathered]
        check_exchange_metadata(metas, dims)
        if any(tuple(p) != key[2] for _, p in gathered) or metas != planned:
            raise CollectiveError(
                f"rank {self.rank}/{self.world_size}: exchange shard_sizes disagree between the ranks "
                f"({[list(p) for _, p in gathered]}) or with the shapes they passed "
                f"({[tuple(m[0].shape) for m in metas]}); every rank must pass the same shard plan")
        self._verified_plans.add(key)
        return planned

    def all_to_all_v(self, tensors, send_splits: Sequence[int], split_dim: int, cat_dim: int | None = None,
                     workspace: dict | None = None, recv_splits: Sequence[int] | None = None,
                     write_own=None):
        """As RankComm.all_to_all_v: chunk j of each tensor (along split_dim) goes to rank j;
        the chunks received are concatenated in source-rank order along cat_dim.

        Straight into the result (see `_AllToAllTransfers`): the chunk a rank keeps is copied
        once from its source into its place, a peer's chunk is packed once (not when dense) and
        lands in its place (via one buffer and a copy where that place is strided, as a head
        block along cat_dim is). Every tensor's transfers start before any is awaited.
        `recv_splits`: see `Communicator.all_to_all_v`; with them the shapes are exchanged on
        a plan's first call only. `workspace`: see `Communicator.exchange`; `write_own`: see
        `Communicator.all_to_all_v`."""
        single, tensors, split_dim, cat_dim, splits = all_to_all_arguments(
            tensors, send_splits, split_dim, cat_dim, self.world_size)
        if self.world_size == 1:
            out = alone_all_to_all(tensors, write_own)
            return out[0] if single else out
        received = self._all_to_all_shapes(tensors, splits, split_dim, cat_dim,
                                           check_recv_splits(recv_splits, self.world_size))
        transfers = _AllToAllTransfers(self, workspace, write_own)
        wires = [tensor.detach().to(self._wire_device) for tensor in tensors]
        posted = [transfers.receive(t, wire, cat_dim, received[t]) for t, wire in enumerate(wires)]
        for t, (wire, (_, places)) in enumerate(zip(wires, posted)):
            transfers.send(t, wire, splits, split_dim, places)
        transfers.finish()
        sent, got = all_to_all_bytes([ShardMeta(tuple(t.shape), t.dtype) for t in tensors], splits, received,
                                     split_dim, self.rank)
        self._count("all_to_all_v", sent=sent, received=got)
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
        if op not in VALID_REDUCE_OPS:
            raise ValueError(f"all_reduce op {op!r} is not supported; use one of {VALID_REDUCE_OPS}")
        if self.world_size == 1:
            return tensor.clone()
        metas = self._gather_metas([tensor], f"all_reduce {op}")
        check_all_reduce_metadata([m[0] for m, _ in metas])
        work = tensor.detach().to(self._wire_device, copy=True).contiguous()
        reduce_op = self._dist.ReduceOp.SUM if op == "sum" else self._dist.ReduceOp.MAX
        self._call("all_reduce", self._dist.all_reduce, work, op=reduce_op, group=self.group)
        moved = all_reduce_traffic(tensor, self.world_size)
        self._count("all_reduce", sent=moved, received=moved)
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
        if self._owns_group and self._dist.is_initialized():
            self._owns_group = False
            self._dist.destroy_process_group()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals
    def _call(self, what: str, fn, *args, **kwargs):
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
                              device=self._wire_device)
        headers = torch.empty(self.world_size * 3, dtype=torch.int64, device=self._wire_device)
        self._call(what, self._all_gather_equal, headers, header, group=self.group)
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
        mine = torch.tensor(code, dtype=torch.int64, device=self._wire_device)
        everyone = torch.empty(self.world_size * length, dtype=torch.int64, device=self._wire_device)
        self._call(what, self._all_gather_equal, everyone, mine, group=self.group)
        rows = everyone.view(self.world_size, length).tolist()
        return [_decode_metas(row, len(tensors), len(splits)) for row in rows]

    def _gather_point_to_point(self, gathers) -> list[list]:
        """The all-gather on gloo: every peer's part received straight into its place, this
        rank's shard copied once into its own place (sequence-major) and sent from there.
        One copy per tensor, as a packed send buffer would cost, but no second copy of the
        own part by the collective, and gloo's point to point moves big messages several
        times faster than its all_gather (bench/bench_exchange.py). Receives are posted first,
        so a peer's send never waits for this rank to be ready."""
        works = []
        for tag, g in enumerate(gathers):
            works.append(_start_point_to_point(self, "exchange", [
                ("recv", g.part(src), src, tag) for src in range(self.world_size)
                if src != self.rank and g.counts[src]]))
        peers = _ring_peers(self.rank, self.world_size)
        for tag, g in enumerate(gathers):
            if not g.counts[self.rank]:
                continue  # every rank skips the same empty shards
            moved = g.tensor.movedim(g.dim, 0)
            own = g.part(self.rank).view(moved.shape).copy_(moved)
            works[tag] += _start_point_to_point(self, "exchange", [("send", own, dst, tag) for dst in peers])
        return works

    def _issue_all_gather(self, send: torch.Tensor, flat: torch.Tensor, counts, displs) -> list:
        """Start gathering every rank's dense `send` into the flat buffer `flat`; the works."""
        if len(set(counts)) == 1:
            return [self._call("exchange", self._all_gather_equal, flat, send.view(-1),
                               group=self.group, async_op=True)]
        flat.narrow(0, displs[self.rank], counts[self.rank]).copy_(send.view(-1))
        works = []
        for root, (count, displ) in enumerate(zip(counts, displs)):
            if count:  # every rank skips the same empty shards
                works.append(self._call("exchange", self._dist.broadcast, flat.narrow(0, displ, count),
                                        src=self._global_rank(root), group=self.group, async_op=True))
        return works

    def _global_rank(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return self._dist.get_global_rank(self.group, group_rank)

    def _count(self, op: str, sent: int, received: int) -> None:
        self._traffic.add(op, sent, received)


# Wire devices whose all-gather and all-to-all go point to point (gloo's host memory); the
# others take all_gather_into_tensor / all_to_all_single (tests run those over gloo by
# emptying this).
_POINT_TO_POINT_WIRES = ("cpu",)


@dataclass(frozen=True)
class _Gather:
    """One tensor of an exchange: its shard, and the flat rank-major buffer it is gathered into."""

    tensor: torch.Tensor
    dim: int
    flat: torch.Tensor
    metas: list
    counts: list[int]
    displs: list[int]

    def part(self, rank: int) -> torch.Tensor:
        return self.flat.narrow(0, self.displs[rank], self.counts[rank])


def _ring_peers(rank: int, world: int) -> list[int]:
    """Every other rank, starting after `rank`: each rank serves a different peer first."""
    return [(rank + step) % world for step in range(1, world)]


# Each collective's point-to-point tags in their own range: after a shard plan is verified no
# shapes travel, so ranks that (wrongly) enter different collectives must not match each
# other's messages; a receive then waits for its own kind and times out with a clear error.
_TAG_BASE = {"exchange": 0, "all_to_all_v": 1 << 16}


def _start_point_to_point(comm: DistributedComm, what: str, ops) -> list:
    """Start point-to-point `ops` (kind "send"/"recv", dense tensor, group rank of the peer,
    tag) of collective `what`; their works. The tag is the tensor's index in the call: the
    same on both ends of a transfer, and unique per pair and direction in one call."""
    if not ops:
        return []
    dist = comm._dist
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, comm._global_rank(peer),
                      group=comm.group, tag=_TAG_BASE[what] + tag) for kind, tensor, peer, tag in ops]
    return list(comm._call(what, dist.batch_isend_irecv, p2p))


class _AllToAllTransfers:
    """The transfers of one all_to_all_v call, straight into each tensor's result: the chunk a
    rank keeps is copied once from its source into its place and never crosses the wire.

    gloo (host memory): point to point. Every receive is posted into its place first (via one
    dense buffer when the place is strided), then per tensor each peer's chunk is packed (one
    copy, none when dense) and sent at once, so gloo's threads move it while this one packs
    the next; the kept chunks are copied after the last send starts, while the wire is busy.
    nccl/hccl: one `all_to_all_single` per tensor (a collective every such backend has,
    stream-ordered like the copies around it), straight from the tensor or into the result
    where their chunks lie back to back (see `_collective`): a byte is copied at most once on
    each side, besides what the call itself moves."""

    def __init__(self, comm: DistributedComm, workspace: dict | None, write_own=None):
        self.comm, self.workspace, self.write_own = comm, workspace, write_own
        self.rank, self.world = comm.rank, comm.world_size
        self.point_to_point = comm._wire_device.type in _POINT_TO_POINT_WIRES
        self.started = []  # (works, [(received buffer, its place)]): awaited in order, then copied
        self.kept = []  # (tensor, the chunk this rank keeps, its place)
        self.rewritten = []  # (tensor, place): own chunks that went through a call unfilled
        self.dense_results = {}  # tensor -> its result, where its places lie back to back in it

    def receive(self, t, like, cat_dim, shapes):
        """Tensor `t`'s result (`shapes`: the chunk from each source), complete after `finish`,
        and its places per source; on gloo the receives are posted."""
        sizes = [s[cat_dim] if numel(s) else 0 for s in shapes]
        kept = [src for src, n in enumerate(sizes) if n]
        if not kept:  # nothing comes from anyone: the concat of the empty chunks
            return torch.cat([like.new_empty(s) for s in shapes], dim=cat_dim), {}
        shape = chunk_shape(shapes[kept[0]], cat_dim, sum(sizes))
        result = scratch(self.workspace, ("out", t), numel(shape), like.dtype, like.device).view(shape)
        places = dict(zip(kept, result.split([sizes[src] for src in kept], cat_dim)))
        if chunks_back_to_back(result, cat_dim):  # the places, in source order, are the result itself
            self.dense_results[t] = result
        if self.point_to_point:
            for src in kept:
                if src != self.rank:
                    self._receive(t, src, places[src])
        return result, places

    def send(self, t, wire, splits, split_dim, places):
        """Send tensor `t`'s chunks to the peers, then copy the chunk kept into its place."""
        offsets = displacements(splits)
        chunks = [wire.narrow(split_dim, offsets[j], splits[j]) for j in range(self.world)]
        if self.point_to_point:
            for dst in _ring_peers(self.rank, self.world):
                if chunks[dst].numel():  # an empty chunk is not received either (see `kept`)
                    self._start([("send", self._dense(("send", t, dst), chunks[dst]), dst, t)], [])
        elif self._collective(t, wire, splits, split_dim, places):
            if self.write_own is not None and self.rank in places:  # it went through unfilled
                self.rewritten.append((t, places[self.rank]))
            return  # the kept chunk went through the collective
        if self.rank in places:  # copied in `finish`, once every tensor's sends are under way
            self.kept.append((t, chunks[self.rank], places[self.rank]))

    def finish(self):
        """Copy the kept chunks into their places while the wire moves the others, then wait
        for every transfer; a chunk received off its place is copied there on arrival."""
        for t, chunk, place in self.kept:  # one copy, from its source to its place
            if self.write_own is None:
                place.copy_(chunk)
            else:
                self.write_own(t, place)
        for works, copies in self.started:
            for work in works:
                self.comm._call("all_to_all_v", work.wait)
            for buf, place in copies:
                place.copy_(buf)
        for t, place in self.rewritten:  # after the call that put the unfilled chunk there
            self.write_own(t, place)

    def _receive(self, t, src, place):
        if place.is_contiguous():
            self._start([("recv", place, src, t)], [])
        else:  # a strided place (e.g. a head block of every row): received densely, copied on arrival
            buf = scratch(self.workspace, ("recv", t, src), place.numel(), place.dtype, place.device)
            buf = buf.view(place.shape)
            self._start([("recv", buf, src, t)], [(buf, place)])

    def _dense(self, key, chunk):
        """`chunk` as the wire takes it: itself when dense, else packed into a buffer (one copy)."""
        if chunk.is_contiguous():
            return chunk
        return scratch(self.workspace, key, chunk.numel(), chunk.dtype, chunk.device).view(chunk.shape).copy_(chunk)

    def _start(self, ops, copies):
        self.started.append((_start_point_to_point(self.comm, "all_to_all_v", ops), copies))

    def _collective(self, t, wire, splits, split_dim, places) -> bool:
        """One all_to_all_single of tensor `t`; True when the kept chunk went through it.

        The call takes counts but no displacements: its buffers hold the chunks back to back in
        rank order. Where the wire's chunks already lie that way (split along its outermost
        dim), the wire is the send buffer; where the places do (concat along the result's), the
        result is the receive buffer. Then the kept chunk travels through the call as well (a
        copy inside the device) so that side needs no copy at all. Otherwise no bytes go to
        self: the peers' chunks are packed, received back to back, and copied to their places."""
        result = self.dense_results.get(t)
        if result is not None or chunks_back_to_back(wire, split_dim):
            send = pack_chunks(wire, splits, split_dim, self.workspace, ("send", t))  # a view when back to back
            out_counts = [numel(chunk_shape(wire.shape, split_dim, n)) for n in splits]
            in_counts = [places[j].numel() if j in places else 0 for j in range(self.world)]
            if result is not None:
                self._all_to_all_single(result.view(-1), send, in_counts, out_counts, {})
            else:
                recv = scratch(self.workspace, ("recv", t), sum(in_counts), wire.dtype, wire.device)
                self._all_to_all_single(recv, send, in_counts, out_counts, places)
            return True
        send, out_counts, _ = pack_peer_chunks(wire, splits, split_dim, self.rank, self.workspace, ("send", t),
                                               back_to_back=True)
        in_counts = [0 if j == self.rank or j not in places else places[j].numel() for j in range(self.world)]
        recv = scratch(self.workspace, ("recv", t), sum(in_counts), wire.dtype, wire.device)
        self._all_to_all_single(recv, send, in_counts, out_counts, places)
        return False

    def _all_to_all_single(self, recv, send, in_counts, out_counts, places):
        """Start the call; arrivals in `places` are copied there from `recv` once it completes."""
        work = self.comm._call("all_to_all_v", self.comm._dist.all_to_all_single, recv, send,
                               output_split_sizes=in_counts, input_split_sizes=out_counts,
                               group=self.comm.group, async_op=True)
        copies = [(recv.narrow(0, offset, n).view(places[j].shape), places[j])
                  for j, (offset, n) in enumerate(zip(displacements(in_counts), in_counts)) if n and j in places]
        self.started.append(([work], copies))


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
