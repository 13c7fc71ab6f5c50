#!/usr/bin/env bash
# The kvdepot CLI's compute subcommands against a real kvdepotd: attend (q
# from a file, output to a file, checked against attention computed here in
# Python on the K/V put), plan, search, and their errors.
#
# Usage: cli_compute.sh KVDEPOTD KVDEPOT_CLI
set -euo pipefail
server=$1
cli=$2
name=cli_compute
. "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

start_server

k model put m --layers 1 --kv-heads 2 --q-heads 4 --head-dim 32 --dtype f32 >/dev/null
# K then V of 300 tokens ([token][head][dim] f32) and a query (4 x 32 f32).
python3 - "$work" <<'PY'
import random, struct, sys
w = sys.argv[1]
r = random.Random(3)
kv = [r.uniform(-1, 1) for _ in range(2 * 300 * 2 * 32)]
open(w + "/kv.bin", "wb").write(struct.pack("<%df" % len(kv), *kv))
q = [r.uniform(-1, 1) for _ in range(4 * 32)]
open(w + "/q.bin", "wb").write(struct.pack("<%df" % len(q), *q))
open(w + "/q-short.bin", "wb").write(struct.pack("<%df" % 32, *q[:32]))
PY
k put s --model m --tokens 300 --file "$work/kv.bin" >/dev/null

out=$(k attend s --layer 0 --q "$work/q.bin" --out "$work/out.bin") || fail "attend failed"
echo "$out" | grep_q "attended 300 tokens" || fail "attend output: $out"
[ "$(stat -c %s "$work/out.bin")" = $((4 * 32 * 4)) ] || fail "attend output file size"
python3 - "$work" <<'PY' || fail "attend output differs from attention computed in Python"
import math, struct, sys
w = sys.argv[1]
kv = struct.unpack("<%df" % (2 * 300 * 64), open(w + "/kv.bin", "rb").read())
q = struct.unpack("<128f", open(w + "/q.bin", "rb").read())
got = struct.unpack("<128f", open(w + "/out.bin", "rb").read())
for h in range(4):
    kh = h // 2
    s = [sum(q[h * 32 + i] * kv[(t * 2 + kh) * 32 + i] for i in range(32)) / math.sqrt(32)
         for t in range(300)]
    mx = max(s)
    p = [math.exp(x - mx) for x in s]
    z = sum(p)
    for i in range(32):
        o = sum(p[t] * kv[300 * 64 + (t * 2 + kh) * 32 + i] for t in range(300)) / z
        if abs(o - got[h * 32 + i]) > 1e-4:
            sys.exit("head %d dim %d: %g vs %g" % (h, i, got[h * 32 + i], o))
PY
k attend s --layer 0 --q "$work/q.bin" --token-start 100 --tokens 50 | grep_q "attended 50 tokens" ||
    fail "attend over a range"

out=$(k plan s --bandwidth 1e9 --flops 1e12) || fail "plan failed"
echo "$out" | grep_q "^split 0 of 300 tokens" || fail "plan output: $out"
# Rates with units: 1G = 1GB/s = 1e9; 10 bytes/s is not 10G; junk is refused.
[ "$(k plan s --bandwidth 1G --flops 1T)" = "$out" ] || fail "plan with 1G/1T differs from 1e9/1e12"
[ "$(k plan s --bandwidth 1GB/s --flops 1e12)" = "$out" ] || fail "plan with 1GB/s differs"
[ "$(k plan s --bandwidth 10 --flops 1e12)" != "$out" ] || fail "10 bytes/s plans like 1 GB/s"
for bad in 1e9x 10Q -5 0 G; do
    rc=0
    k plan s --bandwidth "$bad" --flops 1e12 >/dev/null 2>&1 || rc=$?
    [ "$rc" -eq 2 ] || fail "--bandwidth $bad: exit $rc, want 2"
done

