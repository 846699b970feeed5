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

Every check runs before anything is written. The patch is applied into an empty staging
folder; then each file goes into DIR under a temporary name and is renamed onto its own (no
file is ever cut short under its real name), and a file it replaces or removes is renamed
aside first. A failure while writing undoes all of it, leaving DIR exactly as it was found, or
names what it could not undo. A run cut short by a kill leaves only files with our content: a
rerun completes it and `uninstall` removes them. A second `apply` finds everything in place
and changes nothing. An `apply` over an earlier version replaces that version's files (the
record says which are ours and unedited; an edited overlay file stops it, an edited workflow
is kept). `uninstall` removes only files whose content is still ours, whichever version
installed them.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
# The templates' thumbnails (tools/make_thumbnails.py): pictures the text patch cannot carry go
# beside the pack's workflows, where the Templates browser looks for <name>.jpg.
THUMBNAILS_TARGET = Path("custom_nodes/ComfyUI-MultiNPU/example_workflows")
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


# ----------------------------------------------------------------------------- this version's files

def patch_paths(patch: Path) -> list[str]:
    # "diff --git a/P b/P" heads every file, an empty one included (which has no "+++" line).
    names = [line.rsplit(" b/", 1)[1] for line in patch.read_text().splitlines()
             if line.startswith("diff --git a/")]
    if not names:
        raise OverlayError(f"{patch} holds no files; regenerate it with tools/make_patch.py")
    return names


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
    for source in sorted((project.root / PACK_WORKFLOWS).glob("*.jpg")):
        files.append(ExtraFile(source, THUMBNAILS_TARGET / source.name))
    return files


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def beside(extra: ExtraFile) -> ExtraFile:
    """Where this version of a workflow goes when the user's edited copy holds its name."""
    digest = _digest(extra.source)[:8]
    target = extra.target.with_name(f"{extra.target.stem}.{digest}{extra.target.suffix}")
    return ExtraFile(extra.source, target)


def is_workflow(rel) -> bool:
    return WORKFLOWS_DIR in Path(rel).parents


@dataclass(frozen=True)
class Version:
    """This version's files, each with the file in a staging folder (or this checkout) that
    holds its content. The patch is applied into that empty staging folder, never into DIR:
    `git apply` writes file by file and leaves what it wrote when it fails."""
    patch: dict[str, Path]       # path in DIR -> staged file
    extras: tuple[ExtraFile, ...]
    staging: Path

    def digests(self) -> dict[str, str]:
        """{path in DIR: sha256} of every name this version may write (a beside name too)."""
        files = {rel: _digest(source) for rel, source in self.patch.items()}
        for extra in self.extras:
            files[str(extra.target)] = files[str(beside(extra).target)] = _digest(extra.source)
        return files


@contextlib.contextmanager
def staged(project: Project):
    if not project.patch.is_file():
        raise OverlayError(f"{project.patch} is missing; regenerate it with tools/make_patch.py")
    extras = tuple(extra_files(project))
    with tempfile.TemporaryDirectory(prefix="minimax-h3-staging-") as tmp:
        staging = Path(tmp) / "patch"
        staging.mkdir()
        result = _git(staging, "apply", str(project.patch))
        if result.returncode != 0:
            raise OverlayError(f"cannot apply {project.patch.name} even to an empty folder "
                               f"({result.stderr.strip()}); nothing was changed; regenerate it "
                               f"with tools/make_patch.py (or free space in {tmp})")
        yield Version({rel: staging / rel for rel in patch_paths(project.patch)}, extras, Path(tmp))


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


def recognise(comfyui: Path, record: dict[str, str], version: Version) -> tuple[set[str], list[str]]:
    """(ours, edited). Ours: the files that hold what the record says an install wrote, or this
    version's content (a run cut short, by a crash or a kill, wrote those without a record).
    Edited: the recorded files and this version's names that hold something else."""
    wanted = version.digests()
    ours, edited = set(), []
    for rel in sorted(set(record) | set(wanted)):
        path = comfyui / rel
        if path.is_file() and _digest(path) in (record.get(rel), wanted.get(rel)):
            ours.add(rel)
        elif path.exists() or path.is_symlink():
            edited.append(rel)
    return ours, edited


