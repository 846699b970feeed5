"""The node's inputs as its schema declares them (NODE_SCHEMA of comfy_extras/nodes_multinpu.py,
plain data read without ComfyUI) against the three places a user reads about them: the tooltips,
the help page (web/docs/MultiNPUParallelConfig.md) and the README's input table. Each names
every input, states the schema's default and lists the schema's options, so a changed default
or option fails here until all three say it.

How each place writes an input, so that it can be read here:
  * help page, under "## Inputs": `- **name** (advanced): `a`, `b` or `c`; default `b`. ...`
    (the options in backticks before "; default"; the empty string as "default empty");
  * README, under "The `MultiNPUParallelConfig` node": a row `| `name` (advanced) | values | ... |`
    whose values are the options, comma separated, with the default in bold;
  * tooltip: names every option that is a word, and a default it states is the schema's.
"""

from __future__ import annotations

import re

import pytest

from comfy_extras.nodes_multinpu import NODE_SCHEMA
from tests.docs.markdown import HELP_PAGE, README, REPO, section, user_docs

INPUTS = {spec["name"]: spec for spec in NODE_SCHEMA["inputs"]}
WIDGETS = [name for name, spec in INPUTS.items() if "default" in spec]
COMBOS = [name for name, spec in INPUTS.items() if spec["type"] == "COMBO"]
NODE_SECTION = "The `MultiNPUParallelConfig` node"

# Claims the help once made that tests now prove wrong; none may come back (the proof beside each).
RETIRED_CLAIMS = {
    "no Fun ControlNet yet": "tests/workers/test_pool_runner.py",
    "Not yet with Fun ControlNet": "tests/workers/test_pool_runner.py",
    "nor with `dit_weights` shard": "tests/workers/test_pool.py",
}


def shown(value) -> str:
    """A value as the docs write it: the empty string is the word "empty"."""
    return "empty" if value == "" else str(value)


def help_bullets() -> dict[str, str]:
    """The help page's input bullets by input name, each as one line of text."""
    bullets = re.split(r"^- ", section(HELP_PAGE, "Inputs"), flags=re.M)[1:]
    return {m.group(1): " ".join(b.split()) for b in bullets if (m := re.match(r"\*\*(\w+)\*\*", b))}


def readme_rows() -> dict[str, tuple[str, str]]:
    """The README's input table by input name: (the input cell, the values cell)."""
    table = re.search(r"^\| input \|.*?(?=^[^|])", section(README, NODE_SECTION), re.M | re.S)
    assert table, f"the README has no table headed '| input |' under {NODE_SECTION!r}"
    rows = re.findall(r"^\| (`(\w+)`[^|]*) \| ([^|]*) \|", table.group(0), re.M)
    return {name: (cell, values) for cell, name, values in rows if name in INPUTS}


def stated_defaults(text: str) -> list[str]:
    """Every default a text states: "default `x`", "default empty", "`x` (default)", "**x** (default)"."""
    named = [value or empty for value, empty in re.findall(r"default (?:`([^`]*)`|(empty))", text)]
    return named + re.findall(r"[`*]+([^`*]+)[`*]+ \(default\)", text)

def test_every_input_is_in_the_help_page_and_the_readme_table():
    assert list(help_bullets()) == list(INPUTS), "the help page's Inputs bullets, in the schema's order"
    assert list(readme_rows()) == list(INPUTS), f"the README's input table under {NODE_SECTION!r}, in the schema's order"


@pytest.mark.parametrize("name", WIDGETS)
def test_the_help_page_states_the_schemas_default_and_options(name):
    spec, bullet = INPUTS[name], help_bullets()[name]
    assert stated_defaults(bullet) == [shown(spec["default"])], bullet
    if name in COMBOS:
        listed = bullet.split("; default")[0].split(":", 1)[1]
        assert re.findall(r"`([^`]*)`", listed) == [shown(o) for o in spec["options"]], bullet


@pytest.mark.parametrize("name", WIDGETS)
def test_the_readme_table_states_the_schemas_default_and_options(name):
    spec, (_, values) = INPUTS[name], readme_rows()[name]
    assert re.findall(r"\*\*([^*]+)\*\*", values) == [shown(spec["default"])], values
    if name in COMBOS:
        assert [v.strip(" *`") for v in values.split(",")] == [shown(o) for o in spec["options"]], values


def test_the_advanced_inputs_are_marked_so_in_the_help_page_and_the_readme():
    advanced = [name for name, spec in INPUTS.items() if spec.get("advanced")]
    assert [n for n, bullet in help_bullets().items() if re.match(r"\*\*\w+\*\* \(advanced\)", bullet)] == advanced
    assert [n for n, (cell, _) in readme_rows().items() if cell.endswith("(advanced)")] == advanced


@pytest.mark.parametrize("name", COMBOS)
def test_the_tooltip_names_each_option_and_no_other_default(name):
    spec = INPUTS[name]
    words = [str(o) for o in spec["options"] if not isinstance(o, int)]  # the widget shows the numbers
    missing = [w for w in words if not re.search(rf"\b{re.escape(w)}\b", spec["tooltip"])]
    assert not missing, f"{name}'s tooltip does not say what {missing} do"
    assert set(stated_defaults(spec["tooltip"])) <= {shown(spec["default"])}, spec["tooltip"]


def test_no_retired_claim_comes_back():
    places = {"tooltips": " ".join(spec["tooltip"] for spec in INPUTS.values()),
              **{str(p.relative_to(REPO)): p.read_text(encoding="utf-8") for p in (HELP_PAGE, *user_docs())}}
    assert all((REPO / proof).is_file() for proof in RETIRED_CLAIMS.values())
    found = [(claim, where) for claim in RETIRED_CLAIMS for where, text in places.items() if claim in text]
    assert not found, f"claims the tests prove wrong ({RETIRED_CLAIMS}): {found}"
