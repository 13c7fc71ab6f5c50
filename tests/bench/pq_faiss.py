#!/usr/bin/python3
"""FAISS side of the PQ search benchmark (run_pq_bench.sh, peers/run_peers.sh).

    pq_faiss.py measure DUMP_DIR REPS OUT.csv
        With the FAISS importable by this interpreter: loads the centroids,
        codes and queries bench_pq dumped, puts the very same centroids and
        codes into FAISS indexes (IndexPQ, 8- and 6-bit, and IndexPQFastScan
        built from a 4-bit IndexPQ), times index.search() (best of REPS, one thread
        and all threads), checks that FAISS ranks the same codes like a NumPy
        brute force, and writes one CSV row per case with the FAISS version
        and compile options. PQ_FAISS_SIMD=AVX2 (or another level the
        build holds) picks the SIMD level of a build with dynamic dispatch;
        auto (or unset) leaves it the CPU's best.
    pq_faiss.py report OURS.csv FAISS.csv [FAISS.csv ...]
        One table: kvdepot's figures (bench_pq's CSV) next to every FAISS
        build measured, with the ratios, and the targets. Each argument may
        be a comma-separated list of one system's CSVs from rounds run in
        turn with the others' (run_pq_bench.sh): each case keeps its best
        round, so that a machine whose speed drifts over seconds does not
        favour the side that happened to run in its fast moments.

FAISS searches one query per kv head: the sum of the GQA group's 4 query
heads, which is exactly the query kvdepot's default aggregation ranks by, so
both sides do one scan of the same codes per search.
"""
import csv
import os
import sys
import time

D, G, NMAX = 128, 4, 131072
NAN = float("nan")


def best_time(fn, reps):
    best = 1e30
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(dump, reps, out_csv):
    import numpy as np
    import faiss

    nall = os.cpu_count() or 1
    # A build with dynamic dispatch (PyPI's faiss-cpu from 1.12 on) holds
    # several SIMD levels and picks the CPU's best; PQ_FAISS_SIMD=AVX2
    # (say) measures another one of them. (Not FAISS_SIMD_LEVEL, which FAISS
    # itself reads at import and which knows no "auto".)
    level, simd = os.environ.get("PQ_FAISS_SIMD"), ""
    if hasattr(faiss, "SIMDConfig") and faiss.SIMDConfig.has_dynamic_dispatch():
        if level and level != "auto":  # auto: the CPU's best, as by default
            faiss.SIMDConfig.set_level(faiss.to_simd_level(level.upper()))
        simd = f"; SIMD level {faiss.to_string(faiss.SIMDConfig.get_level())}"
    elif level and level != "auto":
        sys.exit(f"pq_faiss: PQ_FAISS_SIMD={level}, but FAISS {faiss.__version__} "
                 "has no dynamic dispatch: it runs the level it was built for")
    build = f"FAISS {faiss.__version__} ({faiss.get_compile_options().strip()}{simd})"
    q = np.fromfile(os.path.join(dump, "queries.f32"), dtype=np.float32).reshape(G, D)
    qbar = q[0].copy()
    for h in range(1, G):
        qbar = (qbar + q[h]).astype(np.float32)
    qbar = qbar.reshape(1, D)
    rows = []
    for b in (8, 6, 4):
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
                elif b == 6:  # a bit string, first code lowest: 8 codes in 6 bytes
                    c = codes.astype(np.uint64)
                    if m == 2:
                        packed = (c[:, 0] | (c[:, 1] << 6)).astype("<u2").view(np.uint8).reshape(n, 2)
                    else:
                        words = []
                        for g0 in range(0, m, min(m, 8)):
                            w = np.zeros(n, dtype=np.uint64)
                            for j in range(min(m, 8)):
                                w |= c[:, g0 + j] << np.uint64(6 * j)
                            nbytes = min(m, 8) * 6 // 8
                            words.append(w.astype("<u8").view(np.uint8).reshape(n, 8)[:, :nbytes])
                        packed = np.concatenate(words, axis=1)
                else:  # FAISS packs 4-bit codes two per byte, first one low
                    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
                packed = np.ascontiguousarray(packed, dtype=np.uint8)
                assert packed.shape == (n, base.code_size), (packed.shape, base.code_size)
                faiss.copy_array_to_vector(np.ascontiguousarray(packed).ravel(), base.codes)
                base.ntotal = n
                index = base if b != 4 else faiss.IndexPQFastScan(base, 32)
                name = "IndexPQ" if b != 4 else "IndexPQFastScan"
                exact = np.zeros(n, dtype=np.float64)
                for j in range(m):
                    exact += lut[j, codes[:, j]]
                order = np.argsort(-exact, kind="stable")
                for k in (256, 2048):
                    faiss.omp_set_num_threads(1)
                    t1 = best_time(lambda: index.search(qbar, k), reps)
                    faiss.omp_set_num_threads(nall)
                    ta = best_time(lambda: index.search(qbar, k), reps)
                    _, ids = index.search(qbar, k)
                    agree = len(set(ids[0].tolist()) & set(order[:k].tolist())) / k
                    rows.append({"n": n, "m": m, "b": b, "k": k, "index": name, "build": build,
                                 "mcodes_1thr": n * m / t1 / 1e6,
                                 "mcodes_all": n * m / ta / 1e6, "threads": nall,
                                 "agree": agree})
    faiss.omp_set_num_threads(nall)
    with open(out_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"pq_faiss: measured {build}, {len(rows)} cases", file=sys.stderr)


