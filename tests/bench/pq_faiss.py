#!/usr/bin/python3
"""FAISS side of the PQ search benchmark (run by run_pq_bench.sh).

Loads the centroids, codes and queries bench_pq dumped, puts the very same
centroids and codes into FAISS indexes (IndexPQ, 8-bit, and IndexPQFastScan
built from a 4-bit IndexPQ), times index.search(), checks that FAISS ranks
the same codes like a NumPy brute force, and prints one table with kvdepot's
figures (from bench_pq's CSV) and the ratios.

FAISS searches one query per kv head: the sum of the GQA group's 4 query
heads, which is exactly the query kvdepot's default aggregation ranks by, so
both sides do one scan of the same codes per search.
"""
import csv
import os
import sys
import time

import numpy as np
import faiss

D, G, NMAX = 128, 4, 131072


def best_time(fn, reps):
    best = 1e30
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main():
    dump, ours_csv, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nall = os.cpu_count() or 1
    q = np.fromfile(os.path.join(dump, "queries.f32"), dtype=np.float32).reshape(G, D)
    qbar = q[0].copy()
    for h in range(1, G):
        qbar = (qbar + q[h]).astype(np.float32)
    qbar = qbar.reshape(1, D)

    ours = {}
    with open(ours_csv) as f:
        for r in csv.DictReader(f):
            key = (int(r["n"]), int(r["m"]), int(r["b"]), int(r["k"]))
            th = r["threads"]
            label = "1" if th == "1" else ("avx2" if th == "avx2" else "all")
            ours.setdefault(key, {})[label] = float(r["mcodes_per_s"])

    rows = []
    for b in (8, 4):
        for m in (2, 4, 8, 16):
            ksub = 1 << b
            cent = np.fromfile(os.path.join(dump, f"pq_m{m}_b{b}.centroids"), dtype=np.float32)
            cent = cent.reshape(m, ksub, D // m)
            codes_all = np.fromfile(os.path.join(dump, f"pq_m{m}_b{b}.codes"), dtype=np.uint8)
            codes_all = codes_all.reshape(NMAX, m)
            lut = np.einsum("jcd,jd->jc", cent, qbar.reshape(m, D // m))
            for n in (32768, 131072):
                codes = codes_all[:n]
                base = faiss.IndexPQ(D, m, b, faiss.METRIC_INNER_PRODUCT)
                faiss.copy_array_to_vector(cent.ravel(), base.pq.centroids)
                base.is_trained = True
                if b == 8:
                    packed = codes
                else:  # FAISS packs 4-bit codes two per byte, first one low
                    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
                faiss.copy_array_to_vector(np.ascontiguousarray(packed).ravel(), base.codes)
                base.ntotal = n
                index = base if b == 8 else faiss.IndexPQFastScan(base, 32)
                name = "IndexPQ" if b == 8 else "IndexPQFastScan"
                exact = np.zeros(n, dtype=np.float64)
                for j in range(m):
                    exact += lut[j, codes[:, j]]
                order = np.argsort(-exact, kind="stable")
                for k in (256, 2048):
                    faiss.omp_set_num_threads(1)
                    t1 = best_time(lambda: index.search(qbar, k), reps)
                    faiss.omp_set_num_threads(nall)
                    ta = best_time(lambda: index.search(qbar, k), reps)
                    _, I = index.search(qbar, k)
                    agree = len(set(I[0].tolist()) & set(order[:k].tolist())) / k
                    o = ours.get((n, m, b, k), {})
                    rows.append((n, m, b, k, name, o.get("1", float("nan")), n * m / t1 / 1e6,
                                 o.get("all", float("nan")), n * m / ta / 1e6, agree,
                                 o.get("avx2", float("nan"))))
    faiss.omp_set_num_threads(nall)

    print()
    print(f"PQ top-k search, one kv head, head_dim {D}, GQA group {G} (FAISS: the summed query),")
    print(f"M codes/s = n*m / best-of-{reps} search time; ratio = kvdepot / FAISS; "
          f"'all' = {nall} threads")
    print("FAISS@k = share of FAISS's top-k inside the exact top-k of the same codes "
          "(IndexPQFastScan ranks with 8-bit quantized tables)")
    print("AVX2 = kvdepot's AVX2-only path, one thread (CPUs without AVX-512 VBMI)")
    hdr = (f"{'n':>7} {'m':>3} {'b':>2} {'k':>5} {'FAISS index':<16}| {'kvd 1thr':>9} {'FAISS 1thr':>10}"
           f" {'ratio':>6} | {'kvd all':>9} {'FAISS all':>10} {'ratio':>6} | {'AVX2':>6} {'ratio':>6}"
           f" | {'FAISS@k':>7}")
    print(hdr)
    print("-" * len(hdr))
    for n, m, b, k, name, o1, f1, oa, fa, agree, o2 in rows:
        print(f"{n:>7} {m:>3} {b:>2} {k:>5} {name:<16}| {o1:>9.0f} {f1:>10.0f} {o1 / f1:>6.2f} |"
              f" {oa:>9.0f} {fa:>10.0f} {oa / fa:>6.2f} | {o2:>6.0f} {o2 / f1:>6.2f} | {agree:>7.3f}")

    def worst(pred, col=5, nmin=0):
        sel = [r for r in rows if pred(r) and r[0] >= nmin]
        return min(r[col] / r[6] for r in sel) if sel else float("nan")

    print()
    print("targets, one thread, worst case over m (n = 128K as in DESIGN.md; all n in brackets):")
    for label, pred in (("IndexPQ k=256   >= 2x", lambda r: r[2] == 8 and r[3] == 256),
                        ("IndexPQ k=2048  >= 4x", lambda r: r[2] == 8 and r[3] == 2048),
                        ("FastScan 4-bit  >= 2x", lambda r: r[2] == 4)):
        print(f"  {label} : {worst(pred, 5, 131072):.2f}x [{worst(pred):.2f}x]"
              f"   AVX2-only path: {worst(pred, 10, 131072):.2f}x [{worst(pred, 10):.2f}x]")


if __name__ == "__main__":
    main()
