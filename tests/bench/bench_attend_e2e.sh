#!/bin/bash
# Attend over gRPC on the GPU, end to end, against "Read fp16 + PyTorch SDPA
# on the GPU" (the table of issue "The GPU data path"):
#
#   tests/bench/bench_attend_e2e.sh BUILD_DIR [--quick]
#
# Runs kvdepotd from BUILD_DIR (KVDEPOT_DEVICE, default cuda; the device
# tier KVDEPOT_DEVICE_TIER_BYTES, default 8GiB) with bench_attend_e2e as its
# client on the same machine, then bench_attend_sdpa.py for the alternative.
# Tables on stdout; CSV and logs under $OUT (default /tmp/kvd-bench).
# KVDEPOT_DEVICE=cpu runs the same on the CPU.
set -euo pipefail
build=${1:?usage: $0 BUILD_DIR [--quick]}
shift
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/kvd-bench}
mkdir -p "$out"
export KVDEPOT_DEVICE=${KVDEPOT_DEVICE:-cuda}
export KVDEPOT_DEVICE_TIER_BYTES=${KVDEPOT_DEVICE_TIER_BYTES:-8GiB}
"$build/tests/bench_attend_e2e" "$build/service/kvdepotd" "$@" --csv "$out/attend_e2e.csv" |
    tee "$out/attend_e2e.txt"
echo
python3 "$here/bench_attend_sdpa.py" --csv "$out/attend_e2e.csv" "$@" | tee "$out/attend_sdpa.txt"
