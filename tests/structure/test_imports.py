"""The package's shape: no import cycle, low layers never import high ones, nothing of ours
outside comfy/multidevice/ in upstream's comfy/ folder.

Every import statement counts, also the ones inside functions: a lazy import that closes a
cycle is still a cycle between the two modules' responsibilities.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "comfy" / "multidevice"
ROOT = "comfy.multidevice"

# A sub-package may import its own modules and those of lower layers only.
LAYERS = {
    "devices": 0, "comfy_objects": 0, "comfy_cancel": 0, "progress": 0, "tensor_bytes": 0, "commands": 0,
    "cards": 1,
    "comm": 1, "weights": 1, "miniature": 1, "tryout": 1,
    "sp": 2, "tp": 2, "vae": 2,
    "workers": 3,
    "roles": 4,
    "cli": 5,
}
LEAVES = ("comm.errors", "comm.layout", "comm.protocol", "comm.settings",  # import nothing of the package
          "commands", "comfy_cancel")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, modules) -> set[str]:
    """The package modules `path` imports (`from a.b import c` counts a.b, and a.b.c when that
    is a module); the package root itself is only a re-export and is left out."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(ROOT))
    return {m for m in found if m in modules and m != ROOT}


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports_of(p, modules) - {m} for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def sub_package(module: str) -> str:
    return module[len(ROOT) + 1:].split(".")[0]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    found = cycles(import_graph())
    assert not found, f"import cycles: {found}"


def test_every_sub_package_has_a_layer():
    tops = {sub_package(m) for m in package_modules() if m != ROOT}
    assert tops == set(LAYERS), f"give new sub-packages a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def test_low_layers_never_import_high_ones():
    wrong = []
    for module, deps in import_graph().items():
        if module == ROOT:
            continue
        mine = LAYERS[sub_package(module)]
        for dep in deps:
            if sub_package(dep) == sub_package(module):
                continue
            if dep[len(ROOT) + 1:] in LEAVES and LAYERS[sub_package(dep)] <= mine:
                continue  # a leaf imports nothing: its own layer may use it without a cycle
            if LAYERS[sub_package(dep)] >= mine:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports against the layering: " + ", ".join(sorted(wrong))


def test_leaf_modules_import_nothing_of_the_package():
    graph = import_graph()
    for leaf in LEAVES:
        assert graph[f"{ROOT}.{leaf}"] == set(), f"{leaf} must stay a leaf"


def test_nothing_of_ours_outside_the_package_in_upstreams_comfy_folder():
    ours = [p.relative_to(REPO).as_posix() for p in (REPO / "comfy").rglob("*")
            if p.is_file() and PACKAGE not in p.parents and "__pycache__" not in p.parts]
    assert ours == [], f"move these under comfy/multidevice/: {ours}"
