"""NCCL through ctypes: the NVIDIA backend of the multi-device coordinator.

One NCCL communicator per rank GPU from `ncclCommInitAll` (single process, many GPUs).
Every rank thread issues its own calls concurrently on its GPU's current CUDA stream;
the results are synchronized before use (comfy/multidevice/comm/ctypes_lib.py does that part for
HCCL and NCCL alike).

NCCL has no all-gather-V. The exchange is therefore one NCCL group
(`ncclGroupStart` ... `ncclGroupEnd`) holding one `ncclBroadcast` per root rank, each
writing that root's shard into its slice of one flat receive buffer. Inside a group NCCL
only records the calls and launches them together at `ncclGroupEnd`, so the W
broadcasts of a rank cannot block each other. When every shard has the same length
the exchange is a single `ncclAllGather` instead.

All-to-all-V is one group of `ncclSend` / `ncclRecv` per peer (NCCL >= 2.7; without them
the coordinator all-gathers the packed send buffers instead); the rank's own chunk is a
local copy.

A collective stuck in NCCL (a peer that never comes, a failed link) is ended by
`ncclCommAbort`, with `ncclCommGetAsyncError` polled meanwhile: comm/abort.py.

Peer access: one process drives every GPU, so NCCL would read the peers' buffers directly;
ComfyUI's default allocator (`PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync`) makes memory
from stream-ordered pools, which `cudaDeviceEnablePeerAccess` does not open to peers (that
needs `cudaMemPoolSetAccess`, which PyTorch grants only for a pair it has copied between).
So `NCCL_P2P_DIRECT_DISABLE=1` is set before `ncclCommInitAll` unless the user set it
(logged once, with which value and why).

Library: `NCCL_SO_PATH`, else `libnccl.so.2` from the loader path (the CUDA builds of
torch ship it).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from ctypes import byref, c_char_p, c_int, c_size_t, c_void_p, POINTER

import torch

from comfy.multidevice.comm.abort import WatchedCommunicators
from comfy.multidevice.comm.ctypes_lib import (CFunction, CollectiveLibrary, CollectiveLibraryError,
                                               CommunicatorBackend)

log = logging.getLogger(__name__)

NCCL_PATH_ENV = "NCCL_SO_PATH"
NCCL_DEFAULT_LIBRARY = "libnccl.so.2"
# NCCL reads it when it initializes: "1" makes it not access other GPUs' user buffers directly.
P2P_DIRECT_ENV = "NCCL_P2P_DIRECT_DISABLE"
_p2p_policy_logged = False

ncclResult_t = c_int
ncclComm_t = c_void_p
ncclDataType_t = c_int
ncclRedOp_t = c_int
cudaStream_t = c_void_p
buffer = c_void_p

# Values of ncclResult_t (nccl.h); ncclTimeout exists from NCCL 2.23 on.
NCCL_RESULTS = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
    8: "ncclTimeout",
}
NCCL_SUCCESS = 0
NCCL_IN_PROGRESS = 7

# Values of ncclDataType_t (nccl.h).
NCCL_DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}

# Values of ncclRedOp_t (nccl.h).
NCCL_REDUCE_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

NCCL_FUNCTIONS = (
    CFunction("ncclGetErrorString", c_char_p, (ncclResult_t,)),
    # ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist)
    CFunction("ncclCommInitAll", ncclResult_t, (POINTER(ncclComm_t), c_int, POINTER(c_int))),
    CFunction("ncclCommDestroy", ncclResult_t, (ncclComm_t,)),
    CFunction("ncclGroupStart", ncclResult_t, ()),
    CFunction("ncclGroupEnd", ncclResult_t, ()),
    # ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
    CFunction("ncclBroadcast", ncclResult_t,
              (buffer, buffer, c_size_t, ncclDataType_t, c_int, ncclComm_t, cudaStream_t)),
    # ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
    CFunction("ncclAllGather", ncclResult_t,
              (buffer, buffer, c_size_t, ncclDataType_t, ncclComm_t, cudaStream_t)),
    # ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
    CFunction("ncclAllReduce", ncclResult_t,
              (buffer, buffer, c_size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t)),
    # ncclSend(sendbuff, count, datatype, peer, comm, stream) / ncclRecv(recvbuff, count,
    # datatype, peer, comm, stream): NCCL >= 2.7, used for all-to-all-V.
    CFunction("ncclSend", ncclResult_t,
              (buffer, c_size_t, ncclDataType_t, c_int, ncclComm_t, cudaStream_t), optional=True),
    CFunction("ncclRecv", ncclResult_t,
              (buffer, c_size_t, ncclDataType_t, c_int, ncclComm_t, cudaStream_t), optional=True),
    # ncclCommAbort(comm): frees the communicator without waiting for its pending work and stops
    # its kernels, even while a peer never comes: the only way to get a card back from a stuck
    # collective (destroy would wait for it). ncclCommGetAsyncError(comm, *asyncError): a
    # failure NCCL saw while a kernel waits (a peer or a link gone), safe to poll from another
    # thread. Both NCCL >= 2.4; without them a stuck communicator is left open.
    CFunction("ncclCommAbort", ncclResult_t, (ncclComm_t,), optional=True),
    CFunction("ncclCommGetAsyncError", ncclResult_t, (ncclComm_t, POINTER(ncclResult_t)), optional=True),
)


class NcclError(CollectiveLibraryError):
    result_type = "ncclResult_t"
    result_names = NCCL_RESULTS


class NcclLibrary(CollectiveLibrary):
    """The bound library: one thin Python method per C function used."""

    what = "NCCL"
    table = NCCL_FUNCTIONS
    path_env = NCCL_PATH_ENV
    default_path = NCCL_DEFAULT_LIBRARY
    error_string = "ncclGetErrorString"
    error_class = NcclError
    success = NCCL_SUCCESS
    dtypes = NCCL_DTYPES
    reduce_ops = NCCL_REDUCE_OPS

    def comm_init_all(self, device_ids: list[int]) -> list[int]:
        apply_p2p_direct_policy()  # before the init: NCCL reads its peer-access settings there
        n = len(device_ids)
        comms = (ncclComm_t * n)()
        self.call("ncclCommInitAll", comms, n, (c_int * n)(*device_ids))
        return list(comms)

    def comm_destroy(self, comm) -> None:
        self.call("ncclCommDestroy", comm)

    def group_start(self) -> None:
        self.call("ncclGroupStart")

    def group_end(self) -> None:
        self.call("ncclGroupEnd")

    @contextmanager
    def group(self):
        """The calls of the block in one NCCL group; on an error the group is still closed, so
        this thread's NCCL state is clean, and the first error wins."""
        self.group_start()
        try:
            yield
        except BaseException:
            self.functions["ncclGroupEnd"]()
            raise
        self.group_end()

    def broadcast(self, send, recv, count, dtype, root, comm, stream) -> None:
        self.call("ncclBroadcast", send, recv, count, dtype, root, comm, stream)

    def all_gather(self, send, recv, count, dtype, comm, stream) -> None:
        self.call("ncclAllGather", send, recv, count, dtype, comm, stream)

    def all_reduce(self, send, recv, count, dtype, op, comm, stream) -> None:
        self.call("ncclAllReduce", send, recv, count, dtype, op, comm, stream)

    @property
    def has_send_recv(self) -> bool:
        return self.has("ncclSend") and self.has("ncclRecv")

    def send(self, buf, count, dtype, peer, comm, stream) -> None:
        self.call("ncclSend", buf, count, dtype, peer, comm, stream)

    def recv(self, buf, count, dtype, peer, comm, stream) -> None:
        self.call("ncclRecv", buf, count, dtype, peer, comm, stream)

    @property
    def can_abort(self) -> bool:
        return self.has("ncclCommAbort")

    def comm_abort(self, comm) -> None:
        self.call("ncclCommAbort", comm)

    def async_error(self, comm) -> NcclError | None:
        """The error NCCL saw on `comm` while its work ran (ncclCommGetAsyncError), else None
        (also when the library is too old to say)."""
        if not self.has("ncclCommGetAsyncError"):
            return None
        code = ncclResult_t(NCCL_SUCCESS)
        self.call("ncclCommGetAsyncError", comm, byref(code))
        if code.value in (NCCL_SUCCESS, NCCL_IN_PROGRESS):  # in progress: a non-blocking call runs
            return None
        return self.error("ncclCommGetAsyncError", code.value)


