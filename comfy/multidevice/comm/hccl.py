"""HCCL through ctypes: the Ascend backend of the multi-device coordinator.

One HCCL communicator per rank device from `HcclCommInitAll` (single process, many
devices). Every rank thread issues its own call concurrently on its device's current
stream; the results are synchronized before use. Equal shards go through `HcclAllGather`;
uneven ones through `HcclAllGatherV`, which is optional in older CANN releases and not
supported on the Atlas training series (910A and its kin, told by the chip name): without it
the exchange is one `HcclBroadcast` per root into the same flat buffer, exact but slower
(logged once).

Library: `HCCL_SO_PATH`, else `libhccl.so` from the loader path (CANN's set_env.sh).
"""

from __future__ import annotations

import ctypes
import logging
from ctypes import c_char_p, c_int, c_int32, c_uint32, c_uint64, c_void_p, POINTER

import torch

from comfy.multidevice.comm.ctypes_lib import (CFunction, CollectiveLibrary, CollectiveLibraryError,
                                               CommunicatorBackend)
from comfy.multidevice.comm.settings import BACKEND_ENV
from comfy.multidevice.devices import chip_name

log = logging.getLogger(__name__)

HCCL_PATH_ENV = "HCCL_SO_PATH"
HCCL_DEFAULT_LIBRARY = "libhccl.so"

HcclResult = c_int
HcclComm = c_void_p
HcclDataType = c_int
HcclReduceOp = c_int
aclrtStream = c_void_p
buffer = c_void_p

HCCL_SUCCESS = 0

# Values of CANN's HcclDataType (hccl_types.h).
HCCL_DTYPES = {
    torch.int8: 0,
    torch.int16: 1,
    torch.int32: 2,
    torch.float16: 3,
    torch.float32: 4,
    torch.int64: 5,
    torch.uint8: 7,
    torch.float64: 10,
    torch.bfloat16: 11,
}

# Values of CANN's HcclReduceOp.
HCCL_REDUCE_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3}

HCCL_FUNCTIONS = (
    CFunction("HcclGetErrorString", c_char_p, (HcclResult,)),
    # HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms)
    CFunction("HcclCommInitAll", HcclResult, (c_uint32, POINTER(c_int32), POINTER(HcclComm))),
    CFunction("HcclCommDestroy", HcclResult, (HcclComm,)),
    # HcclAllGatherV(sendBuf, sendCount, recvBuf, recvCounts[u64 host], recvDispls[u64 host],
    #                dataType, comm, stream)
    CFunction("HcclAllGatherV", HcclResult,
              (buffer, c_uint64, buffer, c_void_p, c_void_p, HcclDataType, HcclComm, aclrtStream),
              optional=True),
    # HcclAlltoAllV(sendBuf, sendCounts[u64 host], sdispls[u64 host], sendType,
    #               recvBuf, recvCounts[u64 host], rdispls[u64 host], recvType, comm, stream)
    # (hccl.h; counts and displacements in elements). Optional: without it the coordinator
    # all-gathers the packed send buffers instead.
    CFunction("HcclAlltoAllV", HcclResult,
              (buffer, c_void_p, c_void_p, HcclDataType, buffer, c_void_p, c_void_p, HcclDataType,
               HcclComm, aclrtStream),
              optional=True),
    # HcclAllGather(sendBuf, recvBuf, sendCount, dataType, comm, stream)
    CFunction("HcclAllGather", HcclResult,
              (buffer, buffer, c_uint64, HcclDataType, HcclComm, aclrtStream)),
    # HcclAllReduce(sendBuf, recvBuf, count, dataType, op, comm, stream)
    CFunction("HcclAllReduce", HcclResult,
              (buffer, buffer, c_uint64, HcclDataType, HcclReduceOp, HcclComm, aclrtStream)),
    # HcclBroadcast(buf, count, dataType, root, comm, stream)
    CFunction("HcclBroadcast", HcclResult,
              (buffer, c_uint64, HcclDataType, c_uint32, HcclComm, aclrtStream)),
)


class HcclError(CollectiveLibraryError):
    result_type = "HcclResult"


class HcclLibrary(CollectiveLibrary):
    """The bound library: one thin Python method per C function used."""

    what = "HCCL"
    table = HCCL_FUNCTIONS
    path_env = HCCL_PATH_ENV
    default_path = HCCL_DEFAULT_LIBRARY
    error_string = "HcclGetErrorString"
    error_class = HcclError
    success = HCCL_SUCCESS
    dtypes = HCCL_DTYPES
    reduce_ops = HCCL_REDUCE_OPS

    @property
    def has_all_gather_v(self) -> bool:
        return self.has("HcclAllGatherV")

    def comm_init_all(self, device_ids: list[int]) -> list[int]:
        n = len(device_ids)
        comms = (HcclComm * n)()
        self.call("HcclCommInitAll", n, (c_int32 * n)(*device_ids), comms)
        return list(comms)

    def comm_destroy(self, comm) -> None:
        self.call("HcclCommDestroy", comm)

    def all_gather_v(self, send, send_count, recv, counts, displs, dtype, comm, stream) -> None:
        self.call("HcclAllGatherV", send, send_count, recv, counts, displs, dtype, comm, stream)

    @property
    def has_all_to_all_v(self) -> bool:
        return self.has("HcclAlltoAllV")

    def all_to_all_v(self, send, send_counts, send_displs, recv, recv_counts, recv_displs, dtype,
                     comm, stream) -> None:
        self.call("HcclAlltoAllV", send, send_counts, send_displs, dtype, recv, recv_counts,
                  recv_displs, dtype, comm, stream)

    def all_gather(self, send, recv, count, dtype, comm, stream) -> None:
        self.call("HcclAllGather", send, recv, count, dtype, comm, stream)

    def all_reduce(self, send, recv, count, dtype, op, comm, stream) -> None:
        self.call("HcclAllReduce", send, recv, count, dtype, op, comm, stream)

    def broadcast(self, buf, count, dtype, root, comm, stream) -> None:
        self.call("HcclBroadcast", buf, count, dtype, root, comm, stream)


