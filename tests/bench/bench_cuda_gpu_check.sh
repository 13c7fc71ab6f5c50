#!/bin/sh
# One call on a GPU machine: build the CUDA backend for the device (sm_90:
# H100/H200), run the comparison tests (every op, then decode attention),
# then the benchmarks (PQ, K-means, encode, decode attention, each next to
# PyTorch where torch is importable), then kvdepotd itself on the GPU: the
# end-to-end compute tests with --device cuda and the Attend-over-gRPC
# benchmark against Read fp16 + PyTorch SDPA (bench_attend_e2e.sh). Logs and CSV go to $OUT (default: a
# temporary directory); the last lines printed are the summary tables.
#
#   tests/bench/bench_cuda_gpu_check.sh [--quick] [--profile] [--sanitize]
#
# --profile adds Nsight Compute runs (ncu, clocks left alone): the time of
# every K-means kernel (ncu_kmeans.txt) and, for one launch of each decode-
# attention form at 8 x 16K, speed of light, occupancy and warp stalls
# (ncu_attn_FORM.txt). --sanitize adds compute-sanitizer: memcheck over the
# comparison tests (memcheck_*.txt) and racecheck over the kernels that share
# work through shared memory (racecheck.txt). Each takes a minute or two.
#
# KVD_CUDA_ARCH overrides the architecture (default 90). KVD_GPU_BUILD names
# a build made elsewhere (tests/bench/gpu_pack.sh packs one, with the shared
# libraries the GPU machine lacks): nothing is built then. Each step stops
# after KVD_GPU_STEP_S seconds (default 300), so one hang loses no other step.
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
jobs=$(nproc 2>/dev/null || echo 2)
step() { timeout -k 5 "${KVD_GPU_STEP_S:-300}" "$@"; }
quick='' profile=0 sanitize=0
for a in "$@"; do
    case $a in
    --quick) quick=--quick ;;
    --profile) profile=1 ;;
    --sanitize) sanitize=1 ;;
    *) echo "usage: $0 [--quick] [--profile] [--sanitize]" >&2; exit 2 ;;
    esac
done

nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,driver_version --format=csv > "$out/gpu.txt" 2>&1
if [ -n "${KVD_GPU_BUILD:-}" ]; then
    build=$(cd "$KVD_GPU_BUILD" && pwd)
else
    build="$root/build-cuda"
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_CUDA_ARCHITECTURES="${KVD_CUDA_ARCH:-90}" > "$out/cmake.log" 2>&1 &&
        cmake --build "$build" -j"$jobs" \
            --target test_cuda_ops test_cuda_backend test_cuda_attn bench_cuda bench_cuda_attn \
            kvdepotd e2e_compute bench_attend_e2e \
            > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
fi

(cd "$build" && step ./tests/test_cuda_backend && step ./tests/test_cuda_ops) > "$out/tests.log" 2>&1
trc=$?
(cd "$build" && KVD_CUDA_KMEANS_EXACT=1 step ./tests/test_cuda_ops) > "$out/tests_exact.log" 2>&1
erc=$?
(cd "$build" && step ./tests/test_cuda_attn) > "$out/tests_attn.log" 2>&1
arc=$?
OUT="$out" step sh "$root/tests/bench/bench_cuda_run.sh" "$build" $quick > "$out/bench.log" 2>&1
brc=$?
# kvdepotd serving from the GPU: the compute e2e tests, then Attend over gRPC
erc2=0
for t in device attend codecs lse_merge search append_pages; do
    (cd "$build" && KVDEPOT_DEVICE=cuda step ./tests/e2e_compute ./service/kvdepotd $t) \
        >> "$out/tests_e2e_gpu.log" 2>&1 || erc2=1
done
OUT="$out" step bash "$root/tests/bench/bench_attend_e2e.sh" "$build" $quick > "$out/attend_e2e.log" 2>&1
e2rc=$?
if [ $profile = 1 ]; then
    (cd "$build" && step ncu --clock-control none --metrics gpu__time_duration.sum \
        --print-summary per-kernel --launch-count 2000 ./tests/bench_cuda --only kmeans) \
        > "$out/ncu_kmeans.txt" 2>&1
    for f in fp16 int2 int4 vq; do
        (cd "$build" && step ncu --clock-control none --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section LaunchStats --launch-skip 3 --launch-count 4 \
            ./tests/bench_cuda_attn --form $f --row 8:16384) > "$out/ncu_attn_$f.txt" 2>&1
    done
fi
if [ $sanitize = 1 ]; then
    for t in test_cuda_backend test_cuda_ops; do
        (cd "$build" && step compute-sanitizer --tool memcheck ./tests/$t) \
            > "$out/memcheck_$t.txt" 2>&1
    done
    (cd "$build" && step compute-sanitizer --tool racecheck --racecheck-report hazard \
        --kernel-regex kns='seed_step|multi_lloyd|select|bucket|hadamard|vq|int_kernel' \
        ./tests/test_cuda_ops) > "$out/racecheck.txt" 2>&1
fi

echo "== $(tail -n +2 "$out/gpu.txt" | head -1)"
echo "== comparison tests (rc $trc; exact K-means rc $erc; attention rc $arc)"
grep -E "FAILED|passed|skipped" "$out/tests.log" | tail -12
grep -E "passed" "$out/tests_exact.log" | tail -1
grep -E "FAILED|passed|skipped" "$out/tests_attn.log" | tail -12
echo "== kvdepotd --device cuda, e2e compute tests (rc $erc2)"
grep -E "^(PASS|FAIL)|backend|pages attended" "$out/tests_e2e_gpu.log" | tail -12
echo "== benchmarks (rc $brc), full output in $out"
tail -60 "$out/bench.log"
echo "== Attend over gRPC vs Read fp16 + SDPA (rc $e2rc)"
cat "$out/attend_sdpa.txt" 2>/dev/null || tail -20 "$out/attend_e2e.log"
if [ $profile = 1 ]; then
    echo "== ncu: K-means kernels (us per launch), decode attention at 8 x 16K"
    grep -E "Invocations|gpu__time" "$out/ncu_kmeans.txt" | sed 's/([^)]*)//g' | cut -c1-120
    for f in fp16 int2 int4 vq; do
        grep -E "^  [a-z_<]|Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued" \
            "$out/ncu_attn_$f.txt" | sed 's/(long long[^)]*)//' | cut -c1-120 | head -6
    done
fi
if [ $sanitize = 1 ]; then
    echo "== compute-sanitizer"
    grep -H -E "ERROR SUMMARY|RACECHECK SUMMARY|passed" "$out"/memcheck_*.txt "$out/racecheck.txt"
fi
