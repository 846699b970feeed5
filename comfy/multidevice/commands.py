"""Our commands as a user types them: by the paths they have in the user's install.

The project's root folder (the one that holds comfy/multidevice/ and minimax_h3_parallel.py) is
its own checkout, a ComfyUI folder the patch went into, or a clone in ComfyUI's custom_nodes/.
A message names a command from the folder a user works in: ComfyUI's for a clone (where
`python minimax_h3_parallel.py` does not exist: it is custom_nodes/<clone>/minimax_h3_parallel.py),
else the project's root folder itself.
"""

from __future__ import annotations

from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]
CLI_SCRIPT = "minimax_h3_parallel.py"
INSTALLER = "install_deps_minimax_h3.sh"


def install_root(project_dir: Path | None = None) -> Path:
    """The folder a user's commands start from: ComfyUI's when the project (default: this one)
    is a clone in its custom_nodes/, else the project's root folder (a checkout, or ComfyUI's
    with the patch)."""
    project_dir = PROJECT_DIR if project_dir is None else project_dir
    return project_dir.parent.parent if project_dir.parent.name == "custom_nodes" else project_dir


def script_command(name: str, *args: str, project_dir: Path | None = None) -> str:
    """`python <path> args` (`bash` for a .sh) for `name`, a file of the project's root folder,
    with its path from `install_root`. The patch brings no installer: where the file is not in
    this install it is named as the repository's."""
    project_dir = PROJECT_DIR if project_dir is None else project_dir
    runner = "bash" if name.endswith(".sh") else "python"
    path = project_dir / name
    if not path.is_file():
        return " ".join([runner, name, *args]) + " (from a checkout of this project)"
    return " ".join([runner, path.relative_to(install_root(project_dir)).as_posix(), *args])


def module_command(module: str, *args: str, project_dir: Path | None = None) -> str:
    """`python -m module args` run from `install_root`; in a clone with the clone's folder on
    PYTHONPATH, since ComfyUI's folder does not hold our package."""
    project_dir = PROJECT_DIR if project_dir is None else project_dir
    root = install_root(project_dir)
    prefix = [] if root == project_dir else [f"PYTHONPATH={project_dir.relative_to(root).as_posix()}"]
    return " ".join([*prefix, "python", "-m", module, *args])
