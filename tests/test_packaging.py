"""Packaging: the additive patch, the ComfyUI install, the pins file, the workflows, the inputs.

The installer runs against a small ComfyUI-shaped git checkout made here (no upstream code),
from a copy of this project with a freshly generated patch. Dependency installs go to a fake
Python that records what pip was asked for, so nothing is downloaded.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import comfyui_overlay  # noqa: E402
import make_patch  # noqa: E402
import make_sample_inputs  # noqa: E402
import make_workflows  # noqa: E402

RUN_TIMEOUT_S = 120
PINS = json.loads((REPO / "source_deps_info.json").read_text())
WORKFLOW_DIR = REPO / "example_workflows"
WORKFLOW_NAMES = ("ref2va_8steps_lora", "fl2va_8steps_lora", "ref2va_21steps", "fl2va_21steps",
                  "ref2va_50steps", "fl2va_50steps")
LOADER_FOLDERS = {"UNETLoader": ("unet_name", "diffusion_models"),
                  "CLIPLoader": ("clip_name", "text_encoders"),
                  "VAELoader": ("vae_name", "vae"),
                  "LoraLoaderModelOnly": ("lora_name", "loras")}


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S).stdout


def new_repo(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    git(path, "init", "-q")
    return path


def snapshot(root: Path) -> dict:
    """Every file and folder below root (.git aside): content hash, mode and mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] == ".git":
            continue
        st = p.stat()
        out[str(rel)] = ("dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest(),
                         stat.S_IMODE(st.st_mode), None if p.is_dir() else st.st_mtime_ns)
    return out


def without_mtimes(snap: dict) -> dict:
    return {k: v[:2] for k, v in snap.items()}


# ----------------------------------------------------------------------------- the patch

def committed_overlay(repo: Path) -> dict[str, tuple[bytes, str]]:
    files = make_patch.read_overlay(repo, make_patch.resolve_commit(repo))
    return {f.path: (f.data, f.mode) for f in files}


def assert_applies_identically(patch_text: str, expected: dict[str, tuple[bytes, str]], tmp: Path):
    target = new_repo(tmp / "empty")
    patch = tmp / "overlay.patch"
    patch.write_text(patch_text, encoding="utf-8", newline="")
    git(target, "apply", str(patch))
    produced = {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()
                and ".git" not in p.relative_to(target).parts}
    assert produced == set(expected)
    for rel, (data, mode) in expected.items():
        assert (target / rel).read_bytes() == data, rel
        assert bool((target / rel).stat().st_mode & stat.S_IXUSR) == (mode == "100755"), rel
    git(target, "apply", "--reverse", "--check", str(patch))


def test_fresh_patch_applies_to_an_empty_repository_byte_identical(tmp_path):
    expected = committed_overlay(REPO)
    assert "minimax_h3_parallel.py" in expected and any(p.startswith("comfy/") for p in expected)
    patch = make_patch.generate(REPO)
    assert patch.count("diff --git ") == len(expected)
    assert "\n--- a/" not in patch and "deleted file" not in patch  # purely additive
    assert_applies_identically(patch, expected, tmp_path)


def test_committed_patch_is_up_to_date():
    # Fails after an overlay file is committed without regenerating the patch: run
    # `.venv/bin/python tools/make_patch.py` and commit comfy-ui-changes.patch.
    result = subprocess.run([sys.executable, str(REPO / "tools" / "make_patch.py"), "--check"],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr


def test_docs_list_every_file_the_patch_adds():
    # docs/patch.md, "What the patch adds", names the overlay file by file: a new overlay file
    # needs its row there.
    text = (REPO / "docs" / "patch.md").read_text(encoding="utf-8")
    table = text.split("\n## What the patch adds\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([^`]+)` \|", table, re.M))
    assert listed == set(committed_overlay(REPO)), "add/remove rows in docs/patch.md 'What the patch adds'"


def test_docs_file_table_is_generated_from_the_patch():
    # The rows come from the patch's file list and each file's docstring: regenerate them with
    # `.venv/bin/python tools/make_file_table.py` after adding, removing or re-describing a file.
    result = subprocess.run([sys.executable, str(REPO / "tools" / "make_file_table.py"), "--check"],
                            capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr


def _overlay_repo(tmp: Path, files: dict[str, bytes], executable=()) -> Path:
    repo = new_repo(tmp / "project")
    for rel, data in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(data)
        if rel in executable:
            (repo / rel).chmod(0o755)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "overlay")
    return repo


def test_patch_keeps_edge_cases_exact(tmp_path):
    files = {
        "comfy/empty.py": b"",
        "comfy/no_final_newline.py": b"x = 1\ny = 2",
        "comfy/one_line.py": b"z = 3\n",
        "comfy/crlf.py": b"a = 1\r\nb = 2\r\n",
        "comfy/unicode.py": "name = 'Ω ü 中'\n\n\n".encode(),
        "comfy_extras/nodes_x.py": b"# blank lines\n\n\n",
        "__init__.py": b"from .x import *\n",  # the pack's: lands in custom_nodes/ComfyUI-MultiNPU/
        "minimax_h3_parallel.py": b"#!/usr/bin/env python3\nprint('hi')\n",
        "tests/not_overlay.py": b"ignored\n",
    }
    repo = _overlay_repo(tmp_path, files, executable=("minimax_h3_parallel.py",))
    expected = committed_overlay(repo)
    assert "tests/not_overlay.py" not in expected and len(expected) == len(files) - 1
    assert "custom_nodes/ComfyUI-MultiNPU/__init__.py" in expected and "__init__.py" not in expected
    assert_applies_identically(make_patch.generate(repo), expected, tmp_path)


@pytest.mark.parametrize("path, data, message", [
    ("comfy/__init__.py", b"", "must not exist"),
    ("comfy/blob.py", b"\x00\x01binary", "binary"),
    ("comfy/bad name.py", b"x\n", "quote"),
])
def test_patch_refuses_what_cannot_be_an_additive_text_patch(tmp_path, path, data, message):
    repo = _overlay_repo(tmp_path, {path: data, "comfy/ok.py": b"ok\n"})
    with pytest.raises(make_patch.PatchError, match=message):
        make_patch.generate(repo)


