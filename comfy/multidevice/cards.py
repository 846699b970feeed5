"""Card selection for the node: which visible cards a run uses, or an error that names the fix.

`probe_devices()` asks torch (and torch_npu when installed) how many accelerators of each kind
are visible. `select_devices(n_cards, kind, devices, inventory)` turns the node's request into a
list of device names ('npu:0', 'cuda:1', 'cpu'; strings, because an 'npu' torch.device only
exists once torch_npu is imported), or raises one of the errors below. Each error says what
was asked, what was found (count, kind, the visible-devices variable) and what to change.
Nothing here moves weights or changes state, so the caller can validate first and only then
touch the models. `auto_kind` and `visible_device_names` are the rules the doctor and the dry
run share with it.

CPU "devices" exist for tests and the dry run: asking for `kind="cpu"` gives n CPU ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from comfy.multidevice.comm.settings import read_visible_devices, VISIBLE_DEVICES_ENV
from comfy.multidevice.commands import CLI_SCRIPT, script_command
from comfy.multidevice.devices import accelerator_api, ACCELERATOR_KINDS


SUPPORTED_CARD_COUNTS = (1, 2, 4, 8)
DEVICE_KINDS = ("auto",) + ACCELERATOR_KINDS + ("cpu",)


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
        counts = [f"{k}: {self.count(k)} ({self.env_text(k)})" for k in ACCELERATOR_KINDS]
        return "; ".join(counts + list(self.notes))


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
    return DeviceInventory(counts=counts, env=read_visible_devices(), notes=tuple(notes))


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
                        f"run {script_command(CLI_SCRIPT, 'doctor')})")
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
                f"build of torch is installed ({script_command(CLI_SCRIPT, 'doctor')} says which), or "
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



def auto_kind(inventory: DeviceInventory) -> str:
    """device kind "auto": the NPUs when any are visible, else the CUDA GPUs, else the CPU."""
    return next((k for k in ACCELERATOR_KINDS if inventory.count(k)), "cpu")


def visible_device_names(kind: str, inventory: DeviceInventory) -> list[str]:
    """'npu:0', 'npu:1', ... for every visible card of `kind`."""
    return [f"{kind}:{i}" for i in range(inventory.count(kind))]
