"""What the HCCL and NCCL ctypes backends share.

- `CFunction`: one entry of a declarative table of C functions (name, result, argument
  types, optional or not), bound once from a shared library by `bind`.
- `CollectiveLibrary`: the thin typed wrapper around one such library: where it is
  found, how a non-zero result becomes a `CollectiveLibraryError` with its text.
- `CommunicatorBackend`: one library communicator per rank device; it turns the coordinator's
  collectives into calls on flat device buffers, issued by each rank thread on its device's
  current stream, back to back, synchronized once before the results are used.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from comfy.multidevice.comm.errors import BackendUnavailable, CollectiveError
from comfy.multidevice.comm.layout import (displacements, numel, pack_peer_chunks, received_chunk_shapes,
                                           scratch, sequence_major, unflatten_gathered, unpack_received)
from comfy.multidevice.comm.settings import library_path
from comfy.multidevice.devices import current_stream_handle, synchronize

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CFunction:
    name: str
    restype: Any
    argtypes: tuple
    optional: bool = False


def bind(path: str, table: Sequence[CFunction], what: str, path_env: str) -> dict[str, Any]:
    """The functions of `table` in the shared library at `path`, typed, by name (an optional one
    the library lacks is left out)."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise BackendUnavailable(
            f"cannot load {what} library {path!r} ({exc}); install it or point {path_env} "
            "at it") from exc
    functions: dict[str, Any] = {}
    for spec in table:
        try:
            fn = getattr(lib, spec.name)
        except AttributeError:
            if spec.optional:
                continue
            raise BackendUnavailable(
                f"{what} library {path!r} has no symbol {spec.name}; it is too old or not "
                f"{what}") from None
        fn.restype = spec.restype
        fn.argtypes = list(spec.argtypes)
        functions[spec.name] = fn
    return functions


class CollectiveLibraryError(CollectiveError):
    """A library call returned a non-zero result; carries the function, code and library text."""

    result_type = "result"  # the C result type's name, e.g. HcclResult / ncclResult_t
    result_names: dict = {}  # code -> enum name, where the library's header is mirrored

    def __init__(self, function: str, code: int, text: str):
        name = self.result_names.get(code)
        shown = f"{code} ({name})" if name else f"{code}"
        super().__init__(f"{function} failed with {self.result_type} {shown}: {text}")
        self.function = function
        self.code = code


class CollectiveLibrary:
    """One collective library, bound from `table`; subclasses add one method per call.

    Class attributes say what the library is: `what` (for messages), `table` (the
    CFunction table), `path_env` / `default_path` (where it is found), `error_string`
    (the C function that names a result code) and `error_class`.
    """

    what = "collective"
    table: tuple = ()
    path_env = ""
    default_path = ""
    error_string = ""
    error_class = CollectiveLibraryError
    success = 0
    dtypes: dict = {}      # torch dtype -> the library's dtype enum
    reduce_ops: dict = {}  # "sum" / "max" / ... -> the library's reduction enum

    def __init__(self, path: str | None = None, functions: dict[str, Any] | None = None):
        """`functions`: Python callables by C name in place of the library's (tests record the
        ctypes arguments with them)."""
        self.path = path or library_path(self.path_env, self.default_path)
        self.functions = bind(self.path, self.table, self.what, self.path_env) if functions is None \
            else dict(functions)

    def has(self, name: str) -> bool:
        return name in self.functions

    def error(self, function: str, code: int) -> CollectiveLibraryError:
        """The error of result `code` of `function`, with the library's own text for it."""
        text = self.functions[self.error_string](code)
        return self.error_class(function, code, text.decode(errors="replace") if text else "unknown error")

    def call(self, function: str, *args) -> None:
        """Call `function` and raise `error_class` on a non-zero result."""
        code = self.functions[function](*args)
        if code != self.success:
            raise self.error(function, code)

    @classmethod
    def dtype(cls, dtype: torch.dtype) -> int:
        """The library's dtype enum of `dtype`; CollectiveError naming the supported ones."""
        try:
            return cls.dtypes[dtype]
        except KeyError:
            raise CollectiveError(
                f"{cls.what} cannot move tensors of dtype {dtype}; supported: "
                f"{', '.join(str(d) for d in cls.dtypes)}") from None


