#!/usr/bin/env bash
# The kvdepot CLI's activation flags against a real kvdepotd: put --activations
# (K, V then X from one file; the sequence is created storing activations),
# plan (the split bounded by the stored activations), get --activation-tokens
# (X of the first tokens, then K and V of the rest) checked byte for byte, and
# the errors.
#
# Usage: cli_activations.sh KVDEPOTD KVDEPOT_CLI
set -euo pipefail
server=$1
cli=$2
name=cli_activations
. "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

start_server

# 2 layers, 2 kv heads x 8 dims, hidden 16, f16: per token and layer K or V
# is 32 bytes and X 32 bytes.
k model put m --layers 2 --kv-heads 2 --head-dim 8 --hidden 16 --dtype f16 >/dev/null
k model put m0 --layers 2 --kv-heads 2 --head-dim 8 --dtype f16 >/dev/null
head -c $((3 * 2 * 300 * 32)) /dev/urandom >"$work/kvx.bin"
head -c $((2 * 2 * 300 * 32)) "$work/kvx.bin" >"$work/kv.bin"

k put s --model m --tokens 300 --file "$work/kvx.bin" --activations >/dev/null ||
    fail "put --activations"
k seq stat s | grep_q "^activation_tokens: *300$" || fail "stat: $(k seq stat s)"
out=$(k plan s --bandwidth 1e6 --flops 1e15) || fail "plan failed"
echo "$out" | grep_q "^split 300 of 300 tokens" || fail "plan output: $out"

out=$(k get s --file "$work/got.bin" --activation-tokens 120) || fail "get failed"
echo "$out" | grep_q "X of tokens 0..119" || fail "get output: $out"
python3 - "$work" <<'PY' || fail "activation-first get differs from what was put"
import sys
w = sys.argv[1]
src = open(w + "/kvx.bin", "rb").read()
got = open(w + "/got.bin", "rb").read()
n, l, tb = 300, 120, 32
part = lambda base, t0, t1: b"".join(src[base + (layer * n + t0) * tb: base + (layer * n + t1) * tb]
                                     for layer in range(2))
want = part(2 * 2 * n * tb, 0, l) + part(0, l, n) + part(2 * n * tb, l, n)
sys.exit(0 if got == want else "differs (%d vs %d bytes)" % (len(got), len(want)))
PY

# Errors: X for a sequence without a hidden size, a file without X, more X
# tokens than stored.
rc=0
err=$(k put s0 --model m0 --tokens 300 --file "$work/kvx.bin" --activations 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "hidden" || fail "no hidden size: rc=$rc $err"
rc=0
err=$(k put s --model m --tokens 300 --file "$work/kv.bin" --activations 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "with X" || fail "file without X: rc=$rc $err"
rc=0
err=$(k get s --file "$work/x.bin" --activation-tokens 301 2>&1) || rc=$?
[ "$rc" -ne 0 ] && echo "$err" | grep_q "INVALID_ARGUMENT" || fail "301 X tokens: rc=$rc $err"
k seq stat s | grep_q "^activation_tokens: *300$" || fail "stat after errors: $(k seq stat s)"
echo "$name: ok"
