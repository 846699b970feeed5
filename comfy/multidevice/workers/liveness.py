"""Which worker ended: one TCP connection per worker to rank 0, open for the worker's life.

A collective that loses a peer only says that a connection closed (gloo names an address, and
several ranks may share one server). Each worker also connects here and says its rank, server
and pid; the kernel closes that connection when its process ends, however it ends (SIGKILL
included), so rank 0 can name exactly the ranks that are gone, on this server or another.
A hung worker keeps its connection: it is named by the collective's timeout instead.
"""

from __future__ import annotations

import os
import select
import socket
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerIdentity:
    rank: int
    server: str  # the worker's host name, and the address it connected from when known
    pid: int

    def describe(self) -> str:
        return f"rank {self.rank} on {self.server} (pid {self.pid})"


class LivenessError(RuntimeError):
    """Rank 0 cannot listen for its workers' connections; the message names the port and the fix."""


class Liveness:
    """Rank 0's side: accepts the workers' connections on `address`, `port` (0: the OS picks one)."""

    def __init__(self, address: str, port: int = 0):
        try:
            self._listener = socket.create_server((address, port))
        except OSError as exc:
            raise LivenessError(
                f"cannot watch the worker processes on {address}:{port} ({exc}); a pool with a fixed "
                "rendezvous port listens on the port after it too: give COMFYUI_MULTI_DEVICE_RENDEZVOUS "
                "a port whose next port is free as well") from None
        self.address = (address, self._listener.getsockname()[1])
        self._connections: dict[int, tuple[socket.socket, WorkerIdentity]] = {}
        self._lock = threading.Lock()
        self._accepting = threading.Thread(target=self._accept, name="worker-liveness", daemon=True)
        self._accepting.start()

    def _accept(self):
        while True:
            try:
                conn, peer = self._listener.accept()
            except OSError:  # closed
                return
            try:
                conn.settimeout(10)
                line = conn.makefile("r", encoding="ascii").readline().split()
                identity = WorkerIdentity(int(line[0]), f"{line[1]} [{peer[0]}]", int(line[2]))
                conn.setblocking(False)
            except (OSError, ValueError, IndexError):
                conn.close()
                continue
            with self._lock:
                self._connections[identity.rank] = (conn, identity)

    def identity(self, rank: int) -> WorkerIdentity | None:
        with self._lock:
            entry = self._connections.get(rank)
        return entry[1] if entry else None

    def ended(self) -> list[WorkerIdentity]:
        """The workers whose connection closed (their process ended), in rank order."""
        with self._lock:
            entries = sorted(self._connections.items())
        gone = []
        for _, (conn, identity) in entries:
            readable, _, _ = select.select([conn], [], [], 0)
            if readable:
                try:
                    if conn.recv(1) == b"":
                        gone.append(identity)
                except OSError:
                    gone.append(identity)
        return gone

    def close(self):
        try:  # wakes the accepting thread (a bare close would leave its accept holding the port)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._accepting.join(5)
        with self._lock:
            for conn, _ in self._connections.values():
                conn.close()
            self._connections.clear()


def report_alive(address: tuple[str, int], rank: int) -> socket.socket:
    """A worker's side: connect and say who it is; keep the socket open until the process ends."""
    conn = socket.create_connection(address, timeout=30)
    conn.sendall(f"{rank} {socket.gethostname()} {os.getpid()}\n".encode("ascii"))
    return conn
