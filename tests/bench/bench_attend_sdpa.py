#!/usr/bin/env python3
"""The alternative to kvdepot's Attend RPC, second half, and the comparison.

    bench_attend_sdpa.py --csv attend_e2e.csv [--quick]

For every (tokens, batch) row of bench_attend_e2e's CSV: the time to copy
the fp16 caches a Read returned (batch x tokens x 8 kv heads x 128, K and
V, pageable host memory) to the GPU and run PyTorch's scaled_dot_product_
attention on them (32 query heads, GQA), median of 5 after a warm-up, with
CUDA synchronisation. "Read fp16 + SDPA" = batch x (Read fp16 ms per query,
from the CSV) + that time. Then one table: each cache form's Attend RPC
time and its speed-up over fp16 Attend and over Read fp16 + SDPA.
Without torch or a CUDA device the SDPA column says why and the rest of the
table is still printed.
"""
import argparse
import csv
import statistics
import sys
import time

HQ, H, D = 32, 8, 128


def sdpa_ms(torch, tokens, batch):
    """H2D of the fp16 caches + SDPA on the GPU, ms (median of 5)."""
    k = torch.randn(batch, H, tokens, D, dtype=torch.float16)
    v = torch.randn(batch, H, tokens, D, dtype=torch.float16)
    q = torch.randn(batch, HQ, 1, D, dtype=torch.float16, device="cuda")
    f = torch.nn.functional.scaled_dot_product_attention
    times = []
    for rep in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kd, vd = k.to("cuda"), v.to("cuda")
        try:
            f(q, kd, vd, enable_gqa=True)
        except TypeError:  # torch < 2.5: expand the kv heads
            g = HQ // H
            f(q, kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1))
        torch.cuda.synchronize()
        if rep:
            times.append((time.perf_counter() - t0) * 1e3)
        del kd, vd
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    rows = list(csv.DictReader(open(a.csv)))
    if not rows:
        sys.exit("no rows in " + a.csv)
    why = None
    try:
        import torch
        if not torch.cuda.is_available():
            why = "no CUDA device for torch"
        else:
            dev = torch.cuda.get_device_name(0)
    except ImportError:
        why = "torch not installed"
    print(f"kvdepotd backend {rows[0]['backend']} ({rows[0]['device'] or 'CPU'});"
          f" SDPA: {why or 'torch ' + torch.__version__ + ' on ' + dev}\n")
    print("| tokens | batch | cache | Attend ms | vs fp16 Attend | Read fp16 + SDPA ms |"
          " vs Read fp16 + SDPA | pages on the GPU per call |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    fp16 = {}
    alt = {}
    for r in rows:
        key = (int(r["tokens"]), int(r["batch"]))
        ms = float(r["attend_ms"])
        if r["cache"] == "fp16":
            fp16[key] = ms
        if key not in alt:
            alt[key] = None
            if not why:
                try:
                    alt[key] = key[1] * float(r["read_fp16_ms_per_query"]) + sdpa_ms(torch, *key)
                except RuntimeError as e:  # out of memory on the GPU
                    alt[key] = None
                    print(f"<!-- {key}: {e} -->")
        base = alt[key]
        print(f"| {key[0] // 1024}K | {key[1]} | {r['cache']} | {ms:.2f} |"
              f" {fp16[key] / ms:.2f}x | {f'{base:.2f}' if base else '-'} |"
              f" {f'{base / ms:.1f}x' if base else '-'} | {r['device_pages_per_call']} |")


if __name__ == "__main__":
    main()
