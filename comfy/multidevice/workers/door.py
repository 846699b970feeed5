"""Rank 0's door: the one port where worker processes and other servers reach a pool.

Every connection proves the pool's secret first (workers/admission.py); then it is one of
- "live": a worker's connection for its life. The kernel closes it when the worker ends,
  however it ends, so rank 0 names exactly the ranks that are gone; rank 0 sends a heartbeat
  on it, a "go" before each control message and a "stop" when the pool closes, so an idle
  worker waits here, without the collective timeout, for as long as rank 0 lives (a pool
  survives a pause);
- "store": a tunnel to the pool's torch.distributed store, which listens on loopback only
  (torch's TCPStore trusts whoever connects, so it is never exposed);
- "follow": a join command of another server, told of each pool that takes its ranks.
A connection that fails the proof, speaks another version, or claims a rank that is not its
to claim is refused, named by address in the log, and the pool goes on without it. Before
the proof a connection gets at most MAX_LINE bytes read and HANDSHAKE_S seconds, and at most
MAX_UNPROVEN such connections are open at once: a stranger can neither grow rank 0's memory
nor hold its threads.
"""

from __future__ import annotations

import datetime
import logging
import select
import socket
import threading
from dataclasses import dataclass, field

from comfy.multidevice.workers import admission
from comfy.multidevice.workers.admission import AdmissionError, LineReader, send_line

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # rank 0's beat on every live and follow connection
MAX_UNPROVEN = 32  # connections in their handshake at once; more are closed at once
REFUSALS_KEPT = 100


class RendezvousError(RuntimeError):
    """The door could not be served or reached; the message names the address and the fix."""


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True)
class WorkerIdentity:
    rank: int
    server: str  # the worker's host name, and the address it connected from
    pid: int

    def describe(self) -> str:
        return f"rank {self.rank} on {self.server} (pid {self.pid})"


class Member:
    """An admitted worker's live connection: rank 0 writes beats, go's and a stop on it; the
    worker writes one line, when its DiT is built (or failed to build) at a pool's start."""

    def __init__(self, conn: socket.socket, identity: WorkerIdentity, reader: LineReader | None = None):
        self.conn = conn
        self.identity = identity
        self.reader = reader or LineReader(conn, identity.describe())
        self._lock = threading.Lock()

    def send(self, message: dict) -> bool:
        with self._lock:
            try:
                send_line(self.conn, message)
                return True
            except OSError:
                return False

    def line(self) -> dict | None:
        """The worker's next line if one has arrived (None: nothing yet); AdmissionError when
        the connection closed or carries what is not a line."""
        readable, _, _ = select.select([self.conn], [], [], 0)
        if not readable and b"\n" not in self.reader.pending:
            return None
        line = self.reader.read(admission.HANDSHAKE_S)
        if line is None:
            raise AdmissionError(f"{self.identity.describe()} ended (its connection closed)")
        return line

    def ended(self) -> bool:
        """Its connection closed (the worker's one line, if unread, counts as alive)."""
        try:
            readable, _, _ = select.select([self.conn], [], [], 0)
            return bool(readable) and self.conn.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


@dataclass
class PoolAdmission:
    """One pool (a generation) at the door: its key and the ranks admitted to it."""

    generation: int
    world: int
    local: int  # ranks 0 .. local - 1 run on this server
    nonce: str
    key: bytes
    members: dict = field(default_factory=dict)  # rank -> Member
    open: bool = True  # takes ranks until its process group formed

    @property
    def store_prefix(self) -> str:
        return admission.store_prefix(self.key)

    def identity(self, rank: int) -> WorkerIdentity | None:
        member = self.members.get(rank)
        return member.identity if member else None

    def ended(self) -> list[WorkerIdentity]:
        return [m.identity for _, m in sorted(self.members.items()) if m.ended()]

    def missing(self) -> list[int]:
        return [r for r in range(1, self.world) if r not in self.members]

    def go(self) -> None:
        """Wake every worker for the control message that follows."""
        for member in list(self.members.values()):
            member.send({"go": 1})

    def stop(self) -> None:
        """Tell every worker to end: no collective follows (a worker that left already, or
        a broken group, cannot hold the others' stop up)."""
        for member in list(self.members.values()):
            member.send({"stop": 1})


@dataclass
class Follower:
    conn: Member
    peer: str
    first: int
    count: int

    @property
    def last(self) -> int:
        return self.first + self.count - 1