def test_check_compares_committed_patch_with_committed_overlay(tmp_path):
    repo = _overlay_repo(tmp_path, {"comfy/a.py": b"a = 1\n"})
    tool = [sys.executable, str(REPO / "tools" / "make_patch.py"), "--repo", str(repo)]
    run = lambda *extra: subprocess.run([*tool, *extra], capture_output=True, text=True,  # noqa: E731
                                        timeout=RUN_TIMEOUT_S)
    assert run("--check").returncode == 1  # no patch committed yet
    assert run().returncode == 0
    git(repo, "add", make_patch.PATCH_NAME)
    git(repo, "commit", "-qm", "patch")
    assert run("--check").returncode == 0
    (repo / "comfy" / "a.py").write_text("a = 2  # not committed\n")
    assert run("--check").returncode == 0  # only committed content counts
    git(repo, "commit", "-qam", "edit")
    stale = run("--check")
    assert stale.returncode == 1
    assert "stale" in stale.stderr and "tools/make_patch.py && git add comfy-ui-changes.patch" in stale.stderr


# ----------------------------------------------------------------------------- the installer

def project_copy(tmp: Path, pins: dict | None = None) -> Path:
    """This project's installer, helpers, additional files and a freshly generated patch."""
    project = tmp / "project"
    (project / "tools").mkdir(parents=True)
    shutil.copy2(REPO / "install_deps_minimax_h3.sh", project)
    shutil.copy2(REPO / "tools" / "comfyui_overlay.py", project / "tools")
    shutil.copytree(REPO / "additional_files", project / "additional_files",
                    ignore=shutil.ignore_patterns("*.log", "*.pid", "__pycache__"))
    shutil.copytree(WORKFLOW_DIR, project / WORKFLOW_DIR.relative_to(REPO))
    (project / "source_deps_info.json").write_text(json.dumps(pins or PINS, indent=2))
    (project / make_patch.PATCH_NAME).write_text(make_patch.generate(REPO), newline="")
    return project


