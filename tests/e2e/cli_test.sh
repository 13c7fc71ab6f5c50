#!/usr/bin/env bash
# End-to-end test of the kvdepot CLI against a real kvdepotd: register a
# model, put a file of raw K/V, get it back byte for byte (whole and in
# ranges), prefix hashes and lookup, restart, and the error paths (message
# format and exit codes).
#
# Usage: cli_test.sh KVDEPOTD KVDEPOT_CLI
set -euo pipefail
# `grep -q` stops reading at the first match; under pipefail the writer then
# dies of SIGPIPE and the pipeline fails when the writer is slow (sanitizer
# builds). grep_q reads all of its input.
grep_q() { grep "$@" >/dev/null; }

server=$1
cli=$2
work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-cli-XXXXXX")
pid=

fail() {
    echo "cli_test: FAIL: $*" >&2
    if [ -f "$work/server.log" ]; then
        echo "---- server log ----" >&2
        tail -n 40 "$work/server.log" >&2
    fi
    exit 1
}

start() {
    rm -f "$work/port"
    "$server" --listen "127.0.0.1:${port:-0}" --data-dir "$work/data" \
        --port-file "$work/port" >>"$work/server.log" 2>&1 &
    pid=$!
    for _ in $(seq 1 600); do
        if [ -s "$work/port" ] && [ "$(tail -c 1 "$work/port" | od -An -c | tr -d ' ')" = '\n' ]; then
            port=$(tr -d '\n' <"$work/port")
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            # The old port may have been taken meanwhile; any port will do.
            if [ "${port:-0}" != 0 ]; then
                port=0
                start
                return 0
            fi
            fail "kvdepotd exited before serving"
        fi
        sleep 0.05
    done
    fail "kvdepotd wrote no port file"
}

stop() {
    kill -TERM "$pid"
    local rc=0
    wait "$pid" || rc=$?
    pid=
    [ "$rc" -eq 0 ] || fail "kvdepotd exited with $rc on SIGTERM"
}

cleanup() {
    if [ -n "$pid" ]; then kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

start
k() { "$cli" --addr "127.0.0.1:$port" "$@"; }

# Expect failure with a given exit code and an error line "kvdepot: STATUS: ...".
expect_error() {
    local want_status=$1 want_rc=$2
    shift 2
    local out rc=0
    out=$("$@" 2>&1) || rc=$?
    [ "$rc" -eq "$want_rc" ] || fail "'$*' exited $rc, want $want_rc (output: $out)"
    case "$out" in
    *"kvdepot: $want_status"*) ;;
    *) fail "'$*' printed '$out', want 'kvdepot: $want_status...'" ;;
    esac
}

[ "$(k health)" = SERVING ] || fail "health is not SERVING"
k --help >/dev/null
"$cli" help | grep_q "model put" || fail "help text lacks 'model put'"
# --version (the library's, the server's release), help CMD, CMD --help.
[ "$("$cli" --version)" = "kvdepot $("$server" --version | cut -d' ' -f2)" ] ||
    fail "--version: $("$cli" --version)"
[ "$("$cli" version)" = "$("$cli" --version)" ] || fail "version"
out=$("$cli" help put) || fail "help put"
echo "$out" | head -1 | grep_q "^  put ID --model M" || fail "help put: $out"
echo "$out" | grep_q "model put\|  get ID" && fail "help put shows other commands: $out"
out=$("$cli" seq --help) || fail "seq --help"
[ "$(echo "$out" | grep -c '^  seq ')" = 4 ] || fail "seq --help: $out"
[ "$("$cli" plan x -h)" = "$("$cli" help plan)" ] || fail "plan -h differs from help plan"
expect_error '' 2 "$cli" help nope

# A small model: 4 layers x 2 kv heads x 64 dims, f16 -> 512 bytes per token of K.
k model put tiny --layers 4 --kv-heads 2 --q-heads 8 --head-dim 64 --dtype f16 --revision r1 >/dev/null
k model put tiny --layers 4 --kv-heads 2 --q-heads 8 --head-dim 64 --dtype f16 --revision r1 |
    grep_q "already" || fail "putting the same model twice is not reported as unchanged"
k models | grep_q '^tiny ' || fail "models does not list tiny"
k model get tiny | grep_q 'layers: *4' || fail "model get tiny lacks 'layers: 4'"

per_token=$((2 * 4 * 2 * 64 * 2)) # K+V bytes per token over all layers
head -c $((300 * per_token)) /dev/urandom >"$work/kv.bin"
k put req-1 --model tiny --tokens 300 --file "$work/kv.bin" >/dev/null
k seq stat req-1 | grep_q 'num_tokens: *300' || fail "seq stat does not show 300 tokens"
k get req-1 --file "$work/back.bin" >/dev/null
cmp "$work/kv.bin" "$work/back.bin" || fail "get returned different bytes"
k get req-1 --file - | cmp - "$work/kv.bin" || fail "get to stdout returned different bytes"

