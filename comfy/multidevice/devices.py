"""Devices: npu / cuda / cpu dispatch, which cards are visible, checks before any weight moves.

`accelerator_api(kind)` is torch.npu / torch.cuda / None; every per-kind call of the package
(current device, stream, synchronize, cache) goes through it. `probe_devices()` asks torch
(and torch_npu when installed) how many accelerators of each kind are visible.
`select_devices(n_cards, kind, devices, inventory)` turns the node's request into a list of
device names ('npu:0', 'cuda:1', 'cpu'; strings, because an 'npu' torch.device only exists once
torch_npu is imported), or raises one of the errors below. Each error says what was asked, what
was found (count, kind, the visible-devices variable) and what to change. Nothing here moves
weights or changes state, so the caller can validate first and only then touch the models.
`auto_kind` and `visible_device_names` are the rules the doctor and the dry run share with it.

CPU "devices" exist for tests and the dry run: asking for `kind="cpu"` gives n CPU ranks.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- devices

def resolve_device(spec: Any) -> torch.device:
    """'npu:1' / 'cuda:0' / 'cpu' / torch.device -> torch.device (imports torch_npu for npu)."""
    if isinstance(spec, torch.device):
        return spec
    text = str(spec)
    if text.startswith("npu"):
        try:
            import torch_npu  # noqa: F401  (registers the 'npu' device type)
        except ImportError as exc:
            raise ValueError(
                f"device {text!r} needs torch_npu, which is not installed; "
                "run install_deps_minimax_h3.sh on the Ascend host or use cuda/cpu devices") from exc
    try:
        return torch.device(text)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {text!r}: use 'npu:i', 'cuda:i' or 'cpu'") from exc


def accelerator_api(kind: str):
    """torch.npu or torch.cuda for an accelerator kind, None for the CPU or when torch_npu is
    not installed. Importing torch_npu is what registers torch.npu."""
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            return None
        return torch.npu
    return None


def set_thread_device(device: torch.device) -> None:
    """Make `device` current for the calling thread (NPU/CUDA keep a per-thread current device)."""
    api = accelerator_api(device.type)
    if api is not None:
        api.set_device(device)


def synchronize(device: torch.device) -> None:
    api = accelerator_api(device.type)
    if api is not None:
        api.current_stream(device).synchronize()


def free_memory_bytes(device) -> int | None:
    """Bytes a card can still give: free on the device plus what this process's caching
    allocator holds unused. None for the CPU (or when the runtime cannot say)."""
    device = resolve_device(device)
    api = accelerator_api(device.type)
    if api is None or not hasattr(api, "mem_get_info"):
        return None
    try:
        free, _total = api.mem_get_info(device)
        cached = api.memory_reserved(device) - api.memory_allocated(device)
    except Exception:  # a runtime that cannot answer: the plan reports "unknown"
        return None
    return int(free + max(cached, 0))


def available_memory_bytes() -> int | None:
    """Host memory a new allocation can get now (MemAvailable), else the total RAM: what CPU
    ranks, which share it, can still use."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def current_stream_handle(device: torch.device) -> int | None:
    """The raw stream handle of the calling thread's current stream (None on CPU)."""
    api = accelerator_api(device.type)
    if api is None:
        return None
    stream = api.current_stream(device)
    return stream.npu_stream if device.type == "npu" else stream.cuda_stream


