"""How much of the machine other jobs took while a timing ran (Linux's /proc/stat).

On CPU ranks the dry run's `speedup` compares W ranks with one device on all the cores, both on
this machine's cores. Another job on those cores bends the two unequally (an OpenMP team of all
the cores stalls whenever one of its threads loses its core; one-thread ranks lose less), so the
ratio then shows the load, not the parallel overhead. `LoadMeter` measures, over the timed
span, the share of the cores that went to other processes (all busy time less ours) and to the
hypervisor (steal); `not_quiet_reason` decides from it whether the figure is printed at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

LOADED_SHARE = 0.10  # others' + steal share of all cores above which a CPU timing is not trusted
_STAT = "/proc/stat"


@dataclass(frozen=True)
class MachineLoad:
    """Shares of all the cores' time over a span (0..1)."""

    other_processes: float
    steal: float

    @property
    def loaded(self) -> bool:
        return self.other_processes + self.steal > LOADED_SHARE

    def as_report(self) -> dict:
        return {"other_processes_share": round(self.other_processes, 3), "steal_share": round(self.steal, 3),
                "loaded": self.loaded, "threshold": LOADED_SHARE}

    def describe(self, cores: int) -> str:
        return (f"other processes took {self.other_processes:.0%} and the hypervisor "
                f"{self.steal:.0%} of the {cores} cores")


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(busy, steal, total) seconds of all cores together since boot; None off Linux."""
    try:
        with open(_STAT, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    ticks = [int(v) for v in fields[1:9]]
    ticks += [0] * (8 - len(ticks))  # kernels without a steal column
    user, nice, system, idle, iowait, irq, softirq, steal = ticks
    hz = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq
    return busy / hz, steal / hz, (busy + idle + iowait + steal) / hz


class LoadMeter:
    """Start before a timed span, `stop()` after it: the machine's load over the span, or None
    where it cannot be read (no /proc/stat)."""

    def __init__(self):
        self._start = _cpu_seconds()
        self._own = self._own_seconds()

    @staticmethod
    def _own_seconds() -> float:
        t = os.times()  # this process, all its threads
        return t.user + t.system

    def stop(self) -> MachineLoad | None:
        end = _cpu_seconds()
        if self._start is None or end is None:
            return None
        busy, steal, total = (b - a for a, b in zip(self._start, end))
        if total <= 0:
            return None
        own = self._own_seconds() - self._own
        others = max(0.0, busy - own)
        return MachineLoad(other_processes=min(1.0, others / total), steal=min(1.0, steal / total))



def not_quiet_reason(load: MachineLoad | None, cores: int, ranks: int, cpu_ranks: bool) -> str | None:
    """Why a speedup of `ranks` ranks measured under `load` on `cores` cores says nothing about
    the parallel run (with the fix), or None when the machine was quiet enough to print it."""
    if not cpu_ranks:  # each rank has its own card: the host's cores only launch the work
        return None
    if cores < ranks:
        return (f"{ranks} CPU ranks on {cores} core(s): fewer cores than ranks, so the ranks took turns; "
                f"use --devices {cores} or fewer")
    if load is None:
        return "this machine's load cannot be read (no /proc/stat), so a busy run cannot be told from a quiet one"
    if load.loaded:
        return (f"{load.describe(cores)} while it ran (above {LOADED_SHARE:.0%}); on CPU that slows the "
                "one-device run (an OpenMP team of all the cores) more than the ranks: rerun on an idle machine")
    return None