# A second put appends at the end: the file then reads back as the two
# halves of each of K and V interleaved per layer, so compare via ranges.
head -c $((20 * per_token)) /dev/urandom >"$work/kv2.bin"
k put req-1 --model tiny --tokens 20 --file "$work/kv2.bin" >/dev/null
k get req-1 --file "$work/tail.bin" --token-start 300 --tokens 20 >/dev/null
cmp "$work/kv2.bin" "$work/tail.bin" || fail "appended range reads back different"
k get req-1 --file "$work/head.bin" --tokens 300 >/dev/null
cmp "$work/kv.bin" "$work/head.bin" || fail "first range changed after the second put"

# Layer by layer: layer 2 alone.
layer_bytes=$((2 * 2 * 64 * 2)) # K+V bytes per token of one layer
head -c $((10 * layer_bytes)) /dev/urandom >"$work/l2.bin"
k put req-2 --model tiny --tokens 10 --layer-start 2 --layers 1 --file "$work/l2.bin" >/dev/null
k get req-2 --file "$work/l2back.bin" --layer-start 2 --layers 1 --tokens 10 >/dev/null
cmp "$work/l2.bin" "$work/l2back.bin" || fail "single-layer put/get differs"

k seqs | grep_q '^req-1 ' || fail "seqs does not list req-1"
k seqs --model tiny | grep_q '^req-2 ' || fail "seqs --model tiny does not list req-2"

# Prefix hashes: 600 token ids -> 2 complete blocks of 256.
page=$(k seq stat req-1 | awk '/page_tokens:/ {print $2}')
seq 1 600 >"$work/ids.txt"
k hash --token-ids "$work/ids.txt" --page-tokens "$page" >"$work/hashes.txt"
nblocks=$((600 / page))
[ "$(wc -l <"$work/hashes.txt")" -eq "$nblocks" ] || fail "hash printed the wrong number of blocks"
head -c $((600 * per_token)) /dev/urandom >"$work/kv600.bin"
k put req-3 --model tiny --tokens 600 --file "$work/kv600.bin" --token-ids "$work/ids.txt" >/dev/null
# shellcheck disable=SC2046
k lookup --model tiny $(cat "$work/hashes.txt") | grep_q "matched_blocks: $nblocks" ||
    fail "lookup does not find the $nblocks blocks"
k lookup --model tiny 0123456789abcdef | grep_q "matched_blocks: 0" || fail "lookup of a bogus hash matched"

# Restart: everything is still there.
stop
start
k get req-1 --file "$work/back2.bin" --tokens 300 >/dev/null
cmp "$work/kv.bin" "$work/back2.bin" || fail "data differs after restart"
k get req-3 --file "$work/back600.bin" >/dev/null
cmp "$work/kv600.bin" "$work/back600.bin" || fail "req-3 differs after restart"

# Errors: status name and message on stderr, exit status 1; usage errors 2.
expect_error 'NOT_FOUND: ' 1 k seq stat nope
expect_error 'NOT_FOUND: ' 1 k get nope --file "$work/x.bin"
expect_error 'NOT_FOUND: ' 1 k model get nope
expect_error 'NOT_FOUND: ' 1 k put req-9 --model nope --tokens 1 --file "$work/kv.bin"
expect_error 'OUT_OF_RANGE: ' 1 k get req-1 --file "$work/x.bin" --token-start 400 --tokens 10
expect_error 'INVALID_ARGUMENT: ' 1 k model put "bad name" --layers 1 --kv-heads 1 --head-dim 8 --dtype f16
expect_error 'ALREADY_EXISTS: ' 1 k model put tiny --layers 5 --kv-heads 2 --head-dim 64 --dtype f16
expect_error 'FAILED_PRECONDITION: ' 1 k model rm tiny
expect_error '' 1 k put req-1 --model tiny --tokens 7 --file "$work/kv.bin" # size mismatch
expect_error '' 2 k model put x --layers 1
expect_error '' 2 k frobnicate
expect_error '' 2 k get req-1
expect_error 'UNAVAILABLE: ' 1 "$cli" --addr 127.0.0.1:1 --deadline-ms 3000 health
grep -q . "$work/x.bin" 2>/dev/null && fail "a failed get left data in its file"

k seq rm req-2 >/dev/null
expect_error 'NOT_FOUND: ' 1 k seq stat req-2
k model rm tiny --force | grep_q "2 sequences" || fail "model rm --force did not report 2 sequences"
expect_error 'NOT_FOUND: ' 1 k seq stat req-1
stop
echo "cli_test: PASS"
