#!/bin/sh
# Run the GPU benchmarks and print the PQ search table of kvdepot next to
# plain PyTorch (when torch is importable), with the speed-up per row.
#
#   tests/bench/bench_cuda_run.sh [BUILD_DIR] [--quick]
#
# BUILD_DIR defaults to ./build-cuda; bench_cuda must be built there
# (cmake --build BUILD_DIR --target bench_cuda). Full tables and CSV go to
# $OUT (or a temporary directory) as bench_cuda.txt, bench_cuda.csv,
# bench_pq_torch.txt, bench_pq_torch.csv.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
build=${1:-build-cuda}
quick=${2:-}
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"

"$build/tests/bench_cuda" $quick --csv "$out/bench_cuda.csv" | tee "$out/bench_cuda.txt"
python3 "$here/bench_pq_torch.py" $quick --csv "$out/bench_pq_torch.csv" | tee "$out/bench_pq_torch.txt"

python3 - "$out/bench_cuda.csv" "$out/bench_pq_torch.csv" <<'PY'
import csv, os, sys
cu, tp = sys.argv[1], sys.argv[2]
if not os.path.exists(cu) or os.path.getsize(cu) == 0:
    print("\n(no kvdepot rows: no GPU?)")
    sys.exit(0)
torch = {}
if os.path.exists(tp):
    for r in csv.DictReader(open(tp)):
        torch[(r["n"], r["mxb"], r["k"])] = float(r["us"])
print("\n## PQ search: kvdepot CUDA vs plain PyTorch (target: >= 5x)")
print("%8s %5s %5s %10s %7s %10s %8s" % ("n", "mxb", "k", "kvd us", "%HBM", "torch us", "speedup"))
for r in csv.DictReader(open(cu)):
    if r["table"] != "pq_search":
        continue
    t = torch.get((r["n"], r["mxb"], r["k"]))
    print("%8s %5s %5s %10.1f %6.1f%% %10s %8s" % (
        r["n"], r["mxb"], r["k"], float(r["us"]), float(r["pct_hbm"]),
        "%.1f" % t if t else "-", "%.1fx" % (t / float(r["us"])) if t else "-"))
PY
echo "full output in $out"
