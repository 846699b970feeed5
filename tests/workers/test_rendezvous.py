"""The worker rendezvous (workers/rendezvous.py): one store on rank 0, one generation per pool;
a rank that comes once a pool has started waits for the next one."""

from __future__ import annotations

import socket
import threading

import pytest

from comfy.multidevice.workers.rendezvous import PoolFollower, Rendezvous, rendezvous_at, RendezvousError

pytestmark = pytest.mark.timeout(60)


def _in_thread(function, *args):
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=function(*args)), daemon=True)
    thread.start()
    return thread, out


def test_a_follower_joins_the_open_pool_and_waits_for_the_next_once_it_started():
    rank0 = Rendezvous("127.0.0.1", 0, timeout_s=10)
    follower = PoolFollower("127.0.0.1", rank0.port, timeout_s=10)
    assert rank0.open(4)[0] == 1
    assert follower.next_pool(0) == (1, 4)  # open and not closed: join it
    rank0.close(1)
    late = PoolFollower("127.0.0.1", rank0.port, timeout_s=10)  # e.g. a worker back after a kill
    thread, out = _in_thread(late.next_pool, 0)
    thread.join(1.0)
    assert thread.is_alive()  # pool 1 started without it: it waits
    generation, store = rank0.open(3)
    thread.join(5)
    assert out["value"] == (2, 3) == (generation, 3)
    assert follower.next_pool(1) == (2, 3)  # the one that served pool 1 takes pool 2 too
    store.set("x", "1")  # each pool's keys under its own prefix
    assert rank0.store.get("pool2/x") == b"1"


def test_one_rendezvous_per_address_and_a_port_in_use_is_named():
    first = rendezvous_at("127.0.0.1", 0, timeout_s=10)
    assert rendezvous_at("127.0.0.1", 0, timeout_s=10) is first
    assert rendezvous_at("127.0.0.1", first.port, timeout_s=10) is first
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match=rf"cannot serve the worker rendezvous on 127.0.0.1:{port} .*"
                                                  r"set COMFYUI_MULTI_DEVICE_RENDEZVOUS to an address of this "
                                                  r"server and a free port"):
            rendezvous_at("127.0.0.1", port, timeout_s=10)


def test_a_follower_without_rank_0_says_so():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    with pytest.raises(RendezvousError, match=rf"rank 0 is not serving 127.0.0.1:{port}"):
        PoolFollower("127.0.0.1", port, timeout_s=1)
