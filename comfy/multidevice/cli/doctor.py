"""`minimax_h3_parallel.py doctor`: what this machine offers, and whether the chosen set-up works.

The report (`collect_report`) has: platform and versions; visible devices per kind with
names and memory; for each backend whether its library loads, which symbols it has and
how it does all-gather-V; the environment variables that steer the backends; and a
self-test exchange on the selected devices and backend, checked against torch.cat of
the shards. `main` prints it (text, or JSON with --json) and exits 0 when the selected
configuration works, 1 with the reason when it does not.

Device selection: `--device-kind auto` takes the NPUs if any are visible, else the CUDA
GPUs, else the CPU. `--devices N` asks for N cards of that kind and fails when fewer are
visible. With no accelerator the self-test runs on 2 CPU ranks (the smallest exchange
between ranks, with uneven shards); `--devices N` is then an error, since the machine has
no N devices for a real run, unless `--device-kind cpu` asks for N CPU ranks on purpose.

Under torchrun (RANK/WORLD_SIZE/LOCAL_RANK set) the self-test runs over torch.distributed
(comfy/multidevice/comm/torch_dist.py) with one rank per process instead, and only rank 0 prints.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import time

import torch

from comfy.multidevice.cards import auto_kind, DEVICE_KINDS, DeviceInventory, visible_device_names
from comfy.multidevice.cli.deep_checks import deep_checks
from comfy.multidevice.cli.options import cpu_ranks_problem, integer, seconds
from comfy.multidevice.comm import torch_dist as multinode
from comfy.multidevice.comm.group import SequenceParallelCoordinator
from comfy.multidevice.comm.hccl import (all_gather_v_supported_on, HCCL_DEFAULT_LIBRARY, HCCL_FUNCTIONS,
                                        HCCL_PATH_ENV)
from comfy.multidevice.comm.nccl import NCCL_DEFAULT_LIBRARY, NCCL_FUNCTIONS, NCCL_PATH_ENV
from comfy.multidevice.comm.settings import (BACKEND_ENV, backend_from_env, check_environment,
                                             launched_by_torchrun, library_path, MAX_TIMEOUT_S,
                                             MULTI_DEVICE_ENV_VARS, read_variables, read_visible_devices,
                                             SettingError, VALID_BACKENDS)
from comfy.multidevice.devices import accelerator_api, ACCELERATOR_KINDS

CPU_SELF_TEST_RANKS = 2
# Variables shown even when unset; every other HCCL_* / NCCL_* variable is shown when set.
ENV_VARS = (*MULTI_DEVICE_ENV_VARS, "ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES",
            "HCCL_SO_PATH", "NCCL_SO_PATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
ENV_PREFIXES = ("HCCL_", "NCCL_", "ASCEND_", "GLOO_")


class DoctorFailure(RuntimeError):
    """The selected configuration does not work; the message says why and what to change."""


# ----------------------------------------------------------------------------- facts

def platform_report() -> dict:
    return {"system": platform.system(), "release": platform.release(), "machine": platform.machine(),
            "python": platform.python_version(), "executable": sys.executable}


def versions_report() -> dict:
    try:
        import torch_npu
        npu_version = getattr(torch_npu, "__version__", "unknown")
    except ImportError:
        npu_version = None
    except Exception as exc:  # installed but broken (driver/CANN): say so, don't crash
        npu_version = f"import failed: {type(exc).__name__}: {exc}"
    return {"python": platform.python_version(), "torch": torch.__version__, "torch_npu": npu_version,
            "cuda_runtime": torch.version.cuda}


def _accelerator(kind: str) -> dict:
    """Visible devices of one kind with name and memory; count 0 and a note when unavailable."""
    entry = {"count": 0, "devices": [], "note": None}
    try:
        module = accelerator_api(kind)
        if module is None:
            entry["note"] = "torch_npu is not installed"
            return entry
        if not module.is_available():
            entry["note"] = f"torch reports no {kind} device"
            return entry
        entry["count"] = int(module.device_count())
        for i in range(entry["count"]):
            props = module.get_device_properties(i)
            entry["devices"].append({"index": i, "name": getattr(props, "name", "unknown"),
                                     "memory_bytes": int(getattr(props, "total_memory", 0))})
    except Exception as exc:
        entry["note"] = f"probe failed: {type(exc).__name__}: {exc}"
    return entry


def devices_report() -> dict:
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        memory = None
    return {"npu": _accelerator("npu"), "cuda": _accelerator("cuda"),
            "cpu": {"count": os.cpu_count(), "memory_bytes": memory}}


def probe_library(table, path_env: str, default_path: str) -> dict:
    """Load a collective library the way the backend would and list the symbols of its table."""
    path = library_path(path_env, default_path)
    entry = {"path": path, "path_from": path_env if read_variables([path_env])[path_env] else "default",
             "loaded": False, "usable": False, "error": None, "symbols": {}, "missing_required": []}
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        entry["error"] = f"cannot load {path!r}: {exc}; install it or set {path_env}"
        return entry
    entry["loaded"] = True
    entry["symbols"] = {spec.name: hasattr(lib, spec.name) for spec in table}
    entry["missing_required"] = [spec.name for spec in table
                                 if not (spec.optional or entry["symbols"][spec.name])]
    if entry["missing_required"]:
        entry["error"] = f"missing required symbol(s) {', '.join(entry['missing_required'])}"
    entry["usable"] = entry["error"] is None
    if hasattr(lib, "ncclGetVersion"):
        version = ctypes.c_int()
        if lib.ncclGetVersion(ctypes.byref(version)) == 0:
            entry["version"] = version.value
    return entry


def backends_report(npu_names: list[str] = ()) -> dict:
    """`npu_names`: the visible NPUs' chip names (a chip of the Atlas training series exchanges
    uneven shards by broadcasts even where the library has HcclAllGatherV: comm/hccl.py)."""
    hccl = probe_library(HCCL_FUNCTIONS, HCCL_PATH_ENV, HCCL_DEFAULT_LIBRARY)
    hccl["all_gather_v"] = bool(hccl["symbols"].get("HcclAllGatherV"))
    unsupported = sorted({n for n in npu_names if not all_gather_v_supported_on(n)})
    uneven = "HcclAllGatherV" if hccl["all_gather_v"] else "one HcclBroadcast per rank"
    if hccl["all_gather_v"] and unsupported:
        uneven = f"one HcclBroadcast per rank ({', '.join(unsupported)}: no HcclAllGatherV on this chip)"
    hccl["exchange_method"] = (f"{uneven} (HcclAllGather when shards are equal)"
                               if hccl["loaded"] else None)
    nccl = probe_library(NCCL_FUNCTIONS, NCCL_PATH_ENV, NCCL_DEFAULT_LIBRARY)
    nccl["all_gather_v"] = False  # NCCL has none; the backend emulates it exactly:
    nccl["exchange_method"] = ("one group of ncclBroadcast per rank (ncclAllGather when shards "
                               "are equal)" if nccl["loaded"] else None)
    dist = {"available": False}
    try:
        import torch.distributed as td
        if td.is_available():
            dist = {"available": True, "gloo": td.is_gloo_available(), "nccl": td.is_nccl_available(),
                    "hccl": "hccl" in getattr(td.Backend, "backend_list", [])}
    except Exception as exc:
        dist["error"] = f"{type(exc).__name__}: {exc}"
    return {"peer": {"usable": True, "exchange_method": "tensor.to(device) + torch.cat"},
            "hccl": hccl, "nccl": nccl, "torch.distributed": dist}


# ----------------------------------------------------------------------------- selection

def self_test_devices(kind: str, count: int | None, devices: dict) -> list[str]:
    """The devices the self-test uses; DoctorFailure when they are not there."""
    if count is not None and count < 1:
        raise DoctorFailure(f"--devices {count}: give a positive number of devices")
    inventory = DeviceInventory(counts={k: devices[k]["count"] for k in ACCELERATOR_KINDS},
                                env=read_visible_devices())
    if kind == "auto":
        kind = auto_kind(inventory)
        if kind == "cpu" and count is not None:
            raise DoctorFailure(
                f"asked for {count} device(s) but found 0 accelerators (npu: 0, cuda: 0; "
                f"{inventory.env_text('npu')}, {inventory.env_text('cuda')}). Check the driver and that "
                "torch_npu or a CUDA build of torch is installed; to self-test "
                f"{count} CPU ranks instead, add --device-kind cpu")
    if kind == "cpu":
        if problem := cpu_ranks_problem(count):
            raise DoctorFailure(problem)
        return ["cpu"] * (count or CPU_SELF_TEST_RANKS)
    have = inventory.count(kind)
    want = have if count is None else count
    if have == 0 or want > have:
        raise DoctorFailure(
            f"asked for {want if count is not None else 'the'} {kind} device(s) but found {have} "
            f"{kind} device(s) ({inventory.env_text(kind)}); use --devices {have} or fewer"
            + (", or make more cards visible" if have else ", or check the driver / torch build"))
    return visible_device_names(kind, inventory)[:want]


# ----------------------------------------------------------------------------- self-test

def _self_test_rank(rank, comm):
    """One rank's part: uneven fp32 and bf16 shards (rank r holds r + 1 rows), then
    all-reduce sum and max of small integers (exact in fp32). Returns per-check verdicts."""
    world = comm.world_size
    shards = [torch.arange((r + 1) * 3, dtype=torch.float32).view(r + 1, 3) + 100 * r for r in range(world)]
    want = torch.cat(shards)
    got = comm.exchange([shards[rank].to(comm.device), shards[rank].to(comm.device, torch.bfloat16)], [0, 0])
    total = comm.all_reduce(torch.full((4,), float(rank + 1), device=comm.device), "sum")
    peak = comm.all_reduce(torch.full((4,), float(rank + 1), device=comm.device), "max")
    return {
        "exchange_fp32_exact": torch.equal(got[0].cpu(), want),
        "exchange_bf16_exact": torch.equal(got[1].cpu(), want.to(torch.bfloat16)),
        "all_reduce_sum_exact": torch.equal(total.cpu(), torch.full((4,), world * (world + 1) / 2)),
        "all_reduce_max_exact": torch.equal(peak.cpu(), torch.full((4,), float(world))),
    }


def _summarize(per_rank: list[dict]) -> dict:
    checks = {name: all(r[name] for r in per_rank) for name in per_rank[0]}
    return {"ok": all(checks.values()), "checks": checks}


def self_test(devices: list[str], backend: str, timeout_s: float) -> dict:
    """Exchange between threads of one process over the coordinator; never raises."""
    result = {"mode": "threads", "devices": devices, "world_size": len(devices), "backend_requested": backend,
              "backend": None, "fallback_reason": None, "ok": False, "error": None}
    start = time.perf_counter()
    try:
        with SequenceParallelCoordinator(devices, backend=backend, timeout_s=timeout_s) as coord:
            result["backend"] = coord.backend_name
            result["fallback_reason"] = coord.fallback_reason
            result.update(_summarize(coord.run(_self_test_rank)))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = round(time.perf_counter() - start, 4)
    return result


def distributed_self_test(device_kind: str, timeout_s: float) -> dict:
    """Under torchrun: one rank per process over torch.distributed; never raises."""
    result = {"mode": "torch.distributed", "ok": False, "error": None}
    start = time.perf_counter()
    comm = None
    try:
        device = "cpu" if device_kind == "cpu" else None
        comm = multinode.init_from_env(device=device, timeout_s=timeout_s)
        result.update(rank=comm.rank, world_size=comm.world_size, device=str(comm.device),
                      backend=comm.backend_name)
        verdicts = _self_test_rank(comm.rank, comm)
        # Every rank learns whether every rank passed (1 = pass), so all exit alike.
        passed = comm.all_reduce(torch.tensor([0.0 if all(verdicts.values()) else 1.0], device=comm.device), "max")
        result.update(_summarize([verdicts]))
        result["all_ranks_ok"] = float(passed.item()) == 0.0
        result["ok"] = result["ok"] and result["all_ranks_ok"]
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if comm is not None:
            comm.close()
    result["seconds"] = round(time.perf_counter() - start, 4)
    return result


# ----------------------------------------------------------------------------- report

def deep_devices(devices: list[str], count: int | None) -> list[str]:
    """The deep checks' ranks: the self-test's, but 3 CPU ranks when the CPU stands in for
    cards by default (a pair of ranks other than 0 needs 3)."""
    if count is None and all(d == "cpu" for d in devices) and len(devices) < 3:
        return ["cpu"] * 3
    return devices


def collect_report(device_kind: str = "auto", count: int | None = None, backend: str | None = None,
                   timeout_s: float = 60.0, deep: bool = False) -> dict:
    report = {"ok": False, "reason": None, "platform": platform_report(), "versions": versions_report()}
    report["devices"] = devices_report()
    report["backends"] = backends_report([d["name"] for d in report["devices"]["npu"]["devices"]])
    report["environment"] = read_variables(ENV_VARS, ENV_PREFIXES)
    try:  # the same checks, and the same words, as `run`
        check_environment()
        requested = backend_from_env(backend)
    except SettingError as exc:
        report["reason"] = str(exc)
        report["bad_setting"] = True
        return report
    if launched_by_torchrun():
        report["self_test"] = distributed_self_test(device_kind, timeout_s)
    else:
        try:
            devices = self_test_devices(device_kind, count, report["devices"])
        except DoctorFailure as exc:
            report["reason"] = str(exc)
            return report
        report["self_test"] = self_test(devices, requested, timeout_s)
        if deep:
            report["deep"] = deep_checks(deep_devices(devices, count), requested, timeout_s)
    test = report["self_test"]
    report["ok"] = bool(test["ok"])
    if not test["ok"]:
        failed = [k for k, v in test.get("checks", {}).items() if not v]
        report["reason"] = (f"self-test failed: {test['error']}" if test["error"]
                            else f"self-test results wrong: {', '.join(failed) or 'on another rank'}")
    elif deep and "deep" not in report:
        report["ok"] = False
        report["reason"] = "--deep runs rank threads of one process: run it without torchrun"
    elif deep:
        failed = [name for name, verdict in report["deep"].items() if not verdict["ok"]]
        report["ok"] = not failed
        if failed:
            report["reason"] = "deep check(s) failed: " + "; ".join(
                f"{name}: {report['deep'][name]['detail']}" for name in failed)
    return report


def format_text(report: dict) -> str:
    lines = []
    p, v = report["platform"], report["versions"]
    lines.append(f"platform   {p['system']} {p['release']} {p['machine']}, Python {v['python']}")
    lines.append(f"torch      {v['torch']}, torch_npu {v['torch_npu'] or 'not installed'}, "
                 f"CUDA runtime {v['cuda_runtime'] or 'none'}")
    d = report["devices"]
    for kind in ACCELERATOR_KINDS:
        entry = d[kind]
        names = ", ".join(f"{kind}:{x['index']} {x['name']} {x['memory_bytes'] / 2**30:.1f} GiB"
                          for x in entry["devices"])
        lines.append(f"{kind:<10} {entry['count']} visible" + (f": {names}" if names else "")
                     + (f" ({entry['note']})" if entry["note"] else ""))
    mem = d["cpu"]["memory_bytes"]
    lines.append(f"cpu        {d['cpu']['count']} cores" + (f", {mem / 2**30:.1f} GiB" if mem else ""))
    b = report["backends"]
    lines.append("backends   peer: usable")
    for name in ("hccl", "nccl"):
        e = b[name]
        state = (f"usable ({e['path']}); all-gather-V: {e['exchange_method']}" if e.get("usable")
                 else f"not usable: {e['error']}")
        lines.append(f"           {name}: {state}")
    dist = b["torch.distributed"]
    if dist.get("available"):
        lines.append("           torch.distributed: " + ", ".join(
            f"{k} {'yes' if dist[k] else 'no'}" for k in ("gloo", "nccl", "hccl")))
    env = {k: val for k, val in report["environment"].items() if val is not None}
    lines.append("environment " + (", ".join(f"{k}={val}" for k, val in env.items()) or "(none of the variables set)"))
    test = report.get("self_test")
    if test:
        where = (f"{test['world_size']} rank(s) on {', '.join(test['devices'])}" if test["mode"] == "threads"
                 else f"rank {test.get('rank')} of {test.get('world_size')} on {test.get('device')} (torchrun)")
        backend = test.get("backend") or test.get("backend_requested")
        lines.append(f"self-test  {where}, backend {backend}: "
                     + ("passed" if test["ok"] else "FAILED") + f" in {test['seconds']:.3f}s")
        if test.get("fallback_reason"):
            lines.append(f"           note: auto fell back to peer-copy: {test['fallback_reason']}")
    for name, verdict in (report.get("deep") or {}).items():
        lines.append(f"deep       {name}: " + ("ok" if verdict["ok"] else "FAILED")
                     + f" in {verdict['seconds']:.3f}s: {verdict['detail']}")
    lines.append("result     " + ("OK" if report["ok"] else f"NOT OK: {report['reason']}"))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--devices", type=integer, default=None, metavar="N",
                        help="self-test on N devices (default: all visible accelerators; "
                             f"{CPU_SELF_TEST_RANKS} CPU ranks when there is none); fails when fewer are visible")
    parser.add_argument("--device-kind", choices=DEVICE_KINDS, default="auto",
                        help="which devices: auto = NPUs, else CUDA GPUs, else the CPU (default auto)")
    parser.add_argument("--backend", choices=VALID_BACKENDS, default=None,
                        help=f"collective backend to test (default: ${BACKEND_ENV} or auto)")
    parser.add_argument("--deep", action="store_true",
                        help="also run a few seconds on each risky card path (exchange between ranks other "
                             "than 0, shard gathers beside the K/V exchange, quantized weights gathered and "
                             "released, a stuck rank recovered, both attention exchanges timed and kept for "
                             "sp_mode auto); the first thing to run on new cards")
    parser.add_argument("--timeout", type=seconds, default=60.0, metavar="S",
                        help="seconds a self-test collective may wait for the other ranks "
                             f"(default 60, at most {MAX_TIMEOUT_S:g})")


def main(args: argparse.Namespace) -> int:
    report = collect_report(args.device_kind, args.devices, args.backend, args.timeout, getattr(args, "deep", False))
    test = report.get("self_test") or {}
    quiet = test.get("mode") == "torch.distributed" and test.get("rank") not in (0, None)
    if not quiet:
        print(json.dumps(report, indent=2, default=str) if args.json else format_text(report))
    if not report["ok"]:
        print(f"doctor: {report['reason']}", file=sys.stderr)
        return 2 if report.get("bad_setting") else 1
    return 0
