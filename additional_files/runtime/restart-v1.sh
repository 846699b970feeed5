#!/usr/bin/env bash
# (Re)start ComfyUI with the MiniMax-H3 multi-device settings, as a clean new process.
#
#   runtime/restart-v1.sh [extra main.py arguments...]
#
# 1. Stops the server this script started before (runtime/stop-v1.sh: by its pid file,
#    never by process name) and waits until it is gone, so its device memory is free; then
#    waits until its port is free too (a process that inherited the listening socket, or the
#    kernel still tearing a large process down, can hold it a moment longer).
# 2. Sets the environment (each only when not already set):
#      ASCEND_RT_VISIBLE_DEVICES     0,1,2,3   the NPUs ComfyUI may use
#      COMFYUI_MULTI_DEVICE_BACKEND  auto      auto | hccl | nccl | peer
#      PYTORCH_NPU_ALLOC_CONF        expandable_segments:True   (less fragmentation)
#      PYTORCH_CUDA_ALLOC_CONF       expandable_segments:True
#      MINIMAX_H3_MODELS             <ComfyUI>/models   (read by extra_model_paths.yaml)
# 3. Starts <ComfyUI>/main.py --listen HOST --port PORT in its own session, output to
#    runtime/comfyui.log (the previous log is kept as runtime/comfyui.previous.log).
#    Before that, a port already taken by another process is an error naming that process
#    (its readiness probe would otherwise be answered by the other server).
# 4. Waits until http://HOST:PORT/ answers. If the process exits or the wait times out,
#    prints the exception that ended it (the last traceback's, not an earlier harmless one
#    such as an optional custom node that failed to import), stops what it started, exits 1.
#
# Settings (environment): COMFYUI_DIR (default: the folder above runtime/), COMFYUI_PYTHON
# (default: <ComfyUI>/venv/bin/python or <ComfyUI>/.venv/bin/python if present, else python3),
# COMFYUI_HOST (127.0.0.1), COMFYUI_PORT (8188), COMFYUI_ARGS (more main.py arguments),
# COMFYUI_START_TIMEOUT_S (900: loading weights onto 4 cards takes a while),
# COMFYUI_STOP_TIMEOUT_S (60), COMFYUI_PORT_FREE_TIMEOUT_S (30: the wait for the stopped
# server's port).
set -euo pipefail

RUNTIME_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
COMFYUI_DIR="${COMFYUI_DIR:-$(dirname "$RUNTIME_DIR")}"
HOST="${COMFYUI_HOST:-127.0.0.1}"
PORT="${COMFYUI_PORT:-8188}"
START_TIMEOUT_S="${COMFYUI_START_TIMEOUT_S:-900}"
PORT_FREE_TIMEOUT_S="${COMFYUI_PORT_FREE_TIMEOUT_S:-30}"
PID_FILE="$RUNTIME_DIR/comfyui.pid"
LOG_FILE="$RUNTIME_DIR/comfyui.log"

fail() {
    echo "restart-v1.sh: error: $*" >&2
    exit 1
}

[ -f "$COMFYUI_DIR/main.py" ] || fail "no main.py in $COMFYUI_DIR; set COMFYUI_DIR to your ComfyUI checkout"
case "$PORT" in ''|*[!0-9]*) fail "COMFYUI_PORT='$PORT' is not a port number" ;; esac
case "$START_TIMEOUT_S" in ''|*[!0-9]*) fail "COMFYUI_START_TIMEOUT_S='$START_TIMEOUT_S' is not a whole number of seconds" ;; esac
case "$PORT_FREE_TIMEOUT_S" in ''|*[!0-9]*) fail "COMFYUI_PORT_FREE_TIMEOUT_S='$PORT_FREE_TIMEOUT_S' is not a whole number of seconds" ;; esac

if [ -n "${COMFYUI_PYTHON:-}" ]; then
    PYTHON="$COMFYUI_PYTHON"
elif [ -x "$COMFYUI_DIR/venv/bin/python" ]; then
    PYTHON="$COMFYUI_DIR/venv/bin/python"
elif [ -x "$COMFYUI_DIR/.venv/bin/python" ]; then
    PYTHON="$COMFYUI_DIR/.venv/bin/python"
else
    PYTHON="python3"
fi
command -v "$PYTHON" >/dev/null 2>&1 || fail "Python '$PYTHON' not found; set COMFYUI_PYTHON"

# The port must be free: another server there would answer the readiness probe for us.
port_holder() {  # "pid command" of the process listening on PORT (Linux /proc), or nothing
    "$PYTHON" - "$PORT" <<'PY' 2>/dev/null || true
import os, sys
port = int(sys.argv[1])
inodes = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    try:
        rows = open(table).read().splitlines()[1:]
    except OSError:
        continue
    for row in rows:
        fields = row.split()
        if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        links = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    except OSError:
        continue
    if any(f"socket:[{inode}]" in links for inode in inodes):
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
        print(pid, cmd[:200])
        break
else:
    if inodes:
        print("? (a process of another user)")
PY
}
port_in_use() {
    "$PYTHON" - "$HOST" "$PORT" <<'PY' 2>/dev/null
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
except OSError:
    sys.exit(1)
PY
}

# 1. A clean process: whatever ran before (an out-of-memory run included) is gone first, and
#    so is its hold on the port.
stopped_ours=0
[ -f "$PID_FILE" ] && stopped_ours=1
"$RUNTIME_DIR/stop-v1.sh" || fail "could not stop the running server (see above)"
if [ "$stopped_ours" -eq 1 ] && port_in_use; then
    echo "restart-v1.sh: waiting for port $PORT to be free (up to ${PORT_FREE_TIMEOUT_S}s, COMFYUI_PORT_FREE_TIMEOUT_S)"
    until_free=$((SECONDS + PORT_FREE_TIMEOUT_S))
    while port_in_use && [ "$SECONDS" -lt "$until_free" ]; do sleep 0.5; done
