"""The dry run's load meter: other processes' and the hypervisor's share of the cores over a span,
and whether the speedup measured under it is printed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from comfy.multidevice.cli import machine_load
from comfy.multidevice.cli.report import paired_speedup
from comfy.multidevice.cli.machine_load import LOADED_SHARE, LoadMeter, MachineLoad, not_quiet_reason


def _stat_line(user, system, idle, steal):
    # cpu user nice system idle iowait irq softirq steal guest guest_nice
    return f"cpu  {user} 0 {system} {idle} 0 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


@pytest.fixture
def fake_machine(tmp_path, monkeypatch):
    """/proc/stat and this process's CPU seconds under the test's control (100 ticks a second)."""
    stat = tmp_path / "stat"
    own = SimpleNamespace(seconds=0.0)
    monkeypatch.setattr(machine_load, "_STAT", str(stat))
    monkeypatch.setattr(machine_load.os, "sysconf", lambda name: 100)
    monkeypatch.setattr(machine_load.os, "times", lambda: SimpleNamespace(user=own.seconds, system=0.0))
    return stat, own


def test_others_busy_time_is_the_machines_less_ours(fake_machine):
    stat, own = fake_machine
    stat.write_text(_stat_line(user=1000, system=0, idle=1000, steal=0))
    meter = LoadMeter()
    # 2 cores for 1 s = 200 ticks: 150 busy (100 of them ours), 50 idle
    stat.write_text(_stat_line(user=1150, system=0, idle=1050, steal=0))
    own.seconds = 1.0
    load = meter.stop()
    assert load == MachineLoad(other_processes=0.25, steal=0.0) and load.loaded


def test_our_own_work_is_not_load(fake_machine):
    stat, own = fake_machine
    stat.write_text(_stat_line(user=500, system=500, idle=0, steal=0))
    meter = LoadMeter()
    stat.write_text(_stat_line(user=600, system=595, idle=5, steal=0))  # 195 busy of 200, all ours
    own.seconds = 1.95
    load = meter.stop()
    assert load.other_processes == 0.0 and not load.loaded
    assert load.as_report() == {"other_processes_share": 0.0, "steal_share": 0.0, "loaded": False,
                                "threshold": LOADED_SHARE}


def test_steal_counts_as_load(fake_machine):
    stat, own = fake_machine
    stat.write_text(_stat_line(user=0, system=0, idle=0, steal=0))
    meter = LoadMeter()
    stat.write_text(_stat_line(user=150, system=0, idle=20, steal=30))
    own.seconds = 1.5
    load = meter.stop()
    assert load.steal == pytest.approx(0.15) and load.loaded
    assert "hypervisor 15%" in load.describe(2)


def test_no_proc_stat_means_no_figure(tmp_path, monkeypatch):
    monkeypatch.setattr(machine_load, "_STAT", str(tmp_path / "absent"))
    assert LoadMeter().stop() is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux's /proc/stat is where the load is read")
@pytest.mark.timeout(60)
def test_a_busy_process_beside_us_is_seen():
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        time.sleep(0.5)
        meter = LoadMeter()
        time.sleep(1.5)  # we sleep: whatever ran was someone else
        load = meter.stop()
    finally:
        hog.kill()
        hog.wait(timeout=10)
    # one busy process has at least a share of one core of os.cpu_count()
    assert load.other_processes > 0.5 / (os.cpu_count() or 1) * 0.8 and load.loaded, load


def test_the_speedup_is_the_median_of_back_to_back_pairs():
    # the first step of each run is left out; one step slowed by load moves a ratio of means, not this
    reference = [9.0, 2.0, 2.0, 2.0, 8.0, 2.0]
    ranks = [9.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert paired_speedup(reference, ranks) == 2.0
    assert paired_speedup([3.0], [1.5]) == 2.0  # one step: that step


QUIET = MachineLoad(other_processes=0.02, steal=0.01)
BUSY = MachineLoad(other_processes=0.35, steal=0.0)


def test_a_quiet_machine_with_a_core_per_rank_prints_its_speedup():
    assert not_quiet_reason(QUIET, cores=8, ranks=4, cpu_ranks=True) is None


@pytest.mark.parametrize("load, cores, ranks, says", [
    (QUIET, 2, 4, "4 CPU ranks on 2 core(s): fewer cores than ranks, so the ranks took turns; use --devices 2"),
    (BUSY, 8, 4, "other processes took 35% and the hypervisor 0% of the 8 cores while it ran (above 10%)"),
    (None, 8, 4, "this machine's load cannot be read (no /proc/stat)"),
])
def test_a_busy_or_crowded_machine_says_why_instead_of_a_figure(load, cores, ranks, says):
    assert not_quiet_reason(load, cores, ranks, cpu_ranks=True).startswith(says)


def test_ranks_on_cards_are_judged_by_the_cards_not_the_hosts_load():
    assert not_quiet_reason(BUSY, cores=2, ranks=8, cpu_ranks=False) is None
