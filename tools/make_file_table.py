#!/usr/bin/env python3
"""Regenerate the "What the patch adds" table of docs/patch.md from comfy-ui-changes.patch.

One row per file the patch adds, described by the first line of that file's module docstring,
so the table can only name files the patch really adds, with the words the file itself uses.

  tools/make_file_table.py           rewrite the table in docs/patch.md
  tools/make_file_table.py --check   exit 1 when docs/patch.md's table differs (and say what to run)
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

from make_patch import repository_path  # tools/ is first on sys.path when this runs as a script

REPO_DIR = Path(__file__).resolve().parent.parent
PATCH = REPO_DIR / "comfy-ui-changes.patch"
TARGET = REPO_DIR / "docs" / "patch.md"
TABLE_HEAD = "| file | what it is |\n|---|---|\n"
SECTION = "## What the patch adds"


def patched_files(patch_text: str) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/\S+$", patch_text, re.M)


def describe(path: Path) -> str:
    """A file's own first words: a Python module's docstring line, a TOML file's first comment,
    a Markdown file's title, the license's title; a workflow is named by its folder's role."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text))
    elif path.suffix == ".toml":
        doc = next((line.lstrip("# ") for line in text.splitlines() if line.startswith("#")), None)
    elif path.suffix == ".md":
        doc = next((line.lstrip("# ") + " (the node's help page)" for line in text.splitlines()
                    if line.startswith("# ")), None)
    elif path.suffix == ".json" and path.parent.name == "example_workflows":
        doc = f"example workflow {path.stem} (ComfyUI's Templates browser lists it)"
    elif path.name == "LICENSE":
        doc = ", ".join(line.strip() for line in text.splitlines()[:2]) + ": the project's license"
    else:
        doc = None
    if not doc:
        raise SystemExit(f"{path.relative_to(REPO_DIR)} has no description; give it a module "
                         "docstring / a first comment (its first line is the file's row in docs/patch.md)")
    return doc.strip().splitlines()[0].rstrip(".").replace("|", "\\|")


def table(patch_text: str) -> str:
    rows = [f"| `{name}` | {describe(REPO_DIR / repository_path(name))} |" for name in patched_files(patch_text)]
    return TABLE_HEAD + "\n".join(rows) + "\n"


def with_table(doc: str, new_table: str) -> str:
    start = doc.index(SECTION)
    head = doc.index(TABLE_HEAD, start)
    end = doc.index("\n\n", head) + 1
    return doc[:head] + new_table + doc[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, change nothing")
    args = parser.parse_args(argv)
    doc = TARGET.read_text(encoding="utf-8")
    wanted = with_table(doc, table(PATCH.read_text(encoding="utf-8")))
    if args.check:
        if wanted != doc:
            print("docs/patch.md's file table is stale: run tools/make_file_table.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