class Door:
    """Rank 0's listener on `host`:`port` (0: the system picks), the loopback store behind
    it, and the pools it admits to."""

    def __init__(self, host: str, port: int, timeout_s: float, base_secret: bytes):
        import torch.distributed as dist  # only pools need torch.distributed
        self._dist = dist
        self.timeout_s = timeout_s
        self._base = base_secret
        self.cluster = False  # whether the base is the user's cluster secret (rendezvous.py sets it)
        try:
            self._listener = socket.create_server((host, port), family=_family(host), backlog=64)
        except OSError as exc:
            raise RendezvousError(
                f"cannot serve the worker rendezvous on {format_address(host, port)} ({exc.strerror}); set "
                "COMFYUI_MULTI_DEVICE_RENDEZVOUS to an address of this server and a free port") from None
        self.host, self.port = host, self._listener.getsockname()[1]
        self.store = self._loopback_store()
        self.generation = 0
        self.pools: dict[int, PoolAdmission] = {}
        self.followers: list[Follower] = []
        self.refusals: list[str] = []  # the last REFUSALS_KEPT, for tests and messages
        self._lock = threading.Lock()
        self._unproven = threading.BoundedSemaphore(MAX_UNPROVEN)
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._accept, name="pool-door", daemon=True),
                         threading.Thread(target=self._beat, name="pool-door-beat", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _loopback_store(self):
        """torch's TCPStore on 127.0.0.1 only (it would listen on every interface if given a
        port): this process makes the socket and hands it over."""
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.store_port = listener.getsockname()[1]
        return self._dist.TCPStore("127.0.0.1", self.store_port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=self.timeout_s),
                                   master_listen_fd=listener.detach(), use_libuv=False)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def store_of(self, pool: PoolAdmission):
        """`pool`'s view of the store: its keys under the prefix only its key's holders can name."""
        return self._dist.PrefixStore(pool.store_prefix, self.store)

    # -- pools ------------------------------------------------------------------------------

    def open_pool(self, world: int, local: int) -> PoolAdmission:
        """A new generation for a pool of `world` ranks, `local` of them on this server;
        announced to the join commands following this door when it has remote ranks."""
        with self._lock:
            self.generation += 1
            nonce = admission.new_nonce()
            pool = PoolAdmission(self.generation, world, local, nonce,
                                 admission.pool_key(self._base, self.generation, nonce))
            self.pools[pool.generation] = pool
            followers = list(self.followers) if world > local else []
        for follower in followers:
            if follower.first < local or follower.last >= world:  # the join command says so too
                log.warning("worker pool door: the join command at %s runs ranks %d-%d, which do not fit pool %d "
                            "(ranks 0-%d on this server, %d in all): fix its --first-rank / --devices or "
                            "COMFYUI_MULTI_DEVICE_REMOTE_RANKS here", follower.peer, follower.first, follower.last,
                            pool.generation, local - 1, world)
            self._announce(follower, pool)
        return pool

    def close_pool(self, pool: PoolAdmission, drop: bool = False) -> None:
        """`pool` takes no more ranks; with `drop`, its live connections close too (its
        workers, if still waiting for rank 0, then end)."""
        with self._lock:
            pool.open = False
            if drop:
                self.pools.pop(pool.generation, None)
                members, pool.members = list(pool.members.values()), {}
            else:
                members = []
        for member in members:
            _close(member.conn)

    def _announce(self, follower: Follower, pool: PoolAdmission) -> None:
        if not follower.conn.send({"pool": pool.generation, "world": pool.world, "local": pool.local,
                                   "nonce": pool.nonce}):
            self._drop_follower(follower)

    def covering(self, rank: int) -> str:
        """Which following join command covers `rank`, for a message about a missing rank."""
        with self._lock:
            for f in self.followers:
                if f.first <= rank <= f.last:
                    return f"the join command at {f.peer} (ranks {f.first}-{f.last})"
        return "no join command following this server covers it"

    # -- connections ------------------------------------------------------------------------

    def _accept(self):
        while not self._closed.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            peer = format_address(*peer[:2])
            if not self._unproven.acquire(blocking=False):  # closed without a word
                self._remember_refusal(peer, "too many connections in their handshake")
                _close(conn)
                continue
            threading.Thread(target=self._admit, args=(conn, peer), name="pool-door-admit", daemon=True).start()

    def _admit(self, conn: socket.socket, peer: str) -> None:
        keep = False
        try:
            reader = LineReader(conn, peer)
            hello = admission.hello_of(reader)
            purpose = hello["purpose"]
            if purpose == "follow":
                keep = self._admit_follower(reader, hello)
            elif purpose in ("live", "store"):
                keep = self._admit_rank(reader, hello)
            else:
                raise AdmissionError(f"{peer} asked for {purpose!r}, not live, store or follow")
        except AdmissionError as exc:
            self._refuse(conn, peer, str(exc))
        except Exception as exc:  # noqa: BLE001 - a stranger's bytes never take the door down
            self._refuse(conn, peer, f"{type(exc).__name__}: {exc}")
        finally:
            self._unproven.release()
            if not keep:
                _close(conn)

    def _pool_for(self, hello: dict, peer: str) -> PoolAdmission:
        with self._lock:
            pool = self.pools.get(hello["generation"])
        if pool is None:
            raise AdmissionError(f"{peer} asked for pool {hello['generation']}, which this server does not "
                                 f"hold (its newest is {self.generation})")
        return pool

    def _admit_rank(self, reader: LineReader, hello: dict) -> bool:
        peer, rank = reader.peer, hello["rank"]
        pool = self._pool_for(hello, peer)
        admission.check_proof_of(reader, pool.key, hello)  # from here on the peer holds the secret
        if not 0 < rank < pool.world:
            raise AdmissionError(f"{peer} claims rank {rank}, but pool {pool.generation} has ranks 1-"
                                 f"{pool.world - 1} besides rank 0: check its --first-rank and --devices")
        if hello["purpose"] == "store":
            if rank not in pool.members or not pool.open:
                raise AdmissionError(f"{peer} asked for pool {pool.generation}'s store as rank {rank}, "
                                     "which is not (or no longer) admitted")
            send_line(reader.conn, {"admitted": True})
            self._tunnel(reader.conn, peer)
            return True
        identity = WorkerIdentity(rank, f"{str(hello.get('server', '?'))[:100]} [{peer.rsplit(':', 1)[0]}]",
                                  hello.get("pid") if isinstance(hello.get("pid"), int) else -1)
        with self._lock:
            held = pool.members.get(rank)
            if not pool.open:
                problem = f"pool {pool.generation} has started without it"
            elif held is not None and not held.ended():
                problem = f"rank {rank} of pool {pool.generation} is held by {held.identity.describe()}"
            else:
                problem = None
                pool.members[rank] = Member(reader.conn, identity, reader)
        if problem:
            raise AdmissionError(f"{peer} claims rank {rank}, but {problem}")
        send_line(reader.conn, {"admitted": True})
        return True

    def _admit_follower(self, reader: LineReader, hello: dict) -> bool:
        peer = reader.peer
        admission.check_proof_of(reader, admission.follow_key(self._base), hello)
        first, count = hello["rank"], hello.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or not 0 < count <= 4096 or first < 1:
            raise AdmissionError(f"{peer} follows with ranks {first}, count {count!r}: give --first-rank 1 or "
                                 "more and at least one device")
        follower = Follower(Member(reader.conn, WorkerIdentity(first, peer, -1)), peer, first, count)
        with self._lock:
            clash = next((f for f in self.followers if f.first <= follower.last and follower.first <= f.last
                          and not f.conn.ended()), None)
            if clash is None:
                self.followers.append(follower)
            pools = [p for p in self.pools.values() if p.open and p.world > p.local]
        if clash is not None:
            raise AdmissionError(f"{peer} claims ranks {first}-{follower.last}, but the join command at "
                                 f"{clash.peer} holds ranks {clash.first}-{clash.last}: give each server its "
                                 "own --first-rank")
        send_line(reader.conn, {"admitted": True})
        log.info("worker pool door: the join command at %s follows this server's pools (ranks %d-%d)",
                 peer, first, follower.last)
        for pool in pools:
            self._announce(follower, pool)
        return True

    def _drop_follower(self, follower: Follower) -> None:
        with self._lock:
            if follower in self.followers:
                self.followers.remove(follower)
        _close(follower.conn.conn)

    def _tunnel(self, conn: socket.socket, peer: str) -> None:
        """Pipe an admitted store connection to the loopback store, both ways, until either closes."""
        try:
            store = socket.create_connection(("127.0.0.1", self.store_port), timeout=self.timeout_s)
        except OSError as exc:
            raise AdmissionError(f"the pool's store is not reachable for {peer} ({exc})") from None
        conn.settimeout(None)
        store.settimeout(None)
        pipe(conn, store)

    def _refuse(self, conn: socket.socket, peer: str, reason: str) -> None:
        reason = " ".join(reason.split())[:400]
        log.warning("worker pool door: refused %s: %s", peer, reason)
        self._remember_refusal(peer, reason)
        try:
            send_line(conn, {"refused": reason})
        except (OSError, ValueError):
            pass

    def _remember_refusal(self, peer: str, reason: str) -> None:
        with self._lock:
            self.refusals = (self.refusals + [f"{peer}: {reason}"])[-REFUSALS_KEPT:]

    def _beat(self):
        while not self._closed.wait(HEARTBEAT_S):
            with self._lock:
                members = [m for p in self.pools.values() for m in p.members.values()]
                followers = list(self.followers)
            for member in members:
                member.send({"beat": 1})
            for follower in followers:
                if follower.conn.ended() or not follower.conn.send({"beat": 1}):
                    self._drop_follower(follower)

    def close(self):
        self._closed.set()
        try:  # wakes the accepting thread (a bare close would leave its accept holding the port)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = [m.conn for p in self.pools.values() for m in p.members.values()]
            conns += [f.conn.conn for f in self.followers]
            self.pools, self.followers = {}, []
        for conn in conns:
            _close(conn)


def pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways between `a` and `b` on two daemon threads, closing both when done."""
    def copy(src, dst, done):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if done.is_set():
            _close(a)
            _close(b)
        done.set()
    done = threading.Event()
    for src, dst in ((a, b), (b, a)):
        threading.Thread(target=copy, args=(src, dst, done), name="pool-store-tunnel", daemon=True).start()


def _close(conn: socket.socket) -> None:
    try:
        conn.close()
    except OSError:
        pass


def _family(host: str) -> int:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
