"""Every shell command of README.md and docs/*.md (the fenced bash, sh, console and shell blocks)
is run here or checked by its structure, and the lists below say which: a command in neither
fails until it is classified, and a listed command no doc has any more fails too.

Run: quick ones (seconds on a 2-core machine), from the repository root, with `python` and
`.venv/bin/python` this interpreter and HOME a temporary folder; each must exit 0.
Checked (all of them, the run ones too): every repository path a command names exists, every
script or `python -m` module of ours it runs exists, every --flag it passes to one of ours is in
that program's --help, every `from X import Y` of ours in a `python -c` imports, and every
COMFYUI_/MINIMAX_ variable it sets is one the code reads.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.markdown import REPO, fenced_blocks, user_docs

LANGUAGES = ("bash", "sh", "console", "shell")
RUN_TIMEOUT_S = 120  # each run command takes seconds; the margin is for a busy machine

# Run here, as written.
RUN = {
    '.venv/bin/python -c "from comfy.multidevice.roles.plan import roles_table; import json; '
    'print(json.dumps(roles_table(), indent=1))"',
    ".venv/bin/python minimax_h3_parallel.py doctor",
    ".venv/bin/python minimax_h3_parallel.py doctor --json",
    ".venv/bin/python bench/bench_card.py --cpu",
    'python -c "import secrets; print(secrets.token_hex(32))" > ~/.minimax-h3-pool.secret '
    '&& chmod 600 ~/.minimax-h3-pool.secret',
}

# Checked only, each with why it does not run here.
CARDS = "needs Ascend or NVIDIA cards"
COMFYUI = "needs a ComfyUI checkout"
LONG = "runs for minutes on this machine (the tests of its parts run in the suite)"
CHECKED = {
    "cd ComfyUI/custom_nodes && git clone <this repository> minimax-h3-multinpu": "installs into a ComfyUI",
    "ASCEND_RT_VISIBLE_DEVICES=0,1,2,3 ComfyUI/runtime/restart-v1.sh": "starts a ComfyUI server",
    "ComfyUI/runtime/stop-v1.sh": "stops a ComfyUI server",
    "export COMFYUI_MULTI_DEVICE_RENDEZVOUS=10.0.0.1:29600": "sets up a server of a cluster",
    "export COMFYUI_MULTI_DEVICE_REMOTE_RANKS=8": "sets up a server of a cluster",
    "export COMFYUI_MULTI_DEVICE_SECRET_FILE=~/.minimax-h3-pool.secret": "sets up a server of a cluster",
    "COMFYUI_MULTI_DEVICE_SECRET_FILE=~/.minimax-h3-pool.secret python -m comfy.multidevice.workers.join "
    "--rendezvous 10.0.0.1:29600 --first-rank 8 --devices npu:0,npu:1,npu:2,npu:3,npu:4,npu:5,npu:6,npu:7":
        "needs a ComfyUI server to join and 8 cards",
    "bash install_deps_minimax_h3.sh --comfyui /path/to/ComfyUI --python /path/to/ComfyUI/venv/bin/python": COMFYUI,
    "/path/to/ComfyUI/venv/bin/python -m pip install pytest pytest-timeout hypothesis": COMFYUI,
    # both run on a real tree, server and template in tests/e2e/test_tryout.py
    "python minimax_h3_parallel.py tryout --comfyui /path/to/ComfyUI": COMFYUI,
    "python minimax_h3_parallel.py tryout --comfyui /path/to/ComfyUI --remove": COMFYUI,
    "COMFYUI_DIR=/path/to/ComfyUI /path/to/ComfyUI/venv/bin/python -m pytest -q -rs tests/upstream": COMFYUI,
    "bash install_deps_minimax_h3.sh && .venv/bin/python -m pytest -q": "the whole suite, this test included",
    ".venv/bin/python minimax_h3_parallel.py run": LONG,
    ".venv/bin/python minimax_h3_parallel.py doctor --devices 4 --backend hccl": CARDS,
    ".venv/bin/python minimax_h3_parallel.py doctor --deep": CARDS,
    ".venv/bin/python minimax_h3_parallel.py run --devices 4 --steps 2": LONG,
    ".venv/bin/python minimax_h3_parallel.py run --devices 4 --sp-mode ulysses --steps 2": LONG,
    ".venv/bin/python minimax_h3_parallel.py run --devices 4 --sp-mode auto --sp-overlap 3": LONG,
    ".venv/bin/torchrun --standalone --nproc-per-node 2 minimax_h3_parallel.py run --cpu --steps 2": LONG,
    ".venv/bin/torchrun --nnodes 2 --node-rank 0 --nproc-per-node 4 --master-addr 10.0.0.1 "
    "--master-port 29500 minimax_h3_parallel.py run": "needs two machines",
    ".venv/bin/torchrun --nnodes 2 --node-rank 1 --nproc-per-node 4 --master-addr 10.0.0.1 "
    "--master-port 29500 minimax_h3_parallel.py run": "needs two machines",
    "docker run -it --name comfyui-h3 --network host --shm-size 64g --device /dev/davinci0 --device /dev/davinci1 "
    "--device /dev/davinci2 --device /dev/davinci3 --device /dev/davinci_manager --device /dev/devmm_svm "
    "--device /dev/hisi_hdc -v /usr/local/Ascend/driver:/usr/local/Ascend/driver:ro -v /usr/local/dcmi:/usr/local/dcmi:ro "
    "-v /usr/local/bin/npu-smi:/usr/local/bin/npu-smi:ro -v /path/to/minimax-h3-weights:/models/minimax-h3 "
    "<an image with CANN 9.1.0 and Python 3.11> bash": "needs an Ascend host and a CANN image",
    "source /usr/local/Ascend/ascend-toolkit/set_env.sh": "needs the CANN toolkit",
    "git clone https://github.com/Comfy-Org/ComfyUI && git -C ComfyUI checkout "
    "<upstream.commit from source_deps_info.json>": "downloads ComfyUI",
    "python3 -m venv ComfyUI/venv": "part of the container set-up",
    "git clone <this repository> minimax-h3 && cd minimax-h3": "part of the container set-up",
    "bash install_deps_minimax_h3.sh --platform ascend --comfyui ../ComfyUI --python ../ComfyUI/venv/bin/python":
        "installs torch_npu into a ComfyUI (GBs)",
    "../ComfyUI/venv/bin/pip install -r ../ComfyUI/requirements.txt": "downloads ComfyUI's requirements (GBs)",
    "python bench/bench_card.py > card.json": CARDS,
    "python bench/bench_card.py --quick > card.json": CARDS,
    "COMFYUI_DIR=<ComfyUI> python bench/bench_card.py > card.json": CARDS,
    "python bench/project_h3.py --card-json card.json": "needs the card.json a card run writes",
    ".venv/bin/python bench/bench_exchange.py": LONG,
    ".venv/bin/python bench/bench_sp_scaling.py": LONG,
    ".venv/bin/python bench/bench_sp_modes.py": LONG,
    ".venv/bin/python bench/bench_mixed_split.py": "about 20 s; its --quick run is tests/bench/test_bench_mixed_split.py",
    "COMFYUI_DIR=<ComfyUI checkout> <its python> bench/bench_weights.py": COMFYUI,
    "flock /tmp/bench.lock .venv/bin/python bench/bench_memory.py [--video-rows 4096] [--rounds 3] [--blocks 24]": LONG,
    "COMFYUI_DIR=<ComfyUI> <its Python> bench/bench_real_length.py [--seconds 15] [--cards 4]": COMFYUI,
    ".venv/bin/python bench/bench_tensor_parallel.py": LONG,
    ".venv/bin/python bench/project_h3.py [--plot out/project_h3_speedup.png] [--text-tokens 256] "
    "[--half-rows H] [--card-json card.json]": "writes a plot; its tests run in the suite (tests/bench)",
    ".venv/bin/python -m pytest -q tests/test_nodes_multinpu.py tests/roles/test_plan.py tests/test_devices.py "
    "tests/vae/test_chunked.py": "tests that run in the suite anyway",
}

# Where the patch route and the docs' set-ups put our files, by the repository path they come from.
INSTALLED_AS = {"ComfyUI/runtime/": "additional_files/runtime/"}
OPERATORS = {"&&", "||", "|", ";", "&"}
REDIRECTS = {">", ">>", "<", "2>"}
OUR_VARIABLE = re.compile(r"^(COMFYUI_|MINIMAX_)\w+$")
# The repository's top folders: a word under one of them names a file of ours.
REPO_FOLDERS = ("additional_files", "bench", "comfy", "comfy_extras", "docs", "example_workflows", "tests", "tools", "web")


def doc_commands() -> dict[str, list[str]]:
    """Each command of the docs (continuations joined, comments dropped, spaces collapsed) with
    the docs that show it."""
    found: dict[str, list[str]] = {}
    for doc in user_docs():
        for block in fenced_blocks(doc, LANGUAGES):
            for line in block.replace("\\\n", " ").splitlines():
                command = " ".join(re.sub(r"(^|\s)#.*$", "", line).split())
                if command:
                    found.setdefault(command, []).append(str(doc.relative_to(REPO)))
    return found


COMMANDS = doc_commands()


def simple_commands(command: str) -> list[list[str]]:
    """The words of each simple command (split at && || | ; &), placeholders such as
    <ComfyUI> as one word, usage brackets and redirection targets dropped."""
    text = re.sub(r"<[^<>]*>", "PLACEHOLDER", command).replace("[", " ").replace("]", " ")
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    parts, words, skip = [], [], False
    for token in lexer:
        if token in OPERATORS:
            parts.append(words)
            words = []
        elif token in REDIRECTS:
            skip = True
        elif skip:
            skip = False
        else:
            words.append(token)
    return [w for w in [*parts, words] if w]


def repository_path(word: str) -> Path | None:
    """The repository file or folder a word names, or None when it names none of ours (an
    absolute path, a placeholder, ComfyUI's own files, an output file)."""
    for installed, source in INSTALLED_AS.items():
        if word.startswith(installed):
            return REPO / source / word[len(installed):]
    if word.startswith(("/", "~", ".", "-")) or "=" in word or "PLACEHOLDER" in word:
        return None
    if word.split("/")[0] in REPO_FOLDERS or word.endswith((".py", ".sh")):
        return REPO / word
    return None


def interpreter_path(word: str) -> Path | None:
    """A program of .venv/bin/ is this interpreter's neighbour (the suite runs in .venv)."""
    return Path(sys.executable).parent / word[len(".venv/bin/"):] if word.startswith(".venv/bin/") else None


@functools.cache
def help_text(*program: str) -> str:
    result = subprocess.run([*program, "--help"], cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(program)} --help exited {result.returncode}: {result.stderr[-2000:]}"
    return result.stdout + result.stderr


def our_program(words: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """The program of ours a simple command runs (as a command line for --help) and the words
    after it, or None when it runs only other programs."""
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            module = words[i + 1]
            if module.split(".")[0] not in ("comfy", "comfy_extras", "tests", "bench", "tools"):
                return None  # pytest, pip, venv: not ours to check
            assert importlib.util.find_spec(module), f"python -m {module}: no such module"
            return (sys.executable, "-m", module), words[i + 2:]
        path = repository_path(word)
        if path is not None and path.suffix in (".py", ".sh"):
            assert path.is_file(), f"{word}: no such script ({path.relative_to(REPO)})"
            rest = words[i + 1:]
            runner = ("bash",) if path.suffix == ".sh" else (sys.executable,)
            if rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):  # a subcommand: `run`, `doctor`
                return (*runner, str(path), rest[0]), rest[1:]
            return (*runner, str(path)), rest
    return None


@functools.cache
def code_read_variables() -> str:
    """The text of the code that reads environment variables: ours, the scripts and the tests."""
    places = [REPO / "comfy", REPO / "comfy_extras", REPO / "additional_files", REPO / "tests", REPO / "bench"]
    files = [p for place in places for p in place.rglob("*") if p.suffix in (".py", ".sh") or p.suffix == ""]
    files += [REPO / "minimax_h3_parallel.py", REPO / "__init__.py"]
    return "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files if p.is_file())


def check_structure(command: str) -> None:
    for words in simple_commands(command):
        variables = [w.split("=")[0] for w in words if re.match(r"^\w+=", w)]
        unread = [v for v in variables if OUR_VARIABLE.match(v) and v not in code_read_variables()]
        assert not unread, f"{command!r} sets {unread}, which no code reads"
        for word in words:
            path = interpreter_path(word) or repository_path(word)
            assert path is None or path.exists(), f"{command!r} names {word}, which does not exist"
        if "-c" in words:
            code = words[words.index("-c") + 1]
            for module, names in re.findall(r"from ((?:comfy|comfy_extras|tests)[\w.]*) import ([\w, ]+)", code):
                loaded = importlib.import_module(module)
                missing = [n.strip() for n in names.split(",") if not hasattr(loaded, n.strip())]
                assert not missing, f"{command!r}: {module} has no {missing}"
        program = our_program(words)
        if program is not None:
            line, rest = program
            flags = [w.split("=")[0] for w in rest if w.startswith("--")]
            unknown = [f for f in flags if not re.search(rf"{re.escape(f)}(?![\w-])", help_text(*line))]
            assert not unknown, f"{command!r}: {' '.join(line[1:])} --help does not list {unknown}"


def test_every_command_of_the_docs_is_run_or_checked_here():
    unclassified = {c: docs for c, docs in COMMANDS.items() if c not in RUN and c not in CHECKED}
    stale = (RUN | set(CHECKED)) - set(COMMANDS)
    assert not unclassified, f"classify these in RUN or CHECKED of {Path(__file__).name}: {unclassified}"
    assert not stale, f"no doc shows these any more; remove them from RUN / CHECKED: {stale}"
    assert not RUN & set(CHECKED)


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=lambda c: c[:60])
def test_each_command_names_what_exists_and_passes_flags_its_program_takes(command):
    check_structure(command)


@pytest.mark.parametrize("command", sorted(RUN), ids=lambda c: c[:60])
def test_each_quick_command_runs(command, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # the docs' `python` is this interpreter (a wrapper, not a link: a venv is found by the path run)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "HOME": str(home)}
    line = command.replace(".venv/bin/python", shlex.quote(sys.executable))
    result = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{command!r} exited {result.returncode}:\n{result.stderr[-3000:]}"
    assert result.stdout.strip() or list(home.iterdir()), f"{command!r} printed and wrote nothing"
