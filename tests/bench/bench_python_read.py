"""Read throughput of the Python package next to the C client, in one run.

A request's cache (32 layers x 8 KV heads x 128, f16, SIZE MiB of K+V) is
stored once; then, in alternating rounds, the C client (bench_read_c) and
the package read it back: Client.read (the library's buffer, NumPy views of
it, no copy) and Client.read_into (the caller's arrays). Prints the median
GB/s of each and the package's share of the C client's (target: >= 90 %).

    python bench_python_read.py ADDR BENCH_READ_C [--sizes 16,64] [--reps 5] [--rounds 3]
"""
import argparse
import json
import statistics
import subprocess
import time

import numpy as np

import kvdepot

L, H, D = 32, 8, 128


def main():
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("bench_read_c")
    p.add_argument("--sizes", default="16,64")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    print("| MiB | C client GB/s (library buffer) | C client GB/s (caller buffer) | "
          "Python read GB/s | Python read_into GB/s | read / C | read_into / C |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    with kvdepot.Client(a.addr) as c:
        c.put_model(kvdepot.Model("pyb", num_layers=L, num_kv_heads=H, head_dim=D))
        for mib in (int(x) for x in a.sizes.split(",")):
            tokens = mib * (1 << 20) // (2 * L * H * D * 2)
            rng = np.random.default_rng(mib)
            k = rng.standard_normal((L, tokens, H, D)).astype(np.float16)
            v = rng.standard_normal((L, tokens, H, D)).astype(np.float16)
            sid = f"pyb-{mib}"
            c.create_sequence(sid, "pyb")
            c.append(sid, k, v, token_start=0)
            kb, vb = np.empty_like(k), np.empty_like(v)
            cl, cc, pr, pi = [], [], [], []
            for _ in range(a.rounds):
                out = subprocess.run([a.bench_read_c, a.addr, sid, str(a.reps)], check=True,
                                     capture_output=True, text=True).stdout
                r = json.loads(out)
                nbytes = r["bytes"]
                cl.append(r["library_buffer_s"])
                cc.append(r["caller_buffer_s"])
                t = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    k2, v2 = c.read(sid)
                    t.append(time.perf_counter() - t0)
                pr.append(statistics.median(t))
                t = []
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    c.read_into(sid, kb, vb)
                    t.append(time.perf_counter() - t0)
                pi.append(statistics.median(t))
            assert np.array_equal(k2, k) and np.array_equal(vb, v)
            gb = [nbytes / statistics.median(x) / 1e9 for x in (cl, cc, pr, pi)]
            print(f"| {mib} | {gb[0]:.2f} | {gb[1]:.2f} | {gb[2]:.2f} | {gb[3]:.2f} | "
                  f"{gb[2] / gb[0]:.0%} | {gb[3] / gb[1]:.0%} |")
            c.delete_sequence(sid)


if __name__ == "__main__":
    main()
