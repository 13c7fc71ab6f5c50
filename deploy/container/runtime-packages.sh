#!/bin/sh
# Print the Debian packages that provide the shared libraries the given
# binaries load, one per line, so the runtime image installs exactly what the
# build stage linked against (no list to keep in step by hand).
#
#   deploy/container/runtime-packages.sh build/service/kvdepotd build/client/kvdepot
#
# Exits non-zero when a library cannot be traced to a package, so a missing
# runtime dependency fails the image build instead of the container start.
set -eu
[ $# -gt 0 ] || { echo "usage: $0 BINARY..." >&2; exit 2; }
status=0
out=""
libs=$(for b in "$@"; do ldd "$b"; done | awk '/=> \// { print $3 } /^\t\/[^ ]+ \(/ { print $1 }' | sort -u)
for lib in $libs; do
    real=$(readlink -f "$lib")
    pkg=""
    # Debian 12 merged /lib into /usr/lib, but dpkg still records some
    # libraries under /lib: try every spelling of the path.
    for p in "$lib" "$real" "${lib#/usr}" "${real#/usr}" "/usr$lib" "/usr$real"; do
        pkg=$(dpkg -S "$p" 2>/dev/null | grep -v '^diversion' | head -n1 | cut -d: -f1) || true
        [ -n "$pkg" ] && break
    done
    if [ -z "$pkg" ]; then
        echo "runtime-packages: no package provides $lib" >&2
        status=1
        continue
    fi
    out="$out$pkg
"
done
printf '%s' "$out" | sort -u
exit $status
