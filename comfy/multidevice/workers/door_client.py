"""The other side of rank 0's door (workers/door.py): a worker's live link and store tunnel,
and a join command's connection that follows rank 0's pools.

Each connection proves the secret and checks rank 0's proof first (workers/admission.py), so
a worker never takes orders from, nor a join command starts workers for, a program that only
holds rank 0's address.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import threading
from typing import Callable

from comfy.multidevice.workers import admission
from comfy.multidevice.workers.admission import AdmissionError
from comfy.multidevice.workers.door import format_address, HEARTBEAT_S, pipe, RendezvousError

BEATS_MISSED = 6  # rank 0 is taken for lost after this many heartbeats without a line
CONNECT_S = 30.0


class RankZeroLost(RuntimeError):
    """Rank 0 closed the link or stopped beating."""


def _proven(host: str, port: int, key: bytes, purpose: str, rank: int, generation: int, extra: dict | None = None):
    """(the connection, rank 0's address, its reader), once rank 0 and this side proved the secret."""
    peer = format_address(host, port)
    try:
        conn = socket.create_connection((host, port), timeout=CONNECT_S)
    except OSError as exc:
        raise RendezvousError(f"rank 0 is not serving {peer} ({exc.strerror or exc})") from None
    return conn, peer, admission.prove_to_rank0(conn, peer, key, purpose, rank, generation, extra)


def _identity() -> dict:
    return {"server": socket.gethostname(), "pid": os.getpid()}


def _next_line(reader: admission.LineReader, closed: str) -> dict:
    """Rank 0's next line (a beat included); RankZeroLost when it closed the connection (saying
    `closed`) or sent nothing for BEATS_MISSED heartbeats."""
    try:
        line = reader.read(HEARTBEAT_S * BEATS_MISSED)
    except AdmissionError as exc:
        raise RankZeroLost(f"rank 0 at {reader.peer} went silent ({exc})") from None
    if line is None:
        raise RankZeroLost(f"rank 0 at {reader.peer} {closed}")
    return line


class RankLink:
    """A worker's live connection to rank 0: open for the worker's life; rank 0 beats on it,
    says "go" before each control message, and "stop" when it closes the pool.

    A helper thread reads it all the time, so a link rank 0 closes (it dropped the pool) is
    seen even while the worker is blocked in a collective: dropping a pool does not always
    close the collectives' own sockets (gloo keeps a group's pairs open while any reference to
    it lives), and a peer blocked on one would wait the whole collective timeout - long enough
    for rank 0's next pool to give up on this server's ranks. `on_lost(RankZeroLost)` is called
    from that thread when rank 0 is lost, unless "stop" came first
    (the stop travels on this link, not as a collective: rank 0 closes the link right after it,
    and a stop seen before the close is never mistaken for a lost rank 0)."""

    def __init__(self, host: str, port: int, key: bytes, rank: int, generation: int,
                 on_lost: Callable[[RankZeroLost], None] | None = None):
        self.conn, self.peer, self.reader = _proven(host, port, key, "live", rank, generation, _identity())
        self._on_lost = on_lost
        self._finished = False
        self._events: queue.Queue = queue.Queue()  # True per "go", False for "stop", then what ended it
        threading.Thread(target=self._watch, name="pool-link", daemon=True).start()

    def _watch(self):
        while True:
            try:
                line = _next_line(self.reader, "closed the pool")
            except RankZeroLost as lost:
                self._events.put(lost)
                if self._on_lost is not None and not self._finished:
                    self._on_lost(lost)
                return
            if line.get("stop"):
                self._finished = True  # rank 0 closes the link next: expected
                self._events.put(False)
            elif line.get("go"):
                self._events.put(True)

    def wait_for_go(self) -> bool:
        """Block until rank 0 says go (True) or stop (False), however long it idles, as long
        as it beats."""
        event = self._events.get()
        if isinstance(event, RankZeroLost):
            self._events.put(event)  # every later wait fails alike
            raise event
        if not event:
            self._events.put(event)  # a stop stays said
        return event

    def say_built(self) -> None:
        """Tell rank 0 this worker's DiT is built (or failed to: the statuses say which); rank 0
        waits for every worker's line however long the loads take, then says go."""
        admission.send_line(self.conn, {"built": 1})

    def close(self):
        self._finished = True
        self.conn.close()


def store_through_door(host: str, port: int, key: bytes, rank: int, generation: int, timeout_s: float):
    """Pool `generation`'s store (under its key's prefix), reached through the door: a
    loopback listener here pipes each connection torch's store client makes to an admitted
    door connection. Returns (the store, the listener: it lives as long as the caller keeps it)."""
    import torch.distributed as dist
    local = socket.create_server(("127.0.0.1", 0))
    failures: list[str] = []

    def serve():
        while True:
            try:
                conn, _ = local.accept()
            except OSError:
                return
            try:
                remote = _proven(host, port, key, "store", rank, generation)[0]
            except (AdmissionError, RendezvousError, OSError) as exc:
                failures.append(str(exc))
                conn.close()
                continue
            remote.settimeout(None)
            pipe(conn, remote)

    threading.Thread(target=serve, name="pool-store-door", daemon=True).start()
    try:
        client = dist.TCPStore("127.0.0.1", local.getsockname()[1], is_master=False,
                               timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as exc:  # noqa: BLE001 - named with the door's answer
        raise RendezvousError(f"pool {generation}'s store at {format_address(host, port)} could not be reached: "
                              f"{failures[-1] if failures else exc}") from None
    return dist.PrefixStore(admission.store_prefix(key), client), local


class Following:
    """A join command's connection to rank 0: the pools that take its ranks, as they open."""

    def __init__(self, host: str, port: int, base: bytes, first_rank: int, count: int):
        self.base = base
        self.conn, self.peer, self.reader = _proven(host, port, admission.follow_key(base), "follow", first_rank, 0,
                                                    {"count": count, **_identity()})

    def next_pool(self) -> tuple[int, int, int, bytes]:
        """(generation, world size, local ranks of rank 0's server, the pool's key) of the
        next pool rank 0 announces; RankZeroLost when rank 0 goes away."""
        while True:
            line = _next_line(self.reader, "closed the connection")
            if "pool" not in line:
                continue
            try:
                generation, world, local = (admission.field(line, n, int, self.peer) for n in ("pool", "world", "local"))
                nonce = admission.field(line, "nonce", str, self.peer)
            except AdmissionError as exc:
                raise RankZeroLost(f"rank 0 at {self.peer} announced a malformed pool ({exc})") from None
            return generation, world, local, admission.pool_key(self.base, generation, nonce)

    def close(self):
        self.conn.close()
