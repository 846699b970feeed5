"""Every test file is named for what it tests, so a module's tests are found where the module is.

tests/<sub>/test_<module>.py tests comfy/multidevice/<sub>/<module>.py; tests/test_<module>.py a
top-level module of the package or comfy_extras/<module>.py. A test that covers a topic instead
of one module is declared below with what it covers.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
PACKAGE = REPO / "comfy" / "multidevice"

# Folders whose files each cover a topic of their own.
TOPIC_FOLDERS = {
    "upstream": "the package against a real upstream ComfyUI tree (COMFYUI_DIR)",
    "e2e": "the real server and canvas with tiny model files",
    "packaging": "the patch, the installer, the pins file, the workflows, the node pack",
    "structure": "the shape of the package and of its tests",
    "bench": "the benchmark scripts of bench/ (tests/bench/test_<script>.py)",
    "docs": "the user docs: README, docs/*.md, the node's help page and tooltips",
}
# Single files that cover a topic across modules.
TOPIC_FILES = {
    "cli/test_help.py": "every command's --help text",
    "comm/test_all_to_all.py": "all_to_all_v on every backend and the byte counters",
    "comm/test_card_threads.py": "no thread touches a card it did not make current (threads mode)",
    "comm/test_card_rules.py": "the fake HCCL / NCCL libraries refuse what the vendors forbid",
    "test_node_errors.py": "the sentence a ComfyUI user reads for every refusal",
    "test_runtime_scripts.py": "additional_files/runtime/ restart and stop scripts",
    "workers/test_servers.py": "one worker pool over two servers (network namespaces)",
    "workers/test_hardening.py": "ranks as processes against the audit's stranger, on one server",
}


def all_test_files() -> list[str]:
    return sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("test_*.py"))


def module_tested_by(name: str) -> Path | None:
    """The module a file named tests/<sub>/test_<module>.py mirrors, where it exists."""
    *folders, file = Path(name).parts
    module = file[len("test_"):]
    candidates = [PACKAGE.joinpath(*folders, module)]
    if not folders:
        candidates.append(REPO / "comfy_extras" / module)
    return next((c for c in candidates if c.is_file()), None)


def test_every_test_file_mirrors_a_module_or_is_a_declared_topic():
    unnamed = [name for name in all_test_files()
               if Path(name).parts[0] not in TOPIC_FOLDERS and name not in TOPIC_FILES
               and module_tested_by(name) is None]
    assert not unnamed, (f"{unnamed}: name each after the module it tests (tests/<sub>/test_<module>.py), "
                         "or declare its topic in TOPIC_FILES")


def test_every_declared_topic_exists_and_names_no_module():
    files = set(all_test_files())
    assert all((TESTS / folder).is_dir() for folder in TOPIC_FOLDERS)
    stale = [name for name in TOPIC_FILES if name not in files]
    mirrored = [name for name in TOPIC_FILES if module_tested_by(name) is not None]
    assert not stale and not mirrored, (stale, mirrored)
