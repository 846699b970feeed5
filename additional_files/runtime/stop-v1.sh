#!/usr/bin/env bash
# Stop the ComfyUI server that runtime/restart-v1.sh started, and wait until it is gone.
#
# It finds the server only through runtime/comfyui.pid ("PID START_TICKS"), never by process
# name. A pid file whose process is gone, whose pid now belongs to another process (other
# start time), or that has no start time to check, is not trusted: it is removed and nothing
# is signalled. Otherwise the server's whole
# process group gets SIGTERM, then SIGKILL after COMFYUI_STOP_TIMEOUT_S (default 60) seconds.
# Linux only (/proc).
set -euo pipefail

RUNTIME_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PID_FILE="$RUNTIME_DIR/comfyui.pid"
STOP_TIMEOUT_S="${COMFYUI_STOP_TIMEOUT_S:-60}"
case "$STOP_TIMEOUT_S" in ''|*[!0-9]*) echo "stop-v1.sh: error: COMFYUI_STOP_TIMEOUT_S='$STOP_TIMEOUT_S' is not a whole number" >&2; exit 1 ;; esac

# Fields of /proc/PID/stat after the command name: 1 state, 3 process group, 20 start time.
stat_fields() {
    local stat
    { read -r stat < "/proc/$1/stat"; } 2>/dev/null || return 1
    echo "${stat##*) }"
}

exited() {  # state $1 of process $2: a zombie has exited (it only waits for its parent to
            # read its status), unless it leads threads that are still exiting: a process exits
            # thread by thread, and its files (the listening socket) close with the last one
    case "$1" in Z|X) [ "$(ls "/proc/$2/task" 2>/dev/null | wc -l)" -le 1 ] ;; *) return 1 ;; esac
}

running() {
    local fields
    fields="$(stat_fields "$1")" || return 1
    ! exited "${fields%% *}" "$1"
}

group_running() {  # any live process left in process group $1
    local f stat fields
    for f in /proc/[0-9]*/stat; do
        { read -r stat < "$f"; } 2>/dev/null || continue
        # shellcheck disable=SC2086
        set -- ${stat##*) }
        [ "${3:-}" = "$GROUP" ] && ! exited "$1" "${f//[!0-9]/}" && return 0
    done
    return 1
}

wait_gone() {  # up to $1 seconds
    local until=$((SECONDS + $1))
    while running "$PID" || group_running; do
        [ "$SECONDS" -lt "$until" ] || return 1
        sleep 0.5
    done
}

if [ ! -f "$PID_FILE" ]; then
    echo "stop-v1.sh: no pid file ($PID_FILE): no server of ours is running"
    exit 0
fi
read -r PID TICKS < "$PID_FILE" || true
case "${PID:-}" in
    ''|*[!0-9]*|0|1)
        echo "stop-v1.sh: pid file holds no usable pid ('${PID:-}'); removed it, signalled nothing"
        rm -f "$PID_FILE"; exit 0 ;;
esac
if ! running "$PID"; then
    echo "stop-v1.sh: stale pid file: process $PID is not running (it exited or crashed); removed it"
    rm -f "$PID_FILE"; exit 0
fi
fields="$(stat_fields "$PID")"
# shellcheck disable=SC2086
set -- $fields
if [ -z "${TICKS:-}" ]; then
    echo "stop-v1.sh: pid file has no start time, so pid $PID cannot be told apart from another process that got the same pid; signalled nothing, removed the pid file (if pid $PID is our ComfyUI, stop it with: kill $PID)"
    rm -f "$PID_FILE"; exit 0
fi
if [ "${20:-}" != "$TICKS" ]; then
    echo "stop-v1.sh: stale pid file: pid $PID now belongs to another process (started at another time); left that process alone, removed the pid file"
    rm -f "$PID_FILE"; exit 0
fi
# restart-v1.sh starts the server as the leader of its own process group.
GROUP="$PID"
[ "${3:-}" = "$PID" ] || GROUP=""

echo "stop-v1.sh: stopping ComfyUI (pid $PID)"
if [ -n "$GROUP" ]; then kill -TERM -- "-$GROUP" 2>/dev/null || true; else kill -TERM "$PID" 2>/dev/null || true; fi
if ! wait_gone "$STOP_TIMEOUT_S"; then
    echo "stop-v1.sh: still running after ${STOP_TIMEOUT_S}s; sending SIGKILL"
    if [ -n "$GROUP" ]; then kill -KILL -- "-$GROUP" 2>/dev/null || true; else kill -KILL "$PID" 2>/dev/null || true; fi
    if ! wait_gone 15; then
        echo "stop-v1.sh: error: pid $PID survived SIGKILL (stuck in the device driver?); check it with ps -o pid,stat,cmd -g $PID" >&2
        exit 1
    fi
fi
rm -f "$PID_FILE"
echo "stop-v1.sh: stopped"
