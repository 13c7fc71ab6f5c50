# Shared by the CLI test scripts. Source it after `set -euo pipefail` with
# `name`, `server` (kvdepotd) and `cli` (kvdepot) set. It gives:
#   grep_q PATTERN      like `grep -q`, but reads all of its input: under
#                       pipefail a writer cut off by `grep -q` dies of SIGPIPE
#                       and fails the pipeline when it is slow (sanitizers)
#   fail MESSAGE        print it with the server log's tail, exit 1
#   $work               a temporary directory removed on exit (with the server)
#   start_server [FLAG...]  start kvdepotd on a free loopback port; sets $pid
#                       and $port once it serves
#   k ARGS...           the CLI against that server
grep_q() { grep "$@" >/dev/null; }

work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-$name-XXXXXX")
pid=
port=

fail() {
    echo "$name: FAIL: $*" >&2
    [ -f "$work/server.log" ] && tail -n 40 "$work/server.log" >&2
    exit 1
}
cleanup() {
    if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

start_server() {
    "$server" --listen 127.0.0.1:0 --data-dir "$work/data" --port-file "$work/port" "$@" \
        >>"$work/server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do
        # The port file is complete once it ends in a newline.
        if [ -s "$work/port" ] && [ "$(tail -c 1 "$work/port" | od -An -c | tr -d ' ')" = '\n' ]; then
            port=$(tr -d '\n' <"$work/port")
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || fail "kvdepotd exited before serving"
        sleep 0.05
    done
    fail "kvdepotd wrote no port file"
}

k() { "$cli" --addr "127.0.0.1:$port" "$@"; }
