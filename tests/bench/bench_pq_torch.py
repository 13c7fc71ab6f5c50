#!/usr/bin/env python3
"""PQ top-k search in plain PyTorch, the way the PQCache paper does it, on
the same grid as bench_cuda's single-search table (n = 4K..1M tokens,
m x b in {2x6, 4x8, 8x4, 16x8}, k = 64..2048, D = 128, G = 4 query heads
summed, 4 sink and 64 window tokens forced).

Per search: one einsum for the (m, 2^b) lookup table, a gather of the table
with the codes, a sum over sub-spaces, torch.topk over the middle tokens,
and a cat with the forced tokens. Codes are kept as int64 on the device (a
gather index must be int64; converting per search would add a pass), which
is what a PyTorch implementation holds.

Prints a table and, with --csv FILE, rows "table,n,mxb,k,us" that
bench_cuda_run.sh joins with bench_cuda's. Exits 0 with a message when
torch or a GPU is missing.
"""
import argparse
import statistics
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_pq_torch: torch is not importable; skipped.")
        return 0
    if not torch.cuda.is_available():
        print("bench_pq_torch: no CUDA device; skipped.")
        return 0
    dev = torch.device("cuda")
    D, G, sink, window = 128, 4, 4, 64
    ns = [16384, 262144] if args.quick else [4096, 16384, 65536, 262144, 1048576]
    ks = [64, 256, 1024, 2048]
    mbs = [(2, 6), (4, 8), (8, 4), (16, 8)]
    gen = torch.Generator(device=dev)
    gen.manual_seed(1)
    rows = []

    def search(cent, codes_t, q, k, n):
        m, _, dsub = cent.shape
        qbar = q.sum(0).view(m, dsub)
        lut = torch.einsum("mcd,md->mc", cent, qbar)          # (m, 2^b)
        scores = lut.gather(1, codes_t).sum(0)                 # (n,)
        mid = scores[sink:n - window]
        top = torch.topk(mid, min(k, mid.numel())).indices + sink
        forced = torch.cat([torch.arange(sink, device=dev),
                            torch.arange(n - window, n, device=dev)])
        idx = torch.cat([top, forced])
        return idx, scores[idx]

    def timeit(fn, reps=20, trials=7):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(trials):
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(reps):
                fn()
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / reps * 1e3)  # us
        return statistics.median(times)

    print(f"## PQ search in plain PyTorch {torch.__version__} on "
          f"{torch.cuda.get_device_name(0)}: D={D} G={G} sink={sink} window={window}")
    print(f"{'n':>8} {'mxb':>5} {'k':>5} {'us':>10}")
    for m, b in mbs:
        K, dsub = 1 << b, D // m
        cent = torch.randn(m, K, dsub, device=dev, generator=gen)
        q = torch.randn(G, D, device=dev, generator=gen)
        for n in ns:
            codes = torch.randint(0, K, (n, m), device=dev, generator=gen, dtype=torch.uint8)
            codes_t = codes.t().contiguous().long()            # (m, n) gather index
            for k in ks:
                us = timeit(lambda: search(cent, codes_t, q, k, n))
                print(f"{n:>8} {m}x{b:<3} {k:>5} {us:>10.1f}")
                rows.append(("pq_search", n, f"{m}x{b}", k, us))
            del codes, codes_t
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("table,n,mxb,k,us\n")
            for r in rows:
                f.write("%s,%d,%s,%d,%.3f\n" % r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
