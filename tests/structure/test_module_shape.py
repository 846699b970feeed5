"""Every module of the package says its one job in its first line, and imports our own
modules at module level (a lazy import of our own code would hide a layering problem; only
ComfyUI and torch_npu, which may be absent, are imported inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "comfy" / "multidevice"
ROOT = "comfy.multidevice"


def modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts]


def function_local_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ROOT):
                    found.append((node.lineno, node.module))
                elif isinstance(node, ast.Import):
                    found += [(node.lineno, a.name) for a in node.names if a.name.startswith(ROOT)]
    return found


def test_the_local_import_finder_finds_one():
    tree = ast.parse("import os\ndef f():\n    import json\n    from comfy.multidevice.devices import x\n")
    assert function_local_imports(tree) == [(4, "comfy.multidevice.devices")]


def test_every_module_opens_with_a_line_that_names_its_job():
    missing = []
    for path in modules():
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        if not doc or not doc.split("\n", 1)[0].strip():
            missing.append(path.relative_to(REPO).as_posix())
    assert not missing, f"give these modules a first docstring line naming their job: {missing}"


def test_our_own_modules_are_imported_at_module_level():
    found = [f"{path.relative_to(REPO).as_posix()}:{line}: {module}"
             for path in modules() for line, module in function_local_imports(ast.parse(path.read_text(encoding="utf-8")))]
    assert not found, "import these at the top of the module:\n" + "\n".join(found)


MAX_MODULE_LINES = 500  # issue "One seam": past this a module holds more than one job


def test_no_module_is_over_500_lines():
    long = {path.relative_to(REPO).as_posix(): n for path in modules()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES}
    assert not long, f"split these modules by responsibility (at most {MAX_MODULE_LINES} lines): {long}"
