#!/usr/bin/env bash
# Set up MiniMax-H3 multi-device: a .venv in this repository with the pinned
# dependencies for the platform found here (Ascend / NVIDIA / CPU).
# Pins live in source_deps_info.json; this script only reads them.
set -euo pipefail

REPO_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PINS_FILE="$REPO_DIR/source_deps_info.json"
VENV_DIR="$REPO_DIR/.venv"
PLATFORM="auto"
BASE_PYTHON="${PYTHON:-python3}"
WITH_TESTS=1
FORCE=0

usage() {
    cat <<'USAGE'
Usage: bash install_deps_minimax_h3.sh [options]

Creates .venv in this repository and installs the pinned dependencies
(from source_deps_info.json) for the platform it finds:
  Ascend (CANN present)  -> the recorded torch + torch_npu pair
  NVIDIA (nvidia-smi)    -> the recorded torch
  otherwise              -> the recorded CPU torch
A second run with unchanged pins checks the environment and installs nothing.

Options:
  --platform NAME    ascend | nvidia | cpu | auto (default auto: detect)
  --base-python PATH the interpreter that creates .venv (default: $PYTHON or python3;
                     must be Python 3.11 or newer)
  --no-test-deps     skip the test-only packages (pytest, hypothesis, ...)
  --force            reinstall even if the environment already matches the pins
  -h, --help         show this help and exit
USAGE
}

die() {
    echo "install_deps_minimax_h3.sh: error: $*" >&2
    exit 1
}

while [ $# -gt 0 ]; do
    case "$1" in
        --platform) [ $# -ge 2 ] || die "--platform needs a value (ascend|nvidia|cpu|auto)"; PLATFORM="$2"; shift 2 ;;
        --platform=*) PLATFORM="${1#*=}"; shift ;;
        --base-python) [ $# -ge 2 ] || die "--base-python needs a path"; BASE_PYTHON="$2"; shift 2 ;;
        --base-python=*) BASE_PYTHON="${1#*=}"; shift ;;
        --no-test-deps) WITH_TESTS=0; shift ;;
        --force) FORCE=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1' (see --help)" ;;
    esac
done

[ -f "$PINS_FILE" ] || die "$PINS_FILE is missing; run this script from a full checkout of the repository"
command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "Python interpreter '$BASE_PYTHON' not found; install Python 3.11+ or pass --base-python PATH"
"$BASE_PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die "'$BASE_PYTHON' is $("$BASE_PYTHON" -V 2>&1); Python 3.11 or newer is required (pass --base-python PATH)"

detect_platform() {
    if [ -n "${ASCEND_HOME_PATH:-}" ] || [ -n "${ASCEND_TOOLKIT_HOME:-}" ] || [ -d /usr/local/Ascend/ascend-toolkit ]; then
        echo ascend
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo nvidia
    else
        echo cpu
    fi
}

case "$PLATFORM" in
    auto) PLATFORM="$(detect_platform)" ;;
    ascend|nvidia|cpu) ;;
    *) die "unknown platform '$PLATFORM'; use ascend, nvidia, cpu or auto" ;;
esac

# The requirement lines for this platform, read from the pins file.
REQUIREMENTS="$("$BASE_PYTHON" - "$PINS_FILE" "$PLATFORM" "$WITH_TESTS" <<'PY'
import json, sys
path, platform, with_tests = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
try:
    pins = json.load(open(path))
    torch_pins = pins["torch"][platform]
    lines = [f"torch=={torch_pins['torch']}"]
    if platform == "ascend":
        lines.append(f"torch_npu=={torch_pins['torch_npu']}")
    deps = dict(pins["python_dependencies"]["runtime"])
    if with_tests:
        deps.update(pins["python_dependencies"]["test"])
    lines += [f"{name}=={version}" for name, version in deps.items()]
except (OSError, ValueError, KeyError, TypeError) as exc:
    sys.exit(f"cannot read the pins for platform {platform!r} from {path}: {exc!r}")
print("\n".join(lines))
PY
)" || die "source_deps_info.json is not readable; restore it from git (git checkout source_deps_info.json)"

STAMP="$VENV_DIR/.minimax_h3_requirements"
echo "MiniMax-H3 multi-device set-up: platform $PLATFORM, environment $VENV_DIR"

if [ "$FORCE" -eq 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$REQUIREMENTS" ] \
    && "$VENV_DIR/bin/python" -c 'import torch, safetensors' >/dev/null 2>&1; then
    echo "Already set up: .venv matches source_deps_info.json (use --force to reinstall)."
    exit 0
fi

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$BASE_PYTHON" -m venv "$VENV_DIR" \
        || die "could not create $VENV_DIR; on Debian/Ubuntu install the python3-venv package"
fi

REQ_FILE="$(mktemp)"
trap 'rm -f "$REQ_FILE"' EXIT
printf '%s\n' "$REQUIREMENTS" > "$REQ_FILE"
echo "Installing:"
sed 's/^/  /' "$REQ_FILE"

if [ "$PLATFORM" = "ascend" ]; then
    # torch_npu needs these at import time; the CANN toolkit itself is installed by the host.
    "$VENV_DIR/bin/python" -m pip install --quiet pyyaml setuptools \
        || die "pip could not install pyyaml/setuptools (needed by torch_npu); check network access to the package index"
fi
"$VENV_DIR/bin/python" -m pip install --quiet -r "$REQ_FILE" \
    || die "pip could not install the pinned dependencies above; check network access to the package index, or rerun with --platform cpu"

"$VENV_DIR/bin/python" -c 'import torch, safetensors; print("torch", torch.__version__)' \
    || die "the new environment cannot import torch; rerun with --force"
printf '%s\n' "$REQUIREMENTS" > "$STAMP"
echo "Done. Run the tests with: .venv/bin/python -m pytest -q"
