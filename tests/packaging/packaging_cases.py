"""What the packaging tests share: this project's files (pins, workflows, the committed overlay),
the tools/ modules they test, and small git checkouts made for them."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))  # tools/ is a folder of scripts, not a package

import comfyui_overlay  # noqa: E402,F401
import make_patch  # noqa: E402
import make_sample_inputs  # noqa: E402,F401
import make_thumbnails  # noqa: E402,F401
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


def overlay_repo(tmp: Path, files: dict[str, bytes], executable=()) -> Path:
    """A git repository holding `files` (bytes by path) in one commit, those in `executable` 0755."""
    repo = new_repo(tmp / "project")
    for rel, data in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_bytes(data)
        if rel in executable:
            (repo / rel).chmod(0o755)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "overlay")
    return repo


def committed_overlay(repo: Path) -> dict[str, tuple[bytes, str]]:
    files = make_patch.read_overlay(repo, make_patch.resolve_commit(repo))
    return {f.path: (f.data, f.mode) for f in files}


def official_templates() -> dict[str, dict]:
    base = make_workflows.templates_dir() / "templates"
    return {p.name: json.loads(p.read_text()) for p in sorted(base.glob("video_minimax_h3_*.json"))}


def load_workflow(name: str) -> dict:
    return json.loads((WORKFLOW_DIR / f"{name}.json").read_text())


def one_node(workflow: dict, node_type: str) -> dict:
    """The one node of `node_type` in the workflow (the test fails when there are none or several)."""
    found = [n for n in workflow["nodes"] if n["type"] == node_type]
    assert len(found) == 1, (node_type, len(found))
    return found[0]