def apply_p2p_direct_policy() -> str:
    """Set NCCL_P2P_DIRECT_DISABLE=1 unless the user set it; the value in effect. Called before
    ncclCommInitAll (NCCL reads it once, at its first initialization in the process)."""
    global _p2p_policy_logged
    user_value = os.environ.get(P2P_DIRECT_ENV)
    if user_value is None:
        os.environ[P2P_DIRECT_ENV] = "1"
        why = ("set by the multi-device backend: the ranks' memory may come from cudaMallocAsync "
               "pools that peers cannot read directly; set it to 0 yourself to let NCCL read peers' "
               "buffers directly")
    else:
        why = "kept as the user set it"
    if not _p2p_policy_logged:
        _p2p_policy_logged = True
        log.info("NCCL in one process over several GPUs: %s=%s (%s)", P2P_DIRECT_ENV,
                 os.environ[P2P_DIRECT_ENV], why)
    return os.environ[P2P_DIRECT_ENV]


class NcclBackend(WatchedCommunicators, CommunicatorBackend):
    name = "nccl"
    device_kind = "cuda"
    hardware = "NVIDIA GPUs"
    library_class = NcclLibrary

    def _all_gather_v_flat(self, rank, send, recv, counts, displs, stream):
        self._entering_library(rank)
        nccl, dtype, comm = self.library, self.library.dtype(send.dtype), self.comms[rank]
        if len(set(counts)) == 1:  # every rank knows all counts, so all take the same branch
            nccl.all_gather(send.data_ptr(), recv.data_ptr(), counts[rank], dtype, comm, stream)
            return None
        itemsize = recv.element_size()
        with nccl.group():
            for root, (count, displ) in enumerate(zip(counts, displs)):
                if not count:  # skipped on every rank alike
                    continue
                slot = recv.data_ptr() + displ * itemsize
                # The root sends its shard; the others only receive (sendbuff unused there).
                source = send.data_ptr() if root == rank else slot
                nccl.broadcast(source, slot, count, dtype, root, comm, stream)
        return None

    @property
    def has_all_to_all_v(self) -> bool:
        return self.library.has_send_recv

    def _all_to_all_v_flat(self, rank, send, recv, send_counts, send_displs, recv_counts,
                           recv_displs, stream):
        self._entering_library(rank)
        recv.narrow(0, recv_displs[rank], recv_counts[rank]).copy_(
            send.narrow(0, send_displs[rank], send_counts[rank]))
        nccl, dtype, comm = self.library, self.library.dtype(send.dtype), self.comms[rank]
        itemsize = send.element_size()
        with nccl.group():
            peers = [p for p in range(len(send_counts)) if p != rank]
            if not any(send_counts[p] or recv_counts[p] for p in peers):
                # Nothing to move (e.g. a rank with no rows in a gather to rank 0): a zero-size
                # pair to itself keeps the group non-empty, a no-op for NCCL, and lets the
                # test library (which meets every rank at each group end) see this rank.
                nccl.send(send.data_ptr(), 0, dtype, rank, comm, stream)
                nccl.recv(recv.data_ptr(), 0, dtype, rank, comm, stream)
            for peer in peers:  # zero counts are skipped on both sides alike (the peer knows ours)
                if send_counts[peer]:
                    nccl.send(send.data_ptr() + send_displs[peer] * itemsize, send_counts[peer],
                              dtype, peer, comm, stream)
                if recv_counts[peer]:
                    nccl.recv(recv.data_ptr() + recv_displs[peer] * itemsize, recv_counts[peer],
                              dtype, peer, comm, stream)
        return None
