#!/usr/bin/env python3
"""Install or remove the MiniMax-H3 overlay in a ComfyUI checkout.

Called by `install_deps_minimax_h3.sh --comfyui DIR [--uninstall]`; usable on its own:

  tools/comfyui_overlay.py check     --comfyui DIR [--uninstall]   validate, change nothing
  tools/comfyui_overlay.py apply     --comfyui DIR
  tools/comfyui_overlay.py uninstall --comfyui DIR

What it installs:
- comfy-ui-changes.patch (new files only) through `git apply`, after `git apply --check`: the
  package comfy/multidevice/, the node and the node pack (the repository root's pack files)
  as custom_nodes/ComfyUI-MultiNPU/ (with its example_workflows/, which ComfyUI's Templates
  browser lists);
- the pack's workflows again into DIR/user/default/workflows/minimax-h3/ (ComfyUI versions
  without that browser; a workflow the user saved over ours is kept, ours goes beside it),
  additional_files/: sample inputs into DIR/input/, the service scripts into DIR/runtime/.
  DIR's extra_model_paths.yaml is never touched: the node pack adds $MINIMAX_H3_MODELS/<folder>
  itself when that variable is set;
- DIR/.minimax-h3-install.json: every file it wrote, with its sha256.

Every check runs before anything is written; a failure while writing undoes what this run
wrote. A second `apply` finds everything in place and changes nothing. An `apply` over an
earlier version replaces that version's files (the record says which are ours and unedited;
an edited overlay file stops it, an edited workflow is kept). `uninstall` removes only files
whose content is still ours, whichever version installed them.
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
    "input": Path("input"),
    "runtime": Path("runtime"),
}
# The workflows live in the node pack at the repository root (ComfyUI's Templates browser lists
# its example_workflows/);
# they are copied too where ComfyUI versions without that browser look: the default user's
# folder. A workflow the user saved over ours (Ctrl+S) is theirs: kept, and this version of
# ours goes beside it under a name that carries its content hash.
PACK_WORKFLOWS = Path("example_workflows")
WORKFLOWS_DIR = Path("user/default/workflows")
WORKFLOWS_TARGET = WORKFLOWS_DIR / "minimax-h3"
# What an install wrote, with content hashes: an upgrade replaces exactly the earlier install's
# files the user has not edited, and an uninstall removes those, whichever version wrote them.
RECORD = Path(".minimax-h3-install.json")
RECORD_FORMAT = 1
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


def explain_conflict(comfyui: Path, patch: Path, uninstalling: bool, paths=None) -> OverlayError:
    detail = _git(comfyui, "apply", "--check", str(patch)).stderr.strip()
    present = paths or [p for p in patch_paths(patch) if (comfyui / p).exists()]
    if uninstalling:
        return OverlayError(f"the overlay in {comfyui} is not the one in {patch.name} (files were "
                            f"edited, or another version was installed): {', '.join(present) or detail}; "
                            f"nothing was removed; restore or delete those files by hand")
    where = (f"these overlay files already exist, edited or not written by this installer: "
             f"{', '.join(present)}" if present else f"git apply --check says: {detail}")
    return OverlayError(f"cannot apply {patch.name} to {comfyui}: {where}. Nothing was changed. "
                        f"Restore or delete those files (an overlay installed before {RECORD} "
                        f"existed: remove it with --uninstall from the checkout that installed "
                        f"it), then rerun")


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


@dataclass(frozen=True)
class Project:
    """What an install takes from this repository checkout."""
    root: Path

    @property
    def patch(self) -> Path:
        return self.root / "comfy-ui-changes.patch"

    @property
    def pins(self) -> Path:
        return self.root / "source_deps_info.json"


def extra_files(project: Project) -> list[ExtraFile]:
    files = []
    extras_dir = project.root / "additional_files"
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
    for source in sorted((project.root / PACK_WORKFLOWS).glob("*.json")):
        files.append(ExtraFile(source, WORKFLOWS_TARGET / source.name))
    return files


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_content(a: Path, b: Path) -> bool:
    return a.is_file() and b.is_file() and _digest(a) == _digest(b)


def beside(extra: ExtraFile) -> ExtraFile:
    """Where this version of a workflow goes when the user's edited copy holds its name."""
    digest = _digest(extra.source)[:8]
    target = extra.target.with_name(f"{extra.target.stem}.{digest}{extra.target.suffix}")
    return ExtraFile(extra.source, target)


