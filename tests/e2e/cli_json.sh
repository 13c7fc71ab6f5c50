#!/usr/bin/env bash
# The kvdepot CLI's --json output, global options after the command, the
# progress line of put and get, and the bash completion, against a real
# kvdepotd. Every command that prints data is run with --json; its output is
# parsed and compared with what was stored (and with the text output where
# both carry the same figure).
#
# Usage: cli_json.sh KVDEPOTD KVDEPOT_CLI COMPLETION_SCRIPT
set -euo pipefail
server=$1
cli=$2
completion=$3
name=cli_json
. "$(dirname "${BASH_SOURCE[0]}")/cli_lib.sh"

start_server
# jq-like checks: J 'python expression over d' < json
J() { python3 -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if ($1) else 1)"; }

"$cli" version --json | J 'd["version"] == "'"$("$cli" --version | cut -d' ' -f2)"'"' ||
    fail "version --json"
k health --json | J 'd == {"status": "SERVING"}' || fail "health --json"

# Global options after the command, and between its arguments.
"$cli" model put m --addr "127.0.0.1:$port" --layers 2 --kv-heads 2 --q-heads 4 --head-dim 32 \
    --dtype f32 --json >"$work/m.json" || fail "model put with --addr after the command"
J 'd["name"] == "m" and d["layers"] == 2 and d["q_heads"] == 4 and d["dtype"] == "f32" and d["created"] is True and d["bytes_per_token"] == 2 * 2 * 2 * 32 * 4' <"$work/m.json" ||
    fail "model put --json: $(cat "$work/m.json")"
"$cli" models --json --addr="127.0.0.1:$port" | J 'len(d) == 1 and d[0]["name"] == "m" and d[0]["head_dim"] == 32' ||
    fail "models --json"
k model get m --json | J 'd["kv_heads"] == 2 and d["created_ms"] > 0' || fail "model get --json"
"$cli" --json --addr "127.0.0.1:$port" model put m --layers 2 --kv-heads 2 --q-heads 4 \
    --head-dim 32 --dtype f32 | J 'd["created"] is False' || fail "model put again --json"

# K then V of 300 tokens, 2 layers, f32; a query of 4 heads.
python3 - "$work" <<'PY'
import random, struct, sys
w = sys.argv[1]
r = random.Random(5)
kv = [r.uniform(-1, 1) for _ in range(2 * 2 * 300 * 2 * 32)]
open(w + "/kv.bin", "wb").write(struct.pack("<%df" % len(kv), *kv))
q = [r.uniform(-1, 1) for _ in range(4 * 32)]
open(w + "/q.bin", "wb").write(struct.pack("<%df" % len(q), *q))
open(w + "/ids.txt", "w").write(" ".join(str(i) for i in range(300)))
PY
k put s --model m --tokens 300 --file "$work/kv.bin" --token-ids "$work/ids.txt" --json \
    --pq m4b4i2t256 >"$work/put.json" || fail "put --json"
J 'd["id"] == "s" and d["created"] and d["tokens_appended"] == 300 and d["token_start"] == 0 and d["layers"] == 2 and d["bytes"] == 2 * 2 * 300 * 2 * 32 * 4 and d["sequence"]["num_tokens"] == 300 and d["sequence"]["layer_tokens"] == [300, 300]' <"$work/put.json" ||
    fail "put --json: $(cat "$work/put.json")"
k seq stat s --json >"$work/stat.json" || fail "seq stat --json"
J 'd["id"] == "s" and d["model"] == "m" and d["num_tokens"] == 300 and d["page_tokens"] > 0 and d["codecs"]["pq"]["m"] == 4 and d["codecs"]["pq"]["bits"] == 4 and d["codecs"]["pq"]["min_train_tokens"] == 256 and d["codecs"]["k"]["codec"] == "raw" and len(d["block_hashes"]) == 300 // d["page_tokens"]' <"$work/stat.json" ||
    fail "seq stat --json: $(cat "$work/stat.json")"
