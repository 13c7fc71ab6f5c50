#!/usr/bin/env bash
# Build the kvdepot container images with docker, podman or buildah (the
# first one found), from the committed sources (git archive HEAD: uncommitted
# edits, build directories and local secrets never reach the image).
#
#   deploy/build-images.sh [--cuda] [--tag TAG] [--bootstrap-base] [--smoke]
#
#   --cuda            build deploy/Dockerfile.cuda (kvdepot:TAG-cuda) instead
#                     of deploy/Dockerfile (kvdepot:TAG)
#   --tag TAG         image tag (default: 0.1.0)
#   --bootstrap-base  for builders that cannot pull from a registry: make
#                     localhost/debian:12 (and :12-slim) with debootstrap from
#                     the Debian mirror and build FROM them (CPU image only)
#   --smoke           after building, run `kvdepotd --version` and
#                     `kvdepot --help` inside the image's root filesystem
#
# Environment: KVD_JOBS (parallel compile jobs, default 2), KVD_BUILDER
# (docker|podman|buildah to force one).
#
# podman and buildah build with chroot isolation, which works inside
# unprivileged containers and CI runners without a container engine daemon.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cuda=0 tag=0.1.0 bootstrap=0 smoke=0
while [ $# -gt 0 ]; do
    case "$1" in
    --cuda) cuda=1 ;;
    --tag) tag=$2; shift ;;
    --bootstrap-base) bootstrap=1 ;;
    --smoke) smoke=1 ;;
    *) echo "build-images: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done

builder=${KVD_BUILDER:-}
if [ -z "$builder" ]; then
    for b in docker podman buildah; do
        command -v "$b" >/dev/null || continue
        # A docker client without a reachable daemon cannot build.
        [ "$b" = docker ] && ! docker info >/dev/null 2>&1 && continue
        builder=$b
        break
    done
fi
[ -n "$builder" ] || { echo "build-images: no docker, podman or buildah found" >&2; exit 77; }

ctx=$(mktemp -d "${TMPDIR:-/tmp}/kvdepot-image-XXXXXX")
trap 'rm -rf "$ctx"' EXIT
git -C "$root" archive HEAD | tar -x -C "$ctx"

dockerfile=deploy/Dockerfile image=kvdepot:$tag
[ $cuda = 1 ] && dockerfile=deploy/Dockerfile.cuda image=kvdepot:$tag-cuda
version=$(sed -n 's/^project(kvdepot VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
args=(--build-arg "JOBS=${KVD_JOBS:-2}" --build-arg "VERSION=$version"
      --build-arg "REVISION=$(git -C "$root" rev-parse HEAD)"
      --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)")

if [ $bootstrap = 1 ]; then
    [ $cuda = 0 ] || { echo "build-images: --bootstrap-base makes Debian bases only" >&2; exit 2; }
    if ! "$builder" image inspect localhost/debian:12 >/dev/null 2>&1; then
        command -v debootstrap >/dev/null || { echo "build-images: debootstrap is needed" >&2; exit 77; }
        rootfs=$ctx.rootfs
        # The same Debian mirror this machine's apt uses (deb822 sources or
        # the classic sources.list), so the image needs no other network.
        mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)
        [ -n "$mirror" ] || mirror=$(awk '$1 == "deb" && $2 !~ /^\[/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
        [ -n "$mirror" ] || { echo "build-images: no Debian mirror found in apt's sources" >&2; exit 77; }
        debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >/dev/null
        # Like the official slim image: no documentation or man pages.
        rm -rf "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/var/cache/apt/*.bin
        tar -C "$rootfs" -c . | "$builder" import - localhost/debian:12 >/dev/null
        "$builder" tag localhost/debian:12 localhost/debian:12-slim
        rm -rf "$rootfs"
    fi
    args+=(--build-arg BUILD_IMAGE=localhost/debian:12 --build-arg RUNTIME_IMAGE=localhost/debian:12-slim)
fi

case "$builder" in
docker) build=(docker build) ;;
# The docker image format: the OCI one has no HEALTHCHECK.
podman) build=(podman build --isolation chroot --format docker) ;;
buildah) build=(buildah bud --isolation chroot --format docker) ;;
*) echo "build-images: unknown builder $builder" >&2; exit 2 ;;
esac
echo "build-images: $builder building $image from $dockerfile" >&2
"${build[@]}" "${args[@]}" -f "$ctx/$dockerfile" -t "$image" "$ctx"

