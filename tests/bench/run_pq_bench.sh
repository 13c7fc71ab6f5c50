#!/bin/sh
# PQ top-k search: kvdepot vs FAISS on the same codes and queries, in one run.
#   tests/bench/run_pq_bench.sh [BUILD_DIR] [REPS] [ROUNDS]
# Builds bench_pq in BUILD_DIR (default: build), runs it (it checks its
# results against brute force and dumps its inputs), then runs Debian's FAISS
# (python3-faiss, /usr/bin/python3: 1.7.3 built without SIMD) on the dumped
# inputs and prints one table with both and the ratios. FAISS_PYTHON=PY adds
# the FAISS that interpreter imports (a virtual environment with PyPI's
# faiss-cpu, the SIMD build users run; tests/bench/peers/run_peers.sh makes
# one); without python3-faiss, that one alone. The systems run in turn
# ROUNDS times (default 3) and each case keeps its best round: this
# machine's speed may drift over seconds. FAISS_LEVELS="AVX2 auto"
# measures FAISS_PYTHON's FAISS at each of these SIMD levels (a build with
# dynamic dispatch, as PyPI's faiss-cpu is from 1.12 on, holds several and
# otherwise runs the CPU's best: auto), each as one system. PQ_OUT=DIR keeps every
# round's CSVs and bench_pq's output there.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build}
reps=${2:-30}
rounds=${3:-3}
cmake --build "$build" --target bench_pq -j2 >/dev/null
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ours='' debian='' pypi=''
have_debian=1
if ! /usr/bin/python3 -c 'import faiss' 2>/dev/null; then
    [ -n "${FAISS_PYTHON:-}" ] ||
        { echo "run_pq_bench: no FAISS: install python3-faiss, or set FAISS_PYTHON" >&2; exit 1; }
    echo "run_pq_bench: Debian's FAISS (python3-faiss) is not installed: $FAISS_PYTHON's only" >&2
    have_debian=0
fi
r=1
while [ "$r" -le "$rounds" ]; do
    dump=
    [ "$r" -gt 1 ] || dump="--dump $work"
    # shellcheck disable=SC2086 # $dump: an option and its argument, or nothing
    "$build/tests/bench_pq" --reps "$reps" --csv "$work/ours.$r.csv" $dump \
        >"$work/ours.$r.txt"
    ours=${ours:+$ours,}$work/ours.$r.csv
    if [ "$have_debian" = 1 ]; then
        /usr/bin/python3 "$here/pq_faiss.py" measure "$work" "$reps" "$work/faiss-debian.$r.csv"
        debian=${debian:+$debian,}$work/faiss-debian.$r.csv
    fi
    if [ -n "${FAISS_PYTHON:-}" ] && [ -z "${FAISS_LEVELS:-}" ]; then
        "$FAISS_PYTHON" "$here/pq_faiss.py" measure "$work" "$reps" "$work/faiss-pypi.$r.csv"
        pypi=${pypi:+$pypi,}$work/faiss-pypi.$r.csv
    fi
    i=0
    for lv in ${FAISS_PYTHON:+${FAISS_LEVELS:-}}; do
        i=$((i + 1))
        PQ_FAISS_SIMD=$lv "$FAISS_PYTHON" "$here/pq_faiss.py" measure "$work" "$reps" \
            "$work/faiss-pypi-$i.$r.csv"
    done
    r=$((r + 1))
done
# one argument per SIMD level: its rounds' CSVs, comma-separated
i=0
for lv in ${FAISS_PYTHON:+${FAISS_LEVELS:-}}; do
    i=$((i + 1))
    list='' r=1
    while [ "$r" -le "$rounds" ]; do
        list=${list:+$list,}$work/faiss-pypi-$i.$r.csv
        r=$((r + 1))
    done
    pypi=${pypi:+$pypi }$list
done
# shellcheck disable=SC2086 # $debian: one argument or nothing; $pypi: one a level
/usr/bin/python3 "$here/pq_faiss.py" report "$ours" $debian $pypi
[ -z "${PQ_OUT:-}" ] || { mkdir -p "$PQ_OUT" && cp "$work"/*.csv "$work"/*.txt "$PQ_OUT"/; }