k seqs --json | J 'd == [{"id": "s", "model": "m", "tokens": 300, "sealed_pages": d[0]["sealed_pages"], "stored_bytes": d[0]["stored_bytes"]}] and d[0]["stored_bytes"] > 0' ||
    fail "seqs --json"

k get s --file "$work/back.bin" --json >"$work/get.json" || fail "get --json"
cmp "$work/kv.bin" "$work/back.bin" || fail "get --json: data differs"
J 'd["bytes"] == 2 * 2 * 300 * 2 * 32 * 4 and d["tokens"] == 300 and d["layers"] == 2 and d["dtype"] == "f32" and d["kv_heads"] == 2' <"$work/get.json" ||
    fail "get --json: $(cat "$work/get.json")"
rc=0
k get s --file - --json >/dev/null 2>&1 || rc=$?
[ "$rc" = 2 ] || fail "get --file - --json: exit $rc, want 2 (usage)"

# Hashes: the JSON list equals the text one; lookup finds them.
k hash --token-ids "$work/ids.txt" >"$work/hash.txt"
"$cli" hash --token-ids "$work/ids.txt" --json >"$work/hash.json"
python3 - "$work" <<'PY' || fail "hash --json differs from the text output"
import json, sys
w = sys.argv[1]
assert json.load(open(w + "/hash.json")) == open(w + "/hash.txt").read().split()
PY
# shellcheck disable=SC2046
k lookup --model m $(cat "$work/hash.txt") --json | J 'd["matched_blocks"] == 1 and d["matched_tokens"] > 0' ||
    fail "lookup --json"

k attend s --layer 1 --q "$work/q.bin" --out "$work/o.bin" --json >"$work/att.json" || fail "attend --json"
J 'd["tokens"] == 300 and len(d["lse"]) == 4 and all(isinstance(x, float) for x in d["lse"]) and d["out"].endswith("o.bin") and d["q_heads"] == 4' <"$work/att.json" ||
    fail "attend --json: $(cat "$work/att.json")"
text=$(k attend s --layer 1 --q "$work/q.bin")
python3 - "$work/att.json" "$text" <<'PY' || fail "attend --json LSE differs from the text output"
import json, sys
lse = json.load(open(sys.argv[1]))["lse"]
txt = [float(x) for x in sys.argv[2].split(":")[1].split()]
assert all(abs(a - b) <= 1e-5 * max(1, abs(a)) for a, b in zip(lse, txt)) and len(txt) == 4, (lse, txt)
PY
k search s --layer 0 --q "$work/q.bin" --k 5 --json >"$work/search.json" || fail "search --json"
J 'len(d["heads"]) == 2 and all(len(h["tokens"]) == 5 and len(h["scores"]) == 5 and all(0 <= t < 300 for t in h["tokens"]) for h in d["heads"])' <"$work/search.json" ||
    fail "search --json: $(cat "$work/search.json")"
k plan s --bandwidth 1G --flops 1T --json | J 'd["num_tokens"] == 300 and d["split_tokens"] == 0 and d["kv_bytes"] > 0' ||
    fail "plan --json"
k shards --json | J 'd == ["127.0.0.1:'"$port"'"]' || fail "shards --json"
k shards s t --json | J '[x["id"] for x in d] == ["s", "t"] and all(x["server"] == "127.0.0.1:'"$port"'" for x in d)' ||
    fail "shards IDS --json"
k stats --json >"$work/stats.json" || fail "stats --json"
J 'd["durability"] == "spill" and d["sequences"] == 1 and [t["name"] for t in d["tiers"]][:2] == ["device", "host"] and d["memory_bytes"]["rss"] > 0' <"$work/stats.json" ||
    fail "stats --json: $(cat "$work/stats.json")"
k seq evict s --json | J 'd["id"] == "s" and d["pages"] >= 0' || fail "seq evict --json"
k backup "$work/bk" --json | J 'd["dir"].endswith("/bk") and d["files"] > 0 and d["bytes"] > 0' ||
    fail "backup --json"
k seq rm s --json | J 'd == {"id": "s", "pages_freed": d["pages_freed"]} and d["pages_freed"] > 0' ||
    fail "seq rm --json"
