"""Rank 0's door (workers/door.py, admission.py, door_client.py) against strangers: only a
holder of the pool's key is admitted, both sides check versions, a stranger's bytes are
bounded in size, time and number, a rank is held by one process, and the pool's store is
reachable only through the door (it listens on loopback). Refusals are named by address."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import threading
import time

import pytest

from comfy.multidevice.workers import admission
from comfy.multidevice.workers.admission import AdmissionError
from comfy.multidevice.workers.door import Door, MAX_UNPROVEN, RendezvousError
from comfy.multidevice.workers.door_client import Following, RankLink, RankZeroLost, store_through_door
from comfy.multidevice.workers.rendezvous import interface_of, rendezvous_at

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def door():
    d = Door("127.0.0.1", 0, timeout_s=10, base_secret=admission.random_base())
    yield d
    d.close()


def _wait(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_rank_with_the_key_is_admitted_named_and_woken_by_go(door):
    pool = door.open_pool(world=3, local=3)
    link = RankLink("127.0.0.1", door.port, pool.key, 1, pool.generation)
    _wait(lambda: 1 in pool.members)
    assert pool.missing() == [2]
    assert pool.identity(1).rank == 1 and "[127.0.0.1]" in pool.identity(1).server
    pool.go()
    link.wait_for_go()  # returns: the go arrived
    link.close()
    _wait(lambda: [i.rank for i in pool.ended()] == [1])  # the closed connection names it


def test_a_wrong_key_is_refused_on_both_sides_and_named_by_address(door, caplog):
    pool = door.open_pool(world=2, local=2)
    with pytest.raises(AdmissionError, match="does not prove the pool's secret"):
        RankLink("127.0.0.1", door.port, b"\x01" * 32, 1, pool.generation)
    assert pool.members == {}
    # a stranger that answers rank 0's proof with garbage is refused and named
    conn = socket.create_connection(("127.0.0.1", door.port))
    admission.send_line(conn, {"hello": "minimax-h3 pool", **admission.versions(), "purpose": "live", "rank": 1,
                               "generation": pool.generation, "nonce": "n"})
    reader = admission.LineReader(conn, "door")
    assert "proof" in reader.read(5)
    admission.send_line(conn, {"proof": "0" * 64})
    assert "does not prove the pool's secret" in reader.read(5)["refused"]
    conn.close()
    _wait(lambda: any("claiming rank 1" in r for r in door.refusals))
    assert all(r.startswith("127.0.0.1:") for r in door.refusals)
    assert pool.members == {}


def test_another_version_is_refused_on_both_sides_naming_both_versions(door):
    pool = door.open_pool(world=2, local=2)
    # an older worker greets rank 0
    conn = socket.create_connection(("127.0.0.1", door.port))
    admission.send_line(conn, {"hello": "minimax-h3 pool", "project": "0.0.9", "protocol": 2, "purpose": "live",
                               "rank": 1, "generation": pool.generation, "nonce": "n"})
    refused = admission.LineReader(conn, "door").read(5)["refused"]
    assert ("runs MiniMax-H3 multi-device '0.0.9' (pool protocol 2, message schema None) and rank 0 runs '0.1.0' "
            "(pool protocol 3, message schema 1)") in refused
    assert "install the same version on every server" in refused
    conn.close()
    # a worker meets an older rank 0 (here: a program answering as one)
    with socket.create_server(("127.0.0.1", 0)) as old:
        def answer():
            peer, _ = old.accept()
            admission.LineReader(peer, "worker").read(5)
            admission.send_line(peer, {"project": "0.1.0", "protocol": 3, "schema": 2, "nonce": "m", "proof": "0" * 64})
            time.sleep(0.5)
            peer.close()
        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(AdmissionError, match=r"rank 0 at .* runs MiniMax-H3 multi-device '0.1.0' \(pool protocol 3, "
                                                 r"message schema 2\) and this server runs '0.1.0' \(pool protocol 3, "
                                                 r"message schema 1\)"):
            RankLink("127.0.0.1", old.getsockname()[1], pool.key, 1, pool.generation)


def test_a_rank_is_held_by_one_process_and_must_exist(door):
    pool = door.open_pool(world=3, local=1)
    first = RankLink("127.0.0.1", door.port, pool.key, 2, pool.generation)
    with pytest.raises(AdmissionError, match=r"claims rank 2, but rank 2 of pool 1 is held by rank 2 on .*pid"):
        RankLink("127.0.0.1", door.port, pool.key, 2, pool.generation)
    with pytest.raises(AdmissionError, match=r"claims rank 5, but pool 1 has ranks 1-2 .* --first-rank"):
        RankLink("127.0.0.1", door.port, pool.key, 5, pool.generation)
    with pytest.raises(AdmissionError, match="asked for pool 7, which this server does not hold"):
        RankLink("127.0.0.1", door.port, pool.key, 1, 7)
    door.close_pool(pool)
    with pytest.raises(AdmissionError, match="has started without it"):
        RankLink("127.0.0.1", door.port, pool.key, 1, pool.generation)
    first.close()


def test_a_strangers_bytes_are_bounded_in_size_time_and_number(door, monkeypatch):
    monkeypatch.setattr(admission, "HANDSHAKE_S", 1.0)
    # a line without end: read up to MAX_LINE bytes, then refused (not buffered without bound)
    conn = socket.create_connection(("127.0.0.1", door.port))
    try:
        conn.sendall(b"x" * (admission.MAX_LINE * 4))
    except OSError:
        pass
    _wait(lambda: any(f"a line over {admission.MAX_LINE} bytes" in r for r in door.refusals))
    conn.close()
    # silence: dropped after the handshake's deadline
    quiet = socket.create_connection(("127.0.0.1", door.port))
    _wait(lambda: any("sent nothing within 1 s" in r for r in door.refusals))
    assert quiet.recv(4096).startswith(b'{"refused"')
    quiet.close()
    # a crowd in their handshake: beyond MAX_UNPROVEN, closed at once
    crowd = [socket.create_connection(("127.0.0.1", door.port)) for _ in range(MAX_UNPROVEN + 5)]
    _wait(lambda: sum("too many connections" in r for r in door.refusals) >= 5)
    for c in crowd:
        c.close()
    # garbage that parses as JSON but not as a hello
    junk = socket.create_connection(("127.0.0.1", door.port))
    junk.sendall(json.dumps({"hello": "minimax-h3 pool", **admission.versions(), "purpose": "live",
                             "rank": "1; rm -rf /", "generation": 1, "nonce": "n"}).encode() + b"\n")
    assert b"no valid 'rank'" in junk.recv(4096)
    junk.close()


def test_the_store_listens_on_loopback_and_only_admitted_ranks_reach_it_through_the_door(door):
    pool = door.open_pool(world=2, local=2)
    listeners = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True).stdout
    store_lines = [line for line in listeners.splitlines() if line.split()[3].endswith(f":{door.store_port}")]
    assert store_lines and all(line.split()[3] == f"127.0.0.1:{door.store_port}" for line in store_lines)
    with pytest.raises(RendezvousError, match="could not be reached: .*not .*admitted"):
        store_through_door("127.0.0.1", door.port, pool.key, 1, pool.generation, timeout_s=3)
    link = RankLink("127.0.0.1", door.port, pool.key, 1, pool.generation)
    client, tunnel = store_through_door("127.0.0.1", door.port, pool.key, 1, pool.generation, timeout_s=5)
    client.set("k", "v")  # under the pool's prefix, as rank 0's view of the store has it
    assert door.store.get(pool.store_prefix + "/k") == b"v" and door.store_of(pool).get("k") == b"v"
    link.close()
    tunnel.close()


def test_a_join_command_follows_pools_with_remote_ranks_and_overlaps_are_refused(door, caplog):
    base = b"s" * 32
    cluster = Door("127.0.0.1", 0, timeout_s=10, base_secret=base)
    try:
        following = Following("127.0.0.1", cluster.port, base, 2, 2)
        _wait(lambda: cluster.followers)
        with pytest.raises(AdmissionError, match=r"claims ranks 3-3, but the join command at .* holds ranks 2-3"):
            Following("127.0.0.1", cluster.port, base, 3, 1)
        with pytest.raises(AdmissionError, match="does not prove the pool's secret"):
            Following("127.0.0.1", cluster.port, b"t" * 32, 4, 1)  # another secret
        cluster.open_pool(world=2, local=2)  # no remote ranks: not announced
        with caplog.at_level(logging.WARNING, logger="comfy.multidevice.workers.door"):
            misfit = cluster.open_pool(world=4, local=3)  # ranks 0-2 here: 2-3 overlap
        assert following.next_pool()[0] == misfit.generation  # announced: the join command says why it skips
        assert f"runs ranks 2-3, which do not fit pool {misfit.generation} (ranks 0-2 on this server" in caplog.text
        pool = cluster.open_pool(world=4, local=2)
        assert following.next_pool() == (pool.generation, 4, 2, pool.key)
        assert "no join command" in cluster.covering(5) and "ranks 2-3" in cluster.covering(3)
        following.close()
    finally:
        cluster.close()


def test_one_door_per_address_and_a_taken_port_is_named(door):
    first = rendezvous_at("127.0.0.1", 0, timeout_s=10)
    assert rendezvous_at("127.0.0.1", 0, timeout_s=10) is first
    assert rendezvous_at("127.0.0.1", first.port, timeout_s=10) is first
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RendezvousError, match=rf"cannot serve the worker rendezvous on 127.0.0.1:{port}"):
            rendezvous_at("127.0.0.1", port, timeout_s=10)


def test_remote_ranks_need_the_cluster_secret(monkeypatch, tmp_path):
    monkeypatch.delenv(admission.SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv(admission.SECRET_ENV, raising=False)
    with pytest.raises(admission.SecretError, match="COMFYUI_MULTI_DEVICE_SECRET_FILE .*secrets.token_hex"):
        admission.cluster_secret(required=True)
    short = tmp_path / "short"
    short.write_text("abc")
    monkeypatch.setenv(admission.SECRET_FILE_ENV, str(short))
    with pytest.raises(admission.SecretError, match="3 bytes, under 16"):
        admission.cluster_secret(required=True)
    monkeypatch.setenv(admission.SECRET_FILE_ENV, str(tmp_path / "absent"))
    with pytest.raises(admission.SecretError, match="cannot be read"):
        admission.cluster_secret(required=False)
    good = tmp_path / "good"
    good.write_text("f" * 64 + "\n")
    monkeypatch.setenv(admission.SECRET_FILE_ENV, str(good))
    assert admission.cluster_secret(required=True) == admission.cluster_secret(required=False)


def test_loopback_is_named_as_its_interface():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("localhost") == "lo"
    assert interface_of("203.0.113.9") is None  # an address no interface here holds


def test_a_silent_rank0_is_taken_for_lost(door, monkeypatch):
    from comfy.multidevice.workers import door_client
    from comfy.multidevice.workers.door_client import RankZeroLost
    pool = door.open_pool(world=2, local=2)
    monkeypatch.setattr(door_client, "HEARTBEAT_S", 0.1)  # 6 beats missed = 0.6 s; rank 0 beats every 5 s
    link = RankLink("127.0.0.1", door.port, pool.key, 1, pool.generation)
    started = time.monotonic()
    with pytest.raises(RankZeroLost, match="went silent"):
        link.wait_for_go()
    assert time.monotonic() - started < 4
    link.close()
    link = RankLink("127.0.0.1", door.port, pool.key, 1, pool.generation)
    door.close_pool(pool, drop=True)  # rank 0 tore the pool down
    with pytest.raises(RankZeroLost, match="closed the pool"):
        link.wait_for_go()


def test_a_dropped_pool_is_seen_by_a_worker_busy_elsewhere_and_not_after_a_stop(door):
    # a worker blocked in a collective never calls wait_for_go: the link's own reader must
    # tell it (gloo may keep the collective waiting for its whole timeout)
    pool = door.open_pool(world=3, local=3)
    told, finished_told = [], []
    busy = RankLink("127.0.0.1", door.port, pool.key, 1, pool.generation, on_lost=told.append)
    done = RankLink("127.0.0.1", door.port, pool.key, 2, pool.generation, on_lost=finished_told.append)
    _wait(lambda: 2 in pool.members)
    pool.members[2].send({"stop": 1})  # rank 0 stops this one (the others' stop is lost)
    assert done.wait_for_go() is False and done.wait_for_go() is False  # a stop stays said
    door.close_pool(pool, drop=True)
    _wait(lambda: told)
    assert "closed the pool" in str(told[0])
    with pytest.raises(RankZeroLost, match="closed the pool"):
        busy.wait_for_go()
    time.sleep(0.3)
    assert finished_told == []
    busy.close()
    done.close()
