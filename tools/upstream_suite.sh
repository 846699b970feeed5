#!/usr/bin/env bash
# tests/upstream and tests/e2e against real upstream ComfyUI trees, the way a user installs this project.
#
#   bash tools/upstream_suite.sh [TREE ...]        TREE: v0.33.0 | newest-h3 (default: both)
#
# Per tree: a fresh ComfyUI tree from ../shared/upstream-comfyui (make-tree), a CPU Python for it
# from that folder's cpu-requirements-<tree>.txt plus this repository's pinned test packages
# (cached outside the checkout, keyed by what went into it), this project installed into the
# tree and that Python by install_deps_minimax_h3.sh, then `pytest tests/upstream tests/e2e`
# with COMFYUI_DIR set (e2e needs Debian's chromium on PATH: .ci/run installs it). Prints each
# tree's counts, skip reasons and wall time; exits non-zero when any tree fails (pytest's "no
# tests collected" included).
#
# Where ../shared/upstream-comfyui is absent (a clone without the team's shared folder), says
# so in one line and exits 0: run the suite against your own ComfyUI as the README says
# ("Supported ComfyUI").
#
# Environment: UPSTREAM_TREES_DIR (default ../shared/upstream-comfyui), MINIMAX_H3_CI_CACHE
# (default ${XDG_CACHE_HOME:-~/.cache}/minimax-h3-ci: the Pythons), PYTHON (the interpreter
# that creates them, default python3).
set -uo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TREES_DIR="${UPSTREAM_TREES_DIR:-$REPO_DIR/../shared/upstream-comfyui}"
CACHE_DIR="${MINIMAX_H3_CI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/minimax-h3-ci}"
BASE_PYTHON="${PYTHON:-python3}"

say() { echo "upstream suite: $*"; }

if [ ! -x "$TREES_DIR/make-tree" ]; then
    say "skipped: no upstream trees at $TREES_DIR (see README, 'Supported ComfyUI', to run it on your ComfyUI)"
    exit 0
fi
[ $# -gt 0 ] || set -- newest-h3 v0.33.0

# The test packages at the versions source_deps_info.json pins (the suite's own needs).
test_pins() {
    "$BASE_PYTHON" - "$REPO_DIR/source_deps_info.json" <<'PY'
import json, sys
test = json.load(open(sys.argv[1]))["python_dependencies"]["test"]
print("\n".join(f"{name}=={test[name]}" for name in ("pytest", "pytest-timeout", "hypothesis", "playwright")))
PY
}

# A Python for one tree, reused while nothing that went into it changed. A half-built one (no
# stamp: a run stopped while pip worked) is removed and built again.
tree_python() {
    local tree=$1 requirements="$TREES_DIR/cpu-requirements-$1.txt" pins key venv
    [ -f "$requirements" ] || { echo "upstream suite: $requirements is missing" >&2; return 1; }
    pins="$(test_pins)" || return 1
    key="$({ cat "$requirements"; echo "$pins"; "$BASE_PYTHON" -VV; } | sha256sum | cut -c1-16)"
    venv="$CACHE_DIR/python-$tree-$key"
    if [ ! -f "$venv/.complete" ]; then
        rm -rf "$venv"
        mkdir -p "$CACHE_DIR"
        say "$tree: making a Python at $venv (pip, about a minute)" >&2
        "$BASE_PYTHON" -m venv "$venv" || return 1
        printf '%s\n' "$pins" > "$venv/test-pins.txt"
        "$venv/bin/python" -m pip install --quiet -r "$requirements" -r "$venv/test-pins.txt" 2>&1 \
            | grep -v "is ignored: it is neither a file nor a directory" >&2
        [ "${PIPESTATUS[0]}" -eq 0 ] || { rm -rf "$venv"; return 1; }
        touch "$venv/.complete"
    fi
    echo "$venv/bin/python"
}

# One tree: made fresh, the project installed into it as a user installs it (the patch into
# the tree, the runtime pins into its Python), then the suite.
suite_on_tree() {
    local tree=$1 work=$2 python=$3 status
    "$TREES_DIR/make-tree" "$tree" "$work/ComfyUI" >/dev/null || { say "$tree: FAILED to make the tree"; return 1; }
    if ! bash "$REPO_DIR/install_deps_minimax_h3.sh" --comfyui "$work/ComfyUI" --python "$python" >"$work/install.log" 2>&1; then
        cat "$work/install.log"; say "$tree: FAILED to install the project into the tree"; return 1
    fi
    # tests/e2e drives the real canvas in the system's chromium; here a missing browser fails
    (cd "$REPO_DIR" && COMFYUI_DIR="$work/ComfyUI" E2E_REQUIRED=1 "$python" -m pytest -q -rs tests/upstream tests/e2e)
    status=$?
    if [ "$status" -eq 5 ]; then
        say "$tree: pytest collected no tests; that is a failure"; status=1
    fi
    return "$status"
}

run_tree() {
    local tree=$1 start python work status
    start=$(date +%s)
    python="$(tree_python "$tree")" || { say "$tree: FAILED to make its Python"; return 1; }
    work="$(mktemp -d "${TMPDIR:-/tmp}/upstream-$tree-XXXX")"
    suite_on_tree "$tree" "$work" "$python"
    status=$?
    rm -rf "$work"
    say "$tree: exit $status, $(( $(date +%s) - start )) s (tree, Python, install and suite)"
    return "$status"
}

overall=0
for tree in "$@"; do
    case "$tree" in v0.33.0|newest-h3) ;; *) echo "upstream suite: unknown tree '$tree' (v0.33.0 or newest-h3)" >&2; exit 2 ;; esac
    run_tree "$tree" || overall=1
done
exit "$overall"
