#!/usr/bin/env bash
# The install tree: `cmake --install` into a fresh prefix gives kvdepotd,
# the CLI, the header, the shared library and one self-contained static
# archive, with pkg-config files and a CMake package; a small program is
# built against that tree four ways (pkg-config shared and static,
# find_package shared and static) and runs: the library's version, and
# local attention (the kernels inside the archive) against a value
# computed by hand.
#
# Usage: install_test.sh BUILD_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-install-XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() {
    echo "install_test: FAIL: $*" >&2
    exit 1
}
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >"$work/install.log" 2>&1 ||
    fail "cmake --install: $(tail -5 "$work/install.log")"
libdir=$(dirname "$(find "$prefix" -name libkvdepot.a | head -1)")
for f in bin/kvdepotd bin/kvdepot include/kvdepot.h share/bash-completion/completions/kvdepot; do
    [ -e "$prefix/$f" ] || fail "$f not installed"
done
for f in libkvdepot.a libkvdepot.so pkgconfig/kvdepot.pc pkgconfig/kvdepot-static.pc \
    cmake/kvdepot/kvdepotConfig.cmake cmake/kvdepot/kvdepotConfigVersion.cmake; do
    [ -e "$libdir/$f" ] || fail "$libdir/$f not installed"
done
"$prefix/bin/kvdepotd" --version >/dev/null || fail "installed kvdepotd does not run"
# The archive needs nothing of kvdepot's beyond itself.
nm -u "$libdir/libkvdepot.a" 2>/dev/null | awk '{print $2}' | grep -E '^kvd_|^kvd__|^kvdepot__' |
    sort -u >"$work/undef"
nm --defined-only "$libdir/libkvdepot.a" 2>/dev/null | awk 'NF == 3 {print $3}' | sort -u >"$work/def"
missing=$(comm -23 "$work/undef" "$work/def")
[ -z "$missing" ] || fail "libkvdepot.a leaves kvdepot symbols undefined: $missing"

cat >"$work/prog.c" <<'C'
#include <kvdepot.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

int main(void)
{
    /* one query head over two tokens: out = softmax(q.k) v */
    float q[2] = {1, 0}, k[4] = {1, 0, 0, 1}, v[4] = {1, 2, 3, 4}, out[2], lse;
    if (kvdepot_attention_local(KVDEPOT_DTYPE_F32, 1, 1, 2, 1.0f, q, k, v, 2, out, &lse) != 0)
        return 2;
    double w = exp(1.0) / (exp(1.0) + 1.0);
    if (fabs(out[0] - (w * 1 + (1 - w) * 3)) > 1e-5 || fabs(lse - log(exp(1.0) + 1.0)) > 1e-5)
        return 3;
    printf("%s\n", kvdepot_version());
    return 0;
}
C
want=$("$prefix/bin/kvdepotd" --version | cut -d' ' -f2)
check() { # check NAME BINARY LINKAGE(shared|static)
    local got
    got=$(LD_LIBRARY_PATH="$libdir" "$2") || fail "$1: the program failed ($?)"
    [ "$got" = "$want" ] || fail "$1: printed '$got', want '$want'"
    # The whole of ldd's output goes to grep: `grep -q` would stop at the
    # match and ldd, killed by SIGPIPE, would fail the pipeline (pipefail).
    if [ "$3" = shared ]; then
        ldd "$2" | grep libkvdepot.so >/dev/null || fail "$1: not linked to libkvdepot.so"
    else
        ldd "$2" | grep libkvdepot >/dev/null && fail "$1: linked to a shared libkvdepot"
    fi
    echo "install_test: $1 ok"
}
export PKG_CONFIG_PATH=$libdir/pkgconfig
# shellcheck disable=SC2046
cc -o "$work/pc-shared" "$work/prog.c" $(pkg-config --cflags --libs kvdepot) -lm
check "pkg-config kvdepot" "$work/pc-shared" shared
# shellcheck disable=SC2046
cc -o "$work/pc-static" "$work/prog.c" $(pkg-config --cflags --libs kvdepot-static) -lm
check "pkg-config kvdepot-static" "$work/pc-static" static

mkdir -p "$work/cm"
cat >"$work/cm/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.16)
project(uses_kvdepot C)
find_package(kvdepot 0.1 REQUIRED)
add_executable(prog_shared prog.c)
target_link_libraries(prog_shared PRIVATE kvdepot::kvdepot m)
add_executable(prog_static prog.c)
target_link_libraries(prog_static PRIVATE kvdepot::kvdepot_static m)
CM
cp "$work/prog.c" "$work/cm/"
cmake -S "$work/cm" -B "$work/cm/build" -DCMAKE_PREFIX_PATH="$prefix" >"$work/cm.log" 2>&1 ||
    fail "find_package(kvdepot): $(tail -20 "$work/cm.log")"
cmake --build "$work/cm/build" >>"$work/cm.log" 2>&1 || fail "build: $(tail -20 "$work/cm.log")"
check "find_package kvdepot::kvdepot" "$work/cm/build/prog_shared" shared
check "find_package kvdepot::kvdepot_static" "$work/cm/build/prog_static" static
echo "install_test: ok"
