"""Who may take part in a worker pool: the pool's secret, and the proof of it each rank gives.

torch.distributed's store and gloo authenticate nobody, so every connection to rank 0's door
(workers/door.py) starts with a mutual challenge before anything else crosses it: each side
sends a fresh random nonce and answers the other's with an HMAC-SHA256 under a key only
secret holders have. Rank 0 answers first, so a worker (or a join command) never follows a
program that merely holds rank 0's port; the proofs are bound to their direction, purpose,
rank and pool, so one cannot be replayed as another.

The keys. `base`: on a server whose pools take ranks from other servers, the cluster secret
the user placed on every server (COMFYUI_MULTI_DEVICE_SECRET_FILE or _SECRET, like a cluster
token); otherwise random per process, never written anywhere. Each pool's key is derived from
`base` and a random nonce of that pool, so it differs per pool; local workers receive it on
their stdin (never in the store, the command line or the environment), join commands derive
it from the cluster secret and the nonce rank 0 announces to them over an authenticated
connection. The store keys of a pool live under a prefix derived from its key.

Every line on a door connection is one JSON object of at most MAX_LINE bytes, read with a
deadline: a stranger cannot make rank 0 read without bound or wait forever.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import time

from comfy.multidevice.workers.wire import SCHEMA_VERSION

PROJECT_VERSION = "0.1.0"  # pyproject.toml's; a pool's ranks must all run the same
PROTOCOL_VERSION = 3  # the door's handshake and lines (2: the store and liveness of before)
MAX_LINE = 4096  # bytes of one door line, newline included
HANDSHAKE_S = 10.0  # a connection that has not proved the secret by then is dropped

SECRET_FILE_ENV = "COMFYUI_MULTI_DEVICE_SECRET_FILE"
SECRET_ENV = "COMFYUI_MULTI_DEVICE_SECRET"
MIN_SECRET_BYTES = 16


class AdmissionError(RuntimeError):
    """A connection that did not prove the pool's secret, or spoke another version; the
    message names the peer and the fix."""


class SecretError(ValueError):
    """The cluster secret is missing or unusable; the message names the variable and the fix."""


MAKE_SECRET = "python -c \"import secrets; print(secrets.token_hex(32))\" > pool.secret"


def cluster_secret(required: bool) -> bytes | None:
    """The cluster secret this server's user placed: the file COMFYUI_MULTI_DEVICE_SECRET_FILE
    names, else COMFYUI_MULTI_DEVICE_SECRET itself; None when neither is set and not `required`."""
    path = os.environ.get(SECRET_FILE_ENV, "").strip()
    if path:
        try:
            with open(path, "rb") as f:
                text = f.read(4096).strip()
        except OSError as exc:
            raise SecretError(f"{SECRET_FILE_ENV}={path!r} cannot be read ({exc.strerror}): point it at "
                              f"the pool's secret file (make one with: {MAKE_SECRET})") from None
        where = f"the file {SECRET_FILE_ENV}={path!r}"
    else:
        text = os.environ.get(SECRET_ENV, "").strip().encode()
        where = SECRET_ENV
        if not text:
            if required:
                raise SecretError(
                    f"ranks on other servers need a cluster secret on every server: set {SECRET_FILE_ENV} "
                    f"to a file only the user running ComfyUI can read (make one with: {MAKE_SECRET}) and "
                    "place the same file on each joining server")
            return None
    if len(text) < MIN_SECRET_BYTES:
        raise SecretError(f"the cluster secret in {where} has {len(text)} bytes, under {MIN_SECRET_BYTES}: "
                          f"make a long random one ({MAKE_SECRET})")
    return hashlib.sha256(b"minimax-h3 cluster secret|" + text).digest()


def random_base() -> bytes:
    """A base secret for pools whose ranks are all on this server."""
    return secrets.token_bytes(32)


def _mac(key: bytes, *parts) -> str:
    return hmac.new(key, "|".join(map(str, parts)).encode(), hashlib.sha256).hexdigest()


def pool_key(base: bytes, generation: int, nonce: str) -> bytes:
    return bytes.fromhex(_mac(base, "pool", generation, nonce))


def follow_key(base: bytes) -> bytes:
    """The key of a join command's connection that follows rank 0's pools."""
    return bytes.fromhex(_mac(base, "follow"))


def store_prefix(key: bytes) -> str:
    """The store prefix of a pool's keys: only its secret's holders can name them."""
    return "pool-" + _mac(key, "store prefix")[:32]


def proof(key: bytes, side: str, nonce: str, purpose: str, rank: int, generation: int) -> str:
    return _mac(key, side, nonce, purpose, rank, generation)


def proofs_match(a: str, b) -> bool:
    return isinstance(b, str) and hmac.compare_digest(a.encode(), b.encode())


def new_nonce() -> str:
    return secrets.token_hex(16)


# -- framed JSON lines --------------------------------------------------------------------

def send_line(conn: socket.socket, message: dict) -> None:
    data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
    if len(data) > MAX_LINE:
        raise ValueError(f"a door line of {len(data)} bytes exceeds {MAX_LINE}")
    conn.sendall(data)


class LineReader:
    """Reads one JSON object per line from `conn`, each at most MAX_LINE bytes, each within
    a deadline; anything else is an AdmissionError naming `peer`."""

    def __init__(self, conn: socket.socket, peer: str):
        self.conn = conn
        self.peer = peer
        self._buffer = b""

    @property
    def pending(self) -> bytes:
        """Bytes received and not yet returned as a line."""
        return self._buffer

    def read(self, timeout_s: float | None) -> dict | None:
        """The next object; None when the peer closed the connection cleanly."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            if len(self._buffer) >= MAX_LINE:
                raise AdmissionError(f"{self.peer} sent a line over {MAX_LINE} bytes")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AdmissionError(f"{self.peer} sent nothing within {timeout_s:g} s")
                self.conn.settimeout(left)
            else:
                self.conn.settimeout(None)
            try:
                chunk = self.conn.recv(MAX_LINE - len(self._buffer))
            except socket.timeout:
                raise AdmissionError(f"{self.peer} sent nothing within {timeout_s:g} s") from None
            except OSError as exc:
                raise AdmissionError(f"the connection to {self.peer} failed ({exc})") from None
            if not chunk:
                if self._buffer:
                    raise AdmissionError(f"{self.peer} closed the connection mid-line")
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except (UnicodeDecodeError, ValueError):
            raise AdmissionError(f"{self.peer} sent a line that is not JSON") from None
        if not isinstance(message, dict):
            raise AdmissionError(f"{self.peer} sent {type(message).__name__}, not a JSON object")
        return message


