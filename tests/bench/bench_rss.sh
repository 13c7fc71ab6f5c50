#!/usr/bin/env bash
# kvdepotd's resident memory while it stores much more than its memory
# tiers: starts kvdepotd (small tiers) and redis-server (bench_stream needs
# one) on loopback in a temporary directory, puts STORE_MIB of 16 MiB raw
# objects with bench_stream's memory phase (then deletes them), samples the
# server's RSS every half second, and prints RSS over time against the
# memory formula's bound (tiers + 256 MiB; README "Memory").
#
#   tests/bench/bench_rss.sh [BUILD_DIR]
#
# TIER=16MiB (each tier), STORE_MIB=8 x both tiers by default (at least
# 2048), KVDEPOTD_ARGS adds kvdepotd options. Needs kvdepotd, bench_stream
# (libhiredis-dev) and redis-server.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-${KVD_BUILD_DIR:-$root/build}}
kvdepotd=$build/service/kvdepotd
bench=$build/tests/bench_stream
redis_server=$(command -v redis-server || true)
# shellcheck source=servers.sh
. "$here/servers.sh"
bench_die() { echo "bench_rss: $*" >&2; exit 1; }
[ -x "$kvdepotd" ] || bench_die "kvdepotd not found at $kvdepotd"
[ -x "$bench" ] || bench_die "bench_stream not found at $bench (needs libhiredis-dev)"
[ -n "$redis_server" ] || bench_die "redis-server not found (Debian package redis-server)"

tier=${TIER:-16MiB}
tier_mib=$(numfmt --from=iec-i "${tier%B}" | awk '{print int($1 / 1048576)}')
store_mib=${STORE_MIB:-$((16 * tier_mib > 2048 ? 16 * tier_mib : 2048))}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvd-rss-bench.XXXXXX")
kv_pid=""
redis_pid=""
cleanup() {
    bench_stop_pid "$kv_pid" kvdepotd
    bench_stop_pid "$redis_pid" redis-server
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# shellcheck disable=SC2086
bench_start_kvdepotd kv "$tmp/kv" "$kvdepotd" --device-tier-bytes "$tier" --host-tier-bytes "$tier" \
    ${KVDEPOTD_ARGS:-}
bench_start_redis redis "$tmp/redis" "$redis_server"
rss_mib() { awk '/^VmRSS/ {printf "%.0f", $2 / 1024}' "/proc/$1/status"; }
start_rss=$(rss_mib "$kv_pid")
bound=$((2 * tier_mib + 256))
echo "bench_rss: tiers $tier + $tier, storing $store_mib MiB of 16 MiB raw objects, $(nproc) CPUs," \
     "load $(cut -d' ' -f1-3 /proc/loadavg); RSS at start $start_rss MiB, bound (tiers + 256 MiB) $bound MiB"
"$bench" --kvdepot "127.0.0.1:$kv_port" --redis "127.0.0.1:$redis_port" --systems raw --sizes 1 \
    --reps 1 --mem-mib "$store_mib" --kvdepot-pid "$kv_pid" > "$tmp/bench.out" 2>&1 &
bpid=$!
t0=$(date +%s.%N)
peak=0
echo "| s | RSS MiB |"
echo "|---:|---:|"
n=0
while kill -0 "$bpid" 2>/dev/null; do
    r=$(rss_mib "$kv_pid")
    [ "$r" -gt "$peak" ] && peak=$r
    if [ $((n % 4)) -eq 0 ]; then
        printf '| %.1f | %s |\n' "$(echo "$(date +%s.%N) - $t0" | bc)" "$r"
    fi
    n=$((n + 1))
    sleep 0.5
done
wait "$bpid" || { cat "$tmp/bench.out" >&2; bench_die "bench_stream failed"; }
sleep 1
end_rss=$(rss_mib "$kv_pid")
echo "bench_rss: peak $peak MiB, after the deletes $end_rss MiB, bound $bound MiB:" \
     "$([ "$peak" -le "$bound" ] && echo within || echo "over by $((peak - bound)) MiB")"
