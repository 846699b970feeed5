"""The Python calls from the DIFFUSION_MODEL wrapper to the attention kernel, counted.

`KernelStacks` watches the rank threads for the first call our exchange makes into one of
ComfyUI's attention functions (the kernel) and records that thread's frames and the frames of
the thread waiting in the fan-out. `hops` joins the two into one
chain (the caller from `SequenceParallelFanOut.__call__` down to the coordinator's `run`, then
the rank thread from the coordinator's worker loop down to the kernel) and counts its frames
by owner: ours (comfy/multidevice, comfy_extras/nodes_multinpu.py), upstream (the ComfyUI tree)
or other (torch, Python). A frame is one Python call; C calls between them are not seen.
"""

from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = (REPO / "comfy" / "multidevice", REPO / "comfy_extras" / "nodes_multinpu.py")

# where the chain starts on each thread (the code object's qualified name)
FAN_OUT_ENTRY = "SequenceParallelFanOut.__call__"
PROCESS_FAN_OUT_ENTRY = FAN_OUT_ENTRY  # one fan-out for both engines; rank 0 of the processes runs on the caller's thread
WORKER_LOOP = "serve"  # workers/worker.py: a worker process follows rank 0's forwards here
HAND_OFF = "SequenceParallelCoordinator.run"  # the caller waits here while the ranks run
RANK_LOOP = "_RankWorker.run"
ATTENTION_MODULE = "comfy/ldm/modules/attention.py"  # ComfyUI's attention functions, the kernels
BLOCK_LOOP = "MiniMaxH3Model._forward"  # H3 contract: it runs the blocks (or their replacements)


@dataclass(frozen=True)
class Frame:
    owner: str  # "ours", "upstream" or "other"
    where: str  # path relative to its root
    name: str  # the code's qualified name

    def __str__(self) -> str:
        return f"{self.owner:8} {self.where} {self.name}"


def owner_of(filename: str, upstream_tree: Path) -> tuple[str, str]:
    path = Path(filename).resolve()
    for root in OURS:
        if path == root or root in path.parents:
            return "ours", str(path.relative_to(REPO))
    if upstream_tree in path.parents:
        return "upstream", str(path.relative_to(upstream_tree))
    return "other", path.name


def frames_of(top, upstream_tree: Path) -> list[Frame]:
    """The frames from the thread's outermost call down to `top`, outermost first."""
    found = []
    while top is not None:
        owner, where = owner_of(top.f_code.co_filename, upstream_tree)
        found.append(Frame(owner, where, top.f_code.co_qualname))
        top = top.f_back
    return found[::-1]


def from_name(frames: list[Frame], name: str, owner: str = "ours") -> list[Frame]:
    starts = [i for i, f in enumerate(frames) if f.name == name and f.owner == owner]
    assert starts, f"no {owner} frame {name} in:\n" + "\n".join(map(str, frames))
    return frames[starts[-1]:]


def kernel_codes() -> set:
    """The code of every attention function of ComfyUI's attention module, unwrapped: what
    `optimized_attention` and a module's preferred attention finally run."""
    import comfy.ldm.modules.attention as attention
    return {inspect.unwrap(f).__code__ for name, f in vars(attention).items()
            if name.startswith("attention_") and inspect.isfunction(f)}


class KernelStacks:
    """A context that records, on the rank threads started inside it, the first call of an
    attention kernel made by our code (the exchange), with the stack of the thread waiting in
    the fan-out at that moment. A profile hook on those threads only; each drops it once seen."""

    def __init__(self, upstream_tree: Path, this_thread: bool = False):
        self.upstream_tree = upstream_tree
        self.this_thread = this_thread  # also watch the calling thread (rank 0 of the processes)
        self.rank: list[Frame] | None = None
        self.caller: list[Frame] | None = None
        self._kernels = None  # looked up at the first call into the module: a worker's prelude
        # runs before ComfyUI's settings are applied, so it must not import the module itself

    def profile(self, frame, event, arg) -> None:
        if (event != "call" or not frame.f_code.co_name.startswith("attention_")
                or not frame.f_code.co_filename.endswith(ATTENTION_MODULE) or frame.f_back is None):
            return  # (an attention function runs once its module is imported whole)
        if self._kernels is None:
            self._kernels = kernel_codes()
        if frame.f_code not in self._kernels:
            return
        if owner_of(frame.f_back.f_code.co_filename, self.upstream_tree)[0] != "ours":
            return  # not the exchange's call (e.g. the text refiner's attention)
        sys.setprofile(None)  # this thread is measured
        if self.rank is not None:
            return
        self.rank = frames_of(frame, self.upstream_tree)
        for ident, top in sys._current_frames().items():
            frames = frames_of(top, self.upstream_tree) if ident != threading.get_ident() else []
            if any(f.name == FAN_OUT_ENTRY for f in frames):
                self.caller = frames

    def __enter__(self) -> "KernelStacks":
        threading.setprofile(self.profile)  # for threads started from now on: the rank threads
        if self.this_thread:
            sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc) -> None:
        threading.setprofile(None)
        sys.setprofile(None)


