#!/usr/bin/env bash
# Streaming benchmark: starts kvdepotd and two redis-servers on free loopback
# ports in a temporary directory (one Redis without persistence; one with an
# append-only file written before each reply, not fsynced: appendonly yes,
# appendfsync no, the promise of kvdepotd's default durability, the system
# redis-aof), runs bench_stream, prints its table, then stops the servers and
# removes the directory.
#
#   tests/bench/run_stream_bench.sh [BUILD_DIR] [bench_stream options]
#
# BUILD_DIR defaults to <repo>/build (KVD_BUILD_DIR also works). Options go to
# bench_stream, e.g. --sizes 1,4,16,64 --reps 20 --csv out.csv (see --help);
# KVDEPOTD_ARGS adds kvdepotd options (e.g. "--durability none"), REDIS_ARGS
# options of the Redis without persistence.
# Needs: kvdepotd and bench_stream built (bench_stream needs libhiredis-dev),
# redis-server (package redis-server).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${KVD_BUILD_DIR:-$root/build}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    build=$1
    shift
fi
kvdepotd=${KVDEPOTD:-$build/service/kvdepotd}
bench=${BENCH_STREAM:-$build/tests/bench_stream}
redis_server=${REDIS_SERVER:-$(command -v redis-server || true)}
# shellcheck source=servers.sh
. "$here/servers.sh"
bench_die() { echo "run_stream_bench: $*" >&2; exit 1; }

[ -x "$kvdepotd" ] || bench_die "kvdepotd not found at $kvdepotd (build it first)"
[ -x "$bench" ] || bench_die "bench_stream not found at $bench (needs libhiredis-dev; build target bench_stream)"
[ -n "$redis_server" ] || bench_die "redis-server not found (Debian package redis-server)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvd-stream-bench.XXXXXX")
kv_pid=""
redis_pid=""
redis_aof_pid=""
cleanup() {
    bench_stop_pid "$kv_pid" kvdepotd
    bench_stop_pid "$redis_pid" redis-server
    bench_stop_pid "$redis_aof_pid" redis-server
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# shellcheck disable=SC2086
bench_start_kvdepotd kv "$tmp/kv" "$kvdepotd" ${KVDEPOTD_ARGS:-}
# shellcheck disable=SC2086
bench_start_redis redis "$tmp/redis" "$redis_server" ${REDIS_ARGS:-}
bench_start_redis redis_aof "$tmp/redis-aof" "$redis_server" --appendonly yes --appendfsync no

echo "run_stream_bench: kvdepotd on 127.0.0.1:$kv_port, redis-server on 127.0.0.1:$redis_port" \
     "(with an append-only file on 127.0.0.1:$redis_aof_port)," \
     "$(nproc) CPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
timeout 3600 "$bench" --kvdepot "127.0.0.1:$kv_port" --redis "127.0.0.1:$redis_port" \
    --redis-aof "127.0.0.1:$redis_aof_port" --kvdepot-pid "$kv_pid" --redis-pid "$redis_pid" \
    --redis-aof-pid "$redis_aof_pid" "$@" || status=$?
if [ "$status" -ne 0 ]; then
    echo "run_stream_bench: bench_stream failed ($status); kvdepotd log tail:" >&2
    tail -n 20 "$tmp/kv/kvdepotd.log" >&2 || true
fi
exit "$status"
