"""CompressedComm: any Communicator whose exchanges carry int8 / fp8 byte records (compression.py).

It wraps one rank's Communicator (RankComm or DistributedComm, any backend) and codes every
tensor of `exchange` and `all_to_all_v` along its last dim into uint8 records before the call
and back to the tensor's dtype after, so the backends move bytes and know nothing of the
format (NCCL/HCCL get a byte dtype; the fakes carry the records). The last dim is never the
exchange's cat or split dim (the head dim in every SP exchange). `all_reduce` and `barrier`
pass through unchanged. With one rank nothing is exchanged and nothing is coded.

Every value that crosses the seam is rounded once, this rank's own rows included, so every
rank attends to the same rounded K/V. The `exact` precision never makes one of these.
"""

from __future__ import annotations

from comfy.multidevice.comm.checks import all_to_all_arguments
from comfy.multidevice.comm.compression import check_precision, dequantize, EXACT, quantize
from comfy.multidevice.comm.layout import normalize_dims


class CompressedComm:
    """One rank's Communicator with compressed exchanges; see the module docstring."""

    def __init__(self, comm, precision: str):
        precision = check_precision(precision)
        if precision == EXACT:
            raise ValueError("CompressedComm codes int8 or fp8; the exact exchange uses the communicator itself")
        self.inner, self.precision = comm, precision
        self.rank, self.world_size, self.device = comm.rank, comm.world_size, comm.device

    def _code(self, tensors, dims):
        for t, d in zip(tensors, dims):
            if d == t.dim() - 1:
                raise ValueError(f"a compressed exchange codes the last dim; it cannot also split or "
                                 f"concatenate along it (dim {d} of {tuple(t.shape)})")
        return [quantize(t, self.precision) for t in tensors]

    def _decode(self, records, like):
        return [dequantize(r, self.precision, t.dtype, t.shape[-1]) for r, t in zip(records, like)]

    def exchange(self, tensors, cat_dims, shard_sizes=None, workspace=None):
        tensors = list(tensors)
        if self.world_size == 1:
            return self.inner.exchange(tensors, cat_dims, shard_sizes=shard_sizes, workspace=workspace)
        dims = normalize_dims(tensors, cat_dims)
        got = self.inner.exchange(self._code(tensors, dims), dims, shard_sizes=shard_sizes, workspace=workspace)
        return self._decode(got, tensors)

    def all_to_all_v(self, tensors, send_splits, split_dim, cat_dim=None, workspace=None, recv_splits=None,
                     write_own=None):
        if self.world_size == 1:
            return self.inner.all_to_all_v(tensors, send_splits, split_dim, cat_dim=cat_dim, workspace=workspace,
                                           recv_splits=recv_splits, write_own=write_own)
        single, tensors, split, cat, _ = all_to_all_arguments(tensors, send_splits, split_dim, cat_dim,
                                                              self.world_size)
        records = self._code(tensors, [split] * len(tensors))
        if cat == tensors[0].dim() - 1:
            raise ValueError(f"a compressed exchange cannot concatenate along the last dim ({cat})")
        coded_own = None
        if write_own is not None:
            # the caller writes its own chunk straight into the result: here into a plain
            # tensor first, then coded into the record the transport put in its place
            def coded_own(t, place):
                plain = place.new_empty((*place.shape[:-1], tensors[t].shape[-1]), dtype=tensors[t].dtype)
                write_own(t, plain)
                place.copy_(quantize(plain, self.precision))
        got = self.inner.all_to_all_v(records, send_splits, split, cat_dim=cat, workspace=workspace,
                                      recv_splits=recv_splits, write_own=coded_own)
        out = self._decode(got, tensors)
        return out[0] if single else out

    def all_reduce(self, tensor, op="sum"):
        return self.inner.all_reduce(tensor, op)

    def barrier(self):
        self.inner.barrier()

    def byte_counts(self) -> dict:
        return self.inner.byte_counts()

    def __repr__(self):
        return f"CompressedComm({self.precision}, {self.inner!r})"