def is_workflow(extra: ExtraFile) -> bool:
    return WORKFLOWS_DIR in extra.target.parents


def plan_extras(comfyui: Path, extras: list[ExtraFile], gone: frozenset = frozenset()) -> list[ExtraFile]:
    """The extra files to copy; raises, before anything is written, on a file DIR has with other
    content (except a workflow the user edited: kept, ours goes beside it). Paths in `gone` are
    files of an earlier install that will be removed first: they count as absent."""
    def present(rel: Path) -> bool:
        return str(rel) not in gone and (comfyui / rel).exists()

    to_copy, clashes = [], []
    for extra in extras:
        if not present(extra.target):
            to_copy.append(extra)
        elif _same_content(extra.source, comfyui / extra.target):
            continue
        elif is_workflow(extra):
            new = beside(extra)
            if present(new.target) and _same_content(new.source, comfyui / new.target):
                continue
            if present(new.target):
                clashes.append(str(new.target))
                continue
            say(f"kept your edited {extra.target}; this version's workflow is installed beside it "
                f"as {new.target.name}")
            to_copy.append(new)
        else:
            clashes.append(str(extra.target))
    if clashes:
        raise OverlayError(f"{comfyui} already has {', '.join(clashes)} with other content (your edits, "
                           f"or a file this installer did not write); nothing was changed; move those "
                           f"files away, then rerun")
    return to_copy


def copy_extras(comfyui: Path, to_copy: list[ExtraFile], written: list[str]) -> None:
    """Copy; `written` collects what was written, so a failure can be undone by the caller."""
    for extra in to_copy:
        target = comfyui / extra.target
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(extra.source, target)
        shutil.copymode(extra.source, target)
        written.append(str(extra.target))


# ----------------------------------------------------------------------------- the install record

def read_record(comfyui: Path) -> dict[str, str]:
    """{path relative to DIR: sha256} of what the last install wrote; {} when there is none
    (never installed, or installed by a version of this tool that kept no record)."""
    path = comfyui / RECORD
    if not path.exists():
        return {}
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in files.items()):
            raise ValueError("'files' is not a mapping of path to sha256")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OverlayError(f"{path} cannot be read ({exc}); it lists the files an earlier install "
                           f"wrote. Restore it, or delete it and remove that install's files by "
                           f"hand, then rerun") from None
    return files


def unedited(comfyui: Path, record: dict[str, str]) -> set[str]:
    """The recorded files that still hold what the install wrote (the user's edits are theirs)."""
    return {rel for rel, digest in record.items()
            if (comfyui / rel).is_file() and _digest(comfyui / rel) == digest}


def write_record(comfyui: Path, project: Project) -> None:
    """Record every file of this version now in DIR with our content (a kept-beside workflow too)."""
    files = {rel: _digest(comfyui / rel) for rel in patch_paths(project.patch)}
    for extra in extra_files(project):
        for candidate in (extra, beside(extra)):
            if _same_content(candidate.source, comfyui / candidate.target):
                files[str(candidate.target)] = _digest(candidate.source)
    text = json.dumps({"format": RECORD_FORMAT, "tool": "install_deps_minimax_h3.sh --comfyui",
                       "files": dict(sorted(files.items()))}, indent=1) + "\n"
    path = comfyui / RECORD
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)


# ----------------------------------------------------------------------------- commands

H3_NODES = Path("comfy_extras/nodes_minimax_h3.py")


def require_h3(comfyui: Path, pins: Path) -> None:
    """A ComfyUI without MiniMax-H3 gets nothing from this overlay: refuse it (unless forced)."""
    if not (comfyui / H3_NODES).is_file():
        raise OverlayError(f"{comfyui} has no MiniMax-H3 nodes ({H3_NODES} is missing): this ComfyUI "
                           f"predates MiniMax-H3; update it (git pull; tested with upstream commit "
                           f"{pinned_commit(pins)}), or pass --force to install anyway")


@dataclass(frozen=True)
class InstallPlan:
    patch_state: str            # absent | applied | upgrade (an earlier version's files go first)
    replaced: tuple[str, ...]   # files of the earlier install removed before this one goes in
    to_copy: tuple[ExtraFile, ...]


