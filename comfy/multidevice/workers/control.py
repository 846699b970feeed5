"""The control channel of a worker pool: rank 0 tells every worker what to do next.

One message per call, as data of a fixed schema (workers/wire.py, never a pickle: whoever
reaches the rendezvous must not be able to run code in any process), over a CPU (gloo) process
group: its length first, then its bytes, both broadcast from rank 0. The tensors of a step
(latents, timestep, conditioning) travel inside the message; the K/V exchange between the ranks
goes over the communicator, not here. A worker checks the announced length against
MAX_MESSAGE_BYTES before it allocates, and decodes only the records this package registered
(the imports below register them: a recipe, its plan, the split, a repeated tensor, a Fun ControlNet).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from comfy.multidevice.workers import comfy_dit, recipe, repeats, towers  # noqa: F401 - their wire records
from comfy.multidevice.workers.wire import decode, encode, WireError

FORWARD, BUILD = "forward", "build"  # a stop travels on the live link (workers/door.py)
# Generous on purpose: the build message carries the MODEL's weight patches (a Turbo LoRA is
# 1.8 GB, and several can be stacked); the cap only stops a corrupt or hostile length from
# making a worker allocate without bound.
MAX_MESSAGE_BYTES = 32 << 30
MAX_STATUS_BYTES = 64 << 10  # (problem, server, pid): a line of text and two short values


def checked_status(status: Any, rank: int) -> tuple:
    """`status` if it is (problem: str | None, server: str, pid: int); WireError naming the rank."""
    if not (type(status) is tuple and len(status) == 3 and (status[0] is None or type(status[0]) is str)
            and type(status[1]) is str and type(status[2]) is int):
        shown = tuple(type(v).__name__ for v in status) if type(status) is tuple else type(status).__name__
        raise WireError(f"rank {rank}'s status is {shown}, not (problem: str or None, server: str, pid: int)")
    return status


class ControlChannel:
    """Rank 0's messages to every rank of `group` (None: the default group), and the ranks'
    statuses back to all of them."""

    def __init__(self, group=None):
        import torch.distributed as dist  # torch.distributed may be absent: only pools need it

        self._dist = dist
        self.group = group
        self.bytes_sent = 0  # by rank 0, since the channel was made
        self.seconds = 0.0  # spent in send / receive, since the channel was made

    def send(self, message: Any) -> int:
        """Rank 0: broadcast `message`; returns its size in bytes."""
        start = time.perf_counter()
        data = encode(message, name="the control message")  # refused here, before any rank is told
        self._dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.group)
        self._dist.broadcast(torch.frombuffer(data, dtype=torch.uint8), 0, group=self.group)
        self.bytes_sent += len(data)
        self.seconds += time.perf_counter() - start
        return len(data)

    def receive(self) -> Any:
        """A worker: the next message rank 0 broadcasts."""
        size = torch.empty(1, dtype=torch.int64)
        self._dist.broadcast(size, 0, group=self.group)
        length = int(size.item())
        if not 0 < length <= MAX_MESSAGE_BYTES:
            raise WireError(f"rank 0's control message: it announced {length} bytes, not 1 to "
                            f"{MAX_MESSAGE_BYTES} (MAX_MESSAGE_BYTES)")
        data = torch.empty(length, dtype=torch.uint8)
        self._dist.broadcast(data, 0, group=self.group)
        return decode(data.numpy(), max_bytes=MAX_MESSAGE_BYTES, what="rank 0's control message")

    def statuses(self, status: Any) -> list:
        """Every rank's status (its problem or None, its server, its pid), in rank order, on
        every rank (a collective: the lengths, then the bytes padded to the longest)."""
        data = torch.frombuffer(encode(checked_status(status, self._dist.get_rank(self.group)),
                                       name="this rank's status"), dtype=torch.uint8)
        world = self._dist.get_world_size(self.group)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        self._dist.all_gather(lengths, torch.tensor([data.numel()], dtype=torch.int64), group=self.group)
        sizes = [int(n.item()) for n in lengths]
        for rank, size in enumerate(sizes):  # every rank sees the same sizes: all refuse together
            if not 0 < size <= MAX_STATUS_BYTES:
                raise WireError(f"rank {rank}'s status: {size} bytes, not 1 to {MAX_STATUS_BYTES}")
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        gathered = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(world)]
        self._dist.all_gather(gathered, padded, group=self.group)
        return [checked_status(decode(g[:n].numpy(), max_bytes=MAX_STATUS_BYTES, what=f"rank {r}'s status"), r)
                for r, (g, n) in enumerate(zip(gathered, sizes))]


class BlockFlag:
    """Rank 0's yes/no to every rank once per block, one block late: posted (an asynchronous
    broadcast) as a block starts and read as the next one starts, so its round trip overlaps a
    block's work instead of holding every rank at each block start. Every rank calls `post`
    at every block start and `settle` after the last block, in the same order (comfy_cancel.py
    `BlockCancel`; between rank threads: comm/collectives.py `SharedBlockFlag`)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist = dist
        self.group = group  # None: the default group
        self._pending = None
        self.seconds = 0.0  # spent posting and waiting, since the flag was made

    def post(self, value: bool = False) -> bool:
        """The flag posted at the previous block (False at a forward's first block); when it
        is up, nothing new is posted: every rank stops at this block."""
        if self.settle():
            return True
        start = time.perf_counter()
        tensor = torch.tensor([1 if value else 0], dtype=torch.uint8)
        self._pending = (self._dist.broadcast(tensor, 0, group=self.group, async_op=True), tensor)
        self.seconds += time.perf_counter() - start
        return False

    def settle(self) -> bool:
        """Wait for the flag in flight, if any; whether it was up."""
        if self._pending is None:
            return False
        start = time.perf_counter()
        work, tensor = self._pending
        self._pending = None
        work.wait()
        self.seconds += time.perf_counter() - start
        return bool(tensor.item())
