"""The user docs (README.md, docs/*.md): the Python examples import what exists, every section
cited by name anywhere in the project is a heading, relative links point at what exists, the
README stays short enough to read first and shows the test command .ci/run runs."""

from __future__ import annotations

import re

from tests.docs.markdown import README, REPO, doc_headings, fenced_blocks, user_docs, without_code_blocks

README_MAX_LINES = 400  # install, first workflow, the node, errors, operations; the rest is in docs/


def test_every_import_in_the_docs_python_examples_exists():
    # The examples in README.md and docs/*.md name our modules; a module that moved must not
    # leave them stale.
    import importlib
    imports = []
    for doc in user_docs():
        imports += [(doc.relative_to(REPO), *m) for block in fenced_blocks(doc, ("python",))
                    for m in re.findall(r"^from (comfy[\w.]*|comfy_extras[\w.]*) import ([\w, ]+)$", block, re.M)]
    assert imports, "the Python examples of README.md and docs/ import nothing of ours"
    for doc, module, names in imports:
        loaded = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(loaded, name), f"{doc}: from {module} import {name}"


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
        text = without_code_blocks(doc.read_text(encoding="utf-8"))
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


def test_the_readme_is_at_most_400_lines():
    # A ComfyUI user reads it first; projections, container set-up and internals belong in docs/.
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move what is not a user's first need to docs/"


def test_the_readme_shows_the_test_command_ci_runs():
    # .ci/run promises "the README's test command exactly": the two must not drift apart.
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    command = re.search(r"^(bash install_deps_minimax_h3\.sh .*pytest -q)$", ci, re.M)
    assert command, ".ci/run no longer runs the installer and pytest on one line"
    assert command.group(1) in [line for block in fenced_blocks(README, ("bash",)) for line in block.splitlines()]
