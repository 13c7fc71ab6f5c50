#!/usr/bin/env bash
# run_python_client.sh PYTHON CLIENT_DIR LIB_DIR KVDEPOTD WORK
# Build the kvdepot wheel from a copy of CLIENT_DIR/python against
# CLIENT_DIR/include and the libkvdepot in LIB_DIR, install it into a fresh
# virtual environment under WORK, and run its tests against KVDEPOTD.
set -euo pipefail
py=$1 client=$2 libdir=$3 server=$4 work=$5
fatal() { echo "python_client: FATAL: $*" >&2; exit 1; }
rm -rf "$work"
mkdir -p "$work"
"$py" -c 'import cffi, numpy, pytest, setuptools, wheel' 2>/dev/null ||
    fatal "$py lacks cffi, numpy, pytest or setuptools (deploy/dev.sh test installs python3-cffi python3-numpy python3-pytest python3-setuptools python3-wheel)"
"$py" -m venv --system-site-packages "$work/venv" || fatal "python3 -m venv failed (python3-venv)"
cp -r "$client/python" "$work/src" # builds leave their files beside the sources
export KVDEPOT_INCLUDE_DIR=$client/include KVDEPOT_LIB_DIR=$libdir
"$work/venv/bin/pip" wheel -q --no-build-isolation --no-deps --no-index -w "$work/wheel" \
    "$work/src"
wheel=$(ls "$work"/wheel/kvdepot-*.whl)
"$work/venv/bin/pip" install -q --no-deps --no-index "$wheel"
echo "built and installed $(basename "$wheel")"
cd "$work"
KVDEPOTD=$server "$work/venv/bin/python" -m pytest -q -p no:cacheprovider "$work/src/tests"
