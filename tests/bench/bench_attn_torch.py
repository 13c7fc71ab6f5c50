#!/usr/bin/env python3
"""Decode attention in plain PyTorch, for comparison with bench_cuda_attn.

torch.nn.functional.scaled_dot_product_attention on fp16 K/V with the shapes
of bench_cuda_attn: 32 query heads, 8 kv heads, head_dim 128, one query token
per sequence, a batch of equal-length sequences, T = 1K..128K (and 1M for
batch 1), batch 1..64. GQA runs natively (enable_gqa=True, PyTorch >= 2.5);
older versions expand K/V to the query heads first, outside the timed
region, and the row says so (the kernel then reads 4x the bytes).

Time per call: CUDA events around repetitions after a warm-up. Bandwidth:
the bytes of K and V of the kv heads / time (the same count bench_cuda_attn
uses for fp16). Prints a table; --csv FILE writes rows
batch,tokens,us,gbs,gqa. Exits 0 with a message when torch or a GPU is
missing.

    python3 tests/bench/bench_attn_torch.py [--quick] [--csv FILE]
"""
import argparse
import os
import sys

HQ, HKV, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("bench_attn_torch: torch is not installed; skipped")
        return 0
    if not torch.cuda.is_available():
        print("bench_attn_torch: no CUDA device; skipped")
        return 0
    dev = torch.device("cuda")
    budget = int(os.environ.get("KVD_BENCH_ATTN_GIB", "60")) << 30
    Ts = [1024, 16384, 131072] if args.quick else [1024, 4096, 16384, 32768, 65536, 131072, 1048576]
    Bs = [1, 8] if args.quick else [1, 8, 16, 64]
    try:
        q = torch.zeros(1, HQ, 1, D, device=dev, dtype=torch.float16)
        k = torch.zeros(1, HKV, 4, D, device=dev, dtype=torch.float16)
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        native = True
    except TypeError:
        native = False
    print("# bench_attn_torch on %s, torch %s, GQA %s" % (torch.cuda.get_device_name(0), torch.__version__,
                                                           "native" if native else "expanded K/V"))
    out = open(args.csv, "w") if args.csv else None
    if out:
        out.write("batch,tokens,us,gbs,gqa\n")
    print("%6s %9s %10s %9s" % ("batch", "tokens", "us", "GB/s"))
    for B in Bs:
        for T in Ts:
            if T > 131072 and B != 1:
                continue
            need = B * T * HKV * D * 2 * 2 * (1 if native else 1 + HQ // HKV)
            if need > budget:
                print("%6d %9d %10s (does not fit the memory budget)" % (B, T, "-"))
                continue
            try:
                q = torch.randn(B, HQ, 1, D, device=dev, dtype=torch.float16)
                k = torch.randn(B, HKV, T, D, device=dev, dtype=torch.float16)
                v = torch.randn(B, HKV, T, D, device=dev, dtype=torch.float16)
                if not native:
                    k = k.repeat_interleave(HQ // HKV, dim=1)
                    v = v.repeat_interleave(HQ // HKV, dim=1)

                def call():
                    if native:
                        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                    return F.scaled_dot_product_attention(q, k, v)

                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                call()
                e.record()
                torch.cuda.synchronize()
                one = s.elapsed_time(e) / 1e3
                reps = max(3, min(200, int(0.05 / one) if one > 0 else 100))
                s.record()
                for _ in range(reps):
                    call()
                e.record()
                torch.cuda.synchronize()
                t = s.elapsed_time(e) / 1e3 / reps
            except RuntimeError as ex:  # out of memory and the like
                print("%6d %9d %10s (%s)" % (B, T, "-", str(ex).splitlines()[0][:60]))
                torch.cuda.empty_cache()
                continue
            gbs = B * T * HKV * D * 2 * 2 / t / 1e9
            print("%6d %9d %10.1f %9.0f" % (B, T, t * 1e6, gbs))
            if out:
                out.write("%d,%d,%.2f,%.1f,%s\n" % (B, T, t * 1e6, gbs, "native" if native else "expanded"))
            del q, k, v
            torch.cuda.empty_cache()
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
