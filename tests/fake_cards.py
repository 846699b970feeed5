"""A stand-in for torch.npu / torch.cuda that notes which thread touched which card without
having made it current first.

torch_npu gives a thread that touches the NPU without `set_device` card 0 (CARDS.md): a context
and streams on card 0 that no plan counts. `FakeCardApi` is installed as the accelerator API of
CPU "cards" (`cpu:0`, `cpu:1`, ...), so a threads-mode run on CPU goes through every per-card
call the package makes; a call naming a card (or, without one, the thread's current card) from a
thread that never called `set_device` for that card is a stray, kept in `strays` as
(thread name, card, call).
"""

from __future__ import annotations

import contextlib
import threading

import torch

# Every module that looks the accelerator API up by name (from comfy.multidevice.devices import ...).
PATCHED_MODULES = ("comfy.multidevice.devices", "comfy.multidevice.comm.peer_access",
                   "comfy.multidevice.weights.block_shards", "comfy.multidevice.sp.ulysses",
                   "comfy.multidevice.weights.offload")


class FakeStream:
    def __init__(self, api: "FakeCardApi", device):
        self.api, self.device = api, device
        self.cuda_stream = self.npu_stream = None  # the raw handle: none, as on the CPU

    def synchronize(self):
        self.api.touch(self.device, "Stream.synchronize")

    def record_event(self):
        self.api.touch(self.device, "Stream.record_event")
        return object()

    def wait_event(self, event):
        self.api.touch(self.device, "Stream.wait_event")

    def wait_stream(self, other):
        self.api.touch(self.device, "Stream.wait_stream")


class FakeCardApi:
    def __init__(self):
        self.local = threading.local()
        self.strays: list[tuple[str, str, str]] = []
        self.calls = 0
        self._lock = threading.Lock()

    def _set(self) -> set:
        if not hasattr(self.local, "cards"):
            self.local.cards = set()
        return self.local.cards

    def touch(self, device, call: str) -> None:
        with self._lock:
            self.calls += 1
        if device is None:  # "the current card": card 0 for a thread that never set one
            device = getattr(self.local, "current", None)
        card = str(torch.device(device)) if device is not None else "card 0 (never set)"
        if card not in self._set():
            with self._lock:
                self.strays.append((threading.current_thread().name, card, call))

    # -- the API the package calls
    def set_device(self, device):
        self._set().add(str(torch.device(device)))
        self.local.current = device

    def current_stream(self, device=None):
        self.touch(device, "current_stream")
        return FakeStream(self, device if device is not None else getattr(self.local, "current", None))

    def Stream(self, device=None):  # noqa: N802 - torch's name
        self.touch(device, "Stream")
        return FakeStream(self, device)

    def stream(self, stream):
        self.touch(stream.device, "stream")
        return contextlib.nullcontext()

    def synchronize(self, device=None):
        self.touch(device, "synchronize")

    def get_device_name(self, device=None):
        self.touch(device, "get_device_name")
        return "fake card"

    def empty_cache(self):
        self.touch(None, "empty_cache")


def install(monkeypatch) -> FakeCardApi:
    """The fake as the API of CPU cards in every module that looks it up; record_stream (which
    a CPU tensor cannot do with a fake stream) becomes a no-op."""
    import importlib
    api = FakeCardApi()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "accelerator_api", lambda kind: api if kind == "cpu" else None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    return api
