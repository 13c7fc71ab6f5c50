#!/usr/bin/env bash
# The tier commands of the kvdepot CLI against a real kvdepotd with small
# memory tiers: put with --ttl, stats, seq evict, get back byte for byte
# after the eviction, and the TTL deleting the sequence.
#
# Usage: tier_cli.sh KVDEPOTD KVDEPOT_CLI
set -euo pipefail
server=$1
cli=$2
name=tier_cli
. "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

start_server --metrics-listen "" --device-tier-bytes 256KiB --host-tier-bytes 256KiB --durability sync

k model put m --layers 2 --kv-heads 2 --head-dim 64 --dtype f16 >/dev/null || fail "model put"
# 700 tokens: 2 full pages and a tail per layer, more than the tiers hold.
head -c $((2 * 2 * 700 * 2 * 64 * 2)) /dev/urandom >"$work/kv.bin"
k put s1 --model m --tokens 700 --file "$work/kv.bin" >/dev/null || fail "put"
k put s2 --model m --tokens 700 --file "$work/kv.bin" --ttl 1 >/dev/null || fail "put --ttl"
out=$(k stats) || fail "stats"
echo "$out" | grep_q '^durability  sync$' || fail "stats: durability: $out"
echo "$out" | grep_q -E '^backend +(cpu|cuda) \([1-9][0-9]* CPU threads\)$' || fail "stats: backend: $out"
echo "$out" | grep_q -E '^device +262144 ' || fail "stats: device tier: $out"
echo "$out" | grep_q -E '^disk +0 +[0-9]+ +12 ' || fail "stats: disk pages: $out"
k seq evict s1 | grep_q 'evicted from memory' || fail "seq evict"
k get s1 --file "$work/back.bin" >/dev/null || fail "get"
cmp -s "$work/kv.bin" "$work/back.bin" || fail "bytes differ after eviction"
k seq evict nope 2>"$work/err" && fail "evict of a missing sequence succeeded"
grep -q 'NOT_FOUND' "$work/err" || fail "evict of a missing sequence: $(cat "$work/err")"
for _ in $(seq 1 40); do
    k seq stat s2 >/dev/null 2>&1 || break
    sleep 0.1
done
k seq stat s2 >/dev/null 2>&1 && fail "s2 outlived its TTL"
k stats | grep_q -E '^sequences_expired +1$' || fail "stats: sequences_expired"
kill -TERM "$pid"
wait "$pid" || fail "kvdepotd exited with $? on SIGTERM"
pid=
echo "tier_cli: PASS"
