"""Ulysses sequence-parallel attention: all-to-all from sequence shards to head shards.

The K/V exchange strategies of comfy/multidevice/sp/ that move fewer bytes than the
all-gather when W grows (per rank ~4/W^2 of q,k,v,out instead of 2(W-1)/W of k,v):

- `UlyssesKV` ("ulysses"): every rank holds the q, k, v of its sequence rows for all heads.
  An all-to-all turns that into all sequence rows for a block of heads; each rank attends the
  full sequence for its heads (exact: heads are independent), and a second all-to-all returns
  the output rows to their owners. Uneven sequence shards are exact: the all-to-all carries
  per-rank sizes, nothing is padded.
- The hybrid, when the heads do not divide by W: Ulysses inside groups of U consecutive ranks,
  U = the largest divisor of W that also divides the heads (`ulysses_degree`), and K/V of a head
  block sent to every rank owning that block, i.e. an all-gather across the W/U groups. Query
  rows stay inside the group, so each rank attends |group rows| x H/U: the work stays balanced.
  U = 1 degenerates to exactly the all-gather's traffic; U = W is plain Ulysses.
- Overlap (`overlap_chunks` = C > 1): the local head block is cut into C chunks; chunk c+1's
  exchange runs on a helper thread (and a side stream on NPU/GPU) while chunk c is attended.
  Heads are independent, so the result is the same as without chunks.

Every rank must call with the SP core's shard plan (rank r owns rows [S*r//W, S*(r+1)//W)):
Ulysses returns each rank its rows by that plan, and checks its own shard against it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from comfy.multidevice.comm.layout import scratch
from comfy.multidevice.devices import accelerator_api, set_thread_device
from comfy.multidevice.sp.attention_budget import attend_within_budget
from comfy.multidevice.sp.cost_model import ulysses_degree
from comfy.multidevice.sp.plan import SequenceParallelError, shard_sizes, shard_start

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Layout:
    """Who owns what in one attention call."""

    world: int
    rank: int
    heads: int
    degree: int           # U: ranks per Ulysses group
    chunks: int           # C: head chunks per head block (overlap)

    @property
    def group(self) -> int:
        return self.rank // self.degree

    @property
    def members(self) -> range:
        return range(self.group * self.degree, (self.group + 1) * self.degree)

    def block_of(self, rank: int) -> int:
        return rank % self.degree

    def block_heads(self, block: int) -> range:
        """Heads of head block `block` (uneven blocks never happen: U divides the heads)."""
        return range(shard_start(self.heads, self.degree, block), shard_start(self.heads, self.degree, block + 1))

    def chunk_heads(self, block: int, chunk: int) -> range:
        heads = self.block_heads(block)
        return range(heads.start + shard_start(len(heads), self.chunks, chunk),
                     heads.start + shard_start(len(heads), self.chunks, chunk + 1))


class UlyssesKV:
    """K/V exchange strategy "ulysses" (plain, or the hybrid when the heads don't divide by W)."""

    name = "ulysses"

    def __init__(self, degree: int | None = None, overlap_chunks: int = 1):
        if degree is not None and int(degree) < 1:
            raise ValueError(f"ulysses degree must be >= 1, got {degree}")
        if int(overlap_chunks) < 1:
            raise ValueError(f"overlap_chunks must be >= 1 (1 = no overlap), got {overlap_chunks}")
        self.degree = None if degree is None else int(degree)
        self.overlap_chunks = int(overlap_chunks)
        # per (exchange, head chunk): the buffers every block of a forward reuses
        self.workspaces: dict | None = None

    def begin_forward(self) -> None:
        self.workspaces = {}

    def end_forward(self) -> None:
        self.workspaces = None  # nothing held between forwards

    def _workspace(self, key):
        return None if self.workspaces is None else self.workspaces.setdefault(key, {})

    # -- the strategy interface of comfy/multidevice/sp/
    def attend(self, comm, attention_fn, q, k, v, heads, *args, shard_sizes=None, **kwargs):
        # shard_sizes: every rank's rows, when the caller knows them; then the all-to-alls
        # exchange shapes on a plan's first call only (the rows are checked in _member_rows)
        if kwargs.get("mask") is not None:
            raise SequenceParallelError(
                "sequence-parallel attention got an attention mask; the ulysses exchange only "
                "supports full self-attention (mask=None)")
        heads_first_out = bool(kwargs.pop("skip_output_reshape", False))
        q, k, v = (self._heads_first(t, heads, kwargs.get("skip_reshape", False)) for t in (q, k, v))
        kwargs["skip_reshape"] = True
        layout = self._layout(comm, heads, q)
        out = self._run(comm, layout, attention_fn, q, k, v, shard_sizes, args, kwargs)  # [B, S_r, H, D]
        if heads_first_out:
            return out.permute(0, 2, 1, 3)
        return out.reshape(out.shape[0], out.shape[1], -1)

    # -- pieces
    @staticmethod
    def _heads_first(t, heads, skip_reshape):
        if skip_reshape:  # [B, heads, S, head_dim] (H3's layout)
            if t.shape[1] != heads:
                raise SequenceParallelError(f"q/k/v have {t.shape[1]} heads on dim 1, the call says {heads}")
            return t
        b, s, width = t.shape  # [B, S, heads * head_dim]
        return t.view(b, s, heads, width // heads).transpose(1, 2)

    def _layout(self, comm, heads, q) -> _Layout:
        world = comm.world_size
        degree = self.degree or ulysses_degree(world, heads)
        if world % degree or heads % degree:
            raise SequenceParallelError(
                f"ulysses degree {degree} must divide both the world size {world} and the heads "
                f"{heads}; leave the degree unset to use the largest such divisor")
        chunks = min(self.overlap_chunks, heads // degree)
        return _Layout(world, comm.rank, heads, degree, chunks)

    def _run(self, comm, layout, attention_fn, q, k, v, shard_sizes, args, kwargs):
        lane = _CommLane(comm, layout.chunks > 1)
        try:
            pending = [lane.submit(self._exchange_in, comm, layout, c, q, k, v, shard_sizes)
                       for c in range(min(2, layout.chunks))]
            outs = []
            for c in range(layout.chunks):
                q_c, k_c, v_c = lane.result(pending[c])
                rows = self._member_rows(comm, layout, q.shape[2], q_c, k_c)
                my_heads = q_c.shape[1]
                o = attend_within_budget(comm, attention_fn, q_c, k_c, v_c, my_heads, *args,
                                         **kwargs)  # [B, group rows, h*D]
                o = o.view(o.shape[0], o.shape[1], my_heads, -1)
                outs.append(lane.submit(self._exchange_out, comm, layout, rows, o, c))
                if c + 2 < layout.chunks:  # keep one chunk in flight ahead of the attention
                    pending.append(lane.submit(self._exchange_in, comm, layout, c + 2, q, k, v, shard_sizes))
            chunk_outs = [lane.result(f) for f in outs]
        finally:
            lane.close()
        return self._assemble(layout, chunk_outs)

    def _exchange_in(self, comm, layout, chunk, q, k, v, rows=None):
        """Sequence shards -> (q rows of my group, k/v rows of everyone) for my head chunk.

        Plain Ulysses (U = W) sends q, k and v in one all-to-all; the hybrid sends q to its
        group and k, v to every rank (two). What arrives, source after source, is
        [S, B, n, h, D]: the sequence in order with the n tensors side by side in each row;
        q, k, v are returned as [B, h, S, D] views of it (see `_send_peer_major`).
        `rows`: every rank's rows, when known (then the shapes need not travel every call).
        """
        def heads_first(tensors, to, key) -> list:  # [S, B, n, h, D] -> n views [B, h, S, D]
            got = self._send_peer_major(comm, tensors, layout, chunk, to, rows, key)
            return [got.select(2, i).permute(1, 2, 0, 3) for i in range(len(tensors))]

        everyone = range(layout.world)
        if layout.degree == layout.world:
            return tuple(heads_first((q, k, v), everyone, "qkv"))
        return tuple(heads_first((q,), layout.members, "q") + heads_first((k, v), everyone, "kv"))

    def _send_peer_major(self, comm, tensors, layout, chunk, to, rows, key) -> torch.Tensor:
        """One all-to-all of the n tensors ([B, H, S_r, D] each): rank j in `to` gets its head
        block's chunk `chunk` of them for my rows; returns what this rank got, [S, B, n, h, D].

        When the tensors are views of one fused buffer (e.g. fused qkv rows) and every head block
        goes to one rank, they are sent as one strided view split by head block: the transport
        packs the peers' blocks once and copies this rank's own straight into place. Otherwise
        the peers' blocks are packed here once, peer-major, so the transport sends each chunk
        as it lies, and this rank's own block goes from the tensors straight into its place in
        the result (`write_own`): each element is copied once either way."""
        world = layout.world
        batch, heads, mine, dim = tensors[0].shape
        chunk_heads = layout.chunk_heads(0, chunk)
        first, count = chunk_heads.start, len(chunk_heads)  # the same offset inside every head block
        n, groups = len(tensors), len(to) // layout.degree
        received = None if rows is None else [r if j in to else 0 for j, r in enumerate(rows)]
        workspace = self._workspace((key, chunk))

        def blocks(stacked):  # [B, m, H, S_r, D] -> [B, m, U, h, S_r, D], a view
            return stacked.unflatten(2, (layout.degree, heads // layout.degree)).narrow(3, first, count)

        fused = stacked_view(tensors)
        if fused is not None and groups == 1:
            by_block = blocks(fused).permute(4, 0, 1, 2, 3, 5)  # [S_r, B, n, U, h, D]
            splits = [1 if j in to else 0 for j in range(world)]
            return _all_to_all(comm, [by_block], splits, 3, 0, workspace, received)[0].squeeze(3)
        flat = scratch(self._workspace((key + "-pack", chunk)), "send",
                       groups * layout.degree * mine * batch * n * count * dim, tensors[0].dtype, tensors[0].device)
        packed = flat.view(groups, layout.degree, mine, batch, n, count, dim)

        def peer_major(stacked):  # -> [G, U, S_r, B, m, h, D], a view
            b = blocks(stacked)
            return b.unsqueeze(0).expand(groups, *b.shape).permute(0, 3, 5, 1, 2, 4, 6)

        sources = [fused] if fused is not None else [t.unsqueeze(1) for t in tensors]
        own = sorted(to).index(comm.rank)  # this rank's chunk: the own-th of the packed ones
        own_group, own_block = divmod(own, layout.degree)
        for i, src in enumerate(sources):
            dst, by_peer = packed.narrow(4, i, src.shape[1]), peer_major(src)
            for g in range(groups):  # every block but the own one, in at most two runs a group
                skip = own_block if g == own_group else layout.degree
                for start, end in ((0, skip), (skip + 1, layout.degree)):
                    if end > start:
                        dst[g, start:end].copy_(by_peer[g, start:end])

        def write_own(_, place):  # place: [S_r, B, n, h, D]
            for i, src in enumerate(sources):
                place.narrow(2, i, src.shape[1]).copy_(blocks(src)[:, :, own_block].permute(3, 0, 1, 2, 4))

        send = flat.view(groups * layout.degree * mine, batch, n, count, dim)
        splits = [mine if j in to else 0 for j in range(world)]
        return _all_to_all(comm, [send], splits, 0, 0, workspace, received, write_own)[0]

    @staticmethod
    def _member_rows(comm, layout, local_rows, q_c, k_c) -> list[int]:
        """Rows of every rank under the SP shard plan; checks this rank's and its group's."""
        total = k_c.shape[2]
        rows = shard_sizes(total, layout.world)
        mine = [rows[m] for m in layout.members]
        if local_rows != rows[comm.rank] or q_c.shape[2] != sum(mine):
            raise SequenceParallelError(
                f"rank {comm.rank}: its group's query rows ({q_c.shape[2]}) do not follow the shard "
                f"plan [S*r//W, S*(r+1)//W) for S={total}, W={layout.world} ({mine}); ulysses needs "
                "the SP core's shard plan")
        return rows

    def _exchange_out(self, comm, layout, rows, o, chunk):
        """Attention output (group rows x my head chunk) -> my rows x the group's head chunks.

        Sent row-major, [rows, B, h, D] (the attention's own output for B = 1): every member's
        rows lie back to back, so nothing is packed; unpacking puts the heads side by side,
        one copy."""
        to_member = [rows[j] if j in layout.members else 0 for j in range(layout.world)]
        from_member = [len(layout.chunk_heads(layout.block_of(j), chunk)) if j in layout.members else 0
                       for j in range(layout.world)]  # the heads each member sends me
        mine = _all_to_all(comm, [o.transpose(0, 1)], to_member, 0, 2,
                           self._workspace(("out", chunk)), from_member)[0]  # [S_r, B, heads, D]
        return mine.transpose(0, 1)  # [B, S_r, group chunk heads, D]

    @staticmethod
    def _assemble(layout, chunk_outs) -> torch.Tensor:
        """[B, S_r, H, D] in head order from the per-chunk outputs (member-major inside a chunk)."""
        if len(chunk_outs) == 1:
            return chunk_outs[0]
        pieces = []
        for member in range(layout.degree):
            for c, out in enumerate(chunk_outs):
                sizes = [len(layout.chunk_heads(b, c)) for b in range(layout.degree)]
                pieces.append(out.narrow(2, sum(sizes[:member]), sizes[member]))
        return torch.cat(pieces, dim=2)


def stacked_view(tensors) -> torch.Tensor | None:
    """[B, n, H, S, D]: the n tensors ([B, H, S, D] each) as one view when they lie in one
    buffer at equal spacing (e.g. views of fused qkv rows); None otherwise. The view reads
    exactly the elements the tensors do."""
    first = tensors[0]
    if any(t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
           or t.device != first.device or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for t in tensors):
        return None
    offsets = [t.storage_offset() for t in tensors]
    step = offsets[1] - offsets[0] if len(tensors) > 1 else 0
    if len(tensors) > 1 and (step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:]))):
        return None
    b, h, s, d = first.shape
    sb, sh, ss, sd = first.stride()
    return first.as_strided((b, len(tensors), h, s, d), (sb, step, sh, ss, sd), offsets[0])


def _all_to_all(comm, tensors, splits, split_dim, cat_dim, workspace, recv_splits=None, write_own=None):
    # any Communicator (comm/protocol.py takes all three; None: no workspace, plan or own-chunk writer)
    return comm.all_to_all_v(tensors, splits, split_dim, cat_dim=cat_dim, workspace=workspace,
                             recv_splits=recv_splits, write_own=write_own)


class _CommLane:
    """Where a rank's all-to-alls run: inline, or on one helper thread so they overlap the
    attention. One thread and FIFO order keep the collective sequence identical on every rank.
    On NPU/GPU the helper thread works on a side stream; events order it against the caller's
    stream and record_stream keeps the allocator from reusing memory still in use."""

    def __init__(self, comm, overlap: bool):
        self.comm = comm
        self.device = comm.device
        self.executor = None
        self.stream = None
        if overlap:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"sp-rank-{comm.rank}-exchange")
            api = accelerator_api(self.device.type)
            if api is not None:
                self.stream = api.Stream(self.device)
                self.api = api

    def submit(self, fn, *args):
        if self.executor is None:
            return fn(*args)  # inline; "result" of a plain value is the value
        ready = None
        if self.stream is not None:
            ready = self.api.current_stream(self.device).record_event()
            for t in args:
                if torch.is_tensor(t):
                    t.record_stream(self.stream)

        def job():
            _bind_thread_device(self.device)
            if self.stream is None:
                return fn(*args), None
            with self.api.stream(self.stream):
                self.stream.wait_event(ready)
                result = fn(*args)
                return result, self.stream.record_event()
        return self.executor.submit(job)

    def result(self, pending):
        if self.executor is None:
            return pending
        result, done = pending.result()
        if done is not None:
            main = self.api.current_stream(self.device)
            main.wait_event(done)
            for t in (result if isinstance(result, tuple) else (result,)):
                t.record_stream(main)
        return result

    def close(self):
        if self.executor is not None:
            # wait=True: no collective of this rank may still run when the next one starts
            self.executor.shutdown(wait=True, cancel_futures=True)


_bound = threading.local()


def _bind_thread_device(device: torch.device) -> None:
    if getattr(_bound, "device", None) != device:
        set_thread_device(device)
        _bound.device = device