fi
if port_in_use; then
    holder="$(port_holder)"
    if [ -n "$holder" ]; then who="by pid $holder"
    else who="and no process that holds it can be found (it may still be closing, or belong to another network namespace)"
    fi
    if [ "$stopped_ours" -eq 1 ]; then
        fail "port $PORT on $HOST is still in use ${PORT_FREE_TIMEOUT_S}s after stopping our server (COMFYUI_PORT_FREE_TIMEOUT_S=$PORT_FREE_TIMEOUT_S) $who; stop that process, rerun later, or set COMFYUI_PORT to a free port"
    fi
    fail "port $PORT on $HOST is already in use $who; stop that process or set COMFYUI_PORT to a free port"
fi

# 2. Environment.
export ASCEND_RT_VISIBLE_DEVICES="${ASCEND_RT_VISIBLE_DEVICES:-0,1,2,3}"
export COMFYUI_MULTI_DEVICE_BACKEND="${COMFYUI_MULTI_DEVICE_BACKEND:-auto}"
export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export MINIMAX_H3_MODELS="${MINIMAX_H3_MODELS:-$COMFYUI_DIR/models}"

# 3. Start in a new session (its own process group), detached from this terminal.
[ -f "$LOG_FILE" ] && mv -f "$LOG_FILE" "$RUNTIME_DIR/comfyui.previous.log"
echo "restart-v1.sh: starting ComfyUI in $COMFYUI_DIR on $HOST:$PORT (devices $ASCEND_RT_VISIBLE_DEVICES, backend $COMFYUI_MULTI_DEVICE_BACKEND); log $LOG_FILE"
# shellcheck disable=SC2086  # COMFYUI_ARGS is a list of words on purpose
(
    cd "$COMFYUI_DIR"
    exec "$PYTHON" -c 'import os, sys; os.setsid(); os.execv(sys.executable, [sys.executable] + sys.argv[1:])' \
        main.py --listen "$HOST" --port "$PORT" ${COMFYUI_ARGS:-} "$@" </dev/null >>"$LOG_FILE" 2>&1
) &
PID=$!
# The pid file holds the pid and the process start time, so that a later stop can tell this
# process from an unrelated one that got the same pid after a crash or a reboot.
stat_after_name() {  # /proc/PID/stat after the command name: 1 state, ..., 20 start time
    local stat
    { read -r stat < "/proc/$1/stat"; } 2>/dev/null || return 1
    echo "${stat##*) }"
}
START_TICKS="$(stat_after_name "$PID" | cut -d' ' -f20 || true)"
echo "$PID $START_TICKS" > "$PID_FILE"

running() {  # our child counts as gone once it is a zombie
    local fields
    fields="$(stat_after_name "$PID")" || return 1
    case "${fields%% *}" in Z|X) return 1 ;; esac
}

fatal_exception() {
    # The line that names the exception that ended the process: the one closing the log's last
    # traceback ("RuntimeError: ...", "torch.OutOfMemoryError: ..."); without a traceback, the
    # last such line. Earlier tracebacks (e.g. an optional custom node's import) were survived.
    awk -v re='^([A-Za-z_][A-Za-z0-9_]*\\.)*[A-Za-z_][A-Za-z0-9_]*(Error|Exception|Exit|Interrupt)(:|$)' '
        /^Traceback \(most recent call last\):/ { in_tb = 1; next }
        $0 ~ re { if (in_tb) { fatal = $0; in_tb = 0 } else { loose = $0 } }
        END { if (fatal != "") print fatal; else if (loose != "") print loose }
    ' "$LOG_FILE" 2>/dev/null || true
}

explain_and_fail() {
    local why="$1" line
    line="$(fatal_exception)"
    if [ -n "$line" ]; then
        echo "restart-v1.sh: the exception that ended it, from $LOG_FILE: $line" >&2
        case "$line" in
            *"out of memory"*|*OutOfMemory*)
                echo "restart-v1.sh: the cards ran out of memory: use fewer frames or a lower resolution, or check that no other process holds the cards (npu-smi info); a restart starts from a clean process" >&2 ;;
        esac
    else
        echo "restart-v1.sh: no exception in the log; its last lines:" >&2
        tail -n 20 "$LOG_FILE" >&2 || true
    fi
    "$RUNTIME_DIR/stop-v1.sh" >/dev/null 2>&1 || true
    fail "$why"
}

# 4. Wait for the HTTP port.
deadline=$((SECONDS + START_TIMEOUT_S))
while :; do
    if ! running; then
        wait "$PID" 2>/dev/null && status=0 || status=$?
        explain_and_fail "ComfyUI exited (status $status) before it answered on $HOST:$PORT"
    fi
    if "$PYTHON" - "$HOST" "$PORT" <<'PY' 2>/dev/null
import sys, urllib.error, urllib.request
host, port = sys.argv[1], sys.argv[2]
try:
    urllib.request.urlopen(f"http://{host}:{port}/", timeout=2)
except urllib.error.HTTPError:
    pass  # any HTTP answer means the server is up
except Exception:
    sys.exit(1)
PY
    then
        echo "restart-v1.sh: ComfyUI is up: http://$HOST:$PORT/ (pid $PID)"
        exit 0
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
        explain_and_fail "ComfyUI did not answer on $HOST:$PORT within ${START_TIMEOUT_S}s (COMFYUI_START_TIMEOUT_S)"
    fi
    sleep 1
done