def load_ours(paths):
    """bench_pq's CSVs (comma-separated rounds): each case's best."""
    ours = {}
    for path in paths.split(","):
        with open(path) as f:
            for r in csv.DictReader(f):
                key = (int(r["n"]), int(r["m"]), int(r["b"]), int(r["k"]))
                th = r["threads"]
                label = th if th in ("1", "avx2", "packed") else "all"
                v = float(r["mcodes_per_s"])
                case = ours.setdefault(key, {})
                case[label] = max(case.get(label, v), v)
    return ours


def load_faiss(paths):
    """measure's CSVs of one FAISS build (comma-separated rounds): each
    case's row with the best of its rounds' figures."""
    best = {}
    for path in paths.split(","):
        with open(path) as f:
            for r in csv.DictReader(f):
                key = (int(r["n"]), int(r["m"]), int(r["b"]), int(r["k"]))
                if key not in best:
                    best[key] = dict(r)
                    continue
                for col in ("mcodes_1thr", "mcodes_all"):
                    best[key][col] = str(max(float(best[key][col]), float(r[col])))
    return best


def report(ours_csv, faiss_csvs):
    ours = load_ours(ours_csv)
    builds = []
    for paths in faiss_csvs:
        rows = load_faiss(paths)
        one = next(iter(rows.values()))
        builds.append((rows, one["build"], one["threads"]))
    keys = sorted({k for b in builds for k in b[0]}, key=lambda k: (-k[2], k[0], k[1], k[3]))

    print()
    print(f"PQ top-k search, one kv head, head_dim {D}, GQA group {G} (FAISS: the summed query);")
    print("M codes/s = n*m / best search time; ratio = kvdepot / FAISS, one thread; "
          "AVX2 = kvdepot's AVX2-only path, one thread; packed = 4-bit codes packed in blocks "
          "of 32 tokens (kvd_pq_pack4, as FastScan packs its codes), one thread")
    for i, (_, name, threads) in enumerate(builds):
        print(f"  F{i + 1} = {name}, all = {threads} threads")
    print("F@k = share of that FAISS build's top-k inside the exact top-k of the same codes "
          "(FastScan ranks with 8-bit quantized tables); kvdepot's equals the exact top-k "
          "(bench_pq checks it against a brute-force scan)")
    print()
    head = "| n | m | b | k | index | kvdepot 1 thr | kvdepot AVX2 | kvdepot packed |"
    sep = "|---:|---:|---:|---:|---|---:|---:|---:|"
    for i in range(len(builds)):
        head += f" F{i + 1} 1 thr | ratio | ratio AVX2 | ratio packed |"
        sep += "---:|---:|---:|---:|"
    head += " kvdepot all | " + " | ".join(f"F{i + 1} all" for i in range(len(builds))) + \
            " | " + " | ".join(f"F{i + 1}@k" for i in range(len(builds))) + " |"
    sep += "---:|" + "---:|" * (2 * len(builds))
    print(head)
    print(sep)
    ratios = {}  # (build, target) -> [(n, kvdepot/FAISS, AVX2 path/FAISS, packed/FAISS)]
    for key in keys:
        n, m, b, k = key
        o = ours.get(key, {})
        o1, o2, oa = o.get("1", NAN), o.get("avx2", NAN), o.get("all", NAN)
        o3 = o.get("packed", NAN)
        first = next((bd[0][key] for bd in builds if key in bd[0]), None)
        line = (f"| {n} | {m} | {b} | {k} | {first['index'] if first else '?'} | {o1:.0f} |"
                f" {o2:.0f} | " + (f"{o3:.0f}" if o3 == o3 else "-") + " |")
        alls, agrees = [], []
        for i, (rows, _, _) in enumerate(builds):
            r = rows.get(key)
            f1 = float(r["mcodes_1thr"]) if r else NAN
            line += f" {f1:.0f} | {o1 / f1:.2f} | {o2 / f1:.2f} |"
            line += f" {o3 / f1:.2f} |" if o3 == o3 else " - |"
            alls.append(float(r["mcodes_all"]) if r else NAN)
            agrees.append(float(r["agree"]) if r else NAN)
            target = ("IndexPQ k=256 >= 2x" if b == 8 and k == 256 else
                      "IndexPQ k=2048 >= 4x" if b == 8 else
                      "FastScan 4-bit >= 2x" if b == 4 else "IndexPQ 6-bit (no target)")
            ratios.setdefault((i, target), []).append((n, o1 / f1, o2 / f1, o3 / f1))
        line += f" {oa:.0f} | " + " | ".join(f"{a:.0f}" for a in alls)
        line += " | " + " | ".join(f"{a:.3f}" for a in agrees) + " |"
        print(line)
    print()
    print("targets, one thread, worst case over m (n = 128K; all n in brackets):")

    def low(xs):
        xs = [x for x in xs if x == x]
        return min(xs) if xs else NAN

    for i, (_, name, _) in enumerate(builds):
        for target in ("IndexPQ k=256 >= 2x", "IndexPQ k=2048 >= 4x", "FastScan 4-bit >= 2x"):
            rs = ratios.get((i, target), [])
            big = [r for r in rs if r[0] == NMAX]
            line = (f"  vs F{i + 1} {target:<21}: {low(r[1] for r in big):.2f}x "
                    f"[{low(r[1] for r in rs):.2f}x]   AVX2-only path: "
                    f"{low(r[2] for r in big):.2f}x [{low(r[2] for r in rs):.2f}x]")
            if target.startswith("FastScan"):
                line += (f"   packed: {low(r[3] for r in big):.2f}x "
                         f"[{low(r[3] for r in rs):.2f}x]")
            print(line)


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "measure":
        measure(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) >= 4 and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: pq_faiss.py measure DUMP_DIR REPS OUT.csv | "
                 "report OURS.csv[,...] FAISS.csv[,...] [FAISS.csv[,...] ...]")


if __name__ == "__main__":
    main()
