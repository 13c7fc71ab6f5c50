#!/usr/bin/env bash
# Python package vs C client Read throughput: builds the kvdepot wheel into a
# temporary virtual environment (Debian's python3 with cffi and NumPy),
# starts kvdepotd on a free loopback port, runs bench_python_read.py (which
# runs bench_read_c in alternating rounds), then cleans up.
#
#   tests/bench/run_python_bench.sh [BUILD_DIR] [bench_python_read.py options]
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${KVD_BUILD_DIR:-$root/build}
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    build=$1
    shift
fi
build=$(cd "$build" && pwd)
kvdepotd=$build/service/kvdepotd
bench_c=$build/tests/bench_read_c
# shellcheck source=servers.sh
. "$here/servers.sh"
bench_die() { echo "run_python_bench: $*" >&2; exit 1; }
[ -x "$kvdepotd" ] || bench_die "kvdepotd not found at $kvdepotd (build it first)"
[ -x "$bench_c" ] || bench_die "bench_read_c not found at $bench_c (build target bench_read_c)"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvd-python-bench.XXXXXX")
kv_pid=""
cleanup() {
    bench_stop_pid "$kv_pid" kvdepotd
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

/usr/bin/python3 -m venv --system-site-packages "$tmp/venv"
cp -r "$root/client/python" "$tmp/src"
KVDEPOT_INCLUDE_DIR=$root/client/include KVDEPOT_LIB_DIR=$build/client \
    "$tmp/venv/bin/pip" wheel -q --no-build-isolation --no-deps --no-index -w "$tmp/wheel" "$tmp/src"
"$tmp/venv/bin/pip" install -q --no-deps --no-index "$tmp"/wheel/kvdepot-*.whl

bench_start_kvdepotd kv "$tmp/kv" "$kvdepotd" ${KVDEPOTD_ARGS:-}
echo "run_python_bench: kvdepotd on 127.0.0.1:$kv_port, $(nproc) CPUs," \
     "load $(cut -d' ' -f1-3 /proc/loadavg)"
cd "$tmp"
"$tmp/venv/bin/python" "$here/bench_python_read.py" "127.0.0.1:$kv_port" "$bench_c" "$@"
