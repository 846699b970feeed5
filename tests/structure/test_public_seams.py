"""The names one module uses from another are public: no `from comfy.multidevice... import _x`,
and no `obj._attr` in the package that reaches into a class of another module.

A private name (one leading underscore) is an implementation detail of the module that defines
it; when another module needs it, it gets a public name and a docstring where it is defined.
The import rule holds for the tests too: a test calls what the package offers. The attribute
rule is for the package only (tests may look at the state they check).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "comfy" / "multidevice"
ROOT = "comfy.multidevice"

# Private attributes of other projects that the package uses on purpose, with the reason.
EXTERNAL_PRIVATE = {
    # torch.nn.Module's own tables: a weight is swapped in place without a copy (weights/,
    # tp/shard.py) and a quantized layer is rebuilt by its own loader
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_load_from_state_dict",
    # torch internals the read-only guard and the mapping adoption need (weights/read_only.py,
    # weights/checkpoint.py, weights/aimdo_mapping.py)
    "_C", "_ExcludeDispatchKeyGuard", "_cdata", "_untyped_storage",
    # namedtuple's public API (its names start with an underscore to avoid field clashes)
    "_replace",
    # H3 contract: upstream's video VAE decodes one temporal chunk with _adaptive_decode
    "_adaptive_decode",
    # how torch's subclass guide builds a wrapper tensor: doctor --deep's stand-in for a
    # quantized weight (cli/deep_checks.py)
    "_make_wrapper_subclass",
    # the documented exit without clean-up: a worker blocked in a collective ends at once when
    # rank 0 drops its pool (workers/worker.py)
    "_exit",
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def python_files(*folders: Path) -> list[Path]:
    return [p for folder in folders for p in sorted(folder.rglob("*.py")) if "__pycache__" not in p.parts]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO) if REPO in path.parents else path.name}:{line}"


def private_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT):
            found += [f"{where(path, node.lineno)}: from {node.module} import {a.name}"
                      for a in node.names if private(a.name)]
    return found


def defined_here(tree: ast.AST) -> set[str]:
    """Every name the module itself defines or assigns (functions, classes, variables,
    attributes it sets, arguments and keywords it declares)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return names


def foreign_private_attributes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = defined_here(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not private(node.attr):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue  # the class's own state (or what it inherits)
        if node.attr in own or node.attr in EXTERNAL_PRIVATE:
            continue
        found.append(f"{where(path, node.lineno)}: {ast.unparse(node)}")
    return found


def test_the_checks_find_what_they_look_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from comfy.multidevice.weights.replicas import _hidden, shown\n"
                      "class A:\n    def f(self, other):\n        self._mine = 1\n"
                      "        return other._mine, other._theirs, self._inherited, other.__dict__\n")
    assert private_imports(sample) == ["sample.py:1: from comfy.multidevice.weights.replicas import _hidden"]
    assert foreign_private_attributes(sample) == ["sample.py:5: other._theirs"]


def test_nothing_imports_a_private_name_of_the_package():
    folders = [PACKAGE, REPO / "tests", REPO / "bench", REPO / "comfy_extras"]
    found = [f for p in python_files(*folders) + sorted(REPO.glob("*.py")) for f in private_imports(p)]
    assert not found, "give these names a public name where they are defined:\n" + "\n".join(found)


def test_the_package_reaches_into_no_other_modules_private_attributes():
    found = [f for p in python_files(PACKAGE) for f in foreign_private_attributes(p)]
    assert not found, ("make these attributes public (documented where they are defined), or add an "
                       "external one to EXTERNAL_PRIVATE with its reason:\n" + "\n".join(found))
