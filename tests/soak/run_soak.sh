#!/bin/sh
# Soak kvdepotd with mixed load (tests/soak/soak.c): a table of operations,
# errors, server RSS, descriptors, threads and stored sequences every 10 s,
# then an exact read-back. Not part of CI.
#
#   tests/soak/run_soak.sh BUILD_DIR [SECONDS (1800)] [THREADS (8)]
#
# KVDEPOT_* in the environment reach the server (e.g. KVDEPOT_DEVICE,
# KVDEPOT_HOST_TIER_BYTES); the server log is printed when a call failed.
set -eu
build=${1:?usage: $0 BUILD_DIR [SECONDS] [THREADS]}
exec "$build/tests/soak" "$build/service/kvdepotd" "${2:-1800}" "${3:-8}"
