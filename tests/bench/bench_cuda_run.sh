#!/bin/sh
# Run the GPU benchmarks and print the PQ search table and the decode
# attention table of kvdepot next to plain PyTorch (when torch is
# importable), with the speed-up per row.
#
#   tests/bench/bench_cuda_run.sh [BUILD_DIR] [--quick]
#
# BUILD_DIR defaults to ./build-cuda; bench_cuda and bench_cuda_attn must be
# built there (cmake --build BUILD_DIR --target bench_cuda bench_cuda_attn).
# Full tables and CSV go to $OUT (or a temporary directory) as
# bench_cuda.txt/.csv, bench_pq_torch.txt/.csv, bench_cuda_attn.txt/.csv and
# bench_attn_torch.txt/.csv.
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

# Decode attention: kvdepot (fp16, INT2, INT4, VQ) and PyTorch SDPA (fp16).
"$build/tests/bench_cuda_attn" $quick --csv "$out/bench_cuda_attn.csv" | tee "$out/bench_cuda_attn.txt"
python3 "$here/bench_attn_torch.py" $quick --csv "$out/bench_attn_torch.csv" | tee "$out/bench_attn_torch.txt"

python3 - "$out/bench_cuda_attn.csv" "$out/bench_attn_torch.csv" <<'PY'
import csv, os, sys
cu, tp = sys.argv[1], sys.argv[2]
if not os.path.exists(cu) or os.path.getsize(cu) == 0:
    print("\n(no kvdepot attention rows: no GPU?)")
    sys.exit(0)
torch = {}
if os.path.exists(tp):
    for r in csv.DictReader(open(tp)):
        torch[(r["batch"], r["tokens"])] = float(r["us"])
rows = {}
for r in csv.DictReader(open(cu)):
    rows.setdefault((r["batch"], r["tokens"]), {})[r["form"]] = r
print("\n## Decode attention, 32 q / 8 kv heads x 128: kvdepot CUDA vs PyTorch SDPA fp16")
print("targets: fp16 >= 70% HBM at >= 16K; int2, vq >= 3x fp16 and int4 >= 2x at >= 16K, batch >= 8; none slower than fp16 at 1K")
print("%6s %8s | %9s %6s | %9s %6s | %9s %6s | %9s %6s | %9s %8s" % (
    "batch", "tokens", "fp16 us", "%HBM", "int2 us", "x", "int4 us", "x", "vq us", "x", "torch us", "fp16 vs"))
def cell(d, f):
    r = d.get(f)
    return ("%9.1f" % float(r["us"]), "%5.2fx" % float(r["speedup"])) if r else ("%9s" % "-", "%6s" % "-")
for key in sorted(rows, key=lambda k: (int(k[0]), int(k[1]))):
    d = rows[key]
    f16 = d.get("fp16")
    t = torch.get(key)
    line = "%6s %8s | %9s %5s%% |" % (key[0], key[1], "%.1f" % float(f16["us"]) if f16 else "-",
                                       "%.1f" % float(f16["pct_hbm"]) if f16 else "-")
    for f in ("int2", "int4", "vq"):
        a, b = cell(d, f)
        line += " %s %s |" % (a, b)
    line += " %9s %8s" % ("%.1f" % t if t else "-",
                          "%.2fx" % (t / float(f16["us"])) if (t and f16) else "-")
    print(line)
PY
echo "full output in $out"
