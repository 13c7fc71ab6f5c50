#!/usr/bin/env bash
# deploy/monitoring against a live kvdepotd (ctest deploy_monitoring):
#   - a /metrics scrape after some calls passes `promtool check metrics`;
#   - the alerting rules pass `promtool check rules`, and their unit tests
#     (tests/deploy/kvdepot-alerts.test.yaml) `promtool test rules`;
#   - check_monitoring.py: every metric an alert or dashboard query reads is
#     exported, the dashboard is well-formed, its PromQL parses.
#
#   monitoring_test.sh KVDEPOTD KVDEPOT REPO_ROOT
# promtool is in Debian's prometheus package (deploy/dev.sh deps --test).
set -euo pipefail
server=$1 cli=$2 root=$3
command -v promtool >/dev/null ||
    { echo "monitoring_test: promtool not found (Debian package prometheus: deploy/dev.sh deps --test)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-monitoring.XXXXXX")
pid=
cleanup() {
    [ -z "$pid" ] || { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
    rm -rf "$work"
}
trap cleanup EXIT
fail() {
    echo "monitoring_test: FAIL: $*" >&2
    [ ! -f "$work/log" ] || tail -n 20 "$work/log" >&2
    exit 1
}

"$server" --listen 127.0.0.1:0 --port-file "$work/port" --metrics-listen 127.0.0.1:0 \
    --data-dir "$work/data" --threads 2 >"$work/log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
    grep -q 'msg=serving' "$work/log" && break
    kill -0 "$pid" 2>/dev/null || fail "kvdepotd exited"
    sleep 0.1
done
grep -q 'msg=serving' "$work/log" || fail "kvdepotd did not start"
k() { "$cli" --addr "127.0.0.1:$(cat "$work/port")" "$@"; }
mport=$(grep -o 'metrics_port=[0-9]*' "$work/log" | head -n 1 | cut -d= -f2)

# Calls that make the labelled series appear: a model, an append, a read, a
# call that fails.
k model put m --layers 1 --kv-heads 1 --head-dim 8 --dtype f16 >/dev/null
head -c 128 /dev/urandom >"$work/kv"
k put s1 --model m --tokens 4 --file "$work/kv" >/dev/null
k get s1 --file "$work/back" >/dev/null
cmp -s "$work/kv" "$work/back" || fail "the sequence did not read back"
! k seq stat nosuch >/dev/null 2>&1 || fail "a missing sequence was found"
curl -sf "http://127.0.0.1:$mport/metrics" >"$work/metrics.txt" || fail "no /metrics"
grep -q 'kvdepot_requests_total{method="Append",status="OK"} [1-9]' "$work/metrics.txt" ||
    fail "the append is not counted"

promtool check metrics <"$work/metrics.txt" || fail "promtool check metrics"
promtool check rules "$root/deploy/monitoring/kvdepot-alerts.yaml" || fail "promtool check rules"
promtool test rules "$root/tests/deploy/kvdepot-alerts.test.yaml" || fail "promtool test rules"
python3 "$root/tests/deploy/check_monitoring.py" "$work/metrics.txt" \
    "$root/deploy/monitoring/kvdepot-alerts.yaml" "$root/deploy/monitoring/kvdepot-dashboard.json" ||
    fail "check_monitoring.py"
echo "monitoring_test: ok"
