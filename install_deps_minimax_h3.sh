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
COMFYUI_DIR=""
TARGET_PYTHON=""
UNINSTALL=0
NO_DEPS=0

usage() {
    cat <<'USAGE'
Usage: bash install_deps_minimax_h3.sh [options]

Creates .venv in this repository and installs the pinned dependencies
(from source_deps_info.json) for the platform it finds:
  Ascend (CANN present)  -> the recorded torch + torch_npu pair
  NVIDIA (nvidia-smi)    -> the recorded torch
  otherwise              -> the recorded CPU torch
A second run with unchanged pins checks the environment and installs nothing.

With --comfyui DIR it also installs this project into a ComfyUI checkout: it checks
that DIR is one (main.py, comfy/, comfy_extras/, custom_nodes/), warns when DIR's git
commit is not the pinned upstream.commit, applies comfy-ui-changes.patch (new files
only) after `git apply --check`, copies the node pack's example workflows to
user/default/workflows/minimax-h3/ (an edited workflow is kept, ours goes beside it) and
additional_files/ (sample inputs to input/, the service scripts to runtime/),
and records every file it wrote in DIR/.minimax-h3-install.json. Running it again finds
it installed and changes nothing; running a newer checkout's copy upgrades: the earlier
install's unedited files are replaced. Every failure leaves DIR as it was.

Options:
  --platform NAME    ascend | nvidia | cpu | auto (default auto: detect)
  --base-python PATH the interpreter that creates .venv and runs the helpers (default:
                     $PYTHON or python3; must be Python 3.11 or newer)
  --no-test-deps     skip the test-only packages (pytest, hypothesis, ...)
  --force            reinstall even if the environment already matches the pins; with
                     --comfyui: also install into a ComfyUI that has no MiniMax-H3 nodes
                     (with --python: also install the pinned torch over the one there)
  --comfyui DIR      install the patch and additional files into the ComfyUI checkout DIR
  --uninstall        with --comfyui: remove what the install wrote (only files still
                     unchanged, whichever version wrote them); installs no dependencies
  --python PATH      install the runtime dependencies into the Python that runs ComfyUI
                     (e.g. DIR/venv/bin/python) instead of .venv; packages it already has
                     are kept (a version other than the pin gets a warning), missing ones
                     are installed at the pinned version
  --no-deps          install no dependencies at all (only the --comfyui part)
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
        --comfyui) [ $# -ge 2 ] || die "--comfyui needs the ComfyUI folder"; COMFYUI_DIR="$2"; shift 2 ;;
        --comfyui=*) COMFYUI_DIR="${1#*=}"; shift ;;
        --python) [ $# -ge 2 ] || die "--python needs the path of ComfyUI's Python"; TARGET_PYTHON="$2"; shift 2 ;;
        --python=*) TARGET_PYTHON="${1#*=}"; shift ;;
        --uninstall) UNINSTALL=1; shift ;;
        --no-deps) NO_DEPS=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) usage >&2; die "unknown option '$1' (see --help)" ;;
    esac
done

[ -f "$PINS_FILE" ] || die "$PINS_FILE is missing; run this script from a full checkout of the repository"
command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "Python interpreter '$BASE_PYTHON' not found; install Python 3.11+ or pass --base-python PATH"
"$BASE_PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die "'$BASE_PYTHON' is $("$BASE_PYTHON" -V 2>&1); Python 3.11 or newer is required (pass --base-python PATH)"
if [ "$UNINSTALL" -eq 1 ] && [ -z "$COMFYUI_DIR" ]; then
    die "--uninstall needs --comfyui DIR (the checkout to remove the overlay from)"
fi

# The ComfyUI part runs in tools/comfyui_overlay.py; `check` validates DIR and the patch
# before anything (dependencies included) is installed, so a bad DIR fails first.
overlay() {
    local force=()
    [ "$FORCE" -eq 1 ] && force=(--force)  # also: install into a ComfyUI without MiniMax-H3
    "$BASE_PYTHON" "$REPO_DIR/tools/comfyui_overlay.py" "$@" ${force[@]+"${force[@]}"} --comfyui "$COMFYUI_DIR"
}
if [ -n "$COMFYUI_DIR" ]; then
    if [ "$UNINSTALL" -eq 1 ]; then
        overlay uninstall || die "uninstall from $COMFYUI_DIR stopped (see above)"
        exit 0
    fi
    overlay check || die "$COMFYUI_DIR was left unchanged (see above)"
