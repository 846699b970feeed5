"""Peer access enabled once per pair, serially, before the peer-copy backend's ranks copy
(comm/peer_access.py), over a stand-in card API: torch_npu enables a pair at its first copy
through an unlocked cache and opens a card to at most 7 peers (CARDS.md)."""

from __future__ import annotations

import threading

import pytest
import torch

from comfy.multidevice import devices
from comfy.multidevice.comm import peer_access
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.peer import copies_may_overlap, PeerCopyBackend
from comfy.multidevice.comm.peer_access import enable_peer_access, TooManyPeers


class Card:
    """A card as peer_access reads it (type, index), named like torch.device."""

    def __init__(self, kind, index):
        self.type, self.index = kind, index

    def __str__(self):
        return f"{self.type}:{self.index}"


class CardApi:
    """torch.npu as far as enabling peer access (and a peer-copy exchange) uses it: the
    per-thread current card, a stream to synchronize."""

    def __init__(self):
        self.local = threading.local()

    def set_device(self, device):
        self.local.device = device

    def current(self):
        return getattr(self.local, "device", None)

    def current_stream(self, device):  # what the coordinator synchronizes before a peer reads
        return self

    def synchronize(self):
        pass


@pytest.fixture
def cards(monkeypatch):
    """A fresh process registry, a stand-in API for `npu` (and for `cpu`, so CPU ranks act as
    cards), and every touch recorded as (event, source, destination, the thread's card, thread)."""
    api = CardApi()
    touches = []
    monkeypatch.setattr(peer_access, "_enabled", set())
    for module in (devices, peer_access):
        monkeypatch.setattr(module, "accelerator_api", lambda kind: api if kind in ("npu", "cpu") else None)

    def touch(source, destination):
        touches.append(("start", str(source), str(destination), str(api.current()), threading.get_ident()))
        touches.append(("end", str(source), str(destination)))
    monkeypatch.setattr(peer_access, "_touch", touch)
    return touches


def pairs(touches):
    return [(t[1], t[2]) for t in touches if t[0] == "start"]


def test_every_ordered_pair_is_touched_once_from_a_thread_on_its_source_card(cards):
    four = [Card("npu", i) for i in range(4)]
    enabled = enable_peer_access(four)
    assert len(enabled) == 12 and sorted(pairs(cards)) == sorted(
        (f"npu:{a}", f"npu:{b}") for a in range(4) for b in range(4) if a != b)
    starts = [t for t in cards if t[0] == "start"]
    assert all(t[3] == t[1] for t in starts)  # the thread made the source card current first
    assert threading.get_ident() not in {t[4] for t in starts}
    # serially: each touch ends before the next starts
    assert [t[0] for t in cards] == ["start", "end"] * 12
    assert enable_peer_access(four[1:]) == [] and len(pairs(cards)) == 12  # once per process


def test_two_coordinators_starting_at_once_touch_each_pair_once(cards):
    go = threading.Barrier(2)
    results = []

    def start(cards_of_this_one):
        go.wait()
        results.append(enable_peer_access(cards_of_this_one))
    threads = [threading.Thread(target=start, args=([Card("npu", i) for i in (0, 1, 2)],)),
               threading.Thread(target=start, args=([Card("npu", i) for i in (1, 2, 3)],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(pairs(cards)) == sorted(set(pairs(cards)))  # no pair twice
    assert len(pairs(cards)) == 6 + 6 - 2 and sum(len(r) for r in results) == 10
    assert [t[0] for t in cards] == ["start", "end"] * 10


def test_nine_npus_are_refused_with_the_fix_before_any_copy(cards):
    with pytest.raises(TooManyPeers, match=r"npu:0 to 8 other cards.*at most 7 per card.*Use at "
                                           r"most 8 cards with the peer backend, or the hccl backend "
                                           r"\(COMFYUI_MULTI_DEVICE_BACKEND=hccl\)"):
        enable_peer_access([Card("npu", i) for i in range(9)])
    assert cards == []
    assert len(enable_peer_access([Card("npu", i) for i in range(8)])) == 56  # a group of 8 is fine


def test_the_limit_counts_the_pairs_earlier_coordinators_enabled(cards):
    enable_peer_access([Card("npu", i) for i in range(8)])
    with pytest.raises(TooManyPeers, match=r"npu:0 to 8 other cards \(npu:1, .*npu:8\)"):
        enable_peer_access([Card("npu", 0), Card("npu", 8)])
    enable_peer_access([Card("npu", 8), Card("npu", 9)])  # cards outside the group: fine


def test_cuda_has_no_such_limit_and_cpu_needs_nothing(cards, monkeypatch):
    monkeypatch.setattr(peer_access, "accelerator_api", lambda kind: object() if kind == "cuda" else None)
    assert enable_peer_access([torch.device("cpu")] * 3) == []
    monkeypatch.setattr(peer_access, "call_on_device_thread", lambda device, fn: fn())
    assert len(enable_peer_access([Card("cuda", i) for i in range(9)])) == 72


def test_the_peer_backend_enables_its_pairs_before_the_rank_threads_start(cards):
    with SequenceParallelCoordinator(["cpu:0", "cpu:1", "cpu:2"], backend="peer", timeout_s=20) as coord:
        assert isinstance(coord.backend, PeerCopyBackend)
        assert len(pairs(cards)) == 6
        out = coord.run(lambda rank, comm: comm.exchange([torch.full((rank + 1,), float(rank))], 0)[0])
    assert all(torch.equal(o, torch.tensor([0.0, 1, 1, 2, 2, 2])) for o in out)


def test_copies_to_an_npu_do_not_pretend_to_be_non_blocking():
    assert not copies_may_overlap(Card("npu", 0))
    assert copies_may_overlap(torch.device("cpu")) and copies_may_overlap(Card("cuda", 1))
