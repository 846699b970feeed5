"""The peer-copy backend: shared slots, a barrier, each shard copied once into the output.

Works on every device kind (CPU included) and is the fallback of `auto`. Peer access between
the cards is enabled at its start, serially (comm/peer_access.py). Copies to an NPU are not
asked to be non-blocking: torch_npu's cross-card copy synchronizes both cards' streams anyway
(copy_d2d), so the flag would only pretend.
"""

from __future__ import annotations

import logging

import torch

from comfy.multidevice.comm.layout import chunk_shape, concat_received, gathered_shape, numel, scratch
from comfy.multidevice.comm.peer_access import enable_peer_access

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- backends

def copies_may_overlap(device: torch.device) -> bool:
    """The non_blocking flag of a copy into `device`: False on an NPU, where it does nothing."""
    return device.type != "npu"


def _on_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Skipping .to() for same-device tensors saves Python overhead, which all rank
    # threads pay serially under the GIL.
    return tensor if tensor.device == device else tensor.to(device, non_blocking=copies_may_overlap(device))


class PeerCopyBackend:
    """Shared slots + barrier + copy to the local device + cat. Works on any device kind.

    Slots are double-buffered by collective parity: a rank can only start collective n+2
    after every rank has passed the barrier of n+1, i.e. after everyone finished reading n.
    """

    name = "peer"
    # capabilities (comm/protocol.py `Backend`)
    reads_peer_memory = True
    one_collective_per_device = False  # plain tensor copies: a second coordinator may run beside it
    has_all_to_all_v = True
    prepares_all_to_all_v = False

    def __init__(self, coordinator):
        self.coordinator = coordinator
        enable_peer_access(coordinator.devices)  # before any rank thread copies

    def prepare_all_gather_v(self, rank, tensors, dims, metas, workspace=None):
        return None  # nothing to allocate before the ranks meet: each rank reads the others'

    def all_gather_v(self, rank, tensors, dims, metas, slot, prepared=None, workspace=None):
        device = self.coordinator.devices[rank]
        out = []
        overlap = copies_may_overlap(device)
        for i, dim in enumerate(dims):
            shape = gathered_shape([m[i] for m in metas], dim)
            # Sequence-major, like the library backends: each shard's rows are copied once,
            # straight into their place (a row copy where a cat along an inner dim, e.g. H3's
            # [1, H, S, D], would transpose; and no .to(device) before it on another device).
            # narrow, not split: a rank may run in grad mode on a buffer made without it, and
            # torch refuses in-place writes to one of several views made at once there
            full = scratch(workspace, ("recv", i), numel(shape), slot[0][i].dtype, device).view(
                shape[dim], *(n for d, n in enumerate(shape) if d != dim))
            offset = 0
            for shards in slot:
                shard = shards[i]
                full.narrow(0, offset, shard.shape[dim]).copy_(shard.movedim(dim, 0), non_blocking=overlap)
                offset += shard.shape[dim]
            out.append(full.movedim(0, dim))
        return out

    def all_to_all_v(self, rank, tensors, metas, splits, split_dim, cat_dim, slot, workspace=None,
                     write_own=None):
        device = self.coordinator.devices[rank]
        sizes = [s[rank] for s in splits]
        out = []
        for t in range(len(tensors)):
            chunks = [src_tensors[t].narrow(split_dim, sum(splits[src][:rank]), sizes[src])
                      for src, src_tensors in enumerate(slot)]
            if write_own is None or not sizes[rank]:
                out.append(concat_received([_on_device(c, device) for c in chunks], sizes, cat_dim))
                continue
            # each chunk copied once into its place; the own one written by the caller, since
            # the sent tensor's own chunk was never filled
            kept = [src for src, n in enumerate(sizes) if n]
            lengths = [chunks[src].shape[cat_dim] for src in kept]
            shape = chunk_shape(chunks[rank].shape, cat_dim, sum(lengths))
            result = scratch(workspace, ("out", t), numel(shape), chunks[rank].dtype, device).view(shape)
            for src, place in zip(kept, result.split(lengths, cat_dim)):
                if src == rank:
                    write_own(t, place)
                else:
                    place.copy_(chunks[src], non_blocking=copies_may_overlap(device))
            out.append(result)
        return out

    def all_reduce(self, rank, tensor, op, slot):
        device = self.coordinator.devices[rank]
        # Same order of operands on every rank, so every rank gets bit-identical results.
        acc = slot[0].to(device, copy=True)
        for r in range(1, self.coordinator.world_size):
            other = _on_device(slot[r], device)
            if op == "sum":
                acc.add_(other)
            else:
                torch.maximum(acc, other, out=acc)
        return acc

    def close(self):
        pass