fi

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

# The requirement lines for a platform (with or without test packages), read from the pins file.
read_pins() {
"$BASE_PYTHON" - "$PINS_FILE" "$1" "$2" <<'PY'
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
}
REQUIREMENTS="$(read_pins "$PLATFORM" "$WITH_TESTS")" \
    || die "source_deps_info.json is not readable; restore it from git (git checkout source_deps_info.json)"

REQ_FILE="$(mktemp)"
trap 'rm -f "$REQ_FILE"' EXIT

setup_venv() {
STAMP="$VENV_DIR/.minimax_h3_requirements"
echo "MiniMax-H3 multi-device set-up: platform $PLATFORM, environment $VENV_DIR"

if [ "$FORCE" -eq 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$REQUIREMENTS" ] \
    && "$VENV_DIR/bin/python" -c 'import torch, safetensors' >/dev/null 2>&1; then
    echo "Already set up: .venv matches source_deps_info.json (use --force to reinstall)."
    return 0
fi

if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$BASE_PYTHON" -m venv "$VENV_DIR" \
        || die "could not create $VENV_DIR; on Debian/Ubuntu install the python3-venv package"
fi

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
}

# --python: ComfyUI's own environment. Its packages stay as they are; what is missing is
# installed at the pinned version (--force: everything at the pinned version).
setup_target_python() {
    [ -x "$TARGET_PYTHON" ] || command -v "$TARGET_PYTHON" >/dev/null 2>&1 \
        || die "--python '$TARGET_PYTHON' is not an executable; pass the Python that runs ComfyUI (e.g. DIR/venv/bin/python)"
    "$TARGET_PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
        || die "--python '$TARGET_PYTHON' is not Python 3.11 or newer"
    echo "MiniMax-H3 multi-device set-up: platform $PLATFORM, ComfyUI's Python $TARGET_PYTHON"
    local runtime_reqs status wanted have
    # Runtime pins only: the test packages belong to this repository's .venv.
    runtime_reqs="$(read_pins "$PLATFORM" 0)"
    status="$("$TARGET_PYTHON" -c '
import sys
from importlib import metadata
for req in sys.argv[1:]:
    name = req.split("==")[0]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = ""
    print(req + " " + have)
' $runtime_reqs)" || die "'$TARGET_PYTHON' could not list its installed packages"
    : > "$REQ_FILE"
    while read -r wanted have; do
        [ -n "$wanted" ] || continue
        if [ -z "$have" ] || [ "$FORCE" -eq 1 ]; then
            echo "$wanted" >> "$REQ_FILE"
        elif [ "${wanted#*==}" != "${have%%+*}" ]; then  # 2.13.0+cpu is torch 2.13.0
            echo "warning: ComfyUI's Python has ${wanted%%==*} $have; source_deps_info.json pins ${wanted#*==}; keeping $have (--force installs the pin)" >&2
        fi
    done <<< "$status"
    if [ ! -s "$REQ_FILE" ]; then
        echo "ComfyUI's Python already has every runtime dependency; nothing installed."
        return 0
    fi
    echo "Installing into $TARGET_PYTHON:"
    sed 's/^/  /' "$REQ_FILE"
    "$TARGET_PYTHON" -m pip install --quiet -r "$REQ_FILE" \
        || die "pip could not install the pinned dependencies above into $TARGET_PYTHON; check network access to the package index"
}

if [ "$NO_DEPS" -eq 1 ]; then
    echo "--no-deps: no dependencies installed."
elif [ -n "$TARGET_PYTHON" ]; then
    setup_target_python
else
    setup_venv
fi

if [ -n "$COMFYUI_DIR" ]; then
    overlay apply --checked || die "installing into $COMFYUI_DIR stopped (see above)"
    [ -n "$TARGET_PYTHON" ] || [ "$NO_DEPS" -eq 1 ] \
        || echo "Note: ComfyUI runs with its own Python; pass --python PATH to install the dependencies there."
fi
