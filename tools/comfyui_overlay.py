#!/usr/bin/env python3
"""Install or remove the MiniMax-H3 overlay in a ComfyUI checkout.

Called by `install_deps_minimax_h3.sh --comfyui DIR [--uninstall]`; usable on its own:

  tools/comfyui_overlay.py check     --comfyui DIR [--uninstall]   validate, change nothing
  tools/comfyui_overlay.py apply     --comfyui DIR
  tools/comfyui_overlay.py uninstall --comfyui DIR

What it installs:
- comfy-ui-changes.patch (new files only) through `git apply`, after `git apply --check`;
- additional_files/: workflows into DIR/user/default/workflows/ (a workflow the user saved over
  ours is kept, ours goes beside it), sample inputs into DIR/input/, the service scripts into
  DIR/runtime/. DIR's extra_model_paths.yaml is never touched: the node pack adds
  $MINIMAX_H3_MODELS/<folder> itself when that variable is set.

Every check runs before anything is written; a failure while writing undoes what this run
wrote. A second `apply` finds everything in place and changes nothing. `uninstall` removes
only files whose content is still ours.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_DIR = Path(__file__).resolve().parent.parent
REQUIRED_ENTRIES = ("main.py", "comfy", "comfy_extras", "custom_nodes")
# additional_files/<first part> -> where it goes inside the ComfyUI checkout.
EXTRA_DESTINATIONS = {
    "workflows": Path("user/default/workflows"),
    "input": Path("input"),
    "runtime": Path("runtime"),
}
# A workflow the user saved over ours (Ctrl+S) is theirs: kept, and this version of ours goes
# beside it under a name that carries its content hash.
WORKFLOWS_DIR = Path("user/default/workflows")
SKIPPED_SUFFIXES = (".log", ".pid", ".pyc")
# The checkout's required folders existed before any install: an uninstall leaves them in
# place even when it empties them (without custom_nodes/, DIR would no longer pass the
# checkout test). An install that undoes itself after a failure keeps exactly the folders
# that were there before it.
COMFYUI_FOLDERS = frozenset(Path(p) for p in REQUIRED_ENTRIES if p != "main.py")


class OverlayError(RuntimeError):
    """Something stops the install; the message says what and how to fix it."""


def say(message: str) -> None:
    print(f"comfyui_overlay: {message}", flush=True)


# ----------------------------------------------------------------------------- the checkout

def validate_checkout(comfyui: Path) -> Path:
    if not comfyui.is_dir():
        raise OverlayError(f"{comfyui} is not a directory; pass --comfyui the folder of your ComfyUI "
                           f"checkout (the one that holds main.py)")
    missing = [name for name in REQUIRED_ENTRIES
               if not (comfyui / name).is_file() and not (comfyui / name).is_dir()]
    if missing:
        raise OverlayError(f"{comfyui} does not look like a ComfyUI checkout: it has no "
                           f"{', '.join(missing)}; pass --comfyui the folder that holds main.py, "
                           f"comfy/, comfy_extras/ and custom_nodes/")
    return comfyui.resolve()


def _git_env(comfyui: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE")}
    # Never let git climb to a repository above DIR: `git apply` run from a subfolder of an
    # unrelated repository would silently skip every path outside that subfolder.
    env["GIT_CEILING_DIRECTORIES"] = str(comfyui.parent)
    return env


def _git(comfyui: Path, *args: str) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        raise OverlayError("git is not installed; it applies the patch (install git, e.g. "
                           "`apt-get install git`, then rerun)")
    return subprocess.run(["git", *args], cwd=comfyui, env=_git_env(comfyui),
                          capture_output=True, text=True, timeout=300)


def checkout_commit(comfyui: Path) -> str | None:
    """DIR's git commit, or None when DIR is not the top of a git checkout."""
    top = _git(comfyui, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != comfyui:
        return None
    head = _git(comfyui, "rev-parse", "HEAD")
    return head.stdout.strip() if head.returncode == 0 else None


def pinned_commit(pins_file: Path) -> str:
    try:
        return json.loads(pins_file.read_text())["upstream"]["commit"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OverlayError(f"cannot read upstream.commit from {pins_file}: {exc!r}; restore the "
                           f"file from git") from None


def report_commit(comfyui: Path, pins_file: Path) -> None:
    pinned, found = pinned_commit(pins_file), checkout_commit(comfyui)
    if found is None:
        say(f"warning: cannot tell which ComfyUI commit {comfyui} is (not the top of a git "
            f"checkout); this overlay was tested against ComfyUI {pinned}")
    elif found != pinned:
        say(f"warning: {comfyui} is at ComfyUI commit {found}, but this overlay was tested against "
            f"{pinned} (source_deps_info.json upstream.commit); it usually works, and if it does "
            f"not, check out {pinned}")
    else:
        say(f"{comfyui} is at the pinned ComfyUI commit {pinned}")


# ----------------------------------------------------------------------------- the patch

def patch_paths(patch: Path) -> list[str]:
    # "diff --git a/P b/P" heads every file, an empty one included (which has no "+++" line).
    names = [line.rsplit(" b/", 1)[1] for line in patch.read_text().splitlines()
             if line.startswith("diff --git a/")]
    if not names:
        raise OverlayError(f"{patch} holds no files; regenerate it with tools/make_patch.py")
    return names


def patch_state(comfyui: Path, patch: Path) -> str:
    """'absent', 'applied', or 'conflict' (neither applies cleanly)."""
    if _git(comfyui, "apply", "--check", str(patch)).returncode == 0:
        return "absent"
    if _git(comfyui, "apply", "--reverse", "--check", str(patch)).returncode == 0:
        return "applied"
    return "conflict"


def explain_conflict(comfyui: Path, patch: Path, uninstalling: bool) -> OverlayError:
    detail = _git(comfyui, "apply", "--check", str(patch)).stderr.strip()
    present = [p for p in patch_paths(patch) if (comfyui / p).exists()]
    if uninstalling:
        return OverlayError(f"the overlay in {comfyui} is not the one in {patch.name} (files were "
                            f"edited, or another version was installed): {', '.join(present) or detail}; "
                            f"nothing was removed; restore or delete those files by hand")
    where = (f"these overlay files already exist with other content: {', '.join(present)}"
             if present else f"git apply --check says: {detail}")
    return OverlayError(f"cannot apply {patch.name} to {comfyui}: {where}. Nothing was changed. An "
                        f"older version of this overlay may be installed: remove it with the "
                        f"checkout that installed it (--uninstall), or delete those files, then rerun")


def _git_apply(comfyui: Path, patch: Path, *flags: str) -> None:
    result = _git(comfyui, "apply", *flags, str(patch))
    if result.returncode != 0:
        raise OverlayError(f"git apply {' '.join(flags)} {patch.name} failed in {comfyui}: "
                           f"{result.stderr.strip()}")


def _existing_folders(comfyui: Path, files: list[str]) -> frozenset:
    """The folders (relative to DIR) above these files that exist right now."""
    return frozenset(p.relative_to(comfyui) for rel in files for p in (comfyui / rel).parents
                     if comfyui in p.parents and p.is_dir())


def _remove_bytecode_and_empty_dirs(comfyui: Path, removed: list[str], keep=COMFYUI_FOLDERS) -> None:
    """After removing files: their .pyc files, then folders left empty (rmdir never removes
    content), except the folders in `keep` (relative to DIR)."""
    folders = set()
    for rel in removed:
        path = comfyui / rel
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()
        folders.update([path.parent / "__pycache__", *[p for p in path.parents
                                                      if comfyui in p.parents]])
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        if folder.relative_to(comfyui) in keep:
            continue
        try:
            folder.rmdir()
        except OSError:
            pass  # not empty or not there: it holds something that is not ours


# ----------------------------------------------------------------------------- additional files

@dataclass(frozen=True)
class ExtraFile:
    source: Path
    target: Path  # relative to the ComfyUI checkout


def extra_files(extras_dir: Path) -> list[ExtraFile]:
    files = []
    if not extras_dir.is_dir():
        raise OverlayError(f"{extras_dir} is missing; run this from a full checkout of the repository")
    for source in sorted(extras_dir.rglob("*")):
        if not source.is_file() or source.name.endswith(SKIPPED_SUFFIXES) or "__pycache__" in source.parts:
            continue
        rel = source.relative_to(extras_dir)
        if rel.parts[0] not in EXTRA_DESTINATIONS:
            raise OverlayError(f"{source} has no install destination (known: "
                               f"{', '.join(EXTRA_DESTINATIONS)}); add it to EXTRA_DESTINATIONS")
        files.append(ExtraFile(source, EXTRA_DESTINATIONS[rel.parts[0]].joinpath(*rel.parts[1:])))
    return files


def _same_content(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and hashlib.sha256(a.read_bytes()).digest() == \
        hashlib.sha256(b.read_bytes()).digest()


def beside(extra: ExtraFile) -> ExtraFile:
    """Where this version of a workflow goes when the user's edited copy holds its name."""
    digest = hashlib.sha256(extra.source.read_bytes()).hexdigest()[:8]
    target = extra.target.with_name(f"{extra.target.stem}.{digest}{extra.target.suffix}")
    return ExtraFile(extra.source, target)


def is_workflow(extra: ExtraFile) -> bool:
    return WORKFLOWS_DIR in extra.target.parents


def plan_extras(comfyui: Path, extras: list[ExtraFile]) -> list[ExtraFile]:
    """The extra files to copy; raises, before anything is written, on a file DIR has with other
    content (except a workflow the user edited: kept, ours goes beside it)."""
    to_copy, clashes = [], []
    for extra in extras:
        target = comfyui / extra.target
        if not target.exists():
            to_copy.append(extra)
        elif _same_content(extra.source, target):
            continue
        elif is_workflow(extra):
            new = beside(extra)
            if _same_content(new.source, comfyui / new.target):
                continue
            if (comfyui / new.target).exists():
                clashes.append(str(new.target))
                continue
            say(f"kept your edited {extra.target}; this version's workflow is installed beside it "
                f"as {new.target.name}")
            to_copy.append(new)
        else:
            clashes.append(str(extra.target))
    if clashes:
        raise OverlayError(f"{comfyui} already has {', '.join(clashes)} with other content (your edits, "
                           f"or another version); nothing was changed; move those files away, then rerun")
    return to_copy


def copy_extras(comfyui: Path, to_copy: list[ExtraFile], keep=COMFYUI_FOLDERS) -> list[str]:
    written = []
    try:
        for extra in to_copy:
            target = comfyui / extra.target
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(extra.source, target)
            shutil.copymode(extra.source, target)
            written.append(str(extra.target))
    except OSError:
        for rel in written:
            (comfyui / rel).unlink(missing_ok=True)
        _remove_bytecode_and_empty_dirs(comfyui, written, keep)
        raise
    return written


# ----------------------------------------------------------------------------- commands

H3_NODES = Path("comfy_extras/nodes_minimax_h3.py")


def require_h3(comfyui: Path, pins: Path) -> None:
    """A ComfyUI without MiniMax-H3 gets nothing from this overlay: refuse it (unless forced)."""
    if not (comfyui / H3_NODES).is_file():
        raise OverlayError(f"{comfyui} has no MiniMax-H3 nodes ({H3_NODES} is missing): this ComfyUI "
                           f"predates MiniMax-H3; update it (git pull; tested with upstream commit "
                           f"{pinned_commit(pins)}), or pass --force to install anyway")


def check(comfyui: Path, patch: Path, pins: Path, extras_dir: Path, uninstalling: bool,
          report: bool = True, force: bool = False) -> str:
    comfyui = validate_checkout(comfyui)
    if not uninstalling and not force:
        require_h3(comfyui, pins)
    if not patch.is_file():
        raise OverlayError(f"{patch} is missing; regenerate it with tools/make_patch.py")
    if report:
        report_commit(comfyui, pins)
    state = patch_state(comfyui, patch)
    if state == "conflict":
        raise explain_conflict(comfyui, patch, uninstalling)
    if not uninstalling:
        plan_extras(comfyui, extra_files(extras_dir))
    return state


def apply(comfyui: Path, patch: Path, pins: Path, extras_dir: Path, report: bool = True,
          force: bool = False) -> None:
    state = check(comfyui, patch, pins, extras_dir, uninstalling=False, report=report, force=force)
    comfyui = comfyui.resolve()
    to_copy = plan_extras(comfyui, extra_files(extras_dir))
    if state == "applied" and not to_copy:
        say(f"already installed in {comfyui}: the patch is applied and every additional file is in "
            f"place; nothing changed")
        return
    existing = _existing_folders(comfyui, [*patch_paths(patch), *(str(e.target) for e in to_copy)])
    if state == "absent":
        _git_apply(comfyui, patch)
        say(f"applied {patch.name} ({len(patch_paths(patch))} new files) to {comfyui}")
    else:
        say(f"{patch.name} is already applied in {comfyui}")
    try:
        written = copy_extras(comfyui, to_copy, keep=existing)
    except OSError as exc:
        if state == "absent":
            _git_apply(comfyui, patch, "--reverse")
            for folder in existing:  # git removes the folders it empties, earlier ones too
                (comfyui / folder).mkdir(parents=True, exist_ok=True)
            _remove_bytecode_and_empty_dirs(comfyui, patch_paths(patch), keep=existing)
        raise OverlayError(f"copying the additional files into {comfyui} failed ({exc}); what this "
                           f"run wrote was removed again") from None
    for rel in written:
        say(f"installed {rel}")


def uninstall(comfyui: Path, patch: Path, pins: Path, extras_dir: Path, report: bool = True) -> None:
    state = check(comfyui, patch, pins, extras_dir, uninstalling=True, report=report)
    comfyui = comfyui.resolve()
    pid_file = comfyui / "runtime" / "comfyui.pid"
    if pid_file.exists():
        raise OverlayError(f"{pid_file} exists: the ComfyUI service may be running; stop it with "
                           f"runtime/stop-v1.sh, then rerun --uninstall")
    ours = extra_files(extras_dir)
    ours += [b for b in (beside(e) for e in ours if is_workflow(e)) if (comfyui / b.target).exists()]
    if state == "applied":
        own = [comfyui / f for f in COMFYUI_FOLDERS if (comfyui / f).is_dir()]
        _git_apply(comfyui, patch, "--reverse")
        for folder in own:  # git removes the folders it empties, the checkout's own ones too
            folder.mkdir(parents=True, exist_ok=True)
        _remove_bytecode_and_empty_dirs(comfyui, patch_paths(patch))
        say(f"removed the {len(patch_paths(patch))} overlay files of {patch.name} from {comfyui}")
    else:
        say(f"{patch.name} is not applied in {comfyui}; no overlay file to remove")
    removed = []
    for extra in ours:
        target = comfyui / extra.target
        if _same_content(extra.source, target):
            target.unlink()
            removed.append(str(extra.target))
        elif target.exists():
            say(f"kept {extra.target}: its content is no longer ours (edited?)")
    _remove_bytecode_and_empty_dirs(comfyui, removed)
    if removed:
        say(f"removed {len(removed)} additional files")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/comfyui_overlay.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("check", "apply", "uninstall"))
    parser.add_argument("--comfyui", type=Path, required=True, help="the ComfyUI checkout")
    parser.add_argument("--uninstall", action="store_true", help="with check: check for removal")
    parser.add_argument("--patch", type=Path, default=REPO_DIR / "comfy-ui-changes.patch")
    parser.add_argument("--pins", type=Path, default=REPO_DIR / "source_deps_info.json")
    parser.add_argument("--extras", type=Path, default=REPO_DIR / "additional_files")
    parser.add_argument("--checked", action="store_true",
                        help="the caller already ran `check`: don't report the commit again")
    parser.add_argument("--force", action="store_true",
                        help="install into a ComfyUI that has no MiniMax-H3 nodes")
    args = parser.parse_args(argv)
    paths = (args.comfyui, args.patch.resolve(), args.pins, args.extras)
    try:
        if args.command == "check":
            check(*paths, uninstalling=args.uninstall, force=args.force)
        elif args.command == "apply":
            apply(*paths, report=not args.checked, force=args.force)
        else:
            uninstall(*paths, report=not args.checked)
    except OverlayError as exc:
        print(f"comfyui_overlay: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
