"""Two "servers" on one machine for tests: two network namespaces joined by a veth pair (root
makes them; only addresses inside them are used), each with its own loopback and address.
Where they cannot be made (no root, no `ip`), both "servers" are this machine's loopback and
`namespaces` says so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass

ADDRESS_A, ADDRESS_B = "10.213.0.1", "10.213.0.2"


@dataclass
class TwoServers:
    run_a: list[str]  # the command prefix that runs a program on server A
    address_a: str
    run_b: list[str]
    address_b: str
    namespaces: bool  # False: both are loopback


def _ip(*args) -> bool:
    return subprocess.run(["ip", *args], capture_output=True, timeout=30).returncode == 0


@contextlib.contextmanager
def two_servers():
    tag = uuid.uuid4().hex[:6]
    a, b, va, vb = f"h3a{tag}", f"h3b{tag}", f"va{tag}", f"vb{tag}"
    made = []
    ok = os.geteuid() == 0 and shutil.which("ip") is not None
    for name in (a, b) if ok else ():
        ok = ok and _ip("netns", "add", name)
        if ok:
            made.append(name)
    steps = [["link", "add", va, "type", "veth", "peer", "name", vb], ["link", "set", va, "netns", a],
             ["link", "set", vb, "netns", b], ["-n", a, "addr", "add", f"{ADDRESS_A}/24", "dev", va],
             ["-n", b, "addr", "add", f"{ADDRESS_B}/24", "dev", vb], ["-n", a, "link", "set", va, "up"],
             ["-n", b, "link", "set", vb, "up"], ["-n", a, "link", "set", "lo", "up"],
             ["-n", b, "link", "set", "lo", "up"]]
    for step in steps if ok else ():
        ok = ok and _ip(*step)
    try:
        if ok:
            # gloo would advertise the host name's address (loopback here): the pools pick each
            # server's interface themselves (rank 0: the one holding the rendezvous address; a
            # join command: the one routing to it), so GLOO_SOCKET_IFNAME is left unset
            yield TwoServers(["ip", "netns", "exec", a], ADDRESS_A, ["ip", "netns", "exec", b], ADDRESS_B, True)
        else:
            yield TwoServers([], "127.0.0.1", [], "127.0.0.1", False)
    finally:
        for name in made:
            _ip("netns", "del", name)


def child_pid(parent: int, rank: int, timeout_s: float = 30) -> int:
    """The pid of the worker process of `rank` whose parent is `parent` (the namespaces share
    pids with this process: only the network is separate)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            try:
                words = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == parent and b"--rank" in words and words[words.index(b"--rank") + 1] == str(rank).encode():
                return int(entry)
        time.sleep(0.2)
    raise AssertionError(f"no worker process of rank {rank} under pid {parent}")