if [ $smoke = 1 ]; then
    case "$builder" in
    docker)
        docker run --rm --entrypoint kvdepotd "$image" --version
        docker run --rm --entrypoint kvdepot "$image" --help >/dev/null
        ;;
    *)
        # No container runtime needed: run the binaries in the image's root
        # filesystem with chroot, as the image's user.
        c=$(buildah from "$image" 2>/dev/null || podman create "$image")
        mnt=$(buildah mount "$c" 2>/dev/null || podman mount "$c")
        run() { chroot --userspec=10001:10001 "$mnt" env -i HOME=/data "$@"; }
        run /usr/local/bin/kvdepotd --version
        run /usr/local/bin/kvdepot --help >/dev/null
        test "$(stat -c %u "$mnt/data")" = 10001
        # The baked-in config listens on 0.0.0.0 without TLS: it must refuse.
        if run /usr/local/bin/kvdepotd --config /etc/kvdepot/kvdepot.yaml >/dev/null 2>&1; then
            echo "build-images: the image served plaintext on 0.0.0.0" >&2
            exit 1
        fi
        # Serve on loopback from the image's config and answer a health check.
        # exec all the way down: $! is kvdepotd itself, so the kill below
        # stops it (through a function, it would stop only the subshell)
        # Metrics on a free port, which the image's HEALTHCHECK command is
        # then pointed at (KVDEPOT_HEALTH_PORT).
        (exec chroot --userspec=10001:10001 "$mnt" env -i HOME=/data \
            /usr/local/bin/kvdepotd --config /etc/kvdepot/kvdepot.yaml --listen 127.0.0.1:0 \
            --metrics-listen 127.0.0.1:0 --port-file /data/port) >"$ctx.log" 2>&1 &
        pid=$!
        for _ in $(seq 100); do grep -q 'msg=serving' "$ctx.log" && break; sleep 0.1; done
        port=$(cat "$mnt/data/port" 2>/dev/null || true)
        mport=$(grep -o 'metrics_port=[0-9]*' "$ctx.log" | head -n 1 | cut -d= -f2)
        ok=0
        [ -n "$port" ] && run /usr/local/bin/kvdepot --addr "127.0.0.1:$port" health && ok=1
        # The image's health check, as the engine would run it: healthy now,
        # unhealthy once the server is gone.
        hc=$(podman image inspect --format '{{json .HealthCheck.Test}}' "$image" 2>/dev/null ||
             buildah inspect --type image --format '{{json .Docker.Config.Healthcheck.Test}}' "$image")
        readarray -t hcmd < <(python3 -c 'import json,sys; t=json.loads(sys.argv[1]); assert t[0]=="CMD", t; print("\n".join(t[1:]))' "$hc")
        [ $ok = 1 ] && ! run env KVDEPOT_HEALTH_PORT="$mport" "${hcmd[@]}" && {
            echo "build-images: the HEALTHCHECK (${hcmd[*]}) failed on a ready server" >&2
            ok=0
        }
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        [ $ok = 1 ] || { cat "$ctx.log" >&2; echo "build-images: the image did not serve" >&2; exit 1; }
        if run env KVDEPOT_HEALTH_PORT="$mport" "${hcmd[@]}" 2>/dev/null; then
            echo "build-images: the HEALTHCHECK passed with no server" >&2
            exit 1
        fi
        # The labels say what was built.
        lv=$(podman image inspect --format '{{index .Labels "org.opencontainers.image.version"}}' "$image" 2>/dev/null ||
             buildah inspect --type image --format '{{index .Docker.Config.Labels "org.opencontainers.image.version"}}' "$image")
        [ "$lv" = "$version" ] || { echo "build-images: image version label '$lv', want $version" >&2; exit 1; }
        # Nothing the smoke test started may outlive it: no process left
        # whose root is the image's filesystem.
        left=
        for p in /proc/[0-9]*; do
            [ "$(readlink "$p/root" 2>/dev/null)" = "$mnt" ] && left="$left ${p#/proc/}"
        done
        if [ -n "$left" ]; then
            echo "build-images: processes of the smoke test outlived it:$left" >&2
            # shellcheck disable=SC2086
            kill -KILL $left 2>/dev/null || true
            exit 1
        fi
        rm -f "$ctx.log"
        (buildah umount "$c" || podman umount "$c") >/dev/null 2>&1
        (buildah rm "$c" || podman rm "$c") >/dev/null 2>&1
        ;;
    esac
    echo "build-images: $image runs" >&2
fi
