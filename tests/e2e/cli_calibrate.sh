#!/usr/bin/env bash
# The kvdepot CLI's calibrate and artifacts subcommands against a real
# kvdepotd: calibrate from a sample file, artifacts get, put back into another
# model of the same shape and get again (bit-exact), and their errors.
#
# Usage: cli_calibrate.sh KVDEPOTD KVDEPOT_CLI
set -euo pipefail
server=$1
cli=$2
name=cli_calibrate
. "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

start_server

k model put m --layers 2 --kv-heads 2 --q-heads 4 --head-dim 16 --dtype f32 >/dev/null
k model put m2 --layers 2 --kv-heads 2 --q-heads 4 --head-dim 16 --dtype f32 >/dev/null
# K then V of 200 tokens of layers 0 and 1, and Q.
python3 - "$work" <<'PY'
import random, struct, sys
w = sys.argv[1]
r = random.Random(5)
kv = [r.uniform(-1, 1) for _ in range(2 * 2 * 200 * 2 * 16)]
open(w + "/kv.bin", "wb").write(struct.pack("<%df" % len(kv), *kv))
q = [r.uniform(-1, 1) for _ in range(2 * 200 * 4 * 16)]
open(w + "/q.bin", "wb").write(struct.pack("<%df" % len(q), *q))
open(w + "/short.bin", "wb").write(struct.pack("<%df" % 10, *kv[:10]))
PY
out=$(k calibrate --model m --tokens 200 --file "$work/kv.bin" --q "$work/q.bin" --vq d4b4 --svd --seed 3) \
    || fail "calibrate failed"
echo "$out" | grep_q "calibrated 400 tokens; 28 artifacts stored" || fail "calibrate said: $out"
[ "$(echo "$out" | tail -n +3 | wc -l)" = 4 ] || fail "calibrate: expected 4 error rows: $out"

# Codec advice: 512 tokens a layer (a quarter held out), printed as --k/--v
# arguments that put then takes.
k model put m3 --layers 2 --kv-heads 2 --q-heads 4 --head-dim 16 --dtype f32 >/dev/null
python3 - "$work" <<'PY'
import random, struct, sys
w = sys.argv[1]
r = random.Random(6)
kv = [r.gauss(0, 1) for _ in range(2 * 2 * 512 * 2 * 16)]
open(w + "/kv512.bin", "wb").write(struct.pack("<%df" % len(kv), *kv))
q = [r.gauss(0, 1) for _ in range(2 * 512 * 4 * 16)]
open(w + "/q512.bin", "wb").write(struct.pack("<%df" % len(q), *q))
PY
out=$(k calibrate --model m3 --tokens 512 --file "$work/kv512.bin" --q "$work/q512.bin" \
    --error-budget 0.05 --eval-queries 8 --exhaustive) || fail "calibrate --error-budget failed"
echo "$out" | grep_q "codec advice (error budget 0.05: .* of 8 held-out queries over 128 held-out" ||
    fail "calibrate --error-budget said: $out"
[ "$(echo "$out" | grep -c '^  layer [01]: --k .*; exhaustive: --k ')" = 2 ] ||
    fail "calibrate: expected 2 layer lines: $out"
# raw and INT4/INT2 in groups of 32, 64 and 128 along tokens (head_dim 16
# takes no token-axis group), for K and V of 2 layers
[ "$(echo "$out" | grep -c '^    [kv] ')" = 28 ] || fail "calibrate: expected 28 candidates: $out"
args=$(echo "$out" | sed -n 's/^  every layer: \(--k [^ ]* --v [^ ]*\) .*/\1/p')
[ -n "$args" ] || fail "no model-wide advice: $out"
# shellcheck disable=SC2086
k put adv --model m3 --tokens 512 --file "$work/kv512.bin" $args >/dev/null ||
    fail "put with the advised codecs ($args) failed"
if k calibrate --model m3 --tokens 512 --file "$work/kv512.bin" --error-budget 0.05 2>/dev/null; then
    fail "codec advice without --q accepted"
fi

k artifacts get --model m --file "$work/a.bin" >/dev/null || fail "artifacts get"
k artifacts put --model m2 --file "$work/a.bin" | grep_q "stored 28 artifacts" || fail "artifacts put"
k artifacts get --model m2 --file "$work/b.bin" >/dev/null || fail "artifacts get m2"
cmp -s "$work/a.bin" "$work/b.bin" || fail "artifacts differ after a round trip"
k artifacts get --model m --kind 1 --file "$work/l.bin" >/dev/null || fail "artifacts get --kind"
# 4 key smoothing vectors of 16 floats, each after a 24-byte record header.
[ "$(stat -c %s "$work/l.bin")" = $((4 * (24 + 64))) ] || fail "kind filter"

# Errors: nothing stored, nonzero exit.
if k calibrate --model m --tokens 199 --file "$work/kv.bin" 2>/dev/null; then fail "bad sample size accepted"; fi
rc=0
: >"$work/empty.bin"
k calibrate --model m --tokens 0 --file "$work/empty.bin" 2>/dev/null || rc=$?
[ "$rc" -eq 2 ] || fail "calibrate --tokens 0: exit $rc, want 2 (a usage error)"
if k calibrate --model nosuch --tokens 200 --file "$work/kv.bin" 2>/dev/null; then fail "unknown model"; fi
if k artifacts put --model m2 --file "$work/short.bin" 2>/dev/null; then fail "malformed file accepted"; fi
head -c 100 "$work/a.bin" >"$work/trunc.bin"
if k artifacts put --model m2 --file "$work/trunc.bin" 2>/dev/null; then fail "truncated file accepted"; fi
k artifacts get --model m2 --file "$work/c.bin" >/dev/null
cmp -s "$work/a.bin" "$work/c.bin" || fail "a failed put changed the artifacts"
echo "cli_calibrate: PASS"
