"""python -m kvdepot: the kvdepot CLI's common commands, through the package.

    python -m kvdepot [--addr ADDR] [--token TOKEN] COMMAND ...

    health                          is the server serving?
    models                          list models
    model put NAME --layers N --kv-heads N --head-dim N [--dtype f16|bf16|f32]
              [--q-heads N] [--replace]
    model get NAME | model rm NAME [--force]
    seqs [--model M]                list sequences
    seq stat ID | seq rm ID | seq evict ID
    put ID --model M --file F.npz [--k CODEC] [--v CODEC]
                                    append K and V from an .npz holding arrays
                                    k and v (layers, tokens, kv_heads, head_dim),
                                    creating the sequence if needed
    get ID --file F.npz [--layer-start L] [--layers N] [--token-start T] [--tokens N]
                                    read K and V into F.npz (arrays k and v)
    lookup MODEL --token-ids F.npy  how many leading blocks of the token ids'
                                    prefix chain are stored
    stats                           the server's tiers and counters (JSON)

ADDR defaults to $KVDEPOT_ADDR or 127.0.0.1:50051, the token to
$KVDEPOT_TOKEN. Exit status: 0, 1 for a failed call (its status and message
on stderr), 2 for a bad command line.
"""
import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from . import Client, Codecs, KvdepotError, Model, NotFound, prefix_hashes


def _show(obj) -> None:
    def conv(x):
        if isinstance(x, bytes):
            return x.decode(errors="replace")
        if isinstance(x, np.ndarray):
            return x.tolist()
        return x
    if dataclasses.is_dataclass(obj):
        obj = {k: conv(v) for k, v in dataclasses.asdict(obj).items()}
    print(json.dumps(obj, indent=2, default=conv))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvdepot", description="kvdepot client")
    p.add_argument("--addr", default=os.environ.get("KVDEPOT_ADDR", "127.0.0.1:50051"))
    p.add_argument("--token", default=os.environ.get("KVDEPOT_TOKEN"))
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("health")
    sub.add_parser("models")
    sub.add_parser("stats")
    m = sub.add_parser("model").add_subparsers(dest="op", required=True)
    mp = m.add_parser("put")
    mp.add_argument("name")
    mp.add_argument("--layers", type=int, required=True)
    mp.add_argument("--kv-heads", type=int, required=True)
    mp.add_argument("--head-dim", type=int, required=True)
    mp.add_argument("--dtype", default="f16", choices=["f16", "bf16", "f32"])
    mp.add_argument("--q-heads", type=int, default=0)
    mp.add_argument("--replace", action="store_true")
    m.add_parser("get").add_argument("name")
    mr = m.add_parser("rm")
    mr.add_argument("name")
    mr.add_argument("--force", action="store_true")
    sq = sub.add_parser("seqs")
    sq.add_argument("--model")
    s = sub.add_parser("seq").add_subparsers(dest="op", required=True)
    for op in ("stat", "rm", "evict"):
        s.add_parser(op).add_argument("id")
    put = sub.add_parser("put")
    put.add_argument("id")
    put.add_argument("--model", required=True)
    put.add_argument("--file", required=True)
    put.add_argument("--k", default="raw")
    put.add_argument("--v", default="raw")
    get = sub.add_parser("get")
    get.add_argument("id")
    get.add_argument("--file", required=True)
    get.add_argument("--layer-start", type=int, default=0)
    get.add_argument("--layers", type=int, default=0)
    get.add_argument("--token-start", type=int, default=0)
    get.add_argument("--tokens", type=int, default=0)
    lk = sub.add_parser("lookup")
    lk.add_argument("model")
    lk.add_argument("--token-ids", required=True)
    lk.add_argument("--page-tokens", type=int, default=256)
    return p


def _run(a, c: Client) -> None:
    if a.cmd == "health":
        print(c.health())
    elif a.cmd == "models":
        for m in c.list_models():
            print(f"{m.name}\tlayers={m.num_layers} kv_heads={m.num_kv_heads} "
                  f"head_dim={m.head_dim} dtype={m.dtype}")
    elif a.cmd == "stats":
        _show(c.stats())
    elif a.cmd == "model" and a.op == "put":
        m, created = c.put_model(Model(a.name, num_layers=a.layers, num_kv_heads=a.kv_heads,
                                       head_dim=a.head_dim, dtype=a.dtype,
                                       num_q_heads=a.q_heads), replace=a.replace)
        print(("created " if created else "unchanged ") + m.name)
    elif a.cmd == "model" and a.op == "get":
        _show(c.get_model(a.name))
    elif a.cmd == "model" and a.op == "rm":
        print(f"deleted {a.name} and {c.delete_model(a.name, force=a.force)} sequences")
    elif a.cmd == "seqs":
        for s in c.list_sequences(a.model):
            print(f"{s.id.decode(errors='replace')}\tmodel={s.model} tokens={s.num_tokens} "
                  f"stored_bytes={s.stored_bytes}")
    elif a.cmd == "seq" and a.op == "stat":
        _show(c.stat(a.id))
    elif a.cmd == "seq" and a.op == "rm":
        print(f"deleted {a.id} ({c.delete_sequence(a.id)} pages freed)")
    elif a.cmd == "seq" and a.op == "evict":
        pages, nbytes = c.evict(a.id)
        print(f"evicted {pages} pages, {nbytes} bytes")
    elif a.cmd == "put":
        with np.load(a.file) as z:
            k, v = z["k"], z["v"]
        try:
            info = c.stat(a.id)
            if info.model != a.model:
                raise ValueError(f"sequence {a.id} holds model {info.model}, not {a.model}")
            start = info.num_tokens
        except NotFound:
            c.create_sequence(a.id, a.model, codecs=Codecs(k=a.k, v=a.v))
            start = 0
        s = c.append(a.id, k, v, token_start=start)
        print(f"{a.id}: {s.num_tokens} tokens, {s.stored_bytes} bytes stored")
    elif a.cmd == "get":
        k, v = c.read(a.id, layer_start=a.layer_start, num_layers=a.layers,
                      token_start=a.token_start, num_tokens=a.tokens)
        np.savez(a.file, k=k, v=v)
        print(f"{a.id}: k and v {k.shape} {k.dtype} -> {a.file}")
    elif a.cmd == "lookup":
        ids = np.load(a.token_ids)
        blocks, tokens = c.lookup(a.model, prefix_hashes(ids, a.page_tokens))
        print(f"{blocks} blocks, {tokens} tokens stored")


def main(argv=None) -> int:
    a = _parser().parse_args(argv)
    try:
        with Client(a.addr, token=a.token) as c:
            _run(a, c)
    except KvdepotError as e:
        print(f"kvdepot: {e.code}: {e}", file=sys.stderr)
        return 1
    except (OSError, KeyError, ValueError) as e:
        print(f"kvdepot: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