@dataclass
class Hops:
    chain: list[Frame]  # the fan-out's entry .. the hand-off, then the rank's loop .. the kernel
    block: list[Frame]  # the frames below the model's block loop: one block, down to the kernel

    def count(self, owner: str) -> int:
        return sum(f.owner == owner for f in self.chain)

    def switches_in_block(self) -> int:
        """How often control goes ours -> upstream -> ours inside one block."""
        return switches(self.block)

    def switches(self) -> int:
        """The same over the whole chain."""
        return switches(self.chain)

    def ours_names(self) -> list[str]:
        return [f.name for f in self.chain if f.owner == "ours"]

    def table(self) -> str:
        return "\n".join(f"{i:3} {f}" for i, f in enumerate(self.chain, 1))

    def summary(self) -> str:
        return (f"{self.table()}\nours {self.count('ours')}, upstream {self.count('upstream')}, other "
                f"{self.count('other')}; ours -> upstream -> ours: {self.switches()} in all, "
                f"{self.switches_in_block()} in one block\nours: {' -> '.join(self.ours_names())}")


def switches(frames: list[Frame]) -> int:
    """How often control goes ours -> upstream -> ours (torch's and Python's frames between
    them do not count as a change of owner)."""
    owners = [f.owner for f in frames if f.owner != "other"]
    runs = [o for i, o in enumerate(owners) if i == 0 or owners[i - 1] != o]
    return sum(runs[i:i + 3] == ["ours", "upstream", "ours"] for i in range(len(runs)))


def one_thread_hops(frames: list[Frame], entry: str) -> Hops:
    """A chain that one thread runs whole: rank 0 of the processes from its fan-out's entry, or
    a worker from its serve loop."""
    chain = from_name(frames, entry)
    return Hops(chain, from_name(chain, BLOCK_LOOP, owner="upstream")[1:])


def hops(stacks: KernelStacks) -> Hops:
    assert stacks.rank is not None, "no attention kernel ran under the exchanging attention"
    assert stacks.caller is not None, f"no thread was inside {FAN_OUT_ENTRY} while a rank ran"
    caller = from_name(stacks.caller, FAN_OUT_ENTRY)
    hand_off = [i for i, f in enumerate(caller) if f.name == HAND_OFF]
    assert hand_off, f"the caller never reached {HAND_OFF}"
    rank = from_name(stacks.rank, RANK_LOOP)
    block = from_name(rank, BLOCK_LOOP, owner="upstream")[1:]
    return Hops(caller[:hand_off[0] + 1] + rank, block)


# ----------------------------------------------------------------------------- in a worker
# A worker process runs this as a prelude function (workers/comfy_dit.py) and writes its chain
# to the folder CHAIN_DIR_ENV names, one "owner<TAB>where<TAB>name" line per frame.
CHAIN_DIR_ENV = "MULTIDEVICE_TEST_CALL_CHAIN_DIR"


def record_in_worker() -> None:
    import os
    folder = Path(os.environ[CHAIN_DIR_ENV])
    stacks = KernelStacks(Path(os.environ["COMFYUI_DIR"]).resolve())
    watch = stacks.profile

    def profile(frame, event, arg):
        watch(frame, event, arg)
        if stacks.rank is not None:
            lines = ["\t".join((f.owner, f.where, f.name)) for f in stacks.rank]
            (folder / f"worker-{os.getpid()}.txt").write_text("\n".join(lines) + "\n")
            stacks.rank = None  # written once: `watch` has dropped the hook
            sys.setprofile(None)

    sys.setprofile(profile)  # the serve loop's thread: the prelude runs inside its build


def read_worker_chains(folder: Path) -> list[list[Frame]]:
    return [[Frame(*line.split("\t")) for line in path.read_text().splitlines()]
            for path in sorted(folder.glob("worker-*.txt"))]
