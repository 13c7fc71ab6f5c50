#!/usr/bin/env bash
# run_python_client.sh PYTHON CLIENT_DIR LIB_DIR KVDEPOTD WORK [TEST_FILE] [VENV]
# Build the kvdepot wheel from a copy of CLIENT_DIR/python against
# CLIENT_DIR/include and the libkvdepot in LIB_DIR, install it into a
# virtual environment, and run its tests (TEST_FILE of its tests/, default
# test_client.py) against KVDEPOTD. The environment is a fresh one under
# WORK (Debian's packages through --system-site-packages), or VENV when
# given: one deploy/dev.sh test prepared with the pinned packages of
# tests/python/engine-requirements.txt.
set -euo pipefail
py=$1 client=$2 libdir=$3 server=$4 work=$5 tests=${6:-test_client.py} venv=${7:-}
fatal() { echo "python_client: FATAL: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work"
"$py" -c 'import cffi, numpy, pytest, setuptools, wheel' 2>/dev/null ||
    fatal "$py lacks cffi, numpy, pytest or setuptools (deploy/dev.sh test installs python3-cffi python3-numpy python3-pytest python3-setuptools python3-wheel)"
if [ -n "$venv" ]; then
    "$venv/bin/python" -c 'import torch, transformers' 2>/dev/null ||
        fatal "$venv lacks torch or transformers: deploy/dev.sh test makes it (Debian's python3-torch, tests/python/engine-requirements.txt)"
else
    venv=$work/venv
    "$py" -m venv --system-site-packages "$venv" || fatal "python3 -m venv failed (python3-venv)"
fi
cp -r "$client/python" "$work/src" # builds leave their files beside the sources
export KVDEPOT_INCLUDE_DIR=$client/include KVDEPOT_LIB_DIR=$libdir
"$venv/bin/pip" wheel -q --no-build-isolation --no-deps --no-index -w "$work/wheel" \
    "$work/src"
wheel=$(ls "$work"/wheel/kvdepot-*.whl)
"$venv/bin/pip" install -q --force-reinstall --no-deps --no-index "$wheel"
echo "built and installed $(basename "$wheel") into $venv"
cd "$work"
KVDEPOTD=$server "$venv/bin/python" -m pytest -q -rA -p no:cacheprovider "$work/src/tests/$tests"
