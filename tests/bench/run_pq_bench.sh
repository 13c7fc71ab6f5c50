#!/bin/sh
# PQ top-k search: kvdepot vs FAISS on the same codes and queries, in one run.
#   tests/bench/run_pq_bench.sh [BUILD_DIR] [REPS]
# Builds bench_pq in BUILD_DIR (default: build), runs it (it checks its
# results against brute force and dumps its inputs), then runs Debian's FAISS
# (python3-faiss, /usr/bin/python3: 1.7.3 built without SIMD) on the dumped
# inputs and prints one table with both and the ratios. The SIMD build users
# run (PyPI faiss-cpu) is measured beside it by tests/bench/peers/run_peers.sh.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
reps=${2:-30}
cmake --build "$build" --target bench_pq -j2 >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$build/tests/bench_pq" --reps "$reps" --csv "$work/ours.csv" --dump "$work"
/usr/bin/python3 "$here/pq_faiss.py" measure "$work" "$reps" "$work/faiss-debian.csv"
/usr/bin/python3 "$here/pq_faiss.py" report "$work/ours.csv" "$work/faiss-debian.csv"
