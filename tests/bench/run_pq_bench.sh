#!/bin/sh
# PQ top-k search: kvdepot vs FAISS on the same codes and queries, in one run.
#   tests/bench/run_pq_bench.sh [BUILD_DIR] [REPS]
# Builds bench_pq in BUILD_DIR (default: build), runs it (it checks its
# results against brute force and dumps its inputs), then runs FAISS
# (Debian python3-faiss, /usr/bin/python3) on the dumped inputs and prints
# one table with both and the ratios.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
reps=${2:-30}
cmake --build "$build" --target bench_pq -j2 >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$build/tests/bench_pq" --reps "$reps" --csv "$work/ours.csv" --dump "$work"
/usr/bin/python3 "$here/pq_faiss.py" "$work" "$work/ours.csv" "$reps"
