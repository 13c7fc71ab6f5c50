#!/usr/bin/env bash
# kvdepot developer entry point.
#
#   deploy/dev.sh run    install what is missing, build, start kvdepotd on its
#                        embedded defaults (127.0.0.1:50051, ./kvdepot-data)
#   deploy/dev.sh test   install what is missing (test tools included), build,
#                        run the whole test suite with ctest, then the unit,
#                        backend and e2e suites again under ASan+UBSan
#   deploy/dev.sh build  install build dependencies and build only
#   deploy/dev.sh deps [--test]  install dependencies only
#
# Works on Debian 12 as root or as a user with sudo. Environment:
#   KVD_BUILD_DIR   build directory (default: <repo>/build)
#   KVD_JOBS        parallel build jobs (default: nproc)
#   KVD_CMAKE_ARGS  extra arguments for cmake configure
#   KVD_TEST_SANITIZE=0  skip the sanitizer pass of `test`
#   KVD_IMAGE_TEST=0|1   skip / force the container image build of `test`
#                        (default: on as root)
#   KVD_TEST_TSAN=1      add a ThreadSanitizer pass of `test`: the store's
#                        concurrency tests (tiers, appends, reads) in process
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# Build the container image as part of `test` when running as root (it needs
# debootstrap); KVD_IMAGE_TEST=0 skips it, 1 forces it.
if [ -z "${KVD_IMAGE_TEST:-}" ]; then
    KVD_IMAGE_TEST=0
    [ "$(id -u)" -eq 0 ] && KVD_IMAGE_TEST=1
fi
export KVD_IMAGE_TEST
build=${KVD_BUILD_DIR:-$root/build}
jobs=${KVD_JOBS:-$(nproc 2>/dev/null || echo 2)}

build_pkgs=(build-essential cmake pkg-config ca-certificates
            libgrpc-dev grpc-proto protobuf-c-compiler libprotobuf-c-dev
            librocksdb-dev libxxhash-dev libyaml-dev libmicrohttpd-dev libjson-c-dev libisal-dev)
# Test tools, all from Debian: the Python interop client (grpcio), the Go
# interop client (gRPC-Go and the v1.3 protoc-gen-go it speaks), Redis, and
# what the Python package builds and tests with (cffi, NumPy, pytest, venv;
# PyTorch for the transformers integration, whose other packages come from
# PyPI, pinned: engines_venv), promtool (prometheus) for deploy/monitoring,
# and sprig for rendering the Helm chart (deploy_helm; its schema checker
# comes from PyPI, pinned: deploy_venv).
test_pkgs=(libcmocka-dev python3 python3-yaml python3-grpcio python3-protobuf protobuf-compiler
           python3-dev python3-venv python3-setuptools python3-wheel python3-cffi python3-numpy
           python3-pytest python3-torch
           golang-go golang-google-grpc-dev protoc-gen-go-1-3
           redis-server redis-tools libhiredis-dev procps openssl curl
           prometheus golang-github-masterminds-sprig-dev)

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

install_pkgs() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null ||
            missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "kvdepot: installing ${missing[*]}" >&2
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

deps() {
    install_pkgs "${build_pkgs[@]}"
    if [ "${1:-}" = "--test" ]; then
        install_pkgs "${test_pkgs[@]}"
        # The container image test builds deploy/Dockerfile for real with
        # podman (chroot isolation, Debian base made by debootstrap).
        if [ "$KVD_IMAGE_TEST" = 1 ]; then install_pkgs podman debootstrap; fi
    fi
}

# The python_transformers test's virtual environment: Debian's torch (CPU)
# through the system site packages, transformers and its dependencies from
# PyPI at the versions tests/python/engine-requirements.txt pins.
engines_venv() {
    local venv=$build/py-engines
    [ -x "$venv/bin/pip" ] || /usr/bin/python3 -m venv --system-site-packages "$venv"
    "$venv/bin/pip" install -q --require-virtualenv --disable-pip-version-check \
        -r "$root/tests/python/engine-requirements.txt"
}

# deploy_helm's schema checker (kubernetes-validate) at the versions
# tests/deploy/deploy-requirements.txt pins.
deploy_venv() {
    local venv=$build/py-deploy
    [ -x "$venv/bin/pip" ] || /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install -q --require-virtualenv --disable-pip-version-check \
        -r "$root/tests/deploy/deploy-requirements.txt"
}

configure_and_build() {
    # shellcheck disable=SC2086
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo ${KVD_CMAKE_ARGS:-} >/dev/null
    cmake --build "$build" -j "$jobs"
}

case "${1:-}" in
run)
    shift
    deps
    configure_and_build
    exec "$build/service/kvdepotd" "$@"
    ;;
test)
    shift
    deps --test
    configure_and_build
    engines_venv
    deploy_venv
    (cd "$build" && ctest --output-on-failure -j "$jobs" "$@")
    # Second pass: the unit, backend and end-to-end suites again under
    # AddressSanitizer + UndefinedBehaviorSanitizer (CPU build; the slow
    # 512 MiB cases are left to the first pass). KVD_TEST_SANITIZE=0 skips it.
    if [ "${KVD_TEST_SANITIZE:-1}" != 0 ]; then
        asan=${KVD_ASAN_BUILD_DIR:-$build-asan}
        cmake -S "$root" -B "$asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVD_WITH_CUDA=OFF \
            -DKVD_INTEROP_GO=OFF -DKVD_SANITIZE=address,undefined >/dev/null
        cmake --build "$asan" -j "$jobs"
        (cd "$asan" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
            UBSAN_OPTIONS=print_stacktrace=1 \
            ctest --output-on-failure -j "$jobs" -L "unit|backend|e2e" -LE slow)
    fi
    # Optional third pass: ThreadSanitizer over the store's multi-threaded
    # tests. In process only: gRPC, Abseil and RocksDB come from Debian
    # uninstrumented, so a TSan kvdepotd mostly reports (and crawls through)
    # their internals; tests/e2e/tsan.supp names those that remain in process.
    if [ "${KVD_TEST_TSAN:-0}" = 1 ]; then
        tsan=${KVD_TSAN_BUILD_DIR:-$build-tsan}
        cmake -S "$root" -B "$tsan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKVD_WITH_CUDA=OFF \
            -DKVD_SANITIZE=thread >/dev/null
        cmake --build "$tsan" -j "$jobs" --target test_tier test_store
        (cd "$tsan" && TSAN_OPTIONS="halt_on_error=1 suppressions=$root/tests/e2e/tsan.supp" \
            ctest --output-on-failure -R '^store_(tier|store)$')
    fi
    ;;
build)
    deps
    configure_and_build
    ;;
deps)
    shift
    deps "$@"
    ;;
*)
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
