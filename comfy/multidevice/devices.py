"""Device dispatch: npu / cuda / cpu names to torch devices, and every per-kind runtime call.

`accelerator_api(kind)` is torch.npu / torch.cuda / None; every per-kind call of the package
(current device, stream, synchronize, cache, free memory) goes through it. `copy_for_rank`
moves a call's inputs to one rank's device. Which cards a run uses is decided in cards.py.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from typing import Any, Callable

import torch

from comfy.multidevice.commands import INSTALLER, script_command

ACCELERATOR_KINDS = ("npu", "cuda")


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
                f"device {text!r} needs torch_npu, which is not installed; run "
                f"{script_command(INSTALLER, '--platform', 'ascend', '--python', sys.executable)} on the "
                "Ascend host, or use cuda/cpu devices") from exc
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


def call_on_device_thread(device: torch.device, fn: Callable[[], Any]) -> Any:
    """fn() on a short-lived thread that made `device` current first; its result or its error.

    For card work outside the rank threads (backend start): torch_npu gives a thread that
    touches the NPU without set_device card 0 (CARDS.md), a context no plan counts."""
    outcome: dict = {}

    def body():
        try:
            set_thread_device(device)
            outcome["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller
            outcome["error"] = exc
    helper = threading.Thread(target=body, name=f"on-{device}", daemon=True)
    helper.start()
    helper.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def chip_name(device: torch.device) -> str | None:
    """The accelerator's chip name (torch.npu / torch.cuda get_device_name), None for the CPU."""
    api = accelerator_api(device.type)
    if api is None:
        return None
    return call_on_device_thread(device, lambda: api.get_device_name(device))


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


def module_device(module) -> torch.device | None:
    """The device of the module's first parameter (or buffer); None for a tensor-less object."""
    first = next(itertools.chain(module.parameters(), module.buffers()), None) \
        if isinstance(module, torch.nn.Module) else None
    return None if first is None else first.device
