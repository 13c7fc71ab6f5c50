#!/usr/bin/env bash
# SIGTERM the moment kvdepotd serves, many times, with many workers: it must
# exit 0 every time (a worker still requesting its first calls must not meet
# a server that shutdown already destroyed).
#
# Usage: term_at_start.sh KVDEPOTD [ROUNDS]
set -euo pipefail
server=$1
rounds=${2:-25}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-term-XXXXXX")
trap 'rm -rf "$work"' EXIT
for i in $(seq 1 "$rounds"); do
    rm -rf "$work/data" "$work/port"
    "$server" --listen 127.0.0.1:0 --data-dir "$work/data" --port-file "$work/port" \
        --metrics-listen "" --threads 16 >"$work/log" 2>&1 &
    pid=$!
    for _ in $(seq 1 6000); do
        [ -s "$work/port" ] && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.005
    done
    kill -TERM "$pid" 2>/dev/null || true
    rc=0
    wait "$pid" || rc=$?
    if [ "$rc" != 0 ]; then
        echo "term_at_start: round $i: kvdepotd exited $rc" >&2
        tail -n 30 "$work/log" >&2
        exit 1
    fi
done
echo "term_at_start: $rounds rounds, every exit 0"
