#!/usr/bin/env bash
# The Helm chart (deploy/helm/kvdepot), rendered as `helm template` would
# (helmrender: Go's text/template with sprig, from Debian), then:
#   - kubernetes-validate --strict (PyPI; the Kubernetes API schemas) on
#     every render;
#   - check_deploy.py --rendered: the checks the kustomize manifests get
#     (selectors, ports, probes, config keys kvdepotd knows, CLI flags), and
#     the pods and kvdepotd config equal to deploy/k8s's (default values vs
#     base, gpu.enabled vs the gpu overlay);
#   - values that change things change them (config merged under the
#     chart's fixed keys, storage class, replicas), and an empty secretName
#     fails the render with its message.
#
#   helm_test.sh HELMRENDER KUBERNETES_VALIDATE REPO_ROOT KVDEPOTD KVDEPOT
set -euo pipefail
render=$1 validate=$2 root=$3 server=$4 cli=$5
chart=$root/deploy/helm/kvdepot
[ -x "$validate" ] || { echo "helm_test: $validate missing (deploy/dev.sh test makes build/py-deploy)" >&2; exit 1; }
work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-helm.XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "helm_test: FAIL: $*" >&2; exit 1; }

"$render" "$chart" kvdepot kvdepot >"$work/default.yaml" 2>"$work/notes" || fail "default render"
grep -q 'shards:kvdepot-headless.kvdepot.svc.cluster.local:50051' "$work/notes" ||
    fail "NOTES.txt does not give the shard address"
"$render" "$chart" kvdepot kvdepot "$root/tests/deploy/helm-values-gpu.yaml" \
    >"$work/gpu.yaml" 2>/dev/null || fail "gpu render"
cat >"$work/custom.yaml" <<'VALUES'
replicas: 5
persistence: {storageClassName: fast-ssd, size: 10Gi}
config: {disk-bytes: 80GiB, listen: "1.2.3.4:1", durability: sync}
image: {tag: "9.9.9"}
VALUES
"$render" "$chart" rel ns "$work/custom.yaml" >"$work/custom-out.yaml" 2>/dev/null || fail "custom render"

"$validate" --strict --quiet "$work/default.yaml" "$work/gpu.yaml" "$work/custom-out.yaml" \
    >"$work/validate.log" 2>&1 || { cat "$work/validate.log" >&2; fail "kubernetes-validate"; }
# Everything but the ServiceMonitor (a CRD) has a schema and passed.
grep -q ERROR "$work/validate.log" && { cat "$work/validate.log" >&2; fail "kubernetes-validate"; }
[ "$(grep -c '^kind:' "$work/default.yaml")" = 5 ] || fail "default render: not 5 objects"

python3 "$root/tests/deploy/check_deploy.py" "$root" --kvdepotd "$server" --kvdepot "$cli" \
    --rendered "helm=$work/default.yaml" --rendered "helm-gpu=$work/gpu.yaml" ||
    fail "check_deploy.py on the renders"

python3 - "$work/custom-out.yaml" <<'PY' || fail "custom values"
import sys, yaml
objs = {o["kind"]: o for o in yaml.safe_load_all(open(sys.argv[1])) if o}
cfg = yaml.safe_load(objs["ConfigMap"]["data"]["kvdepot.yaml"])
assert cfg["disk-bytes"] == "80GiB" and cfg["durability"] == "sync", cfg
assert cfg["listen"] == "0.0.0.0:50051", "config overrode the chart's listen: %s" % cfg["listen"]
ss = objs["StatefulSet"]
assert ss["spec"]["replicas"] == 5
assert ss["metadata"]["name"] == "rel-kvdepot", ss["metadata"]["name"]
pvc = ss["spec"]["volumeClaimTemplates"][0]["spec"]
assert pvc["storageClassName"] == "fast-ssd" and pvc["resources"]["requests"]["storage"] == "10Gi", pvc
assert ss["spec"]["template"]["spec"]["containers"][0]["image"] == "kvdepot:9.9.9"
assert "ServiceMonitor" not in objs
PY

echo 'secretName: ""' >"$work/nosecret.yaml"
if "$render" "$chart" kvdepot kvdepot "$work/nosecret.yaml" >/dev/null 2>"$work/err"; then
    fail "an empty secretName rendered"
fi
grep -q 'secretName: the Secret with tls.crt' "$work/err" || fail "no message for secretName: $(cat "$work/err")"
echo "helm_test: ok"
