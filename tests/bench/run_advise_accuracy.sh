#!/usr/bin/env bash
# Codec advice on the accuracy data set (docs/kernels-accuracy.md): for each
# error budget, Calibrate's recommended K/V pair next to the best pair of an
# exhaustive sweep of every K x V pair, both measured with both sides coded.
# The sample is tests/bench/accuracy.c's (KVD_ACC_DUMP): its 4096-token
# calibration draw, then a 1024-token evaluation draw that Calibrate holds
# out; the decode queries of the evaluation draw attend all of it.
#
# Usage: run_advise_accuracy.sh BUILD_DIR [BUDGET...]
set -euo pipefail
build=$(cd "${1:?usage: run_advise_accuracy.sh BUILD_DIR [BUDGET...]}" && pwd)
shift
budgets=("$@")
[ ${#budgets[@]} -gt 0 ] || budgets=(0.001 0.003 0.01 0.03 0.1 0.3)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-advise-XXXXXX")
pid=
cleanup() {
    if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
KVD_ACC_DUMP="$work" "$build/tests/kvd_accuracy"
"$build/service/kvdepotd" --listen 127.0.0.1:0 --data-dir "$work/data" --port-file "$work/port" \
    --metrics-listen "" >"$work/server.log" 2>&1 &
pid=$!
for _ in $(seq 1 200); do [ -s "$work/port" ] && break; sleep 0.05; done
k() { "$build/client/kvdepot" --addr "127.0.0.1:$(cat "$work/port")" "$@"; }
k model put acc --layers 1 --kv-heads 2 --q-heads 8 --head-dim 128 --dtype f16 >/dev/null
echo "| budget | recommended K | recommended V | bits/value | error | exhaustive K | exhaustive V | bits/value | error | seconds |"
echo "|---:|---|---|---:|---:|---|---|---:|---:|---:|"
for b in "${budgets[@]}"; do
    t0=$(date +%s.%N)
    out=$(k calibrate --model acc --tokens 5120 --file "$work/kv.bin" --q "$work/q.bin" --vq d4b8 \
        --svd --seed 1 --error-budget "$b" --eval-queries 1 --exhaustive)
    t1=$(date +%s.%N)
    echo "$out" | sed -n 's/^  layer 0: --k \([^ ]*\) --v \([^ ]*\)  (\([^ ]*\) bits\/value, error \([^)]*\)); exhaustive: --k \([^ ]*\) --v \([^ ]*\)  (\([^ ]*\) bits\/value, error \([^)]*\))$/| '"$b"' | \1 | \2 | \3 | \4 | \5 | \6 | \7 | \8 | '"$(echo "$t1 - $t0" | bc)"' |/p'
done
echo
echo "Candidates at the last budget (single side coded, the other exact):"
echo "$out" | sed -n 's/^    \([kv]\) \(.*\)/    \1 \2/p'
