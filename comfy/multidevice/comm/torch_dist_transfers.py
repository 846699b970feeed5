"""How DistributedComm's exchange and all_to_all_v move their bytes: point to point on gloo, collectives on nccl/hccl.

Every function takes the communicator (`comm`: comm/torch_dist.py's DistributedComm) and uses
its rank, group and wire device, and its `call`, which turns a library error into a
CollectiveError. Transfers are started here; the caller awaits the works.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comfy.multidevice.comm.layout import (chunk_shape, chunks_back_to_back, displacements, numel, pack_chunks,
                                           pack_peer_chunks, scratch)

# Wire devices whose all-gather and all-to-all go point to point (gloo's host memory); the
# others take all_gather_into_tensor / all_to_all_single (tests run those over gloo by
# emptying this).
POINT_TO_POINT_WIRES = ("cpu",)


def goes_point_to_point(wire_device: torch.device) -> bool:
    return wire_device.type in POINT_TO_POINT_WIRES


@dataclass(frozen=True)
class Gather:
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


def _start_point_to_point(comm, what: str, ops) -> list:
    """Start point-to-point `ops` (kind "send"/"recv", dense tensor, group rank of the peer,
    tag) of collective `what`; their works. The tag is the tensor's index in the call: the
    same on both ends of a transfer, and unique per pair and direction in one call."""
    if not ops:
        return []
    dist = comm.dist
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, comm.global_rank(peer),
                      group=comm.group, tag=_TAG_BASE[what] + tag) for kind, tensor, peer, tag in ops]
    return list(comm.call(what, dist.batch_isend_irecv, p2p))


def gather_point_to_point(comm, gathers) -> list[list]:
    """The all-gather of an exchange on gloo: every peer's part received straight into its
    place, this rank's shard copied once into its own place (sequence-major) and sent from there.
    One copy per tensor, as a packed send buffer would cost, but no second copy of the
    own part by the collective, and gloo's point to point moves big messages several
    times faster than its all_gather (bench/bench_exchange.py). Receives are posted first,
    so a peer's send never waits for this rank to be ready."""
    works = [_start_point_to_point(comm, "exchange", [("recv", g.part(src), src, tag)
                                                      for src in range(comm.world_size)
                                                      if src != comm.rank and g.counts[src]])
             for tag, g in enumerate(gathers)]
    peers = _ring_peers(comm.rank, comm.world_size)
    for tag, g in enumerate(gathers):
        if not g.counts[comm.rank]:
            continue  # every rank skips the same empty shards
        moved = g.tensor.movedim(g.dim, 0)
        own = g.part(comm.rank).view(moved.shape).copy_(moved)
        works[tag] += _start_point_to_point(comm, "exchange", [("send", own, dst, tag) for dst in peers])
    return works


def issue_all_gather(comm, send: torch.Tensor, flat: torch.Tensor, counts, displs) -> list:
    """nccl/hccl: start gathering every rank's dense `send` into the flat buffer `flat`; the works."""
    if len(set(counts)) == 1:
        return [comm.call("exchange", comm.all_gather_equal, flat, send.view(-1),
                          group=comm.group, async_op=True)]
    flat.narrow(0, displs[comm.rank], counts[comm.rank]).copy_(send.view(-1))
    works = []
    for root, (count, displ) in enumerate(zip(counts, displs)):
        if count:  # every rank skips the same empty shards
            works.append(comm.call("exchange", comm.dist.broadcast, flat.narrow(0, displ, count),
                                   src=comm.global_rank(root), group=comm.group, async_op=True))
    return works


class AllToAllTransfers:
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

    def __init__(self, comm, workspace: dict | None, write_own=None):
        self.comm, self.workspace, self.write_own = comm, workspace, write_own
        self.rank, self.world = comm.rank, comm.world_size
        self.point_to_point = goes_point_to_point(comm.wire_device)
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
        chunks = wire.split(list(splits), split_dim)
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
                self.comm.call("all_to_all_v", work.wait)
            for buf, place in copies:
                place.copy_(buf)
        for t, place in self.rewritten:  # after the call that put the unfilled chunk there
            self.write_own(t, place)

    def _receive(self, t, src, place):
        # a strided place (e.g. a head block of every row): received densely, copied on arrival
        buf = place if place.is_contiguous() else scratch(
            self.workspace, ("recv", t, src), place.numel(), place.dtype, place.device).view(place.shape)
        self._start([("recv", buf, src, t)], [] if buf is place else [(buf, place)])

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
        through = result is not None or chunks_back_to_back(wire, split_dim)  # the kept chunk goes through
        if through:
            send = pack_chunks(wire, splits, split_dim, self.workspace, ("send", t))  # a view when back to back
            out_counts = [numel(chunk_shape(wire.shape, split_dim, n)) for n in splits]
        else:
            send, out_counts, _ = pack_peer_chunks(wire, splits, split_dim, self.rank, self.workspace,
                                                   ("send", t), back_to_back=True)
        in_counts = [places[j].numel() if j in places and (through or j != self.rank) else 0
                     for j in range(self.world)]
        if result is not None:  # arrivals land in their places: nothing to copy after
            self._all_to_all_single(result.view(-1), send, in_counts, out_counts, {})
        else:
            recv = scratch(self.workspace, ("recv", t), sum(in_counts), wire.dtype, wire.device)
            self._all_to_all_single(recv, send, in_counts, out_counts, places)
        return through

    def _all_to_all_single(self, recv, send, in_counts, out_counts, places):
        """Start the call; arrivals in `places` are copied there from `recv` once it completes."""
        work = self.comm.call("all_to_all_v", self.comm.dist.all_to_all_single, recv, send,
                              output_split_sizes=in_counts, input_split_sizes=out_counts,
                              group=self.comm.group, async_op=True)
        copies = [(recv.narrow(0, offset, n).view(places[j].shape), places[j])
                  for j, (offset, n) in enumerate(zip(displacements(in_counts), in_counts)) if n and j in places]
        self.started.append(([work], copies))