k model rm m --json | J 'd == {"model": "m", "sequences_deleted": 0}' || fail "model rm --json"
# Errors stay text on stderr, with the usual exit status.
rc=0
err=$(k seq stat nope --json 2>&1 >/dev/null) || rc=$?
{ [ "$rc" = 1 ] && echo "$err" | grep_q '^kvdepot: NOT_FOUND: '; } || fail "error under --json: $rc $err"

# Progress: forced on, a line on stderr (not stdout); off by default when
# stderr is not a terminal, and with --no-progress.
k model put p --layers 1 --kv-heads 8 --head-dim 128 --dtype f16 >/dev/null
head -c $((2 * 2048 * 8 * 128 * 2)) /dev/urandom >"$work/big.bin"
KVDEPOT_PROGRESS_DELAY_MS=0 k put b --model p --tokens 2048 --file "$work/big.bin" --progress \
    >"$work/out" 2>"$work/err" || fail "put --progress"
grep_q 'put b: .* of 8.00 MiB (.*%), .*/s' "$work/err" || fail "put --progress: no progress line: $(cat -v "$work/err")"
grep_q 'of 8.00 MiB' "$work/out" && fail "progress on stdout"
KVDEPOT_PROGRESS_DELAY_MS=0 k get b --file "$work/b2.bin" --progress 2>"$work/err" >/dev/null ||
    fail "get --progress"
grep_q 'get b: .* of 8.00 MiB' "$work/err" || fail "get --progress: no progress line: $(cat -v "$work/err")"
cmp "$work/big.bin" "$work/b2.bin" || fail "get --progress: data differs"
KVDEPOT_PROGRESS_DELAY_MS=0 k get b --file "$work/b2.bin" 2>"$work/err" >/dev/null
[ ! -s "$work/err" ] || fail "progress shown with stderr not a terminal: $(cat -v "$work/err")"
if command -v script >/dev/null; then
    # On a terminal (script's pseudo-terminal): on by default, off with --no-progress.
    KVDEPOT_PROGRESS_DELAY_MS=0 script -qec "$cli --addr 127.0.0.1:$port get b --file $work/b3.bin" \
        /dev/null >"$work/tty" || fail "get on a terminal"
    grep_q 'get b: .* of 8.00 MiB' "$work/tty" || fail "no progress on a terminal: $(cat -v "$work/tty")"
    KVDEPOT_PROGRESS_DELAY_MS=0 script -qec "$cli --addr 127.0.0.1:$port get b --file $work/b3.bin --no-progress" \
        /dev/null >"$work/tty" || fail "get --no-progress on a terminal"
    grep_q 'of 8.00 MiB' "$work/tty" && fail "--no-progress on a terminal: $(cat -v "$work/tty")"
fi

# Bash completion: commands, subcommands and options from the CLI's help.
comp() {
    bash -c '
        source "$1"; shift
        COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); _kvdepot
        echo "${COMPREPLY[*]}"' _ "$completion" "$cli" "$@"
}
[ "$(comp pu)" = put ] || fail "completion 'pu': $(comp pu)"
[ "$(comp model '')" = "put get rm" ] || fail "completion 'model ': $(comp model '')"
[ "$(comp --addr x:1 seq '')" = "stat rm evict pq-rebuild" ] || fail "completion 'seq ': $(comp --addr x:1 seq '')"
[ "$(comp artifacts '')" = "get put" ] || fail "completion 'artifacts ': $(comp artifacts '')"
[ "$(comp put s --mo)" = --model ] || fail "completion 'put s --mo': $(comp put s --mo)"
[ "$(comp get s --js)" = --json ] || fail "completion 'get s --js': $(comp get s --js)"
[ "$(comp --no-p)" = --no-progress ] || fail "completion '--no-p': $(comp --no-p)"
[ "$(comp model put m --dtype b)" = bf16 ] || fail "completion '--dtype b': $(comp model put m --dtype b)"
[ "$(comp help se)" = "search seq seqs" ] || fail "completion 'help se': $(comp help se)"
echo "cli_json: PASS"