def copy_for_rank(obj: Any, device: torch.device, copy_tensors: bool = False) -> Any:
    """A per-rank copy of call inputs: containers rebuilt, tensors moved to `device`.

    dicts, lists and tuples are rebuilt (a rank may add keys, e.g. its block replacements or
    `block_index`, without the others seeing them); tensors go to the rank's device (always a
    new tensor with copy_tensors: upstream's blocks may write into their input buffer); every
    other object (callables, modules, layouts, named tuples) is shared. Not copy.deepcopy:
    transformer_options carry wrappers that hold the coordinator and the model replicas.
    """
    if torch.is_tensor(obj):
        return obj.to(device, copy=copy_tensors)
    if isinstance(obj, dict):
        return {k: copy_for_rank(v, device, copy_tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_for_rank(v, device, copy_tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(copy_for_rank(v, device, copy_tensors) for v in obj)
    return obj


SUPPORTED_CARD_COUNTS = (1, 2, 4, 8)
ACCELERATOR_KINDS = ("npu", "cuda")
DEVICE_KINDS = ("auto",) + ACCELERATOR_KINDS + ("cpu",)

# The variable that decides which physical cards a process sees, per kind.
VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES"}


class DeviceSelectionError(ValueError):
    """The requested cards cannot be used as asked; the message says what to change."""


class UnsupportedCardCount(DeviceSelectionError):
    pass


class TooFewDevices(DeviceSelectionError):
    pass


class MixedDeviceKinds(DeviceSelectionError):
    pass


class InvalidDeviceList(DeviceSelectionError):
    pass


@dataclass(frozen=True)
class DeviceInventory:
    """Visible accelerators per kind, the visible-devices variables, and probe notes."""

    counts: dict = field(default_factory=dict)      # kind -> visible count (npu, cuda)
    env: dict = field(default_factory=dict)         # variable name -> value or None
    notes: tuple = ()                               # why a kind could not be probed

    def count(self, kind: str) -> int:
        return int(self.counts.get(kind, 0))

    def env_text(self, kind: str) -> str:
        name = VISIBLE_DEVICES_ENV.get(kind)
        if name is None:
            return "no visible-devices variable for cpu"
        value = self.env.get(name)
        return f"{name}={value}" if value is not None else f"{name} unset"

    def describe(self) -> str:
        """'npu: 2 (ASCEND_RT_VISIBLE_DEVICES=0,1); cuda: 0 (CUDA_VISIBLE_DEVICES unset)'."""
        parts = [f"{k}: {self.count(k)} ({self.env_text(k)})" for k in ACCELERATOR_KINDS]
        text = "; ".join(parts)
        if self.notes:
            text += "; " + "; ".join(self.notes)
        return text


def _visible_env() -> dict:
    names = set(VISIBLE_DEVICES_ENV.values()) | {"ASCEND_VISIBLE_DEVICES"}
    return {name: os.environ.get(name) for name in sorted(names)}


def probe_devices() -> DeviceInventory:
    """Count the visible NPUs and CUDA GPUs. Never raises: a failed probe counts 0 and says why."""
    counts = {"npu": 0, "cuda": 0}
    notes = []
    try:
        npu = accelerator_api("npu")  # None: no Ascend stack here, simply no NPUs
        counts["npu"] = int(npu.device_count()) if npu is not None else 0
    except Exception as exc:  # torch_npu present but the driver/CANN is broken
        notes.append(f"npu probe failed: {type(exc).__name__}: {exc}")
    try:
        counts["cuda"] = int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception as exc:
        notes.append(f"cuda probe failed: {type(exc).__name__}: {exc}")
    return DeviceInventory(counts=counts, env=_visible_env(), notes=tuple(notes))


# ----------------------------------------------------------------------------- checks

def check_card_count(n_cards) -> int:
    """The count itself: an int in SUPPORTED_CARD_COUNTS (bool and float are refused, not cast)."""
    if isinstance(n_cards, bool) or not isinstance(n_cards, int) or n_cards not in SUPPORTED_CARD_COUNTS:
        raise UnsupportedCardCount(
            f"npu_count={n_cards!r} is not supported: set npu_count to one of "
            f"{', '.join(map(str, SUPPORTED_CARD_COUNTS))}, the largest one not above the number of "
            f"cards you have.")
    return n_cards


def largest_supported_at_most(available: int) -> int | None:
    fitting = [n for n in SUPPORTED_CARD_COUNTS if n <= available]
    return fitting[-1] if fitting else None


def _too_few(n_cards: int, kind: str, found: int, inventory: DeviceInventory) -> TooFewDevices:
    fit = largest_supported_at_most(found)
    env_name = VISIBLE_DEVICES_ENV[kind]
    fixes = [f"make {n_cards} {kind} cards visible to ComfyUI "
             f"(start it with e.g. {env_name}={','.join(str(i) for i in range(n_cards))})"]
    if fit is not None:
        fixes.insert(0, f"set npu_count to {fit}")
    other = [k for k in ACCELERATOR_KINDS if k != kind and inventory.count(k) >= n_cards]
    if other:
        fixes.append(f"set device_kind to {other[0]} ({inventory.count(other[0])} visible)")
    # A failed probe (e.g. torch_npu present but CANN's set_env.sh not sourced) is the real
    # cause of "0 found": say it first, or the user hunts for cards that are there.
    failed = [note for note in inventory.notes if note.startswith(f"{kind} probe failed")]
    if failed:
        fixes.insert(0, f"repair the {kind} software stack ({'; '.join(failed)}; "
                        f"run minimax_h3_parallel.py doctor)")
    return TooFewDevices(
        f"npu_count is {n_cards} but {found} {kind} card(s) are visible ({inventory.env_text(kind)}): "
        + ", or ".join(fixes) + ".")


_DEVICE_LIST_HELP = ("write 'npu:i', 'cuda:i' or 'cpu' (i = 0, 1, ... in the digits 0-9), separated "
                     "by commas (e.g. 'npu:0,npu:1,npu:2,npu:3'), or leave devices empty to use the "
                     "first npu_count visible cards")


def parse_device_list(text: str | Sequence) -> list[tuple[str, int | None]]:
    """'npu:0, npu:2' (or a list of such strings) -> [(kind, index)].

    Refuses, naming the entry: a value that is not text, empty entries (',,'), bare indices,
    unknown kinds, indices that are not plain ASCII digits (also for 'cpu:i'), duplicates.
    """
    if isinstance(text, str):
        if not text.strip():  # only blanks: the same as empty
            return []
        items = text.split(",")
    elif isinstance(text, (list, tuple)):
        items = list(text)
    else:
        raise InvalidDeviceList(f"devices={text!r} is of type {type(text).__name__}, not text: "
                                f"{_DEVICE_LIST_HELP}.")
    devices = []
    for position, item in enumerate(items, 1):
        if not isinstance(item, str):
            raise InvalidDeviceList(f"devices entry {position} ({item!r}) is of type "
                                    f"{type(item).__name__}, not text: {_DEVICE_LIST_HELP}.")
        item = item.strip()
        if not item:
            raise InvalidDeviceList(f"devices entry {position} is empty (in {text!r}): remove the "
                                    f"extra comma; {_DEVICE_LIST_HELP}.")
        kind, colon, index = (part.strip() for part in item.partition(":"))
        kind = kind.lower()
        ascii_index = index.isascii() and index.isdigit()
        if kind not in ("npu", "cuda", "cpu") or (colon and not ascii_index) or (kind != "cpu" and not colon):
            raise InvalidDeviceList(f"devices entry {item!r} is not a device: {_DEVICE_LIST_HELP}.")
        devices.append((kind, int(index) if colon else None))
    dup = sorted({_name(d) for d in devices if d[0] != "cpu" and devices.count(d) > 1})
    if dup:
        raise InvalidDeviceList(f"devices lists {', '.join(dup)} more than once; each card can "
                                f"hold one rank: list distinct cards.")
    return devices


def _name(spec: tuple[str, int | None]) -> str:
    kind, index = spec
    return kind if index is None else f"{kind}:{index}"


def _kinds_found(devices: Iterable[tuple]) -> list[str]:
    return sorted({kind for kind, _ in devices})


def select_devices(n_cards, kind: str = "auto", devices: str | Sequence | None = None,
                   inventory: DeviceInventory | None = None) -> list[str]:
    """The cards ('npu:0', ...) for an n-card plan, all of one kind; raises before anything is touched.

    kind: 'auto' (the one accelerator kind that is visible), 'npu', 'cuda', or 'cpu' (tests).
    devices: an explicit list ('npu:0,npu:2,...'); empty/None means the first n visible cards.
    """
    try:
        n_cards = check_card_count(n_cards)
    except UnsupportedCardCount:
        if kind == "cpu":
            raise
        inventory = inventory if inventory is not None else probe_devices()
        visible = max((inventory.count(k) for k in ACCELERATOR_KINDS), default=0)
        fit = largest_supported_at_most(visible)
        counts = ", ".join(map(str, SUPPORTED_CARD_COUNTS))
        fix = (f"set npu_count to {fit}, the largest of {counts} not above the {visible} card(s) visible"
               if fit is not None else f"set npu_count to one of {counts}; no card is visible")
        raise UnsupportedCardCount(f"npu_count={n_cards!r} is not supported: {fix} "
                                   f"({inventory.describe()}).") from None
    if kind not in DEVICE_KINDS:
        raise DeviceSelectionError(f"device_kind={kind!r} is unknown: set device_kind to one of "
                                   f"{', '.join(DEVICE_KINDS)}.")
    explicit = [] if devices is None or devices == "" else parse_device_list(devices)
    if kind == "cpu" or (explicit and _kinds_found(explicit) == ["cpu"]):
        if explicit and _kinds_found(explicit) != ["cpu"]:
            raise MixedDeviceKinds(
                f"device_kind is cpu but devices lists {', '.join(map(_name, explicit))}: "
                f"clear devices or set device_kind to auto.")
        if explicit and len(explicit) != n_cards:
            raise InvalidDeviceList(f"devices lists {len(explicit)} entries but npu_count is {n_cards}: "
                                    f"list exactly {n_cards} or leave devices empty.")
        return ["cpu"] * n_cards

    inventory = inventory if inventory is not None else probe_devices()
    if explicit:
        return _check_explicit(n_cards, kind, explicit, inventory)

    if kind == "auto":
        present = [k for k in ACCELERATOR_KINDS if inventory.count(k) > 0]
        if len(present) > 1:
            raise MixedDeviceKinds(
                f"device_kind is auto but more than one kind of card is visible "
                f"({inventory.describe()}): set device_kind to {' or '.join(present)}, since all "
                f"{n_cards} cards of a run must be of one kind.")
        if not present:
            raise TooFewDevices(
                f"npu_count is {n_cards} but this server sees no NPU or CUDA card "
                f"({inventory.describe()}): check the driver and that torch_npu (Ascend) or a CUDA "
                f"build of torch is installed (python minimax_h3_parallel.py doctor says which), or "
                f"set device_kind to cpu for a CPU-only test run.")
        kind = present[0]
    found = inventory.count(kind)
    if found < n_cards:
        raise _too_few(n_cards, kind, found, inventory)
    return [f"{kind}:{i}" for i in range(n_cards)]


def _check_explicit(n_cards: int, kind: str, explicit: list[tuple],
                    inventory: DeviceInventory) -> list[str]:
    kinds = _kinds_found(explicit)
    if len(kinds) > 1:
        raise MixedDeviceKinds(
            f"devices mixes kinds ({', '.join(map(_name, explicit))}); the ranks exchange tensors "
            f"through one backend, so list cards of one kind only.")
    if kind not in ("auto", kinds[0]):
        raise MixedDeviceKinds(
            f"device_kind is {kind} but devices lists {kinds[0]} cards "
            f"({', '.join(map(_name, explicit))}): make them agree (or set device_kind to auto).")
    if len(explicit) != n_cards:
        raise InvalidDeviceList(f"devices lists {len(explicit)} card(s) but npu_count is {n_cards}: "
                                f"list exactly {n_cards} cards or leave devices empty.")
    kind = kinds[0]
    found = inventory.count(kind)
    missing = [_name(d) for d in explicit if d[1] is None or d[1] >= found]
    if missing:
        raise TooFewDevices(
            f"devices asks for {', '.join(missing)}, but only {found} {kind} card(s) are visible "
            f"({inventory.env_text(kind)}; indices count from 0 among the visible cards): list "
            f"cards below {kind}:{found}, or make more cards visible to ComfyUI.")
    return [_name(d) for d in explicit]


def module_device(module) -> torch.device | None:
    """The device of the module's first parameter (or buffer); None for a tensor-less object."""
    if not isinstance(module, torch.nn.Module):
        return None
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return None


def auto_kind(inventory: DeviceInventory) -> str:
    """device kind "auto": the NPUs when any are visible, else the CUDA GPUs, else the CPU."""
    return next((k for k in ACCELERATOR_KINDS if inventory.count(k)), "cpu")


def visible_device_names(kind: str, inventory: DeviceInventory) -> list[str]:
    """'npu:0', 'npu:1', ... for every visible card of `kind`."""
    return [f"{kind}:{i}" for i in range(inventory.count(kind))]