class CommunicatorBackend:
    """The flat collectives over one library communicator per rank device, made by the library's
    single-process init-all call and destroyed on close.

    Subclasses set `name`, `device_kind` / `hardware` (which devices the library drives;
    CPU is always accepted, for the fake libraries) and `library_class`, and implement
    `_all_gather_v_flat` (and optionally `_all_to_all_v_flat` with `has_all_to_all_v` true;
    without it the coordinator emulates all-to-all); the library supplies `comm_init_all`,
    `comm_destroy` and `all_reduce`.
    """

    name = "flat"
    device_kind = ""
    hardware = ""
    library_class = CollectiveLibrary
    # capabilities (comm/protocol.py `Backend`); a subclass with a library all-to-all-V sets
    # has_all_to_all_v (hccl: when the library has the symbol)
    reads_peer_memory = False  # the library moves the data; the stream orders it
    one_collective_per_device = True  # HCCL and NCCL alike (CARDS.md): no second lane beside it
    has_all_to_all_v = False
    prepares_all_to_all_v = True

    def __init__(self, coordinator, library: CollectiveLibrary | None = None):
        self.coordinator = coordinator
        kinds = {d.type for d in coordinator.devices}
        if not kinds <= {self.device_kind, "cpu"}:
            raise BackendUnavailable(
                f"{self.library_class.what} drives {self.hardware}; the devices are {sorted(kinds)}")
        self.library = library or self.library_class()
        # library device ids; CPU "devices" (fake libraries) get their rank
        self.comms = self.library.comm_init_all(
            [d.index if d.index is not None else r for r, d in enumerate(coordinator.devices)])

    # Subclass hooks: issue the call on `stream` for `rank`; raise on a non-zero result.
    # They return whatever host memory the call reads asynchronously (counts, displacements);
    # the caller keeps it alive until the stream is synchronized.
    def _all_gather_v_flat(self, rank, send, recv, counts, displs, stream):
        raise NotImplementedError

    def _all_reduce_flat(self, rank, send, recv, op, stream):
        self.library.all_reduce(send.data_ptr(), recv.data_ptr(), send.numel(),
                                self.library.dtype(send.dtype), self.library.reduce_ops[op],
                                self.comms[rank], stream)

    def _stage_all_gather_v(self, rank, send, recv, counts, displs):
        """Torch work the all-gather-V call needs done first (e.g. the own shard copied into
        recv). Runs before the stream handle is read: torch_npu drains its queue when the handle
        is read, so an op queued after that may run after the collective (CARDS.md)."""

    # Optional: all-to-all-V on flat buffers (counts/displacements in elements, per peer),
    # used when has_all_to_all_v is true.

    def _all_to_all_v_flat(self, rank, send, recv, send_counts, send_displs, recv_counts,
                           recv_displs, stream):
        raise NotImplementedError

    def _buffers_ready(self, rank: int, what: str) -> None:
        """Wait until every rank has its buffers, before any library call.

        A rank that fails while preparing (e.g. out of device memory) raises before this
        barrier and aborts it, so the others never enter a library collective that could
        only complete with it: a native collective cannot be cancelled once entered.
        """
        self.coordinator.barrier(rank, f"{what} (buffers ready)")

    def prepare_all_to_all_v(self, rank, tensors, send_splits, received, split_dim, workspace=None,
                             write_own=None):
        """The buffers of an all-to-all-V (`received`: per tensor, the chunk shape from each
        source), made before any library call; the chunk this rank keeps is copied straight
        into its place in the receive buffer (or written there by `write_own`) and does not go
        through the library."""
        device = self.coordinator.devices[rank]
        plans = []
        for t, tensor in enumerate(tensors):
            send, send_counts, send_displs = pack_peer_chunks(tensor, send_splits, split_dim, rank,
                                                              workspace, ("send", t))
            recv_shapes = received[t]
            recv_counts = [numel(shape) for shape in recv_shapes]
            recv_displs = displacements(recv_counts)
            recv = self._empty(sum(recv_counts), tensor.dtype, device, workspace, ("recv", t))
            if recv_counts[rank]:
                place = recv.narrow(0, recv_displs[rank], recv_counts[rank]).view(recv_shapes[rank])
                if write_own is None:
                    place.copy_(tensor.narrow(split_dim, sum(send_splits[:rank]), send_splits[rank]))
                else:
                    write_own(t, place)
                recv_counts[rank] = 0
            plans.append((send, send_counts, send_displs, recv_shapes, recv_counts, recv_displs, recv))
        return plans

    def all_to_all_v(self, rank, tensors, metas, splits, split_dim, cat_dim, slot, workspace=None,
                     write_own=None, prepared=None):
        """`prepared`: the buffers from `prepare_all_to_all_v`, made before the ranks met (the
        coordinator knew the shapes from the caller's plan): then no second barrier is needed."""
        device = self.coordinator.devices[rank]
        plans = prepared
        if plans is None:
            plans = self.prepare_all_to_all_v(rank, tensors, splits[rank],
                                              received_chunk_shapes(metas, splits, split_dim, rank),
                                              split_dim, workspace, write_own)
            self._buffers_ready(rank, "all_to_all_v")
        keepalive = [self._all_to_all_v_flat(rank, send, recv, send_counts, send_displs, recv_counts,
                                             recv_displs, current_stream_handle(device))  # read right before
                     for send, send_counts, send_displs, _, recv_counts, recv_displs, recv in plans]
        synchronize(device)  # once: the calls are ordered on the stream, back to back
        del keepalive
        sizes = [s[rank] for s in splits]
        return [unpack_received(recv, recv_shapes, sizes, cat_dim)
                for _, _, _, recv_shapes, _, _, recv in plans]

    def prepare_all_gather_v(self, rank, tensors, dims, metas, workspace=None):
        """The send and receive buffers of an all-gather-V, made before any library call (a
        rank that cannot allocate fails while the others can still be cancelled)."""
        device = self.coordinator.devices[rank]
        plans = []
        for i, dim in enumerate(dims):
            shard_metas = [m[i] for m in metas]
            counts = [numel(m.shape) for m in shard_metas]
            displs = displacements(counts)
            send = sequence_major(tensors[i], dim, workspace, ("send", i))  # the library reads one dense buffer
            recv = self._empty(sum(counts), send.dtype, device, workspace, ("recv", i))
            plans.append((dim, shard_metas, counts, displs, send, recv))
        return plans

    def all_gather_v(self, rank, tensors, dims, metas, slot, prepared=None, workspace=None):
        """`prepared`: the buffers from `prepare_all_gather_v`, made before the ranks met (the
        coordinator knew the shapes from the shard plan): then no second barrier is needed."""
        device = self.coordinator.devices[rank]
        plans = prepared
        if plans is None:
            plans = self.prepare_all_gather_v(rank, tensors, dims, metas, workspace)
            self._buffers_ready(rank, "exchange")
        keepalive = []
        for dim, shard_metas, counts, displs, send, recv in plans:
            self._stage_all_gather_v(rank, send, recv, counts, displs)
            stream = current_stream_handle(device)  # read right before the call, after any torch op
            keepalive.append(self._all_gather_v_flat(rank, send, recv, counts, displs, stream))
        synchronize(device)  # once for all tensors: K and V go back to back on the stream
        del keepalive
        return [unflatten_gathered(recv, shard_metas, dim)
                for dim, shard_metas, counts, displs, send, recv in plans]

    def all_reduce(self, rank, tensor, op, slot):
        device = self.coordinator.devices[rank]
        send = tensor.contiguous()
        recv = self._empty(send.numel(), send.dtype, device).view(send.shape)
        self._buffers_ready(rank, "all_reduce")
        self._all_reduce_flat(rank, send, recv, op, current_stream_handle(device))
        synchronize(device)
        return recv

    @staticmethod
    def _empty(numel: int, dtype: torch.dtype, device: torch.device, workspace: dict | None = None,
               key=None) -> torch.Tensor:
        """A receive buffer (a method so tests can make one rank's allocation fail)."""
        return scratch(workspace, key, numel, dtype, device)

    def close(self):
        comms, self.comms = self.comms, []
        for comm in comms:
            try:
                self.library.comm_destroy(comm)
            except CollectiveLibraryError as exc:
                log.warning("%s", exc)
