#!/usr/bin/env python3
"""Peers side of the side-by-side benchmark (run by run_peers.sh).

    peers.py mooncake --master HOST:PORT --metadata URL --pids P,P [common] --csv OUT
        Mooncake Store over TCP: this process is a store client that holds no
        segment of its own (global_segment_size 0), so every put and get
        crosses loopback to the store node (mooncake_client) that does;
        put_from / get_into on buffers registered with the transfer engine
        (its zero-copy calls).
    peers.py lmcache --addr HOST:PORT --pid P [common] --csv OUT
        LMCache's storage server (python -m lmcache.v1.server HOST PORT cpu)
        through its own wire protocol classes (lmcache.v1.protocol): a put is
        the PUT message and its bytes, then an EXIST round trip, since PUT
        has no reply (so the time covers the server taking the object); a
        get is GET, its reply header and recv_into a preallocated buffer.
    peers.py report CSV [CSV ...]
        The put/get tables of every system (bench_stream's CSV and these), as
        Markdown, with ratios to Redis measured in the same run.

Common options follow bench_stream: --sizes 1,4,16,64 (MiB; up to 16 one
layer of 8 KV heads x 128 f16, above a whole 32-layer request), --reps
(default 100 up to 4 MiB, 64 at 16, 16 at 64), --mem-mib 1024 (16 MiB
objects stored for the resident-memory figure of the server processes).
Each call is timed alone; every get is checked bit-exact against what was
put. p99 is nearest rank: with fewer than 100 calls it is the slowest.
"""
import argparse
import csv
import math
import os
import socket
import sys
import time

MiB = 1 << 20
LAYER_MAX_MIB = 16


def default_reps(mib):
    return 100 if mib <= 4 else 64 if mib <= 16 else 16


def percentile(xs, p):
    xs = sorted(xs)
    return xs[max(1, math.ceil(p / 100 * len(xs))) - 1]


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def shape(mib):
    """(kind, layers, tokens) of an object of mib MiB of K+V f16, 8 x 128."""
    if mib <= LAYER_MAX_MIB:
        return "layer", 1, mib * MiB // (2 * 8 * 128 * 2)
    return "request", 32, mib * MiB // (2 * 32 * 8 * 128 * 2)


