"""`minimax_h3_parallel.py tryout`: tiny random weights and the try-out node into a ComfyUI, or --remove them.

Installing refuses (writing nothing) when the ComfyUI folder's models/ (or $MINIMAX_H3_MODELS)
already holds a file of a released name: whoever has the real weights does not need the
try-out, and the try-out node would make upstream's loaders build tiny configs for them. Else it
builds the tiny files with upstream's own classes (so it needs ComfyUI's Python; imported only
here, at run time) and writes them and the node with a record (tryout/record.py).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from comfy.multidevice.commands import CLI_SCRIPT, PROJECT_DIR
from comfy.multidevice.tryout import models, node
from comfy.multidevice.tryout.record import already_there, Record, remove, TryoutError, write_all

NODE_DIR = f"custom_nodes/{node.FOLDER}"
RECORD = f"{NODE_DIR}/tryout-record.json"
MODELS_ENV = "MINIMAX_H3_MODELS"  # the extra model folder the pack's __init__.py adds to ComfyUI's
NEXT_STEPS = """\
Next: restart ComfyUI and open one of the pack's templates (Templates, under the pack). On the
Multi-NPU Parallel Config node set npu_count 4 and device_kind cpu; make the run small (the
seconds 1, width and height 128, steps 2), then Run. The result is noise: the weights are random."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--comfyui", type=Path, required=True, metavar="DIR",
                        help="the ComfyUI folder (the one with main.py) to put the try-out into or remove it from")
    parser.add_argument("--remove", action="store_true",
                        help="remove the try-out: only the files it wrote, and only while unchanged")
    parser.set_defaults(handler=main)


def remove_command(root: Path) -> str:
    """The command that removes the try-out from `root`, with this Python and this script."""
    words = [sys.executable, str(PROJECT_DIR / CLI_SCRIPT), "tryout", "--comfyui", str(root), "--remove"]
    return " ".join(shlex.quote(w) for w in words)


def refuse_if_taken(root: Path) -> None:
    """Raises TryoutError naming every released-name file (or the node's folder) already there:
    in root/models or in $MINIMAX_H3_MODELS, which the pack adds to ComfyUI's model folders."""
    released = [f"{folder}/{name}" for folder, name in models.released_names().values()]  # the BF16 DiT too
    taken = already_there(root, [*(f"models/{rel}" for rel in released), NODE_DIR])
    extra = os.environ.get(MODELS_ENV, "").strip()
    base = Path(extra).expanduser() if extra else None
    elsewhere = [base / rel for rel in released if base is not None and os.path.lexists(base / rel)]
    if taken or elsewhere:
        named = ", ".join([*taken, *(f"{p} (${MODELS_ENV})" for p in elsewhere)])
        raise TryoutError(f"refused: {named} already there. The try-out is for a ComfyUI without the "
                          "MiniMax-H3 weights (its node would make the H3 loaders build tiny models); with "
                          "the real files, run the templates on them instead")


def install(root: Path) -> Record:
    """Write the tiny files and the node into `root`; raises TryoutError (nothing written) when
    something of a released name or the node's folder is already there. Upstream importable."""
    refuse_if_taken(root)
    names = models.released_names()
    files = {f"models/{names[role][0]}/{names[role][1]}": data for role, data in models.tiny_files().items()}
    files.update({f"{NODE_DIR}/{name}": data for name, data in node.node_files(remove_command(root)).items()})
    return write_all(root, RECORD, files)


def import_upstream(root: Path) -> None:
    """ComfyUI of `root` importable in this process, on the CPU (the files are made on the CPU)."""
    if str(root) not in sys.path:
        sys.path.append(str(root))  # after the project: comfy.multidevice stays this one
    try:
        import comfy.cli_args
        comfy.cli_args.args.cpu = True  # before model_management picks a device
        import comfy.ldm.minimax.model  # noqa: F401
    except ImportError as exc:
        raise TryoutError(f"cannot import ComfyUI's MiniMax-H3 code from {root} ({exc}); run this command "
                          "with the Python that runs ComfyUI's main.py, on a ComfyUI that has MiniMax-H3") from exc


def is_comfyui(root: Path) -> bool:
    return (root / "main.py").is_file() and (root / "comfy").is_dir() and (root / "custom_nodes").is_dir()


def main(args: argparse.Namespace) -> int:
    root = args.comfyui.expanduser().resolve()
    if not is_comfyui(root):
        print(f"tryout: {args.comfyui} is not a ComfyUI folder (no main.py, comfy/ and custom_nodes/ there)",
              file=sys.stderr)
        return 2
    try:
        return remove_main(root) if args.remove else install_main(root)
    except TryoutError as exc:
        print(f"tryout: {exc}", file=sys.stderr)
        return 1


def install_main(root: Path) -> int:
    record = Record.load(root, RECORD)
    if record is not None:
        changed = record.changed()
        print(f"The try-out is already in {root}" + (f"; changed since: {', '.join(changed)}" if changed else "")
              + f".\nRemove it with: {remove_command(root)}")
        return 1 if changed else 0
    if not models.PINS.is_file():
        print(f"tryout: {models.PINS.name} is not in {PROJECT_DIR} (a patched ComfyUI has none): run the "
              f"{CLI_SCRIPT} of a checkout or clone of the project", file=sys.stderr)
        return 2
    refuse_if_taken(root)  # before the slow part
    start = time.monotonic()
    try:
        import_upstream(root)
    except TryoutError as exc:
        print(f"tryout: {exc}", file=sys.stderr)
        return 2
    record = install(root)
    print(f"MiniMax-H3 TRY-OUT written into {root} in {time.monotonic() - start:.1f} s "
          "(tiny random weights, not the model):")
    for rel in record.files:
        size = (root / rel).stat().st_size
        print(f"  {rel} ({size / 1e6:.1f} MB)" if size >= 100_000 else f"  {rel} ({size / 1e3:.1f} kB)")
    print(f"ComfyUI logs 'TRY-OUT: ...' at each start while it is there.\n{NEXT_STEPS}\n"
          f"Remove it all with:\n  {remove_command(root)}")
    return 0


def remove_main(root: Path) -> int:
    result = remove(root, RECORD)
    if result is None:
        print(f"No try-out recorded in {root} ({RECORD}): nothing to remove.")
        return 0
    print(f"Removed the try-out from {root}: {len(result.removed)} file(s) deleted"
          + (f", {len(result.gone)} already gone" if result.gone else "") + ".")
    if result.changed:
        print(f"Left in place, changed since the try-out wrote them: {', '.join(result.changed)}. Delete them "
              "yourself if they are not yours, then run this again.", file=sys.stderr)
    if result.folders_left:
        print(f"Folders left, they hold files the try-out did not write: {', '.join(result.folders_left)}",
              file=sys.stderr)
    return 0 if result.complete else 1
