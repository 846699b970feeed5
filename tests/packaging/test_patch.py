"""The additive patch (tools/make_patch.py, comfy-ui-changes.patch): generated from the committed
overlay, applied to an empty repository byte for byte, kept up to date, listed in docs/patch.md.
"""

from __future__ import annotations

import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.packaging.packaging_cases import (REPO, RUN_TIMEOUT_S, committed_overlay, git, make_patch, new_repo,
                                             overlay_repo)


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
    repo = overlay_repo(tmp_path, files, executable=("minimax_h3_parallel.py",))
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
    repo = overlay_repo(tmp_path, {path: data, "comfy/ok.py": b"ok\n"})
    with pytest.raises(make_patch.PatchError, match=message):
        make_patch.generate(repo)


def test_check_compares_committed_patch_with_committed_overlay(tmp_path):
    repo = overlay_repo(tmp_path, {"comfy/a.py": b"a = 1\n"})
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