def plan_install(comfyui: Path, project: Project, report: bool = True, force: bool = False) -> InstallPlan:
    """Every check of an install, before anything is written."""
    comfyui = validate_checkout(comfyui)
    if not force:
        require_h3(comfyui, project.pins)
    if not project.patch.is_file():
        raise OverlayError(f"{project.patch} is missing; regenerate it with tools/make_patch.py")
    if report:
        report_commit(comfyui, project.pins)
    record = read_record(comfyui)
    ours = unedited(comfyui, record)
    extras = extra_files(project)
    state = patch_state(comfyui, project.patch)
    if state == "conflict":
        present = [p for p in patch_paths(project.patch) if (comfyui / p).exists()]
        foreign = [p for p in present if p not in ours]
        if foreign or not record:
            raise explain_conflict(comfyui, project.patch, uninstalling=False, paths=foreign)
        replaced, state = sorted(ours), "upgrade"  # the earlier version as a whole, then this one
    else:
        # Same patch: an extra file of the earlier install that this version changed or dropped
        # (a workflow kept beside the user's edit is wanted under its beside name).
        wanted = {}
        for extra in extras:
            wanted[str(extra.target)] = wanted[str(beside(extra).target)] = _digest(extra.source)
        patch_files = set(patch_paths(project.patch))
        replaced = sorted(rel for rel in ours
                          if rel not in patch_files and wanted.get(rel) != record[rel])
    to_copy = plan_extras(comfyui, extras, gone=frozenset(replaced))
    return InstallPlan(state, tuple(replaced), tuple(to_copy))


def check(comfyui: Path, project: Project, uninstalling: bool, report: bool = True,
          force: bool = False) -> None:
    if not uninstalling:
        plan_install(comfyui, project, report=report, force=force)
        return
    comfyui = validate_checkout(comfyui)
    record = read_record(comfyui)
    if record:
        edited_files(comfyui, record)  # raises on an edited overlay file
        return
    if not project.patch.is_file():
        raise OverlayError(f"{project.patch} is missing; regenerate it with tools/make_patch.py")
    if report:
        report_commit(comfyui, project.pins)
    if patch_state(comfyui, project.patch) == "conflict":
        raise explain_conflict(comfyui, project.patch, uninstalling=True)


def _backup(comfyui: Path, files) -> dict[str, tuple[bytes, int]]:
    return {rel: ((comfyui / rel).read_bytes(), (comfyui / rel).stat().st_mode) for rel in files}


def _restore(comfyui: Path, saved: dict[str, tuple[bytes, int]]) -> None:
    for rel, (data, mode) in saved.items():
        path = comfyui / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def apply(comfyui: Path, project: Project, report: bool = True, force: bool = False) -> None:
    plan = plan_install(comfyui, project, report=report, force=force)
    comfyui = comfyui.resolve()
    patch = project.patch
    if plan.patch_state == "applied" and not plan.to_copy and not plan.replaced:
        had_record = (comfyui / RECORD).is_file()
        write_record(comfyui, project)  # an install by an earlier tool gets its record now
        say(f"already installed in {comfyui}: the patch is applied and every additional file is in "
            f"place; nothing changed" + ("" if had_record else f" (recorded it in {RECORD})"))
        return
    targets = [*patch_paths(patch), *(str(e.target) for e in plan.to_copy), *plan.replaced]
    existing = _existing_folders(comfyui, targets)
    saved = _backup(comfyui, plan.replaced)
    record_before = (comfyui / RECORD).read_bytes() if (comfyui / RECORD).is_file() else None
    written, patched = [], False
    try:
        for rel in plan.replaced:
            (comfyui / rel).unlink()
        _remove_bytecode_and_empty_dirs(comfyui, list(plan.replaced), keep=existing)
        if plan.patch_state in ("absent", "upgrade"):
            _git_apply(comfyui, patch)
            patched = True
        copy_extras(comfyui, list(plan.to_copy), written)
        write_record(comfyui, project)
    except (OSError, OverlayError) as exc:
        for rel in written:
            (comfyui / rel).unlink(missing_ok=True)
        if patched:
            _git_apply(comfyui, patch, "--reverse")
        _restore(comfyui, saved)
        if record_before is None:
            (comfyui / RECORD).unlink(missing_ok=True)
        else:
            (comfyui / RECORD).write_bytes(record_before)
        for folder in existing:  # git removes the folders it empties, earlier ones too
            (comfyui / folder).mkdir(parents=True, exist_ok=True)
        _remove_bytecode_and_empty_dirs(comfyui, [*written, *patch_paths(patch)], keep=existing)
        raise OverlayError(f"installing into {comfyui} failed ({exc}); what this run wrote was "
                           f"removed again and the earlier files restored") from None
    if plan.patch_state == "upgrade":
        say(f"upgraded {comfyui}: removed the {len(plan.replaced)} files of the earlier install "
            f"(none of them edited) and applied {patch.name} ({len(patch_paths(patch))} files)")
    elif plan.patch_state == "absent":
        say(f"applied {patch.name} ({len(patch_paths(patch))} new files) to {comfyui}")
    else:
        say(f"{patch.name} is already applied in {comfyui}")
    if plan.patch_state != "upgrade":  # an upgrade replaces the whole earlier install: said above
        for rel in plan.replaced:
            say(f"replaced {rel} (an earlier version of ours)")
    for rel in written:
        say(f"installed {rel}")


