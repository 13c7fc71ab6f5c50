#!/usr/bin/env bash
# Make a throw-away CA, a server certificate signed by it, and a tokens file
# with one read-write token, for trying kvdepot with TLS and tokens (compose,
# or a test Kubernetes cluster). Production deployments bring certificates
# from their own CA (e.g. cert-manager) and their own tokens.
#
#   deploy/gen-dev-secrets.sh [OUT_DIR] [EXTRA_DNS_NAME...]
#
# OUT_DIR defaults to deploy/compose/secrets (ignored by git). The server
# certificate is valid for localhost, 127.0.0.1, kvdepot, and the extra names,
# e.g. "*.kvdepot-headless.kvdepot.svc.cluster.local" "kvdepot.kvdepot.svc".
# Writes ca.crt, ca.key, tls.crt, tls.key, tokens.yaml and prints the token.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out=${1:-$here/compose/secrets}
[ $# -gt 0 ] && shift
command -v openssl >/dev/null || { echo "gen-dev-secrets: openssl is needed" >&2; exit 1; }
mkdir -p "$out"
cd "$out"

san="DNS:localhost,IP:127.0.0.1,DNS:kvdepot"
for n in "$@"; do san="$san,DNS:$n"; done

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
    -subj "/CN=kvdepot test CA" -keyout ca.key -out ca.crt 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -subj "/CN=kvdepot" -keyout tls.key -out tls.csr 2>/dev/null
openssl x509 -req -in tls.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
    -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san") \
    -out tls.crt 2>/dev/null
rm -f tls.csr ca.srl

token=$(openssl rand -hex 32)
cat > tokens.yaml <<YAML
# Bearer tokens of kvdepotd (format: service/README.md). Clients send
# "authorization: Bearer <token>".
tokens:
  - token: "$token"
    tenant: default
    namespaces: ["*"]
    access: read-write
YAML
# The server runs as uid 10001 in the image and reads these through a bind
# mount: make them readable. Acceptable for throw-away test secrets only.
chmod 0644 ca.crt tls.crt tls.key tokens.yaml
chmod 0600 ca.key
echo "gen-dev-secrets: wrote $out/{ca.crt,ca.key,tls.crt,tls.key,tokens.yaml}"
echo "token: $token"
