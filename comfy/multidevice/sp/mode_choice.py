"""Which sequence-parallel exchange the node runs: its `sp_mode` input, and the one rule of `auto`.

The node offers four choices; each becomes one of the two exchanges of strategies.py:

  allgather  every rank gathers the full K and V (any W, any heads, exact for uneven shards)
  ulysses    all-to-all from rows to heads: refused when the heads do not divide by W
  hybrid     Ulysses inside groups of U ranks (U: the largest divisor of W and the heads),
             K/V gathered across the groups; plain Ulysses when U = W
  auto       `choose_sp_mode`'s rule, first match:
    1. one rank: allgather (nothing is exchanged); an uneven split (`uneven_rows`, sp/split.py):
       allgather, since Ulysses needs even rows (ulysses / hybrid asked with one are refused);
    2. no group size above one divides both W and the heads: allgather (the hybrid would move
       the all-gather's bytes, in two rounds instead of one);
    3. this machine measured both exchanges at this W on these cards (`doctor --deep` keeps it in
       the user cache folder): the faster one, by the measurement;
    4. otherwise the cost model (cost_model.py): ulysses when it receives fewer bytes per rank
       than the all-gather (2/W of them at U = W: half at 4 cards, a quarter at 8); it also
       holds 3/W of the all-gather's exchange buffers. Ties (W = 2) go to the all-gather, one
       collective instead of two. Other servers' ranks only make the bytes count for more: the
       network is slower than one server's card-to-card link. CPU ranks follow the same rule:
       bench/bench_sp_modes.py finds the two modes' steps alike there (Ulysses over all-gather
       0.91-1.07 at W = 2, 4, 8, within the rounds' spread) and Ulysses' peak 0.64x at W = 4.

The Fun ControlNet's tower runs on the full sequence on every rank in either mode (its stream
never reads the base's K/V), so the choice does not change what it costs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from comfy.multidevice.comm.settings import user_cache_dir
from comfy.multidevice.sp.cost_model import attention_traffic, DiTShape, exchanged_bytes, ulysses_degree

SP_MODE_CHOICES = ("auto", "allgather", "ulysses", "hybrid")  # the node's sp_mode
MEASUREMENTS_FILE = "exchange_measurements.json"  # in the user cache folder, written by doctor --deep


@dataclass(frozen=True)
class ModeChoice:
    """What runs on `world` ranks: `mode` is a strategy name of strategies.py ("allgather" or
    "ulysses"), `degree` the Ulysses group size (W: plain Ulysses; below W: the hybrid; 1 for the
    all-gather), `reason` why, in words."""

    mode: str
    degree: int
    world: int
    reason: str

    @property
    def name(self) -> str:
        if self.mode == "allgather":
            return "allgather"
        return "ulysses" if self.degree == self.world else f"hybrid ({self.world // self.degree} groups of {self.degree})"

    def describe(self) -> str:
        return f"sp_mode {self.name}: {self.reason}"


class SPModeError(ValueError):
    """The node's sp_mode cannot run as asked (names the value and the fix)."""


def bytes_ratio(world: int, heads: int, head_dim: int = 128) -> float:
    """Ulysses' (hybrid's) bytes received per block by the busiest rank, over the all-gather's."""
    probe = 1024 * world  # any length: the ratio does not depend on it
    worst = {mode: max(attention_traffic(mode, probe, world, r, heads, head_dim, 2).received
                       for r in range(world)) for mode in ("allgather", "ulysses")}
    return worst["ulysses"] / worst["allgather"]


def held_ratio(world: int, heads: int, head_dim: int, degree: int) -> float:
    """Ulysses' (hybrid's) exchange buffers per rank over the all-gather's (cost_model.exchanged_bytes)."""
    shape, probe = DiTShape(heads=heads, head_dim=head_dim), 1024 * world
    return (exchanged_bytes(shape, probe, world, mode="ulysses", degree=degree)
            / exchanged_bytes(shape, probe, world))