# The Atlas training series (the first-generation Ascend 910) reports these chip names
# (aclrtGetSocName, which torch.npu.get_device_name returns): CANN's runtime names its 32-core
# parts Ascend910A / Ascend910ProA / Ascend910PremiumA and its 30-core parts Ascend910B /
# Ascend910ProB. A plain "Ascend910B" is therefore first generation; Atlas A2 chips report
# Ascend910B1..B4 (and variants), Atlas A3 Ascend910_93xx. The CANN HCCL API reference lists
# HcclAllGatherV as not supported on the training series.
TRAINING_SERIES_CHIPS = frozenset({"Ascend910A", "Ascend910ProA", "Ascend910PremiumA",
                                   "Ascend910B", "Ascend910ProB"})


def all_gather_v_supported_on(chip: str | None) -> bool:
    """False on a chip of the Atlas training series; True elsewhere, and when the chip is unknown
    (CPU ranks over a test library)."""
    return (chip or "").strip() not in TRAINING_SERIES_CHIPS


class HcclBackend(CommunicatorBackend):
    name = "hccl"
    device_kind = "npu"
    hardware = "Ascend NPUs"
    library_class = HcclLibrary

    def __init__(self, coordinator, library: HcclLibrary | None = None):
        super().__init__(coordinator, library)
        # whether uneven exchanges use HcclAllGatherV: the symbol and the chip must both allow it
        self.uses_all_gather_v = self.library.has_all_gather_v
        if not self.uses_all_gather_v:
            log.warning("%s has no HcclAllGatherV: exchanging with one HcclBroadcast per rank "
                        "(exact, slower); a newer CANN provides HcclAllGatherV", self.library.path)
            return
        try:
            chip = chip_name(coordinator.devices[0])  # one chip kind per server
        except Exception as exc:  # noqa: BLE001 - a runtime that cannot say: the symbol decides
            log.warning("could not read the chip name of %s (%s: %s): using HcclAllGatherV, which "
                        "the library offers. An Atlas training series chip (910A) does not support "
                        "it: there, set %s=peer", coordinator.devices[0], type(exc).__name__, exc,
                        BACKEND_ENV)
            return
        if not all_gather_v_supported_on(chip):
            self.uses_all_gather_v = False
            log.info("HCCL on %s (Atlas training series), where HcclAllGatherV is not supported: "
                     "exchanging uneven shards with one HcclBroadcast per rank (exact, slower)", chip)

    def _uses_broadcasts(self, counts) -> bool:
        """Uneven shards without HcclAllGatherV (every rank sees all counts: all agree)."""
        return len(set(counts)) != 1 and not self.uses_all_gather_v

    def _stage_all_gather_v(self, rank, send, recv, counts, displs):
        # The broadcasts carry only the other ranks' shards into recv: the own one is copied
        # here, before the stream handle is read (reading it drains torch_npu's queue; a copy
        # queued after it could run after the broadcasts that peers read recv through).
        if self._uses_broadcasts(counts):
            recv.narrow(0, displs[rank], counts[rank]).copy_(send.view(-1))

    def _all_gather_v_flat(self, rank, send, recv, counts, displs, stream):
        hccl, dtype, comm = self.library, self.library.dtype(send.dtype), self.comms[rank]
        if len(set(counts)) == 1:  # equal shards: the plain all-gather (every rank sees all counts)
            hccl.all_gather(send.data_ptr(), recv.data_ptr(), counts[rank], dtype, comm, stream)
            return None
        if not self._uses_broadcasts(counts):
            n = len(counts)
            host_counts = (c_uint64 * n)(*counts)  # read by the device asynchronously:
            host_displs = (c_uint64 * n)(*displs)  # returned so the caller keeps them to the sync
            hccl.all_gather_v(send.data_ptr(), counts[rank], recv.data_ptr(), ctypes.addressof(host_counts),
                              ctypes.addressof(host_displs), dtype, comm, stream)
            return host_counts, host_displs
        itemsize = recv.element_size()  # the own shard is in recv already (_stage_all_gather_v)
        for root, (count, displ) in enumerate(zip(counts, displs)):
            if count:
                hccl.broadcast(recv.data_ptr() + displ * itemsize, count, dtype, root, comm, stream)
        return None

    @property
    def has_all_to_all_v(self) -> bool:
        return self.library.has_all_to_all_v

    def _all_to_all_v_flat(self, rank, send, recv, send_counts, send_displs, recv_counts,
                           recv_displs, stream):
        n = len(send_counts)
        host = [(c_uint64 * n)(*values)  # host arrays the device reads asynchronously
                for values in (send_counts, send_displs, recv_counts, recv_displs)]
        at = [ctypes.addressof(values) for values in host]
        self.library.all_to_all_v(send.data_ptr(), at[0], at[1], recv.data_ptr(), at[2], at[3],
                                  self.library.dtype(send.dtype), self.comms[rank], stream)
        return host