def record_text(comfyui: Path, version: Version) -> str:
    """The record of every file of this version now in DIR with our content (a beside workflow too)."""
    files = {rel: digest for rel, digest in version.digests().items()
             if (comfyui / rel).is_file() and _digest(comfyui / rel) == digest}
    return json.dumps({"format": RECORD_FORMAT, "tool": "install_deps_minimax_h3.sh --comfyui",
                       "files": dict(sorted(files.items()))}, indent=1) + "\n"


# ----------------------------------------------------------------------------- undoable writes

PARTIAL, ASIDE = ".minimax-h3-partial", ".minimax-h3-old"


def _temporary(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}{suffix}")


def remove_leftovers(comfyui: Path, paths) -> list[str]:
    """The temporary files a run that was killed can leave beside these paths; returns the
    paths beside which one was removed (their folders may now be empty)."""
    found = []
    for rel in paths:
        for suffix in (PARTIAL, ASIDE):
            leftover = _temporary(comfyui / rel, suffix)
            with contextlib.suppress(OSError):
                if leftover.is_file() or leftover.is_symlink():
                    leftover.unlink()
                    found.append(str(rel))
    return found


class Changes:
    """The changes one install makes to DIR, each undoable. A file is written under a temporary
    name and renamed onto its own, so no file is ever cut short under its real name; a file it
    replaces or removes is first renamed aside (that needs no disk space), so undo can rename it
    back; undo also removes every file and folder the run created."""

    def __init__(self, comfyui: Path):
        self.comfyui = comfyui
        self.created: list[Path] = []                # files and folders, in order
        self.aside: list[tuple[Path, Path]] = []     # (path, the name it waits under)

    def _make_folders(self, folder: Path) -> None:
        missing = [p for p in (folder, *folder.parents)
                   if self.comfyui in p.parents and not p.exists() and not p.is_symlink()]
        for path in reversed(missing):
            path.mkdir()
            self.created.append(path)

    def write(self, source: Path, rel: str) -> None:
        path = self.comfyui / rel
        self._make_folders(path.parent)
        partial = _temporary(path, PARTIAL)
        try:
            shutil.copyfile(source, partial)
            shutil.copymode(source, partial)
            if path.exists() or path.is_symlink():
                self.set_aside(rel)
            os.replace(partial, path)
        except BaseException:
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            raise
        self.created.append(path)

    def set_aside(self, rel: str) -> None:
        path = self.comfyui / rel
        aside = _temporary(path, ASIDE)
        os.replace(path, aside)
        self.aside.append((path, aside))

    def undo(self) -> list[str]:
        """Undo everything; returns what could not be undone (empty: DIR is as it was)."""
        left = []
        for path in reversed(self.created):
            try:
                path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                left.append(f"{path.relative_to(self.comfyui)} ({exc.strerror})")
        for path, aside in reversed(self.aside):
            try:
                os.replace(aside, path)
            except OSError as exc:
                left.append(f"{path.relative_to(self.comfyui)}, set aside as {aside.name} ({exc.strerror})")
        return left

    def finish(self) -> None:
        """Drop what was set aside, its bytecode and the folders that left empty."""
        for _, aside in self.aside:
            with contextlib.suppress(OSError):
                aside.unlink()
        _remove_bytecode_and_empty_dirs(self.comfyui, [str(p.relative_to(self.comfyui))
                                                       for p, _ in self.aside])


