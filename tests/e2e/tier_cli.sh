#!/usr/bin/env bash
# The tier commands of the kvdepot CLI against a real kvdepotd with small
# memory tiers: put with --ttl, stats, seq evict, get back byte for byte
# after the eviction, and the TTL deleting the sequence.
#
# Usage: tier_cli.sh KVDEPOTD KVDEPOT_CLI
set -euo pipefail
# `grep -q` stops reading at the first match; under pipefail the writer then
# dies of SIGPIPE and the pipeline fails when the writer is slow (sanitizer
# builds). grep_q reads all of its input.
grep_q() { grep "$@" >/dev/null; }

server=$1
cli=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-tier-cli-XXXXXX")
pid=

fail() {
    echo "tier_cli: FAIL: $*" >&2
    [ -f "$work/server.log" ] && tail -n 30 "$work/server.log" >&2
    exit 1
}
cleanup() {
    if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

"$server" --listen 127.0.0.1:0 --data-dir "$work/data" --port-file "$work/port" \
    --metrics-listen "" --device-tier-bytes 256KiB --host-tier-bytes 256KiB \
    --durability sync >>"$work/server.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
    [ -s "$work/port" ] && break
    kill -0 "$pid" 2>/dev/null || fail "kvdepotd exited before serving"
    sleep 0.05
done
k() { "$cli" --addr "127.0.0.1:$(tr -d '\n' <"$work/port")" "$@"; }

k model put m --layers 2 --kv-heads 2 --head-dim 64 --dtype f16 >/dev/null || fail "model put"
# 700 tokens: 2 full pages and a tail per layer, more than the tiers hold.
head -c $((2 * 2 * 700 * 2 * 64 * 2)) /dev/urandom >"$work/kv.bin"
k put s1 --model m --tokens 700 --file "$work/kv.bin" >/dev/null || fail "put"
k put s2 --model m --tokens 700 --file "$work/kv.bin" --ttl 1 >/dev/null || fail "put --ttl"
out=$(k stats) || fail "stats"
echo "$out" | grep_q '^durability  sync$' || fail "stats: durability: $out"
echo "$out" | grep -Eq '^device +262144 ' || fail "stats: device tier: $out"
echo "$out" | grep -Eq '^disk +0 +[0-9]+ +12 ' || fail "stats: disk pages: $out"
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
k stats | grep -Eq '^sequences_expired +1$' || fail "stats: sequences_expired"
kill -TERM "$pid"
wait "$pid" || fail "kvdepotd exited with $? on SIGTERM"
pid=
echo "tier_cli: PASS"