def field(message: dict, name: str, kind: type, peer: str):
    """`message[name]`, which must be a `kind` (bool is not an int here)."""
    value = message.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise AdmissionError(f"{peer} sent no valid {name!r} ({type(value).__name__})")
    return value


def check_versions(message: dict, peer: str, mine: str) -> None:
    """Refuse a peer of another project, protocol or message schema version, naming both
    (`mine`: this side)."""
    theirs = (message.get("project"), message.get("protocol"), message.get("schema"))
    if theirs != (PROJECT_VERSION, PROTOCOL_VERSION, SCHEMA_VERSION):
        raise AdmissionError(
            f"{peer} runs MiniMax-H3 multi-device {theirs[0]!r} (pool protocol {theirs[1]!r}, message schema "
            f"{theirs[2]!r}) and {mine} runs {PROJECT_VERSION!r} (pool protocol {PROTOCOL_VERSION}, message schema "
            f"{SCHEMA_VERSION}): install the same version on every server")


def versions() -> dict:
    return {"project": PROJECT_VERSION, "protocol": PROTOCOL_VERSION, "schema": SCHEMA_VERSION}


# -- the two sides of the challenge -------------------------------------------------------

def prove_to_rank0(conn: socket.socket, peer: str, key: bytes, purpose: str, rank: int, generation: int,
                   extra: dict | None = None) -> LineReader:
    """A worker's (or a join command's) side: hello, check rank 0's proof, give ours; returns
    the connection's reader once rank 0 admitted us. Raises AdmissionError naming the cause."""
    reader = LineReader(conn, peer)
    nonce = new_nonce()
    send_line(conn, {"hello": "minimax-h3 pool", **versions(), "purpose": purpose, "rank": rank,
                     "generation": generation, "nonce": nonce, **(extra or {})})
    answer = reader.read(HANDSHAKE_S)
    if answer is None:
        raise AdmissionError(f"{peer} closed the connection before its proof")
    if "refused" in answer:
        raise AdmissionError(f"rank 0 at {peer} refused this rank: {str(answer['refused'])[:300]}")
    check_versions(answer, f"rank 0 at {peer}", "this server")
    if not proofs_match(proof(key, "rank0", nonce, purpose, rank, generation), answer.get("proof")):
        raise AdmissionError(
            f"the program at {peer} does not prove the pool's secret: it is not this pool's rank 0, or the "
            f"cluster secrets differ ({SECRET_FILE_ENV} must name the same secret on every server)")
    theirs = field(answer, "nonce", str, peer)
    send_line(conn, {"proof": proof(key, "rank", theirs, purpose, rank, generation)})
    verdict = reader.read(HANDSHAKE_S)
    if verdict is None or verdict.get("admitted") is not True:
        reason = (verdict or {}).get("refused", "it closed the connection")
        raise AdmissionError(f"rank 0 at {peer} refused this rank: {str(reason)[:300]}")
    return reader


def hello_of(reader: LineReader) -> dict:
    """Rank 0's side, first step: the hello, with its fields checked (not yet trusted)."""
    hello = reader.read(HANDSHAKE_S)
    if hello is None or hello.get("hello") != "minimax-h3 pool":
        raise AdmissionError(f"{reader.peer} did not greet as a pool rank")
    check_versions(hello, f"{reader.peer} (rank {hello.get('rank')!r})", "rank 0")
    for name, kind in (("purpose", str), ("rank", int), ("generation", int), ("nonce", str)):
        field(hello, name, kind, reader.peer)
    if not 0 < len(hello["nonce"]) <= 64:
        raise AdmissionError(f"{reader.peer} sent a nonce of {len(hello['nonce'])} characters")
    return hello


def check_proof_of(reader: LineReader, key: bytes, hello: dict) -> None:
    """Rank 0's side, second step: prove ours, then check theirs (AdmissionError if wrong)."""
    nonce = new_nonce()
    args = (hello["purpose"], hello["rank"], hello["generation"])
    send_line(reader.conn, {**versions(), "nonce": nonce, "proof": proof(key, "rank0", hello["nonce"], *args)})
    answer = reader.read(HANDSHAKE_S)
    if answer is None or not proofs_match(proof(key, "rank", nonce, *args), answer.get("proof")):
        raise AdmissionError(f"{reader.peer} (claiming rank {hello['rank']}) does not prove the pool's secret")