class Bench:
    """Drives one store through put(key, n), get(key, n) and delete(key)."""

    def __init__(self, store, label, pids, args):
        import numpy as np

        self.np = np
        self.store, self.label, self.pids, self.args = store, label, pids, args
        top = max(max(args.sizes), 16)
        rng = np.random.default_rng(1)
        vals = rng.uniform(-1, 1, top * MiB // 2).astype(np.float16)
        self.payload = store.buffer(top * MiB)
        self.payload[:] = vals.view(np.uint8)
        self.back = store.buffer(top * MiB)
        self.rows = []

    def tag(self, i):
        self.payload[:2] = self.np.array([512 + (i & 1023)], dtype=self.np.float16).view(
            self.np.uint8)

    def put(self, key, i, n):
        self.tag(i)
        self.store.put(key, self.payload, n)

    def get(self, key, i, n):
        self.back[:n] = 0
        t0 = time.perf_counter()
        self.store.get(key, self.back, n)
        t = time.perf_counter() - t0
        self.tag(i)
        if not self.np.array_equal(self.back[:n], self.payload[:n]):
            sys.exit(f"peers: {self.label} get {key}: bytes differ from what was put")
        return t

    def memory(self):
        mem = self.args.mem_mib
        if not mem or not self.pids:
            return float("nan")
        n = mem // 16
        before = sum(rss_bytes(p) for p in self.pids)
        for i in range(n):
            self.put(f"mem-{i}", i, 16 * MiB)
        after = sum(rss_bytes(p) for p in self.pids)
        for i in range(n):
            self.store.delete(f"mem-{i}")
        return (after - before) / (n * 16 / 1024)

    def run(self):
        mem = self.memory()
        for mib in self.args.sizes:
            kind, _, _ = shape(mib)
            n = mib * MiB
            reps = self.args.reps or default_reps(mib)
            self.put(f"warm-{mib}", reps, n)  # untimed round
            self.get(f"warm-{mib}", reps, n)
            self.store.delete(f"warm-{mib}")
            puts = []
            for i in range(reps):
                t0 = time.perf_counter()
                self.put(f"obj-{mib}-{i}", i, n)
                puts.append(time.perf_counter() - t0)
            gets = [self.get(f"obj-{mib}-{i}", i, n) for i in range(reps)]
            for i in range(reps):
                self.store.delete(f"obj-{mib}-{i}")
            for op, ts in (("put", puts), ("get", gets)):
                p50 = percentile(ts, 50)
                self.rows.append({
                    "system": self.label, "object_mib": mib, "shape": kind, "op": op, "n": reps,
                    "p50_ms": f"{p50 * 1e3:.6f}", "p99_ms": f"{percentile(ts, 99) * 1e3:.6f}",
                    "mbps_at_p50": f"{n / p50 / 1e6:.1f}", "rel_rms": "",
                    "rss_per_gib": "" if mem != mem else f"{mem / (1 << 30):.2f} GiB"})
            print(f"peers: {self.label} {mib} MiB: put p50 {percentile(puts, 50) * 1e3:.2f} ms, "
                  f"get p50 {percentile(gets, 50) * 1e3:.2f} ms", file=sys.stderr)
        with open(self.args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(self.rows[0]))
            w.writeheader()
            w.writerows(self.rows)


class Mooncake:
    def __init__(self, args):
        import numpy as np
        from mooncake.store import MooncakeDistributedStore

        self.np = np
        self.s = MooncakeDistributedStore()
        rc = self.s.setup("127.0.0.1", args.metadata, 0, 64 * MiB, "tcp", "", args.master)
        if rc != 0:
            sys.exit(f"peers: Mooncake setup failed ({rc})")
        self.registered = []

    def buffer(self, n):
        b = self.np.zeros(n, dtype=self.np.uint8)
        if self.s.register_buffer(b.ctypes.data, n) != 0:
            sys.exit("peers: Mooncake register_buffer failed")
        self.registered.append(b)
        return b

    def put(self, key, buf, n):
        rc = self.s.put_from(key, buf.ctypes.data, n)
        if rc != 0:
            sys.exit(f"peers: Mooncake put_from {key}: {rc}")

    def get(self, key, buf, n):
        rc = self.s.get_into(key, buf.ctypes.data, n)
        if rc != n:
            sys.exit(f"peers: Mooncake get_into {key}: {rc}")

    def delete(self, key):
        for _ in range(100):  # a just-read object is leased for a moment
            if self.s.remove(key) == 0:
                return
            time.sleep(0.05)
        sys.exit(f"peers: Mooncake remove {key} kept failing")


class LMCache:
    def __init__(self, args):
        import numpy as np
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1 import protocol

        self.np, self.torch, self.p = np, torch, protocol
        self.Key, self.fmt = CacheEngineKey, MemoryFormat.KV_2LTD
        host, port = args.addr.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.hashes = {}

    def buffer(self, n):
        return self.np.zeros(n, dtype=self.np.uint8)

    def key(self, name):
        h = self.hashes.setdefault(name, len(self.hashes) + 1)
        return self.Key("kvdepot-bench", 1, 0, h, self.torch.float16)

    def meta(self, cmd, key, n):
        tokens = n // (2 * 8 * 128 * 2)
        return self.p.ClientMetaMessage(cmd, self.key(key), n, self.fmt, self.torch.float16,
                                        self.torch.Size([2, 1, tokens, 1024])).serialize()

    def recv_exact(self, view):
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:], len(view) - got)
            if k == 0:
                sys.exit("peers: LMCache server closed the connection")
            got += k

    def reply(self):
        head = bytearray(self.p.ServerMetaMessage.packlength())
        self.recv_exact(memoryview(head))
        return self.p.ServerMetaMessage.deserialize(bytes(head))

    def put(self, key, buf, n):
        self.sock.sendall(self.meta(self.p.ClientCommand.PUT, key, n))
        self.sock.sendall(memoryview(buf)[:n])
        self.sock.sendall(self.meta(self.p.ClientCommand.EXIST, key, 0))
        if self.reply().code != self.p.ServerReturnCode.SUCCESS:
            sys.exit(f"peers: LMCache does not hold {key} after its PUT")

    def get(self, key, buf, n):
        self.sock.sendall(self.meta(self.p.ClientCommand.GET, key, 0))
        r = self.reply()
        if r.code != self.p.ServerReturnCode.SUCCESS or r.length != n:
            sys.exit(f"peers: LMCache GET {key}: code {r.code}, {r.length} bytes")
        self.recv_exact(memoryview(buf)[:n])

    def delete(self, key):
        pass  # the storage server's protocol has no delete: objects stay


