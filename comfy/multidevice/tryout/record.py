"""The try-out's install record: what it wrote into a ComfyUI folder, so that removing takes exactly that.

The record is a small JSON file (in the try-out node's folder) with each file written, as a
path relative to the ComfyUI folder plus its sha256, and each folder made. The rules:
- a file is only ever created, never opened for writing when it exists: a file the try-out did
  not write is never overwritten;
- removing deletes a file only while its bytes still hash to the recorded sha256 (a changed
  file stays, named); then Python's bytecode of the .py files written (ComfyUI's import makes
  it, and the folder could not go otherwise); then each folder made, once it is empty;
- a path in the record that leaves the ComfyUI folder is refused, so an edited record cannot
  make removing delete anything outside it.
No ComfyUI needed: this is plain file work.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

FORMAT = 1
KIND = "minimax-h3 try-out"


class TryoutError(RuntimeError):
    """The try-out cannot go ahead (or cannot finish removing); the message says what to do."""


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def inside(root: Path, relative: str) -> Path:
    """root/relative, refused when `relative` is absolute, has '..' or resolves outside root."""
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or ".." in parts:
        raise TryoutError(f"{relative!r} is not a path inside {root} (an edited try-out record?); "
                          "the try-out writes and removes only inside the ComfyUI folder")
    path = root.joinpath(*parts)
    if root.resolve() not in path.parent.resolve().parents and path.parent.resolve() != root.resolve():
        raise TryoutError(f"{relative} leads outside {root} through a symbolic link; the try-out writes "
                          "and removes only inside the ComfyUI folder")
    return path


@dataclass
class Record:
    """The files (relative path -> sha256) and folders the try-out wrote into `root`."""
    root: Path
    location: str  # the record file itself, relative to root
    files: dict[str, str] = field(default_factory=dict)
    folders: list[str] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return inside(self.root, self.location)

    def save(self) -> None:
        """Written whole to a temporary name and renamed: a record on disk is never half written."""
        data = json.dumps({"kind": KIND, "format": FORMAT, "files": self.files, "folders": self.folders}, indent=1)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(data + "\n")
        os.replace(temporary, self.path)

    @classmethod
    def load(cls, root: Path, location: str) -> Record | None:
        """The record at root/location, or None when there is none."""
        path = inside(root, location)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            ok = data.get("kind") == KIND and data.get("format") == FORMAT
        except (ValueError, AttributeError):
            ok = False
        if not ok:
            raise TryoutError(f"{path} is not a try-out record this version reads; remove the try-out's files by hand")
        return cls(root, location, dict(data["files"]), list(data["folders"]))

    def changed(self) -> list[str]:
        """The recorded files that are missing or no longer hold the bytes written."""
        return [rel for rel, digest in self.files.items()
                if not inside(self.root, rel).is_file() or sha256_of(inside(self.root, rel)) != digest]


def already_there(root: Path, relatives) -> list[str]:
    """Those of `relatives` (paths under root) that exist, as files, folders or links."""
    return [rel for rel in relatives if os.path.lexists(inside(root, rel))]


def write_all(root: Path, location: str, files: dict[str, bytes]) -> Record:
    """Create every file (relative path -> bytes) under root and record it at `location` (its
    folder is made first, so the record exists from the first file on). Refuses, writing
    nothing, when one of them is already there; a failure part-way removes what was written."""
    taken = already_there(root, [location, *files])
    if taken:
        raise TryoutError(f"already there, not written by this try-out: {', '.join(taken)}")
    record = Record(root, location)
    try:
        _make_folders(record, inside(root, location).parent)
        record.save()
        for rel, data in files.items():
            path = inside(root, rel)
            _make_folders(record, path.parent)
            with open(path, "xb") as f:  # "x": fails rather than overwrite a file that appeared meanwhile
                f.write(data)
            record.files[rel] = hashlib.sha256(data).hexdigest()
            record.save()
    except BaseException:
        if record.path.is_file():
            remove(root, location)
        raise
    return record


def _make_folders(record: Record, folder: Path) -> None:
    """Make `folder` and its missing parents, recording each one made (outermost first)."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for made in reversed(missing):
        made.mkdir()
        record.folders.append(made.relative_to(record.root).as_posix())


@dataclass
class Removal:
    """What removing did: files deleted, already gone, left because they changed; folders left."""
    removed: list[str] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    folders_left: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.changed and not self.folders_left


def remove(root: Path, location: str) -> Removal | None:
    """Delete what the record at root/location lists, as the module docstring says; None when
    there is no record. A changed file stays, and so does the record, listing what is left."""
    record = Record.load(root, location)
    if record is None:
        return None
    result = Removal()
    for rel, digest in record.files.items():
        path = inside(root, rel)
        if not os.path.lexists(path):
            result.gone.append(rel)
        elif path.is_file() and not path.is_symlink() and sha256_of(path) == digest:
            path.unlink()
            result.removed.append(rel)
            if path.suffix == ".py":
                for compiled in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
                    compiled.unlink()
        else:
            result.changed.append(rel)
    if result.changed:
        record.files = {rel: record.files[rel] for rel in result.changed}
    else:
        record.path.unlink()
    for rel in reversed(record.folders):  # innermost first
        folder = inside(root, rel)
        cache = folder / "__pycache__"
        if cache.is_dir() and not any(cache.iterdir()):
            cache.rmdir()
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        elif folder.exists() and not result.changed:  # with a changed file, its folders stay
            result.folders_left.append(rel)
    if result.changed:  # the record stays, listing what is left
        record.folders = [rel for rel in record.folders if inside(root, rel).exists()]
        record.save()
    return result