def _remove_bytecode_and_empty_dirs(comfyui: Path, removed: list[str]) -> None:
    """After removing files: their .pyc files, then folders left empty (rmdir never removes
    content), except the checkout's own folders. Failures are left alone: only caches and
    empty folders are at stake."""
    folders = set()
    for rel in removed:
        path = comfyui / rel
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            with contextlib.suppress(OSError):
                pyc.unlink()
        folders.update([path.parent / "__pycache__", *[p for p in path.parents
                                                      if comfyui in p.parents]])
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        if folder.relative_to(comfyui) in COMFYUI_FOLDERS:
            continue
        try:
            folder.rmdir()
        except OSError:
            pass  # not empty or not there: it holds something that is not ours


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
    writes: tuple[tuple[Path, str], ...]  # (content, path in DIR): absent there, or an earlier install's
    replaced: tuple[str, ...]             # the written paths that hold an earlier install's file
    removes: tuple[str, ...]              # an earlier install's files this version does not have


def plan_install(comfyui: Path, project: Project, version: Version, report: bool = True,
                 force: bool = False) -> InstallPlan:
    """Every check of an install, before anything is written."""
    comfyui = validate_checkout(comfyui)
    if not force:
        require_h3(comfyui, project.pins)
    if report:
        report_commit(comfyui, project.pins)
    record = read_record(comfyui)
    ours, edited = recognise(comfyui, record, version)
    digests = version.digests()
    writes, replaced, targets, clashes = [], [], set(), []

    def place(source: Path, rel: str) -> bool:
        """Plan rel (absent, or ours: written unless it holds this version already); False when
        DIR holds something of its own there."""
        path = comfyui / rel
        present = path.exists() or path.is_symlink()
        if present and rel not in ours:
            return False
        if not present or _digest(path) != digests[rel]:
            writes.append((source, rel))
            if present:
                replaced.append(rel)
        targets.add(rel)
        return True

    for rel, source in version.patch.items():
        if not place(source, rel):
            clashes.append(rel)
    for extra in version.extras:
        if place(extra.source, str(extra.target)):
            continue
        new = beside(extra)
        if is_workflow(extra.target) and place(new.source, str(new.target)):
            if writes and writes[-1][1] == str(new.target):
                say(f"kept your edited {extra.target}; this version's workflow is installed beside it "
                    f"as {new.target.name}")
            continue
        clashes.append(str(new.target if is_workflow(extra.target) else extra.target))
    # An overlay file of the earlier install that the user edited stops it (removing the package
    # around it would break it); an edited workflow is theirs, kept.
    clashes += [rel for rel in edited if rel in record and rel not in clashes and not is_workflow(rel)]
    if clashes:
        raise OverlayError(f"cannot install into {comfyui}: these files already exist, edited or "
                           f"not written by this installer: {', '.join(clashes)}. Nothing was changed. Move those files away (an "
                           f"overlay installed before {RECORD} existed: remove it with --uninstall "
                           f"from the checkout that installed it), then rerun")
    removes = sorted(rel for rel in ours if rel in record and rel not in targets)
    return InstallPlan(tuple(writes), tuple(replaced), tuple(removes))


def check(comfyui: Path, project: Project, uninstalling: bool, report: bool = True,
          force: bool = False) -> None:
    with staged(project) as version:
        if uninstalling:
            plan_uninstall(comfyui, project, version, report=report)
        else:
            plan_install(comfyui, project, version, report=report, force=force)


def repair_hint(comfyui: Path) -> str:
    return (f"once the cause is fixed, rerun the install (it completes it) or run "
            f"`install_deps_minimax_h3.sh --comfyui {comfyui} --uninstall` (it removes it): both "
            f"recognise those files as ours")