def edited_files(comfyui: Path, record: dict[str, str]) -> list[str]:
    """Recorded files the user changed, workflows aside (those are kept); raises for overlay
    files: removing the overlay around an edited module would leave a broken package."""
    ours = unedited(comfyui, record)
    edited = [rel for rel in record if rel not in ours and (comfyui / rel).exists()]
    blocking = [rel for rel in edited if WORKFLOWS_DIR not in Path(rel).parents]
    if blocking:
        raise OverlayError(f"these files of the install in {comfyui} were edited: {', '.join(blocking)}; "
                           f"nothing was removed; restore or delete those files by hand, then rerun")
    return edited


def uninstall(comfyui: Path, project: Project, report: bool = True) -> None:
    check(comfyui, project, uninstalling=True, report=report)
    comfyui = comfyui.resolve()
    pid_file = comfyui / "runtime" / "comfyui.pid"
    if pid_file.exists():
        raise OverlayError(f"{pid_file} exists: the ComfyUI service may be running; stop it with "
                           f"runtime/stop-v1.sh, then rerun --uninstall")
    record = read_record(comfyui)
    if record:
        kept = edited_files(comfyui, record)
        removed = sorted(unedited(comfyui, record))
    else:  # installed by a version of this tool that kept no record: this version's files
        kept, removed = _uninstall_unrecorded(comfyui, project)
    for rel in removed:
        (comfyui / rel).unlink()
    (comfyui / RECORD).unlink(missing_ok=True)
    _remove_bytecode_and_empty_dirs(comfyui, removed)
    for rel in kept:
        say(f"kept {rel}: its content is no longer ours (edited?)")
    say(f"removed {len(removed)} files of the MiniMax-H3 install from {comfyui}")


def _uninstall_unrecorded(comfyui: Path, project: Project) -> tuple[list[str], list[str]]:
    patch = project.patch
    removed, kept = [], []
    if patch_state(comfyui, patch) == "applied":
        removed += patch_paths(patch)
    ours = extra_files(project)
    ours += [b for b in (beside(e) for e in ours if is_workflow(e)) if (comfyui / b.target).exists()]
    for extra in ours:
        if _same_content(extra.source, comfyui / extra.target):
            removed.append(str(extra.target))
        elif (comfyui / extra.target).exists():
            kept.append(str(extra.target))
    return kept, removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/comfyui_overlay.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("check", "apply", "uninstall"))
    parser.add_argument("--comfyui", type=Path, required=True, help="the ComfyUI checkout")
    parser.add_argument("--uninstall", action="store_true", help="with check: check for removal")
    parser.add_argument("--project", type=Path, default=REPO_DIR,
                        help="the MiniMax-H3 multi-device checkout to install from (default: this one)")
    parser.add_argument("--checked", action="store_true",
                        help="the caller already ran `check`: don't report the commit again")
    parser.add_argument("--force", action="store_true",
                        help="install into a ComfyUI that has no MiniMax-H3 nodes")
    args = parser.parse_args(argv)
    project = Project(args.project.resolve())
    try:
        if args.command == "check":
            check(args.comfyui, project, uninstalling=args.uninstall, force=args.force)
        elif args.command == "apply":
            apply(args.comfyui, project, report=not args.checked, force=args.force)
        else:
            uninstall(args.comfyui, project, report=not args.checked)
    except OverlayError as exc:
        print(f"comfyui_overlay: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