def report(paths):
    rows = []
    for p in paths:
        with open(p) as f:
            rows += list(csv.DictReader(f))
    order = ["kvdepot raw", "kvdepot raw (durability none)", "kvdepot INT2",
             "kvdepot INT2 pages", "Redis", "Mooncake Store", "LMCache server"]
    systems = sorted({r["system"] for r in rows},
                     key=lambda s: order.index(s) if s in order else len(order))
    by = {(r["system"], int(r["object_mib"]), r["op"]): r for r in rows}
    sizes = sorted({int(r["object_mib"]) for r in rows})
    for op in ("put", "get"):
        print(f"\n**{op}** (latency in ms; MB/s = 10^6 bytes of f16 K+V per second at p50; "
              "x Redis = MB/s over Redis's in the same run)\n")
        print("| system | object | shape | n | p50 ms | p99 ms | MB/s | x Redis | rel. RMS error "
              "| server RSS per GiB stored |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for mib in sizes:
            redis = by.get(("Redis", mib, op))
            for s in systems:
                r = by.get((s, mib, op))
                if r is None:
                    continue
                ratio = (f"{float(r['mbps_at_p50']) / float(redis['mbps_at_p50']):.2f}"
                         if redis else "-")
                err = r["rel_rms"] or ("as INT2" if "pages" in s else "exact")
                print(f"| {s} | {mib} MiB | {r['shape']} | {r['n']} | {float(r['p50_ms']):.2f} "
                      f"| {float(r['p99_ms']):.2f} | {float(r['mbps_at_p50']):.0f} | {ratio} "
                      f"| {err} | {r['rss_per_gib'] or '-'} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("mooncake", "lmcache"):
        p = sub.add_parser(name)
        p.add_argument("--sizes", default="1,4,16,64",
                       type=lambda s: [int(x) for x in s.split(",")])
        p.add_argument("--reps", type=int, default=0)
        p.add_argument("--mem-mib", type=int, default=1024)
        p.add_argument("--csv", required=True)
        if name == "mooncake":
            p.add_argument("--master", required=True)
            p.add_argument("--metadata", required=True)
            p.add_argument("--pids", default="")
        else:
            p.add_argument("--addr", required=True)
            p.add_argument("--pid", default="")
    p = sub.add_parser("report")
    p.add_argument("csvs", nargs="+")
    args = ap.parse_args()
    if args.cmd == "report":
        report(args.csvs)
        return
    if args.cmd == "mooncake":
        store, label, pids = Mooncake(args), "Mooncake Store", args.pids
    else:
        store, label, pids = LMCache(args), "LMCache server", args.pid
    Bench(store, label, [int(p) for p in pids.split(",") if p], args).run()


if __name__ == "__main__":
    main()