def comfyui_checkout(tmp: Path) -> Path:
    """A small ComfyUI-shaped git checkout (placeholder files, no upstream code)."""
    root = new_repo(tmp / "ComfyUI")
    for rel, text in {"main.py": "print('stand-in ComfyUI')\n",
                      "comfy/model_management.py": "# placeholder\n",
                      "comfy/ldm/minimax/model.py": "# placeholder\n",
                      "comfy_extras/nodes_placeholder.py": "# placeholder\n",
                      "comfy_extras/nodes_minimax_h3.py": "# placeholder\n",
                      "custom_nodes/example_node.py.example": "# placeholder\n",
                      "input/example.txt": "placeholder\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    git(root, "add", "-A")
    git(root, "commit", "-qm", "stand-in ComfyUI")
    return root


def install(project: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(project / "install_deps_minimax_h3.sh"), *args],
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})},
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def test_install_apply_twice_and_uninstall_restore_the_checkout(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    before = snapshot(comfy)
    dir_commit = git(comfy, "rev-parse", "HEAD").strip()

    first = install(project, "--comfyui", str(comfy), "--no-deps")
    assert first.returncode == 0, first.stdout + first.stderr
    # The checkout's commit is not the pinned one: the warning names both.
    assert dir_commit in first.stdout and PINS["upstream"]["commit"] in first.stdout
    for rel, (data, _) in committed_overlay(REPO).items():
        assert (comfy / rel).read_bytes() == data, rel
    for name in WORKFLOW_NAMES:
        assert (comfy / "user/default/workflows/minimax-h3" / f"{name}.json").read_bytes() == \
            (WORKFLOW_DIR / f"{name}.json").read_bytes()
    assert (comfy / "input/minimax_h3_first_frame.png").is_file()  # top level: LoadImage lists no subfolders
    assert os.access(comfy / "runtime/restart-v1.sh", os.X_OK)
    assert not (comfy / "extra_model_paths.yaml").exists()  # model folders come from the node pack
    installed = snapshot(comfy)

    second = install(project, "--comfyui", str(comfy), "--no-deps")
    assert second.returncode == 0, second.stderr
    assert "already installed" in second.stdout and "nothing changed" in second.stdout
    assert snapshot(comfy) == installed  # not even a timestamp moved

    removed = install(project, "--comfyui", str(comfy), "--uninstall")
    assert removed.returncode == 0, removed.stderr
    assert without_mtimes(snapshot(comfy)) == without_mtimes(before)
    assert git(comfy, "status", "--porcelain") == ""


def test_pinned_commit_is_reported_as_such(tmp_path):
    comfy = comfyui_checkout(tmp_path)
    pins = json.loads(json.dumps(PINS))
    pins["upstream"]["commit"] = git(comfy, "rev-parse", "HEAD").strip()
    result = install(project_copy(tmp_path, pins), "--comfyui", str(comfy), "--no-deps")
    assert result.returncode == 0, result.stderr
    assert "at the pinned ComfyUI commit" in result.stdout and "warning" not in result.stdout


@pytest.mark.parametrize("missing", ["main.py", "comfy", "comfy_extras", "custom_nodes"])
def test_not_a_comfyui_checkout_is_refused_unchanged(tmp_path, missing):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    target = comfy / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    before = snapshot(comfy)
    result = install(project, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode != 0
    assert "does not look like a ComfyUI checkout" in result.stderr and missing in result.stderr
    assert snapshot(comfy) == before


def test_conflicting_overlay_file_leaves_the_checkout_unchanged(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    clash = next(p for p in committed_overlay(REPO) if p.startswith("comfy/"))
    (comfy / clash).parent.mkdir(parents=True, exist_ok=True)
    (comfy / clash).write_text("# somebody else's file\n")
    before = snapshot(comfy)
    result = install(project, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode != 0
    assert clash in result.stderr and "Nothing was changed" in result.stderr
    assert snapshot(comfy) == before


def test_conflicting_additional_file_stops_before_the_patch(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    edited = comfy / "runtime/restart-v1.sh"
    edited.parent.mkdir(parents=True)
    edited.write_text("#!/bin/sh\necho my own script\n")
    before = snapshot(comfy)
    result = install(project, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode != 0 and "restart-v1.sh" in result.stderr
    assert snapshot(comfy) == before


def test_a_rerun_keeps_a_workflow_the_user_saved_and_installs_ours_beside_it(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    assert install(project, "--comfyui", str(comfy), "--no-deps").returncode == 0
    saved = comfy / "user/default/workflows/minimax-h3/ref2va_21steps.json"
    saved.write_text('{"the user": "saved this with Ctrl+S"}\n')
    result = install(project, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode == 0, result.stdout + result.stderr
    assert saved.read_text() == '{"the user": "saved this with Ctrl+S"}\n'  # theirs, untouched
    beside = [p for p in saved.parent.glob("ref2va_21steps.*.json")]
    assert len(beside) == 1 and "kept your edited" in result.stdout and beside[0].name in result.stdout
    ours = project / WORKFLOW_DIR.relative_to(REPO) / "ref2va_21steps.json"
    assert beside[0].read_bytes() == ours.read_bytes()
    again = install(project, "--comfyui", str(comfy), "--no-deps")  # and a third run changes nothing
    assert again.returncode == 0 and "nothing changed" in again.stdout
    removed = install(project, "--comfyui", str(comfy), "--uninstall")
    assert removed.returncode == 0
    assert saved.exists() and not beside[0].exists()  # uninstall takes ours, leaves theirs


def next_version(tmp: Path) -> tuple[Path, dict[str, str]]:
    """A project copy whose overlay differs from this one as a release would: one module changed,
    one removed, one added, a workflow and a service script changed. Returns it and the changes."""
    project = project_copy(tmp)
    files = {make_patch.repository_path(rel): data for rel, (data, _) in committed_overlay(REPO).items()}
    changed, dropped, added = "comfy/multidevice/devices.py", "comfy/multidevice/comfy_objects.py", \
        "comfy/multidevice/added_in_next_version.py"
    workflow = WORKFLOW_DIR.relative_to(REPO) / "fl2va_21steps.json"
    files[changed] += b"# changed in the next version\n"
    del files[dropped]
    files[added] = b'"""A module the next version adds."""\n'
    changed_workflow = json.loads(files[str(workflow)])
    changed_workflow.setdefault("extra", {})["changed_in"] = "the next version"
    files[str(workflow)] = json.dumps(changed_workflow, indent=2).encode() + b"\n"
    assert files[str(workflow)] != (REPO / workflow).read_bytes()
    (project / workflow).write_bytes(files[str(workflow)])
    script = project / "additional_files/runtime/restart-v1.sh"
    script.write_bytes(script.read_bytes() + b"# changed in the next version\n")
    repo = _overlay_repo(tmp / "next", files, executable=[make_patch.repository_path(p) for p, (_, m)
                                                          in committed_overlay(REPO).items() if m == "100755"])
    (project / make_patch.PATCH_NAME).write_text(make_patch.generate(repo), newline="")
    return project, {"changed": changed, "dropped": dropped, "added": added, "workflow": str(workflow)}


def test_a_newer_version_upgrades_the_install_it_recorded(tmp_path):
    old, comfy = project_copy(tmp_path / "old"), comfyui_checkout(tmp_path)
    before = without_mtimes(snapshot(comfy))
    assert install(old, "--comfyui", str(comfy), "--no-deps").returncode == 0
    record = json.loads((comfy / ".minimax-h3-install.json").read_text())["files"]
    assert "comfy/multidevice/devices.py" in record and "runtime/restart-v1.sh" in record
    saved = comfy / "user/default/workflows/minimax-h3/ref2va_21steps.json"
    saved.write_text('{"the user": "saved this"}\n')

    new, change = next_version(tmp_path / "new")
    result = install(new, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "upgraded" in result.stdout
    assert (comfy / change["changed"]).read_bytes().endswith(b"# changed in the next version\n")
    assert not (comfy / change["dropped"]).exists() and (comfy / change["added"]).is_file()
    assert (comfy / "runtime/restart-v1.sh").read_bytes() == \
        (new / "additional_files/runtime/restart-v1.sh").read_bytes()
    assert os.access(comfy / "runtime/restart-v1.sh", os.X_OK)
    copied = comfy / "user/default/workflows/minimax-h3/fl2va_21steps.json"
    assert copied.read_bytes() == (new / change["workflow"]).read_bytes() == \
        (comfy / make_patch.PACK_HOME / change["workflow"]).read_bytes()
    assert saved.read_text() == '{"the user": "saved this"}\n'  # theirs, kept over the upgrade
    assert install(new, "--comfyui", str(comfy), "--no-deps").stdout.count("nothing changed") == 1

    removed = install(new, "--comfyui", str(comfy), "--uninstall")
    assert removed.returncode == 0, removed.stderr
    left = without_mtimes(snapshot(comfy))
    assert left.pop("user/default/workflows/minimax-h3/ref2va_21steps.json")  # the user's file
    left = {k: v for k, v in left.items() if not k.startswith("user")}  # its folders stay with it
    assert left == {k: v for k, v in before.items() if not k.startswith("user")}


def test_an_upgrade_stops_at_an_edited_overlay_file_and_changes_nothing(tmp_path):
    old, comfy = project_copy(tmp_path / "old"), comfyui_checkout(tmp_path)
    assert install(old, "--comfyui", str(comfy), "--no-deps").returncode == 0
    with open(comfy / "comfy/multidevice/comm/peer.py", "a") as f:
        f.write("# a local edit\n")
    before = snapshot(comfy)
    new, _ = next_version(tmp_path / "new")
    result = install(new, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode != 0
    assert "comfy/multidevice/comm/peer.py" in result.stderr and "Nothing was changed" in result.stderr
    assert snapshot(comfy) == before


def test_a_failed_upgrade_restores_the_earlier_install(tmp_path):
    old, comfy = project_copy(tmp_path / "old"), comfyui_checkout(tmp_path)
    assert install(old, "--comfyui", str(comfy), "--no-deps").returncode == 0
    new, change = next_version(tmp_path / "new")
    # The new version brings a service helper whose folder is a file in DIR: the copy fails
    # after the earlier files were removed and the new patch applied.
    (new / "additional_files/runtime/helpers").mkdir()
    (new / "additional_files/runtime/helpers/extra.sh").write_text("#!/bin/sh\n")
    (comfy / "runtime/helpers").write_text("not a folder\n")
    before = without_mtimes(snapshot(comfy))
    result = install(new, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode != 0 and "restored" in result.stderr
    assert without_mtimes(snapshot(comfy)) == before
    assert (comfy / change["dropped"]).is_file()  # the earlier version is whole again


def test_a_failure_while_copying_undoes_the_patch_and_the_copies(tmp_path):
    # runtime/ is a file here: the copy fails after the patch and some additional files went
    # in; the run removes what it wrote (folders it made included) and nothing else.
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    (comfy / "runtime").write_text("not a folder\n")
    before = snapshot(comfy)
    result = install(project, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode != 0
    assert "failed" in result.stderr and "was removed again" in result.stderr
    assert snapshot(comfy) == before


def overlay(project: Path, comfy: Path, command: str = "apply") -> int:
    """The installer's ComfyUI part, in this process (so that a test can make a write fail)."""
    return comfyui_overlay.main([command, "--comfyui", str(comfy), "--project", str(project)])


def fail_at_write(monkeypatch, n: int | None, error: int) -> list:
    """The n-th file copy (None: the install record's) writes 10 bytes and fails with `error`,
    as a full disk (ENOSPC) or a folder made read-only (EPERM) does. Returns the copies made."""
    real, calls = shutil.copyfile, []

    def copy(src, dst, **kwargs):
        calls.append(str(dst))
        if len(calls) == n or (n is None and ".minimax-h3-install.json" in str(dst)):
            Path(dst).write_bytes(Path(src).read_bytes()[:10])
            raise OSError(error, os.strerror(error), str(dst))
        return real(src, dst, **kwargs)
    monkeypatch.setattr(shutil, "copyfile", copy)
    return calls


@pytest.mark.parametrize("n, error", [(1, 28), (30, 28), (70, 1), (None, 28)])
def test_a_write_that_fails_leaves_the_checkout_exactly_as_it_was(tmp_path, monkeypatch, capsys, n, error):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    before = snapshot(comfy)
    calls = fail_at_write(monkeypatch, n, error)
    assert overlay(project, comfy) == 1
    assert len(calls) == n or n is None
    err = capsys.readouterr().err
    assert os.strerror(error) in err and "is as it was" in err
    assert snapshot(comfy) == before  # nothing created, nothing cut short, not a timestamp moved
    monkeypatch.undo()
    assert overlay(project, comfy) == 0  # and the next run installs
    assert (comfy / ".minimax-h3-install.json").is_file()


@pytest.mark.parametrize("n", [1, 3, None])
def test_a_failed_upgrade_write_restores_every_file_it_replaced(tmp_path, monkeypatch, capsys, n):
    old, comfy = project_copy(tmp_path / "old"), comfyui_checkout(tmp_path)
    assert overlay(old, comfy) == 0
    new, change = next_version(tmp_path / "new")
    before = snapshot(comfy)
    fail_at_write(monkeypatch, n, 28)
    assert overlay(new, comfy) == 1
    assert "is as it was" in capsys.readouterr().err
    assert snapshot(comfy) == before
    monkeypatch.undo()
    assert overlay(new, comfy) == 0 and not (comfy / change["dropped"]).exists()


def test_what_a_failed_install_cannot_undo_is_named_with_the_command_that_repairs_it(
        tmp_path, monkeypatch, capsys):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    before = without_mtimes(snapshot(comfy))
    fail_at_write(monkeypatch, 20, 1)
    real_unlink = Path.unlink

    def unlink(path, missing_ok=False):  # the undo may remove no file (the folder went read-only)
        if comfy in path.parents and "minimax-h3-partial" not in path.name:
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(path, missing_ok=missing_ok)
    monkeypatch.setattr(Path, "unlink", unlink)
    assert overlay(project, comfy) == 1
    err = capsys.readouterr().err
    assert "could not be undone" in err and "as it was" not in err
    left = [p for p in comfy.rglob("*") if p.is_file() and ".git" not in p.relative_to(comfy).parts
            and str(p.relative_to(comfy)) not in before]
    assert len(left) == 19 and all(str(p.relative_to(comfy)) in err for p in left)
    assert f"--comfyui {comfy} --uninstall" in err
    monkeypatch.undo()
    assert overlay(project, comfy, "uninstall") == 0
    assert without_mtimes(snapshot(comfy)) == before


def test_an_immutable_checkout_is_left_as_it_was_and_a_later_install_works(tmp_path):
    # A real failure, where the file system allows it: `chattr +i DIR` (root, ext4 and kin).
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(comfy)],
                                                        capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root and a file system that has it)")
    try:
        before = snapshot(comfy)
        result = install(project, "--comfyui", str(comfy), "--no-deps")
        assert result.returncode != 0 and "Operation not permitted" in result.stderr
        assert "is as it was" in result.stderr
        assert snapshot(comfy) == before
    finally:
        subprocess.run(["chattr", "-i", str(comfy)], check=True)
    assert install(project, "--comfyui", str(comfy), "--no-deps").returncode == 0


KILLED_AT_WRITE = r"""
import os, shutil, sys
sys.path.insert(0, sys.argv[1])
import comfyui_overlay
n, calls, real = int(sys.argv[2]), [], shutil.copyfile
def copy(src, dst, **kwargs):
    calls.append(dst)
    if len(calls) == n:  # killed in the middle of this write: no undo, no cleanup runs
        with open(dst, "wb") as f:
            f.write(open(src, "rb").read()[:10])
        os._exit(9)
    return real(src, dst, **kwargs)
shutil.copyfile = copy
sys.exit(comfyui_overlay.main(sys.argv[3:]))
"""


@pytest.mark.parametrize("repair", ["--no-deps", "--uninstall"])
def test_a_rerun_or_uninstall_repairs_a_checkout_left_by_a_killed_install(tmp_path, repair):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    before = without_mtimes(snapshot(comfy))
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_WRITE, str(project / "tools"), "66",
                             "apply", "--comfyui", str(comfy)], capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert killed.returncode == 9, killed.stderr
    overlay_files = committed_overlay(REPO)
    for rel, (data, _) in overlay_files.items():  # no file cut short under a real name
        assert not (comfy / rel).exists() or (comfy / rel).read_bytes() == data, rel
    result = install(project, "--comfyui", str(comfy), repair)
    assert result.returncode == 0, result.stdout + result.stderr
    if repair == "--uninstall":
        assert without_mtimes(snapshot(comfy)) == before
    else:
        assert all((comfy / rel).read_bytes() == data for rel, (data, _) in overlay_files.items())
        assert not [p for p in comfy.rglob("*minimax-h3-partial")]
        assert install(project, "--comfyui", str(comfy), "--uninstall").returncode == 0
        assert without_mtimes(snapshot(comfy)) == before


def test_uninstall_keeps_the_checkouts_own_folders_even_when_empty(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    (comfy / "custom_nodes/example_node.py.example").unlink()  # custom_nodes/ stays, empty
    before = without_mtimes(snapshot(comfy))
    assert install(project, "--comfyui", str(comfy), "--no-deps").returncode == 0
    removed = install(project, "--comfyui", str(comfy), "--uninstall")
    assert removed.returncode == 0, removed.stderr
    assert without_mtimes(snapshot(comfy)) == before
    again = install(project, "--comfyui", str(comfy), "--no-deps")  # still a ComfyUI checkout
    assert again.returncode == 0, again.stderr


def test_users_extra_model_paths_is_kept(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    own = comfy / "extra_model_paths.yaml"
    own.write_text("mine:\n  base_path: /somewhere\n")
    assert install(project, "--comfyui", str(comfy), "--no-deps").returncode == 0
    assert own.read_text() == "mine:\n  base_path: /somewhere\n"
    assert install(project, "--comfyui", str(comfy), "--uninstall").returncode == 0
    assert own.read_text() == "mine:\n  base_path: /somewhere\n"


def test_uninstall_refuses_an_edited_overlay_and_removes_nothing(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    assert install(project, "--comfyui", str(comfy), "--no-deps").returncode == 0
    edited = next(p for p in committed_overlay(REPO) if p.startswith("comfy/"))
    with open(comfy / edited, "a") as f:
        f.write("# local edit\n")
    before = snapshot(comfy)
    result = install(project, "--comfyui", str(comfy), "--uninstall")
    assert result.returncode != 0 and "nothing was removed" in result.stderr
    assert snapshot(comfy) == before


def test_uninstall_needs_comfyui(tmp_path):
    result = install(project_copy(tmp_path), "--uninstall")
    assert result.returncode != 0 and "--uninstall needs --comfyui" in result.stderr


FAKE_PYTHON = """#!/usr/bin/env bash
# Records pip calls (and the requirement files they name) instead of installing.
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "PIP $*" >> "{log}"
    while [ $# -gt 0 ]; do [ "$1" = "-r" ] && sed 's/^/REQ /' "$2" >> "{log}"; shift; done
    exit 0
fi
if [ "$1" = "-c" ] && [[ "$2" == *"import torch, safetensors"* ]]; then
    echo "torch (fake)"; exit 0
fi
exec "{real}" {site_flag} "$@"
"""


def fake_python(path: Path, log: Path, bare: bool) -> Path:
    """bare: without site-packages, so it has no package yet; else it sees .venv's packages."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE_PYTHON.format(log=log, real=sys.executable, site_flag="-S" if bare else ""))
    path.chmod(0o755)
    return path


def recorded(log: Path) -> tuple[list[str], list[str]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return ([l for l in lines if l.startswith("PIP ")],
            [l[len("REQ "):] for l in lines if l.startswith("REQ ")])


def test_python_option_installs_the_pinned_runtime_deps_into_that_python(tmp_path):
    pins = json.loads(json.dumps(PINS))
    pins["python_dependencies"]["runtime"]["numpy"] = "9.8.7"  # read from the file, not built in
    project, comfy = project_copy(tmp_path, pins), comfyui_checkout(tmp_path)
    log = tmp_path / "pip.log"
    target = fake_python(comfy / "venv/bin/python", log, bare=True)
    result = install(project, "--comfyui", str(comfy), "--python", str(target), "--platform", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    calls, reqs = recorded(log)
    assert len(calls) == 1 and "install" in calls[0]
    expected = [f"torch=={pins['torch']['cpu']['torch']}"] + \
        [f"{k}=={v}" for k, v in pins["python_dependencies"]["runtime"].items()]
    assert reqs == expected  # runtime pins only: no test packages in ComfyUI's environment
    assert (comfy / "comfy").is_dir() and (comfy / "user/default/workflows/minimax-h3").is_dir()


def test_python_option_keeps_packages_the_environment_has(tmp_path):
    pins = json.loads(json.dumps(PINS))
    pins["python_dependencies"]["runtime"]["numpy"] = "9.8.7"
    project = project_copy(tmp_path, pins)
    log = tmp_path / "pip.log"
    target = fake_python(tmp_path / "env/bin/python", log, bare=False)  # sees torch, numpy, ...
    result = install(project, "--python", str(target), "--platform", "cpu")
    assert result.returncode == 0, result.stderr
    assert recorded(log) == ([], [])
    assert "numpy" in result.stderr and "9.8.7" in result.stderr and "keeping" in result.stderr
    forced = install(project, "--python", str(target), "--platform", "cpu", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "numpy==9.8.7" in recorded(log)[1]


def test_venv_set_up_reads_the_pins_and_a_second_run_installs_nothing(tmp_path):
    pins = json.loads(json.dumps(PINS))
    pins["torch"]["cpu"]["torch"] = "2.13.0"
    pins["python_dependencies"]["test"]["pytest"] = "1.2.3"
    project = project_copy(tmp_path, pins)
    log = tmp_path / "pip.log"
    fake_python(project / ".venv/bin/python", log, bare=True)
    first = install(project, "--platform", "cpu")
    assert first.returncode == 0, first.stdout + first.stderr
    calls, reqs = recorded(log)
    assert len(calls) == 1
    assert reqs[0] == "torch==2.13.0" and "pytest==1.2.3" in reqs
    assert set(reqs[1:]) == {f"{k}=={v}" for group in ("runtime", "test")
                             for k, v in pins["python_dependencies"][group].items()}
    second = install(project, "--platform", "cpu")
    assert second.returncode == 0 and "Already set up" in second.stdout
    assert len(recorded(log)[0]) == 1  # no second pip call


# ----------------------------------------------------------------------------- the pins file

VERSION = re.compile(r"^\d+(\.\d+)+$")


def test_pins_file_structure():
    assert re.fullmatch(r"[0-9a-f]{40}", PINS["upstream"]["commit"])
    assert PINS["upstream"]["repository"] == "Comfy-Org/ComfyUI"
    for platform in ("cpu", "nvidia", "ascend"):
        assert VERSION.match(PINS["torch"][platform]["torch"])
    ascend = PINS["torch"]["ascend"]
    assert VERSION.match(ascend["torch_npu"]) and VERSION.match(ascend["cann"])
    # torch_npu is built for exactly one torch release: major.minor must agree.
    assert ascend["torch_npu"].split(".")[:2] == ascend["torch"].split(".")[:2]
    for group in ("runtime", "test"):
        assert PINS["python_dependencies"][group]
        for name, version in PINS["python_dependencies"][group].items():
            assert VERSION.match(version), (name, version)
    files = PINS["model_files"]["files"]
    assert len({f["role"] for f in files}) == len(files)
    for f in files:
        assert f["file"].endswith(".safetensors") and f["size_gib"] > 0
        assert f["folder"] in {"diffusion_models", "text_encoders", "vae", "loras"}
        assert set(f["used_by"]) <= set(WORKFLOW_NAMES)
    roles = {f["role"] for f in files}
    assert {"text_encoder", "video_vae", "audio_vae"} <= roles


def official_templates() -> dict[str, dict]:
    base = make_workflows.templates_dir() / "templates"
    return {p.name: json.loads(p.read_text()) for p in sorted(base.glob("video_minimax_h3_*.json"))}


def test_model_files_are_named_as_in_the_official_templates():
    text = "".join(json.dumps(t) for t in official_templates().values())
    for f in PINS["model_files"]["files"]:
        if f["used_by"]:
            assert f["file"] in text, f["file"]
    for task, rel in PINS["workflow_templates"]["templates"].items():
        assert (make_workflows.templates_dir() / rel).is_file(), (task, rel)


def test_model_files_match_the_workflows_loaders():
    by_file = {f["file"]: f for f in PINS["model_files"]["files"]}
    used = {}
    for name in WORKFLOW_NAMES:
        for node in load_workflow(name)["nodes"]:
            if node["type"] in LOADER_FOLDERS:
                widget, folder = LOADER_FOLDERS[node["type"]]
                file_name = node["widgets_values"][0]
                assert file_name in by_file, (name, file_name)
                assert by_file[file_name]["folder"] == folder
                used.setdefault(file_name, set()).add(name)
    for file_name, entry in by_file.items():
        assert set(entry["used_by"]) == used.get(file_name, set()), file_name


def _load_shim(monkeypatch, environ, input_dir):
    """The node pack's loader, imported with a stand-in for ComfyUI's folder_paths."""
    import importlib.util
    import types
    added = []
    fake = types.ModuleType("folder_paths")
    fake.add_model_folder_path = lambda folder, path, is_default=False: added.append((folder, path))
    fake.get_input_directory = lambda: str(input_dir)
    monkeypatch.setitem(sys.modules, "folder_paths", fake)
    for key in ("MINIMAX_H3_MODELS",):
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    spec = importlib.util.spec_from_file_location("multinpu_shim_under_test",
                                                  REPO / "__init__.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return added


def test_model_folders_from_the_variable_and_nothing_without_it(monkeypatch, tmp_path):
    folders = {f["folder"] for f in PINS["model_files"]["files"]}
    added = _load_shim(monkeypatch, {"MINIMAX_H3_MODELS": str(tmp_path / "models")}, tmp_path / "input")
    assert {folder for folder, _ in added} == folders  # every folder the H3 files use
    assert all(path == str(tmp_path / "models" / folder) for folder, path in added)
    assert _load_shim(monkeypatch, {}, tmp_path / "input") == []  # unset: ComfyUI's own models/<folder>/, no literal path
    assert _load_shim(monkeypatch, {"MINIMAX_H3_MODELS": ""}, tmp_path / "input") == []
    assert "MINIMAX_H3_MODELS" in (REPO / "additional_files/runtime/restart-v1.sh").read_text()


# ----------------------------------------------------------------------------- workflows

def load_workflow(name: str) -> dict:
    return json.loads((WORKFLOW_DIR / f"{name}.json").read_text())


def test_committed_workflows_are_the_generator_output():
    generated = make_workflows.generate()
    assert sorted(generated) == sorted(f"{n}.json" for n in WORKFLOW_NAMES)
    assert sorted(p.name for p in WORKFLOW_DIR.glob("*.json")) == sorted(generated)
    for name, text in generated.items():
        assert (WORKFLOW_DIR / name).read_text(encoding="utf-8") == text, \
            f"{name} is stale: run .venv/bin/python tools/make_workflows.py"


def reference_signatures() -> dict[str, dict]:
    """Node type -> its input and output slots (name -> type) as the official H3 templates use them."""
    sigs: dict[str, dict] = {}
    for template in official_templates().values():
        nodes = list(template["nodes"])
        for sub in template.get("definitions", {}).get("subgraphs", []):
            nodes += sub["nodes"]
        for node in nodes:
            sig = sigs.setdefault(node["type"], {"inputs": {}, "outputs": {}})
            sig["inputs"].update({i["name"]: i["type"] for i in node.get("inputs", [])})
            sig["outputs"].update({o["name"]: o["type"] for o in node.get("outputs", [])})
    return sigs


def our_signature() -> dict:
    schema = make_workflows.node_schema()
    sockets = [s for s in schema["inputs"] if s["type"] in make_workflows.SOCKET_TYPES]
    return {"inputs": {s["name"]: s["type"] for s in sockets},
            "outputs": {o["name"]: o["type"] for o in schema["outputs"]}}


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_workflow_nodes_are_upstream_or_ours_and_links_match_types(name):
    workflow = load_workflow(name)
    refs = reference_signatures()
    ours = make_workflows.node_schema()["node_id"]
    nodes = {n["id"]: n for n in workflow["nodes"]}
    for node in nodes.values():
        sig = our_signature() if node["type"] == ours else refs.get(node["type"])
        assert sig is not None, f"{name}: node type {node['type']} is neither upstream's nor ours"
        for entry in node.get("inputs", []):
            assert sig["inputs"].get(entry["name"]) == entry["type"], (node["type"], entry)
        for entry in node.get("outputs", []):
            assert sig["outputs"].get(entry["name"]) == entry["type"], (node["type"], entry)
    if ours in {n["type"] for n in nodes.values()}:
        node = next(n for n in nodes.values() if n["type"] == ours)
        assert [(i["name"], i["type"]) for i in node["inputs"]] == list(our_signature()["inputs"].items())
        assert [(o["name"], o["type"]) for o in node["outputs"]] == list(our_signature()["outputs"].items())
    seen_inputs = set()
    for link_id, origin, origin_slot, target, target_slot, link_type in workflow["links"]:
        out_entry = nodes[origin]["outputs"][origin_slot]
        in_entry = nodes[target]["inputs"][target_slot]
        assert out_entry["type"] == link_type, (name, link_id)
        assert link_type in in_entry["type"].split(",") or in_entry["type"] == "*", (name, link_id)
        assert link_id in out_entry["links"] and in_entry["link"] == link_id
        assert (target, target_slot) not in seen_inputs  # one link per input
        seen_inputs.add((target, target_slot))
    linked = {(n["id"], s) for n in nodes.values() for s, i in enumerate(n.get("inputs", []))
              if i.get("link") is not None}
    assert linked == seen_inputs
    assert workflow["last_link_id"] == len(workflow["links"])
    assert workflow["last_node_id"] >= max(nodes)


def _widget(node: dict, index: int):
    return node["widgets_values"][index]


def _one(workflow: dict, node_type: str) -> dict:
    found = [n for n in workflow["nodes"] if n["type"] == node_type]
    assert len(found) == 1, (node_type, len(found))
    return found[0]


def _evaluate(expression: str, a: float) -> int:
    """The template's duration formula (names: max, round, a, numbers and + - * %)."""
    tree = ast.parse(expression, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Call, ast.Name, ast.Constant, ast.Load,
               ast.Add, ast.Sub, ast.Mult, ast.Mod)
    assert all(isinstance(n, allowed) for n in ast.walk(tree)), expression
    return eval(compile(tree, "<expr>", "eval"), {"__builtins__": {}}, {"max": max, "round": round, "a": a})


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_workflow_settings(name):
    variant = next(v for v in make_workflows.VARIANTS if v.name == name)
    workflow = load_workflow(name)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    links = {l[0]: l for l in workflow["links"]}
    schema = make_workflows.node_schema()
    parallel = _one(workflow, schema["node_id"])
    widget_names = [s["name"] for s in schema["inputs"] if s["type"] not in make_workflows.SOCKET_TYPES]
    assert parallel["widgets_values"][widget_names.index("npu_count")] == 4

    # Between the loaders and their consumers: the node's inputs come from the loaders, and
    # every MODEL / CLIP / VAE that a non-loader uses comes from the node.
    loaders = set(LOADER_FOLDERS)
    for entry in parallel["inputs"]:
        assert nodes[links[entry["link"]][1]]["type"] in loaders
    for origin, target, link_type in ((l[1], l[3], l[5]) for l in workflow["links"]):
        if link_type in ("MODEL", "CLIP", "VAE") and nodes[target]["type"] not in loaders | {schema["node_id"]}:
            assert origin == parallel["id"], (name, nodes[target]["type"])
    vae_in = {e["name"]: nodes[links[e["link"]][1]]["widgets_values"][0] for e in parallel["inputs"]
              if e["type"] == "VAE"}
    assert "video_vae" in vae_in["video_vae"] and "audio_vae" in vae_in["audio_vae"]

    h3 = next(n for n in workflow["nodes"] if n["type"].startswith("MiniMaxH3") and "ToVideo" in n["type"])
    assert h3["type"] == {"ref2va": "MiniMaxH3ReferenceToVideo", "fl2va": "MiniMaxH3ImageToVideo"}[variant.task]
    names = [i["name"] for i in h3["inputs"]]
    widgets = [i for i in names if i in ("width", "height", "length")]
    offset = 1  # the prompt widget comes first in both nodes
    width, height = (h3["widgets_values"][offset + widgets.index(k)] for k in ("width", "height"))
    assert (width, height) == (1344, 768)
    assert h3["inputs"][names.index("width")]["link"] is None  # fixed, not computed
    expression = nodes[links[h3["inputs"][names.index("length")]["link"]][1]]
    duration = nodes[links[expression["inputs"][0]["link"]][1]]
    assert duration["type"] == "PrimitiveFloat" and duration["widgets_values"][0] == 15
    frames = _evaluate(expression["widgets_values"][0], 15)
    assert frames == make_workflows.frame_count(15) == 362 and (frames - 5) % 17 == 0
    assert _one(workflow, "CreateVideo")["widgets_values"][0] == 24
    assert abs(frames / 24 - 15) < 17 / 24  # 15 s at 24 fps, snapped to the model's grid

    assert _one(workflow, "BasicScheduler")["widgets_values"][1] == variant.steps
    assert _one(workflow, "KSamplerSelect")["widgets_values"][0] == variant.sampler
    assert (variant.steps, variant.sampler) in ((8, "res_multistep"), (21, "res_multistep"), (50, "euler"))
    loras = [n for n in workflow["nodes"] if n["type"] == "LoraLoaderModelOnly"]
    assert len(loras) == (1 if variant.lora else 0) and variant.lora == name.endswith("_lora")
    assert not [n for n in workflow["nodes"] if n["type"] == "ComfySwitchNode"]

    images = [n["widgets_values"][0] for n in workflow["nodes"] if n["type"] == "LoadImage"]
    assert len(images) == 2
    for image in images:
        # directly in input/: upstream's LoadImage lists no subfolders (the canvas would report
        # "Missing Inputs" for a name with a folder in it)
        assert "/" not in image and (REPO / "additional_files" / "input" / image).is_file(), image


def test_generator_uses_the_nodes_own_schema_when_it_can():
    try:
        from comfy_extras.nodes_multinpu import NODE_SCHEMA
    except Exception:
        assert make_workflows.node_schema() is make_workflows.FALLBACK_NODE_SCHEMA
        return
    fallback = make_workflows.FALLBACK_NODE_SCHEMA
    assert make_workflows.node_schema() is NODE_SCHEMA
    assert NODE_SCHEMA["node_id"] == fallback["node_id"]
    keys = ("name", "type", "default", "options")
    assert [{k: s.get(k) for k in keys} for s in NODE_SCHEMA["inputs"]] == \
        [{k: s.get(k) for k in keys} for s in fallback["inputs"]]
    assert [(o["name"], o["type"]) for o in NODE_SCHEMA["outputs"]] == \
        [(o["name"], o["type"]) for o in fallback["outputs"]]


def test_sample_inputs_are_the_generator_output():
    for name, draw in make_sample_inputs.SAMPLES.items():
        path = make_sample_inputs.OUT_DIR / name
        assert path.stat().st_size < 64 * 1024, name
        assert not make_sample_inputs.differs(path, draw()), \
            f"{name} is stale: run .venv/bin/python tools/make_sample_inputs.py"


def test_model_sources_match_the_workflows_own_download_links():
    # Every file a workflow links (node properties "models": url .../OWNER/REPO/resolve/...)
    # has that OWNER/REPO as its source in source_deps_info.json.
    sources = {m["file"]: m["source"] for m in PINS["model_files"]["files"]}
    links = {}
    for path in sorted(WORKFLOW_DIR.glob("*.json")):
        for repo, name in re.findall(r"huggingface\.co/([^/\"]+/[^/\"]+)/resolve/[^/\"]+/(?:[^\"]*/)?([^/\"]+)\"",
                                     path.read_text(encoding="utf-8")):
            links.setdefault(name, set()).add(repo)
    assert links, "no model links found in the workflows"
    for name, repos in links.items():
        assert name in sources, f"{name} is linked by a workflow but not listed in source_deps_info.json"
        assert repos == {sources[name]}, f"{name}: workflows link {sorted(repos)}, pins say {sources[name]}"


def test_a_comfyui_without_the_h3_nodes_is_refused_unless_forced(tmp_path):
    project, comfy = project_copy(tmp_path), comfyui_checkout(tmp_path)
    (comfy / "comfy_extras/nodes_minimax_h3.py").unlink()
    git(comfy, "commit", "-qam", "an older ComfyUI")
    before = snapshot(comfy)
    result = install(project, "--comfyui", str(comfy), "--no-deps")
    assert result.returncode != 0
    assert "no MiniMax-H3 nodes" in result.stderr and PINS["upstream"]["commit"] in result.stderr
    assert "--force" in result.stderr and snapshot(comfy) == before
    forced = install(project, "--comfyui", str(comfy), "--no-deps", "--force")
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert (comfy / "comfy/multidevice/__init__.py").is_file()


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_the_node_sits_inside_the_workflows_models_group(name):
    workflow = load_workflow(name)
    node = next(n for n in workflow["nodes"] if n["type"] == "MultiNPUParallelConfig")
    models = [g for g in workflow["groups"] if g["title"] == "Models"]
    assert len(models) == 1, [g["title"] for g in workflow["groups"]]
    x, y, w, h = models[0]["bounding"]
    (nx, ny), (nw, nh) = node["pos"], node["size"]
    assert x <= nx and nx + nw <= x + w and y <= ny and ny + nh <= y + h, (models[0]["bounding"], node["pos"])
    hidden = [n["type"] for n in workflow["nodes"] if n is not node and
              make_workflows.boxes_overlap(make_workflows.node_box(node), make_workflows.node_box(n))]
    assert hidden == [], f"the node's box (title bar included) covers {hidden}"
    for group in workflow["groups"]:  # the grown group covers no other group
        if group is not models[0]:
            gx, gy, gw, gh = group["bounding"]
            assert gx >= x + w or gx + gw <= x or gy >= y + h or gy + gh <= y, (group["title"], group["bounding"])


# ----------------------------------------------------------------------------- the node pack

PACK_DIR = REPO  # the repository root is the node pack (the patch puts it in custom_nodes/ComfyUI-MultiNPU/)


def pack_project() -> dict:
    import tomllib
    return tomllib.loads((PACK_DIR / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_packs_pyproject_follows_the_registrys_rules():
    # The registry's published rules for [project] name/version and [tool.comfy].
    import re
    data = pack_project()
    name, version = data["project"]["name"], data["project"]["version"]
    assert len(name) < 100 and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*(?:[-_.][A-Za-z0-9]+)*", name), name
    assert "comfyui" not in name.lower()  # the registry asks names not to repeat "ComfyUI"
    assert re.fullmatch(r"\d+\.\d+\.\d+", version), version
    assert data["project"]["license"] == {"file": "LICENSE"}
    comfy = data["tool"]["comfy"]
    assert re.fullmatch(r"[a-z][a-z0-9-]*", comfy["PublisherId"]) and comfy["DisplayName"].strip()


def test_the_whole_project_and_the_pack_carry_the_same_gpl3_license():
    text = (REPO / "LICENSE").read_text(encoding="utf-8")
    assert text.lstrip().startswith("GNU GENERAL PUBLIC LICENSE") and "Version 3, 29 June 2007" in text
    overlay = committed_overlay(REPO)  # the patch's copy of the pack carries it too
    assert overlay["custom_nodes/ComfyUI-MultiNPU/LICENSE"][0] == (REPO / "LICENSE").read_bytes()


def test_the_help_page_is_where_web_directory_serves_it_and_names_every_input_and_output():
    from comfy_extras.nodes_multinpu import NODE_SCHEMA
    shim = (PACK_DIR / "__init__.py").read_text(encoding="utf-8")
    assert 'WEB_DIRECTORY = "./web"' in shim
    page = (PACK_DIR / "web" / "docs" / f"{NODE_SCHEMA['node_id']}.md").read_text(encoding="utf-8")
    for spec in NODE_SCHEMA["inputs"] + NODE_SCHEMA["outputs"]:
        assert f"**{spec['name']}**" in page, spec["name"]
    for spec in NODE_SCHEMA["inputs"]:
        for option in spec.get("options", []):
            assert str(option) in page, (spec["name"], option)


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_workflows_name_the_pack_for_comfyui_manager(name):
    project = pack_project()["project"]
    node = _one(load_workflow(name), "MultiNPUParallelConfig")
    assert node["properties"]["cnr_id"] == project["name"]
    assert node["properties"]["ver"] == project["version"]


def test_every_import_in_the_docs_python_examples_exists():
    # The examples in README.md and docs/*.md name our modules; a module that moved must not
    # leave them stale.
    import importlib
    imports = []
    for doc in user_docs():
        blocks = re.findall(r"```python\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
        imports += [(doc.relative_to(REPO), *m) for block in blocks
                    for m in re.findall(r"^from (comfy[\w.]*|comfy_extras[\w.]*) import ([\w, ]+)$", block, re.M)]
    assert imports, "the Python examples of README.md and docs/ import nothing of ours"
    for doc, module, names in imports:
        loaded = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(loaded, name), f"{doc}: from {module} import {name}"


def user_docs() -> list[Path]:
    """README.md and every docs/*.md: where the project's prose lives."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def doc_headings(doc: Path) -> list[str]:
    """A Markdown file's headings as written, outside code blocks (a `# comment` in a bash
    block is not a heading)."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.M | re.S)
    return [m.strip() for m in re.findall(r"^#{1,6} (.+)$", text, re.M)]


def _section_name(heading: str) -> str:
    # "3. The upstream contract" is cited as "The upstream contract"; backticks are markup
    return re.sub(r"^\d+\.\s+", "", heading.replace("`", ""))


# A section cited by name: README (or README.md, README's) or docs/X.md, then the name in
# quotes, e.g. (README, "Supported ComfyUI"), README 'What the patch adds', docs/ARCHITECTURE.md,
# "The upstream contract". Quotes may be escaped (the workflows' JSON notes).
SECTION_CITATION = re.compile(r"""(?:README(?:\.md)?(?:'s)?|docs/[\w.-]+\.md),?\s+(?:section\s+)?\\?["']([A-Z][^"'\\\n]{2,80})\\?["']""")
CITING_PLACES = ("tests", "tools", "bench", "docs", "comfy", "comfy_extras", "custom_nodes", "additional_files",
                 "example_workflows", "web")
CITING_FILES = ("README.md", "install_deps_minimax_h3.sh", "minimax_h3_parallel.py", "__init__.py", "pyproject.toml", ".ci/run")


def section_citations() -> list[tuple[str, str]]:
    """Every (file, section name) that code and data of this repository cite by name."""
    paths = [REPO / f for f in CITING_FILES if (REPO / f).is_file()]
    for place in CITING_PLACES:
        if (REPO / place).is_dir():
            paths += [p for p in (REPO / place).rglob("*")
                      if p.is_file() and p.suffix in (".py", ".sh", ".json", ".md", ".toml", "")
                      and "__pycache__" not in p.parts]
    found = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += [(str(path.relative_to(REPO)), name) for name in SECTION_CITATION.findall(text)]
    return found


def test_every_section_cited_by_name_is_a_heading():
    # Code, tests and workflows send readers to sections by name (README, "Supported ComfyUI"):
    # moving or renaming a section must not leave such a pointer dangling.
    names = {_section_name(h) for doc in user_docs() for h in doc_headings(doc)}
    cited = section_citations()
    assert {name for _, name in cited} >= {"Supported ComfyUI", "What the patch adds", "Weight placement"}
    dangling = sorted({(where, name) for where, name in cited if name not in names})
    assert not dangling, f"cited sections that are no heading of README.md or docs/*.md: {dangling}"


def _anchor(heading: str) -> str:
    # GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")


def test_relative_links_in_the_docs_point_at_what_exists():
    # [text](path) and [text](path#anchor) in README.md and docs/*.md: the file must exist, and
    # an anchor must be a heading of that file.
    broken = []
    for doc in user_docs():
        text = re.sub(r"^```.*?^```", "", doc.read_text(encoding="utf-8"), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in {_anchor(h) for h in doc_headings(dest)}:
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
