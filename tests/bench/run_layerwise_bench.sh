#!/usr/bin/env bash
# Layer-wise offload benchmark: starts kvdepotd on a free loopback port in a
# temporary directory, runs bench_layerwise (a simulated 32-layer forward
# pass putting each layer's K/V as it is computed, blocking and overlapped),
# prints its table, then stops the server and removes the directory.
#
#   tests/bench/run_layerwise_bench.sh [BUILD_DIR] [bench_layerwise options]
#
# Options go to bench_layerwise (--tokens 512,2048 --layer-ms 5,20 --reps 5);
# KVDEPOTD_ARGS adds kvdepotd options (e.g. "--durability none").
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${KVD_BUILD_DIR:-$root/build}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    build=$1
    shift
fi
kvdepotd=${KVDEPOTD:-$build/service/kvdepotd}
bench=${BENCH_LAYERWISE:-$build/tests/bench_layerwise}
# shellcheck source=servers.sh
. "$here/servers.sh"
bench_die() { echo "run_layerwise_bench: $*" >&2; exit 1; }

[ -x "$kvdepotd" ] || bench_die "kvdepotd not found at $kvdepotd (build it first)"
[ -x "$bench" ] || bench_die "bench_layerwise not found at $bench (build target bench_layerwise)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvd-layerwise-bench.XXXXXX")
kv_pid=""
cleanup() {
    bench_stop_pid "$kv_pid" kvdepotd
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# shellcheck disable=SC2086
bench_start_kvdepotd kv "$tmp/kv" "$kvdepotd" ${KVDEPOTD_ARGS:-}
echo "run_layerwise_bench: kvdepotd on 127.0.0.1:$kv_port, $(nproc) CPUs," \
     "load $(cut -d' ' -f1-3 /proc/loadavg)"
status=0
timeout 3600 "$bench" --address "127.0.0.1:$kv_port" "$@" || status=$?
if [ "$status" -ne 0 ]; then
    echo "run_layerwise_bench: bench_layerwise failed ($status); kvdepotd log tail:" >&2
    tail -n 20 "$tmp/kv/kvdepotd.log" >&2 || true
fi
exit "$status"
