"""Peer access between the cards of one process, enabled once per ordered pair, serially.

The peer-copy backend's rank threads copy from each other's cards. torch_npu (its
NPUPeerToPeerAccess) and PyTorch's CUDA copy enable peer access for a pair lazily, at the
first copy between them, through a cache without a lock: several rank threads making their
first copies at once may race on it (CARDS.md). So the backend enables every pair here, at
its start, one pair after the other, each from a short-lived thread that made the source card
current first; the rank threads then only meet pairs already enabled.

torch_npu counts each NPU in its own peer group and enables at most 8 per group: a card gets
at most 7 peers; beyond that, its copies of a pair are not peer copies. A coordinator whose
NPUs would need more is refused with the fix named, before any copy.
"""

from __future__ import annotations

import threading
from collections import defaultdict

import torch

from comfy.multidevice.comm.errors import BackendUnavailable
from comfy.multidevice.comm.settings import BACKEND_ENV
from comfy.multidevice.devices import accelerator_api, call_on_device_thread

# Per device kind: how many other cards one card may be opened to (torch_npu: a group of 8).
MAX_PEERS_PER_CARD = {"npu": 7}
NATIVE_BACKEND = {"npu": "hccl", "cuda": "nccl"}

_lock = threading.Lock()  # one enabling at a time in the process, whichever coordinator asks
_enabled: set[tuple[str, int, int]] = set()  # (kind, source index, destination index)


class TooManyPeers(BackendUnavailable):
    """The peer-copy backend would open a card to more peers than its runtime allows."""


def _touch(source, destination) -> None:
    """One tiny copy source -> destination: the runtime enables the pair on its first copy."""
    torch.zeros(1, device=source).to(destination)


def _check_limit(wanted: set[tuple[str, int, int]], devices) -> None:
    by_card = defaultdict(set)
    for kind, a, b in _enabled | wanted:  # torch_npu counts a pair on both cards
        by_card[(kind, a)].add(b)
        by_card[(kind, b)].add(a)
    for (kind, card), peers in sorted(by_card.items()):
        limit = MAX_PEERS_PER_CARD.get(kind)
        if limit is not None and len(peers) > limit:
            raise TooManyPeers(
                f"peer-copy over {', '.join(map(str, devices))} would open {kind}:{card} to "
                f"{len(peers)} other cards ({', '.join(f'{kind}:{p}' for p in sorted(peers))}); "
                f"the runtime enables peer access for at most {limit} per card (a group of "
                f"{limit + 1}), and copies beyond it are not peer copies. Use at most {limit + 1} "
                f"cards with the peer backend, or the {NATIVE_BACKEND.get(kind, 'native')} backend "
                f"({BACKEND_ENV}={NATIVE_BACKEND.get(kind, 'auto')})")


def enable_peer_access(devices) -> list[tuple[str, int, int]]:
    """Enable peer access for every ordered pair of distinct accelerator cards in `devices`
    not enabled yet in this process; the pairs enabled now. CPU devices need nothing."""
    by_index = {(d.type, d.index): d for d in devices
                if d.index is not None and accelerator_api(d.type) is not None}
    with _lock:
        wanted = {(kind, a, b) for (kind, a) in by_index for (other, b) in by_index
                  if other == kind and a != b and (kind, a, b) not in _enabled}
        _check_limit(wanted, devices)
        done = []
        for kind, a in sorted({(kind, a) for kind, a, _ in wanted}):
            pairs = sorted(p for p in wanted if p[:2] == (kind, a))
            source = by_index[(kind, a)]

            def touch_all(source=source, pairs=pairs):
                for k, _, b in pairs:
                    _touch(source, by_index[(k, b)])
            call_on_device_thread(source, touch_all)  # one source card at a time, joined
            _enabled.update(pairs)
            done += pairs
        return done
