"""No two classes of the package share a name, not even one that differs only by leading
underscores or by case: a reader who meets `_RankShard` and `RankShard` cannot tell which is
meant, and a search for one finds both.

The package here is comfy/multidevice/, the node (comfy_extras/nodes_multinpu.py) and the node
pack's top-level modules.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((REPO / "comfy" / "multidevice").rglob("*.py")),
           REPO / "comfy_extras" / "nodes_multinpu.py", REPO / "minimax_h3_parallel.py", REPO / "__init__.py"]

# merged by the seam refactor (issue "One seam"): twins the lead folds into one class; empty
# once they are merged. Each entry is a folded name (see `folded`).
MERGED_LATER: frozenset[str] = frozenset()


def folded(name: str) -> str:
    """The name a reader remembers: without leading underscores, in one case."""
    return name.lstrip("_").lower()


def class_names(path: Path) -> list[tuple[str, str]]:
    """(class name, 'file:line') of every class `path` defines, nested ones included."""
    where = path.relative_to(REPO) if REPO in path.parents else path.name
    return [(node.name, f"{where}:{node.lineno}") for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, ast.ClassDef)]


def twins(paths: list[Path]) -> dict[str, list[str]]:
    """Folded name -> where each class of that name is, for names defined more than once."""
    found = defaultdict(list)
    for path in paths:
        for name, where in class_names(path):
            found[folded(name)].append(f"{name} ({where})")
    return {name: places for name, places in found.items() if len(places) > 1}


def test_the_check_finds_twins(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("class RankShard:\n    pass\n\n\nclass Plan:\n    class _Inner:\n        pass\n")
    second.write_text("class _RankShard:\n    pass\n\n\nclass inner:\n    pass\n\n\nclass Plans:\n    pass\n")
    assert twins([first, second]) == {"rankshard": ["RankShard (a.py:1)", "_RankShard (b.py:1)"],
                                      "inner": ["_Inner (a.py:6)", "inner (b.py:5)"]}


def test_no_two_classes_of_the_package_share_a_name():
    found = {name: places for name, places in twins(SOURCES).items() if name not in MERGED_LATER}
    assert not found, ("rename one of each pair to a name that says what it is:\n"
                       + "\n".join(" and ".join(places) for places in found.values()))


def test_every_allowed_twin_is_still_a_twin():
    # an entry the refactor has merged goes from the list, so the list shrinks to nothing
    stale = sorted(MERGED_LATER - set(twins(SOURCES)))
    assert not stale, f"{stale}: no longer twins; remove them from MERGED_LATER"