# Errors: a query of the wrong size, an unknown sequence, search without an index.
rc=0
err=$(k attend s --layer 0 --q "$work/q-short.bin" 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "INVALID_ARGUMENT" || fail "short q: rc=$rc $err"
rc=0
err=$(k attend nope --layer 0 --q "$work/q.bin" 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "NOT_FOUND" || fail "unknown sequence: rc=$rc $err"
rc=0
err=$(k search s --layer 0 --q "$work/q.bin" --k 4 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "FAILED_PRECONDITION" || fail "search: rc=$rc $err"

# Codecs from the command line: INT4 pages and a PQ index; search answers.
k put c --model m --tokens 300 --file "$work/kv.bin" --k int4,g32 --v int2,g32,token \
    --pq m4b4i3t256 >/dev/null || fail "put with codecs"
# seq stat says how each sequence is stored, as the server resolved it (the
# default axis groups per channel)
k seq stat c | grep_q '^codecs: *k int4 g32 channel, v int2 g32 token; pq m4 b4 iterations 3 trained at 256 tokens$' ||
    fail "seq stat codecs of c: $(k seq stat c | grep codecs)"
k seq stat s | grep_q '^codecs: *k raw, v raw$' || fail "seq stat codecs of s: $(k seq stat s | grep codecs)"
raw_bytes=$(k seq stat s | awk '/^stored_bytes:/ {print $2}')
coded_bytes=$(k seq stat c | awk '/^stored_bytes:/ {print $2}')
[ "$coded_bytes" -lt "$raw_bytes" ] || fail "coded sequence stores $coded_bytes bytes, raw $raw_bytes"
out=$(k search c --layer 0 --q "$work/q.bin" --k 8 --initial 2 --recent 3) || fail "search failed"
[ "$(echo "$out" | grep -c '^kv head')" = 2 ] || fail "search output: $out"
# 13 "token:score" pairs per kv head: k + initial + recent
echo "$out" | awk '/^kv head/ { if (NF != 3 + 13) exit 1 }' || fail "search tokens per head: $out"
for t in 0 1 297 298 299; do
    echo "$out" | awk -v t="$t" '/^kv head/ { f = 0; for (i = 4; i <= NF; i++) if ($i ~ "^" t ":") f = 1; if (!f) exit 1 }' ||
        fail "search: forced token $t missing: $out"
done
k search c --layer 0 --q "$work/q.bin" --k 8 --sparse | grep_q "attended 8 tokens" ||
    fail "sparse search"
# The PQ index trained again on every sealed page (one of 256 tokens).
k seq pq-rebuild c | grep_q "^sequence c: PQ index rebuilt (layers 1, tokens coded 256)$" ||
    fail "pq-rebuild: $(k seq pq-rebuild c 2>&1)"
k search c --layer 0 --q "$work/q.bin" --k 8 >/dev/null || fail "search after pq-rebuild"
rc=0
err=$(k seq pq-rebuild s 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "FAILED_PRECONDITION" || fail "pq-rebuild without an index: rc=$rc $err"
# Appending more with the same flags is refused (codecs are fixed at creation).
rc=0
err=$(k put c --model m --tokens 300 --file "$work/kv.bin" --k int4 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "apply only when put creates it" || fail "codecs on an existing sequence: rc=$rc $err"
# Bad specs: usage errors (exit 2) or the server's INVALID_ARGUMENT /
# FAILED_PRECONDITION (VQ without calibration); nothing is created.
for spec in "int3" "int4,g33x" "int4,bogus" "vq-d4" "raw,svd=1.5" "raw,widths="; do
    rc=0
    err=$(k put bad --model m --tokens 300 --file "$work/kv.bin" --k "$spec" 2>&1) || rc=$?
    [ "$rc" = 2 ] || fail "--k $spec: rc=$rc $err"
done
rc=0
err=$(k put bad --model m --tokens 300 --file "$work/kv.bin" --k int4,g48 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "INVALID_ARGUMENT" || fail "--k int4,g48: rc=$rc $err"
rc=0
err=$(k put bad --model m --tokens 300 --file "$work/kv.bin" --k vq-d4b8 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "FAILED_PRECONDITION" || fail "--k vq-d4b8 uncalibrated: rc=$rc $err"
rc=0
err=$(k put bad --model m --tokens 300 --file "$work/kv.bin" --pq m5b4 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "INVALID_ARGUMENT" || fail "--pq m5b4: rc=$rc $err"
rc=0
err=$(k seq stat bad 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "NOT_FOUND" || fail "bad sequence was created: $err"
echo "cli_compute: PASS"
