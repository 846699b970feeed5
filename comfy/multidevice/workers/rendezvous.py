"""Where a worker pool's ranks meet: one store on rank 0 for the process's life, one
generation per pool.

The ranks meet in torch.distributed's TCPStore (the store torchrun's rendezvous uses too).
Rank 0 serves it at one address and port for as long as its process lives, so the workers of
another server, started once by their user (workers/join.py), find every later pool at the
same place. Each pool is a generation: its keys under "pool<N>/", its world size published
when it opens, and marked closed once its ranks met or rank 0 gave up, so a worker that comes
late, or comes back after a kill, waits for the next pool instead of joining one that has
started without it.
"""

from __future__ import annotations

import datetime
import threading
import time

GENERATION_KEY = "generation"
POLL_S = 0.25  # how often a waiting worker asks the store for a new pool


def _key(generation: int, name: str) -> str:
    return f"pool{generation}/{name}"


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RendezvousError(RuntimeError):
    """The rendezvous could not be served or reached; the message names the address and the fix."""


class Rendezvous:
    """Rank 0's side: the store, and the generation of the newest pool."""

    def __init__(self, host: str, port: int, timeout_s: float):
        import torch.distributed as dist  # only pools need torch.distributed
        self._dist = dist
        try:
            self.store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - the address is named in the error
            raise RendezvousError(
                f"cannot serve the worker rendezvous on {format_address(host, port)} ({exc}); set "
                "COMFYUI_MULTI_DEVICE_RENDEZVOUS to an address of this server and a free port") from None
        self.host, self.port = host, self.store.port
        self.generation = 0

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def open(self, world_size: int):
        """A new generation for a pool of `world_size` ranks: (its number, its store)."""
        self.generation += 1
        self.store.set(_key(self.generation, "world"), str(world_size))
        self.store.set(GENERATION_KEY, str(self.generation))
        return self.generation, self._dist.PrefixStore(f"pool{self.generation}", self.store)

    def close(self, generation: int) -> None:
        """Generation `generation` takes no more ranks (they met, or rank 0 gave up)."""
        self.store.set(_key(generation, "closed"), "1")


_served: dict[tuple[str, int], Rendezvous] = {}
_served_lock = threading.Lock()


def rendezvous_at(host: str, port: int, timeout_s: float) -> Rendezvous:
    """This process's rendezvous on `host`:`port`, served from its first call on (port 0: the
    port the system picked then)."""
    with _served_lock:
        for (served_host, served_port), rendezvous in _served.items():
            if served_host == host and port in (0, served_port):
                return rendezvous
        rendezvous = Rendezvous(host, port, timeout_s)
        _served[(host, rendezvous.port)] = rendezvous
        return rendezvous


def generation_store(host: str, port: int, generation: int, timeout_s: float):
    """A worker's side: the store of pool `generation` at rank 0's `host`:`port`."""
    import torch.distributed as dist
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"pool{generation}", client)


class PoolFollower:
    """A server's joined ranks: waits at rank 0's store for each pool they have not served."""

    def __init__(self, host: str, port: int, timeout_s: float):
        import torch.distributed as dist
        try:
            self.store = dist.TCPStore(host, port, is_master=False,
                                       timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 - rank 0 is not there (yet): the caller retries
            raise RendezvousError(f"rank 0 is not serving {format_address(host, port)} ({exc})") from None

    def _get(self, key: str) -> int | None:
        return int(self.store.get(key)) if self.store.check([key]) else None

    def next_pool(self, after: int) -> tuple[int, int]:
        """(generation, world size) of the next pool to join: the newest one when it still
        takes ranks and is newer than `after` (the last served, 0 for none), else the one
        after it once rank 0 opens it. Blocks until then; a lost store raises."""
        newest = self._get(GENERATION_KEY) or 0
        if newest > after and not self.store.check([_key(newest, "closed")]):
            target = newest
        else:
            target = max(newest, after) + 1
        while (world := self._get(_key(target, "world"))) is None:
            time.sleep(POLL_S)
        return target, world
