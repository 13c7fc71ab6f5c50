#!/usr/bin/env bash
# kvdepot side by side with the systems users would pick instead, on this
# machine, over loopback, the same payloads, in one run:
#
#   put/get of KV-cache objects (1-64 MiB of f16 K+V)
#     kvdepot raw (default durability "spill"), raw with --durability none,
#     INT2 coded by the server, INT2 pages coded by the client
#                                  C client (libkvdepot), tests/bench/bench_stream
#     Redis                        Debian redis-server, hiredis, same program
#     Mooncake Store               PyPI mooncake-transfer-engine-non-cuda: its
#                                  master, a store node (mooncake_client) and a
#                                  store client over TCP (peers.py)
#     LMCache storage server       PyPI lmcache (python -m lmcache.v1.server ... cpu),
#                                  through its wire protocol classes (peers.py)
#   PQ top-k search on the same codes and queries
#     kvdepot (tests/bench/bench_pq), Debian FAISS 1.7.3 (python3-faiss,
#     built without SIMD) and PyPI faiss-cpu (the AVX2/AVX-512 build users run)
#
#   tests/bench/peers/run_peers.sh [BUILD_DIR] [--quick] [--skip NAME,...] [--out DIR]
#
# --skip takes mooncake, lmcache, faiss. --quick: few repetitions and small
# memory figures, to check the script, not to quote. Results (CSV, the
# Markdown tables, server logs) go to --out (default: peers-results-<date>).
#
# It installs what it needs: Debian packages through apt (redis-server,
# libhiredis-dev, python3-venv, python3-faiss, libibverbs1 for Mooncake's
# binaries) and the PyPI packages, pinned below, into throwaway virtual
# environments under a temporary directory (LMCache pulls PyTorch with its
# CUDA libraries: about 6 GB and several minutes; it runs on the CPU). Set
# PEERS_ENV=DIR to keep and reuse the environments between runs. Not part of
# the test suite.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../../.." && pwd)
# shellcheck source=../servers.sh
. "$here/../servers.sh"
bench_die() { echo "run_peers: $*" >&2; exit 1; }

MOONCAKE_PKG=mooncake-transfer-engine-non-cuda==0.3.13.post1
FAISS_PKG=faiss-cpu==1.15.1
NUMPY_PKG=numpy==2.2.6
LMCACHE_PKGS=(lmcache==0.5.6 torch==2.15.0 numpy==2.2.6)

build=${KVD_BUILD_DIR:-$root/build}
quick=0
skip=""
out=""
while [ $# -gt 0 ]; do
    case "$1" in
    --quick) quick=1 ;;
    --skip) skip=$2; shift ;;
    --out) out=$2; shift ;;
    -h|--help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) bench_die "unknown option $1" ;;
    *) build=$1 ;;
    esac
    shift
