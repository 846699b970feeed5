"""The control channel of a worker pool: rank 0 tells every worker what to do next.

One message per call, pickled, over a CPU (gloo) process group: its length first, then its
bytes, both broadcast from rank 0. The tensors of a step (latents, timestep, conditioning)
travel inside the message; the K/V exchange between the ranks goes over the communicator,
not here. Only rank 0 (the ComfyUI process) sends, and the workers are processes it started
itself, so unpickling what it sends trusts nobody new.
"""

from __future__ import annotations

import pickle
import time
from typing import Any

import torch

FORWARD, STOP, BUILD = "forward", "stop", "build"


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
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), 0, group=self.group)
        self._dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.group)
        self.bytes_sent += len(data)
        self.seconds += time.perf_counter() - start
        return len(data)

    def receive(self) -> Any:
        """A worker: the next message rank 0 broadcasts."""
        size = torch.empty(1, dtype=torch.int64)
        self._dist.broadcast(size, 0, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        self._dist.broadcast(data, 0, group=self.group)
        return pickle.loads(data.numpy().tobytes())

    def statuses(self, status: Any) -> list:
        """Every rank's status (its problem or None, its server, its pid), in rank order, on
        every rank (a collective)."""
        out: list = [None] * self._dist.get_world_size(self.group)
        self._dist.all_gather_object(out, status, group=self.group)
        return out


class BlockFlag:
    """Rank 0's yes/no to every rank once per block, one block late: posted (an asynchronous
    broadcast) as a block starts and read as the next one starts, so its round trip overlaps a
    block's work instead of holding every rank at each block start. Every rank calls `post`
    at every block start and `settle` after each forward, in the same order."""

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