def apply(comfyui: Path, project: Project, report: bool = True, force: bool = False) -> None:
    with staged(project) as version:
        plan = plan_install(comfyui, project, version, report=report, force=force)
        comfyui = comfyui.resolve()
        had_record = (comfyui / RECORD).is_file()
        changes = Changes(comfyui)
        try:
            for source, rel in plan.writes:
                changes.write(source, rel)
            for rel in plan.removes:
                changes.set_aside(rel)
            text = record_text(comfyui, version)  # an install by an earlier tool gets its record now
            if not had_record or (comfyui / RECORD).read_text() != text:
                (version.staging / RECORD.name).write_text(text)
                changes.write(version.staging / RECORD.name, str(RECORD))
        except (OSError, KeyboardInterrupt) as exc:
            left = changes.undo()
            why = f"installing into {comfyui} failed ({exc or type(exc).__name__})"
            if left:
                raise OverlayError(f"{why}, and these of its changes could not be undone: "
                                   f"{'; '.join(left)}; {repair_hint(comfyui)}") from None
            raise OverlayError(f"{why}; what this run wrote was removed again and the files it "
                               f"replaced restored: {comfyui} is as it was") from None
        changes.finish()
        remove_leftovers(comfyui, [*version.digests(), *plan.removes, str(RECORD)])
    if not plan.writes and not plan.removes:
        say(f"already installed in {comfyui}: the patch is applied and every additional file is in "
            f"place; nothing changed" + ("" if had_record else f" (recorded it in {RECORD})"))
        return
    new = [rel for _, rel in plan.writes if rel not in plan.replaced]
    if plan.replaced or plan.removes:
        say(f"upgraded {comfyui}: replaced {len(plan.replaced)} files of the earlier install (none "
            f"of them edited), removed {len(plan.removes)} it had and this version has not, "
            f"added {len(new)}")
    else:
        say(f"installed {len(new)} files into {comfyui} "
            f"({sum(rel in version.patch for rel in new)} of them from {project.patch.name})")
    for rel in new:
        if rel not in version.patch and rel != str(RECORD):
            say(f"installed {rel}")


def plan_uninstall(comfyui: Path, project: Project, version: Version,
                   report: bool = True) -> tuple[list[str], list[str]]:
    """(to remove, kept): our files, and the edited ones that stay (a workflow, or an additional
    file no record claims). Raises for an edited overlay file: removing the overlay around an
    edited module would leave a broken package."""
    comfyui = validate_checkout(comfyui)
    record = read_record(comfyui)
    if not record and report:
        report_commit(comfyui, project.pins)
    ours, edited = recognise(comfyui, record, version)
    blocking = [rel for rel in edited
                if not is_workflow(rel) and (rel in record or rel in version.patch)]
    if blocking:
        raise OverlayError(f"these files of the install in {comfyui} were edited, or are not the ones "
                           f"in {project.patch.name}: {', '.join(blocking)}; nothing was removed; "
                           f"restore or delete those files by hand, then rerun")
    return sorted(ours), [rel for rel in edited if rel not in blocking]


def uninstall(comfyui: Path, project: Project, report: bool = True) -> None:
    with staged(project) as version:
        to_remove, kept = plan_uninstall(comfyui, project, version, report=report)
        comfyui = comfyui.resolve()
        pid_file = comfyui / "runtime" / "comfyui.pid"
        if pid_file.exists():
            raise OverlayError(f"{pid_file} exists: the ComfyUI service may be running; stop it with "
                               f"runtime/stop-v1.sh, then rerun --uninstall")
        removed, left = [], []
        for rel in to_remove:
            try:
                (comfyui / rel).unlink()
                removed.append(rel)
            except OSError as exc:
                left.append(f"{rel} ({exc.strerror})")
        # a kill during a folder's first write leaves only a temporary file there: its folders
        # go too once it is removed
        cleaned = remove_leftovers(comfyui, [*version.digests(), *read_record(comfyui), str(RECORD)])
    _remove_bytecode_and_empty_dirs(comfyui, removed + cleaned)
    for rel in kept:
        say(f"kept {rel}: its content is no longer ours (edited?)")
    if left:  # the record stays: a rerun still knows the earlier versions' files
        raise OverlayError(f"removed {len(removed)} files of the MiniMax-H3 install from {comfyui}, "
                           f"but could not remove {'; '.join(left)}; fix that, then rerun --uninstall")
    with contextlib.suppress(FileNotFoundError):
        (comfyui / RECORD).unlink()
    say(f"removed {len(removed)} files of the MiniMax-H3 install from {comfyui}")


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
