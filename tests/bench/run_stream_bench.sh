#!/usr/bin/env bash
# Streaming benchmark: starts kvdepotd and redis-server on free loopback ports
# in a temporary directory (Redis without persistence), runs bench_stream,
# prints its table, then stops both servers and removes the directory.
#
#   tests/bench/run_stream_bench.sh [BUILD_DIR] [bench_stream options]
#
# BUILD_DIR defaults to <repo>/build (KVD_BUILD_DIR also works). Options go to
# bench_stream, e.g. --sizes 1,4,16,64 --reps 5 --csv out.csv (see --help).
# Needs: kvdepotd and bench_stream built (bench_stream needs libhiredis-dev),
# redis-server (package redis-server).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=${KVD_BUILD_DIR:-$root/build}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    build=$1
    shift
fi
kvdepotd=${KVDEPOTD:-$build/service/kvdepotd}
bench=${BENCH_STREAM:-$build/tests/bench_stream}
redis_server=${REDIS_SERVER:-$(command -v redis-server || true)}

die() { echo "run_stream_bench: $*" >&2; exit 1; }
[ -x "$kvdepotd" ] || die "kvdepotd not found at $kvdepotd (build it first)"
[ -x "$bench" ] || die "bench_stream not found at $bench (needs libhiredis-dev; build target bench_stream)"
[ -n "$redis_server" ] || die "redis-server not found (Debian package redis-server)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvd-stream-bench.XXXXXX")
kv_pid=""
redis_pid=""

stop_pid() { # pid name
    local pid=$1 name=$2 i
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 1 100); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "run_stream_bench: $name did not stop on SIGTERM, killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

cleanup() {
    stop_pid "$kv_pid" kvdepotd
    stop_pid "$redis_pid" redis-server
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# kvdepotd picks its own port and writes it to the port file.
mkdir -p "$tmp/kv"
"$kvdepotd" --listen 127.0.0.1:0 --data-dir "$tmp/kv" --port-file "$tmp/kv.port" \
    >"$tmp/kvdepotd.log" 2>&1 &
kv_pid=$!
for _ in $(seq 1 300); do
    # Complete once it ends with a newline.
    [ -s "$tmp/kv.port" ] && [ -z "$(tail -c1 "$tmp/kv.port")" ] && break
    kill -0 "$kv_pid" 2>/dev/null || { cat "$tmp/kvdepotd.log" >&2; die "kvdepotd exited"; }
    sleep 0.1
done
[ -s "$tmp/kv.port" ] || { cat "$tmp/kvdepotd.log" >&2; die "kvdepotd wrote no port file"; }
kv_port=$(tr -d '[:space:]' <"$tmp/kv.port")

# Redis cannot pick its own port: try random high ports until one binds.
port_listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
mkdir -p "$tmp/redis"
redis_port=""
for _ in $(seq 1 20); do
    port=$((20000 + RANDOM % 40000))
    port_listening "$port" && continue
    "$redis_server" --bind 127.0.0.1 --port "$port" --protected-mode yes \
        --save '' --appendonly no --dir "$tmp/redis" --logfile "$tmp/redis.log" \
        --daemonize no >/dev/null 2>&1 &
    redis_pid=$!
    for _ in $(seq 1 50); do
        kill -0 "$redis_pid" 2>/dev/null || break
        if port_listening "$port"; then
            redis_port=$port
            break 2
        fi
        sleep 0.1
    done
    stop_pid "$redis_pid" redis-server
    redis_pid=""
done
[ -n "$redis_port" ] || { cat "$tmp/redis.log" >&2 || true; die "could not start redis-server"; }

echo "run_stream_bench: kvdepotd on 127.0.0.1:$kv_port, redis-server on 127.0.0.1:$redis_port," \
     "$(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
timeout 1800 "$bench" --kvdepot "127.0.0.1:$kv_port" --redis "127.0.0.1:$redis_port" "$@" ||
    status=$?
if [ "$status" -ne 0 ]; then
    echo "run_stream_bench: bench_stream failed ($status); kvdepotd log tail:" >&2
    tail -n 20 "$tmp/kvdepotd.log" >&2 || true
fi
exit "$status"