def choose_sp_mode(choice: str, world: int, heads: int | None, head_dim: int = 128,
                   other_servers: bool = False, measured: dict | None = None,
                   uneven_rows: bool = False) -> ModeChoice:
    """The node's `choice` at `world` DiT ranks of a DiT with `heads` heads (None: not readable),
    `other_servers` when ranks of other servers join, `measured` this machine's timing of both
    exchanges at this W on these cards (`measurement_for(device kind, W)`: the device kind enters
    the rule there). `uneven_rows`: the node's split may give the ranks different rows (mixed
    cards, sp/split.py): Ulysses keeps the heads even and needs even rows, so it is refused and
    auto runs the all-gather."""
    if choice not in SP_MODE_CHOICES:
        raise SPModeError(f"sp_mode={choice!r} is unknown: set sp_mode to one of {', '.join(SP_MODE_CHOICES)}.")
    if world <= 1:
        return ModeChoice("allgather", 1, world, "one rank, nothing to exchange")
    if uneven_rows and choice in ("ulysses", "hybrid"):
        raise SPModeError(f"sp_mode={choice} splits the attention heads evenly and needs every card to hold the same "
                          "rows, but split gives the cards different rows: set sp_mode to allgather or auto, or "
                          "split to even.")
    if choice == "allgather":  # any rows, any heads
        return ModeChoice("allgather", 1, world, "asked")
    if uneven_rows:
        return ModeChoice("allgather", 1, world,
                          "auto: split gives the cards different rows, which the all-gather exchanges exactly")
    if heads is None:
        if choice == "auto":
            return ModeChoice("allgather", 1, world,
                              "the DiT's head count is not readable, and the all-gather needs none")
        raise SPModeError(f"sp_mode={choice} splits the attention heads, but this DiT's head count is not "
                          "readable: set sp_mode to allgather or auto.")
    degree = ulysses_degree(world, heads)
    if choice == "ulysses":
        if degree != world:
            hybrid = f"hybrid (Ulysses in groups of {degree}), " if degree > 1 else ""
            raise SPModeError(f"sp_mode=ulysses splits the DiT's {heads} heads over {world} ranks, and {heads} "
                              f"does not divide by {world}: set sp_mode to {hybrid}allgather or auto, or use a "
                              f"card count that divides {heads}.")
        return ModeChoice("ulysses", world, world, f"asked: {heads // world} heads per rank")
    if choice == "hybrid":
        if degree == 1:
            raise SPModeError(f"sp_mode=hybrid needs a group size above one that divides both {world} ranks and "
                              f"the DiT's {heads} heads, and there is none: set sp_mode to allgather or auto.")
        if degree == world:
            return ModeChoice("ulysses", world, world, f"hybrid asked, and {heads} heads divide by {world}")
        return ModeChoice("ulysses", degree, world, f"asked: {heads} heads do not divide by {world}")
    return _auto(world, heads, head_dim, degree, other_servers, measured)


def _auto(world, heads, head_dim, degree, other_servers, measured) -> ModeChoice:
    as_ulysses = "ulysses" if degree == world else f"the hybrid ({world // degree} groups of {degree})"
    if degree == 1:
        return ModeChoice("allgather", 1, world, f"auto: no group size above one divides both {world} ranks "
                                                 f"and {heads} heads")
    if measured is not None:
        faster = "ulysses" if measured["ulysses_s"] < measured["allgather_s"] else "allgather"
        return ModeChoice(faster, degree if faster == "ulysses" else 1, world,
                          f"auto, measured on this machine ({measured.get('measured_by', 'doctor --deep')}): "
                          f"{as_ulysses} {measured['ulysses_s'] * 1e3:.2f} ms, allgather "
                          f"{measured['allgather_s'] * 1e3:.2f} ms per exchange")
    ratio = bytes_ratio(world, heads, head_dim)
    where = "other servers' network" if other_servers else "the cards' link"
    if ratio < 1:
        return ModeChoice("ulysses", degree, world,
                          f"auto: {as_ulysses} receives {ratio:.2f} of the all-gather's bytes per block over "
                          f"{where}, and holds {held_ratio(world, heads, head_dim, degree):.2f} of its "
                          f"exchange buffers")
    return ModeChoice("allgather", 1, world, f"auto: {as_ulysses} would receive {ratio:.2f} of the all-gather's "
                                             f"bytes, in two rounds instead of one")


# ----------------------------------------------------------------------------- measurements

def measurements_path() -> Path:
    return user_cache_dir() / MEASUREMENTS_FILE


def _key(device_kind: str, world: int) -> str:
    return f"{device_kind}:{world}"


def measurement_for(device_kind: str, world: int, path: Path | None = None,
                    backend: str | None = None) -> dict | None:
    """The timing `doctor --deep` kept for `world` ranks on cards of `device_kind`, or None (none
    kept, or a file that does not read as one: the rule then goes by the cost model). `backend`:
    the one the node was told to use (None: any); a timing of another backend does not count."""
    path = measurements_path() if path is None else path
    try:
        entry = json.loads(path.read_text(encoding="utf-8")).get(_key(device_kind, world))
    except (OSError, ValueError, AttributeError):
        return None
    ok = isinstance(entry, dict) and all(isinstance(entry.get(k), (int, float)) and entry[k] > 0
                                         for k in ("allgather_s", "ulysses_s"))
    if ok and backend is not None and entry.get("backend") not in (None, backend):
        return None
    return entry if ok else None


def record_measurement(device_kind: str, world: int, allgather_s: float, ulysses_s: float,
                       detail: dict | None = None, path: Path | None = None) -> Path:
    """Keep one timing of both exchanges (replacing the earlier one for this kind and W); the file
    is written whole to a temporary name and renamed, so a reader never sees half of it."""
    path = measurements_path() if path is None else path
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        kept = kept if isinstance(kept, dict) else {}
    except (OSError, ValueError):
        kept = {}
    kept[_key(device_kind, world)] = {"allgather_s": allgather_s, "ulysses_s": ulysses_s,
                                      "when": time.strftime("%Y-%m-%dT%H:%M:%S"), **(detail or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(kept, indent=1, sort_keys=True), encoding="utf-8")
    temporary.replace(path)
    return path