done
skipped() { case ",$skip," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
out=${out:-$PWD/peers-results-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)

if [ "$quick" = 1 ]; then
    stream_opts=(--sizes 1,64 --reps 3 --mem-mib 64)
    pq_reps=3
else
    stream_opts=(--sizes 1,4,16,64 --mem-mib 1024)
    pq_reps=30
fi

# ---- what is needed -------------------------------------------------------
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
need=()
for p in build-essential cmake redis-server libhiredis-dev python3-venv python3-faiss \
         libibverbs1 iproute2; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "run_peers: installing ${need[*]}" >&2
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${need[@]}" >/dev/null
fi
"$root/deploy/dev.sh" deps >/dev/null
[ -f "$build/CMakeCache.txt" ] || cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "$(nproc)" --target kvdepotd bench_stream bench_pq >/dev/null
kvdepotd=$build/service/kvdepotd
stream=$build/tests/bench_stream
[ -x "$stream" ] || bench_die "bench_stream was not built (libhiredis-dev?)"

work=$(mktemp -d "${TMPDIR:-/tmp}/kvd-peers.XXXXXX")
envs=${PEERS_ENV:-$work/env}
pids=()
cleanup() {
    local p
    for p in "${pids[@]}"; do bench_stop_pid "$p" server; done
    rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
started() { pids+=("$1"); }
stop_all() {
    local p
    for p in "${pids[@]}"; do bench_stop_pid "$p" server; done
    pids=()
}

# Debian's interpreter: python3-faiss is there, and the venvs build on it.
py=/usr/bin/python3
venv() { # dir packages...
    local dir=$1
    shift
    if [ ! -x "$dir/bin/python" ]; then
        echo "run_peers: installing $* into $dir" >&2
        "$py" -m venv "$dir"
        "$dir/bin/pip" install -q --disable-pip-version-check "$@" >"$out/pip-$(basename "$dir").log" 2>&1 ||
            { tail -n 20 "$out/pip-$(basename "$dir").log" >&2; bench_die "pip install $* failed"; }
    fi
}
venv "$envs/peers" "$NUMPY_PKG" "$FAISS_PKG" "$MOONCAKE_PKG"
skipped lmcache || venv "$envs/lmcache" "${LMCACHE_PKGS[@]}"

{
    echo "date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "machine: $(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) CPUs," \
         "$(free -g | awk '/^Mem:/ {print $2}') GiB, $(uname -r)"
    echo "cpu flags: $(grep -o -w 'avx2\|avx512f\|avx512_vbmi' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "kvdepot: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')," \
         "$("$kvdepotd" --version 2>/dev/null | head -n 1)"
    echo "redis: $(redis-server --version | head -n 1)"
    echo "peers: $NUMPY_PKG $FAISS_PKG $MOONCAKE_PKG ${LMCACHE_PKGS[*]}; Debian python3-faiss" \
         "$(dpkg-query -W -f='${Version}' python3-faiss)"
} | tee "$out/machine.txt"

# ---- put/get ---------------------------------------------------------------
bench_start_redis redis "$work/redis" "$(command -v redis-server)"
started "$redis_pid"
run_stream() { # csv-name label kvdepotd-args systems
    local name=$1 label=$2 args=$3 systems=$4
    # shellcheck disable=SC2086
    bench_start_kvdepotd kv "$work/kv-$name" "$kvdepotd" $args
    echo "run_peers: bench_stream $systems ($label)" >&2
    local sys_opts=(--systems "$systems" --kvdepot-pid "$kv_pid")
    case "$systems" in *redis*) sys_opts+=(--redis-pid "$redis_pid") ;; esac
    "$stream" --kvdepot "127.0.0.1:$kv_port" --redis "127.0.0.1:$redis_port" \
        "${sys_opts[@]}" "${stream_opts[@]}" --csv "$out/stream-$name.csv" >"$out/stream-$name.txt" ||
        { cat "$out/stream-$name.txt"; tail -n 20 "$work/kv-$name/kvdepotd.log" >&2; bench_die "bench_stream failed"; }
    cp "$work/kv-$name/kvdepotd.log" "$out/kvdepotd-$name.log"
    bench_stop_pid "$kv_pid" kvdepotd
    if [ -n "$label" ]; then
        sed -i "s/^kvdepot raw,/kvdepot raw ($label),/" "$out/stream-$name.csv"
    fi
}
# A fresh server for each kvdepot configuration, so that each memory figure
# starts from an empty process.
run_stream raw "" "" raw,redis
run_stream raw-none "durability none" "--durability none" raw
run_stream int2 "" "" int2
run_stream int2-pages "" "" int2-pages
csvs=("$out"/stream-*.csv)
stop_all # Redis

if ! skipped mooncake; then
    mdir=$work/mooncake
    mkdir -p "$mdir"
    mport=$(bench_free_port)
    mmeta=$(bench_free_port)
    bin=$envs/peers/bin
    # The lease keeps a just-read object from removal; 2 s instead of 10 s
    # lets the benchmark delete its objects without waiting.
    "$bin/mooncake_master" --port "$mport" --metrics_port "$(bench_free_port)" \
        --enable_http_metadata_server=true --http_metadata_server_host 127.0.0.1 \
        --http_metadata_server_port "$mmeta" --default_kv_lease_ttl 2000 \
        >"$mdir/master.log" 2>&1 &
    master_pid=$!
    started "$master_pid"
    bench_wait_port "$mport" "$master_pid" "$mdir/master.log"
    bench_wait_port "$mmeta" "$master_pid" "$mdir/master.log"
    "$bin/mooncake_client" --master_server_address "127.0.0.1:$mport" \
        --metadata_server "http://127.0.0.1:$mmeta/metadata" --global_segment_size "4 GB" \
        --host 127.0.0.1 --port "$(bench_free_port)" --protocol tcp >"$mdir/client.log" 2>&1 &
    node_pid=$!
    started "$node_pid"
    sleep 3
    kill -0 "$node_pid" 2>/dev/null || { tail -n 20 "$mdir/client.log" >&2; bench_die "mooncake_client exited"; }
    echo "run_peers: Mooncake Store" >&2
    "$bin/python" "$here/peers.py" mooncake --master "127.0.0.1:$mport" \
        --metadata "http://127.0.0.1:$mmeta/metadata" --pids "$node_pid,$master_pid" \
        "${stream_opts[@]}" --csv "$out/peer-mooncake.csv" 2>"$out/peer-mooncake.log" ||
        { tail -n 20 "$out/peer-mooncake.log" >&2; bench_die "the Mooncake benchmark failed"; }
    csvs+=("$out/peer-mooncake.csv")
    stop_all
fi

if ! skipped lmcache; then
    lport=$(bench_free_port)
    "$envs/lmcache/bin/python" -m lmcache.v1.server 127.0.0.1 "$lport" cpu \
        >"$out/lmcache-server.log" 2>&1 &
    started $!
    bench_wait_port "$lport" $! "$out/lmcache-server.log" 120
    lpid=$(bench_listener_pid "$lport")
    [ -n "$lpid" ] || bench_die "no pid listens on LMCache's port $lport"
    started "$lpid"
    echo "run_peers: LMCache storage server" >&2
    "$envs/lmcache/bin/python" "$here/peers.py" lmcache --addr "127.0.0.1:$lport" --pid "$lpid" \
        "${stream_opts[@]}" --csv "$out/peer-lmcache.csv" 2>"$out/peer-lmcache.log" ||
        { tail -n 20 "$out/peer-lmcache.log" >&2; bench_die "the LMCache benchmark failed"; }
    csvs+=("$out/peer-lmcache.csv")
fi
stop_all

"$py" "$here/peers.py" report "${csvs[@]}" | tee "$out/putget.md"

# ---- PQ search ---------------------------------------------------------------
if ! skipped faiss; then
    echo "run_peers: PQ search" >&2
    # Debian's FAISS and PyPI's beside kvdepot, in turn, 3 rounds; PyPI's
    # at its AVX2 level and at the CPU's best (AVX-512 where there is one)
    FAISS_PYTHON="$envs/peers/bin/python" FAISS_LEVELS="AVX2 auto" PQ_OUT="$out" \
        "$here/../run_pq_bench.sh" "$build" "$pq_reps" 3 | tee "$out/pq.md"
fi
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/machine.txt"
echo "run_peers: results in $out" >&2
