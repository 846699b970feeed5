"""The ComfyUI install (install_deps_minimax_h3.sh, tools/comfyui_overlay.py): apply, upgrade and
uninstall leave the checkout exactly as they found it when anything fails.

The installer runs against a small ComfyUI-shaped git checkout made here (no upstream code),
from a copy of this project with a freshly generated patch. Dependency installs go to a fake
Python that records what pip was asked for, so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.packaging_cases import (PINS, REPO, RUN_TIMEOUT_S, WORKFLOW_DIR, WORKFLOW_NAMES,
                                             comfyui_overlay, committed_overlay, git, make_patch, new_repo,
                                             overlay_repo, snapshot, without_mtimes)


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
    repo = overlay_repo(tmp / "next", files, executable=[make_patch.repository_path(p) for p, (_, m)
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
