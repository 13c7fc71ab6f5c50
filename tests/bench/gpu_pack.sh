#!/bin/sh
# Pack what bench_cuda_gpu_check.sh runs from a build made on this machine, for
# a GPU machine that has the CUDA driver and toolkit but none of kvdepot's
# other libraries (gRPC, protobuf-c, RocksDB, ...):
#
#   tests/bench/gpu_pack.sh BUILD_DIR DEST
#
# BUILD_DIR must be configured with -DCMAKE_BUILD_RPATH='$ORIGIN/../lib' and
# -DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags (an RPATH, searched for
# every library a program loads, not only its own), and the targets that
# bench_cuda_gpu_check.sh names built. DEST gets tests/ and service/ with
# those programs and lib/ with every shared library they load except the C
# library, the C++ runtime and CUDA's own (the GPU machine has newer ones).
# Then, there: KVD_GPU_BUILD=DEST tests/bench/bench_cuda_gpu_check.sh.
set -eu
build=${1:?usage: $0 BUILD_DIR DEST}
dest=${2:?usage: $0 BUILD_DIR DEST}
mkdir -p "$dest/tests" "$dest/service" "$dest/lib"
for t in test_cuda_ops test_cuda_backend test_cuda_attn bench_cuda bench_cuda_attn \
    e2e_compute bench_attend_e2e; do
    cp "$build/tests/$t" "$dest/tests/"
done
cp "$build/service/kvdepotd" "$dest/service/"
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libpthread|libdl\.|librt\.|libstdc\+\+|libgcc_s|libcuda|libcublas|libcudart)'
for f in "$dest"/tests/* "$dest"/service/*; do
    ldd "$f" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r name path; do
    echo "$name" | grep -Eq "$skip" || [ "$path" -ef "$dest/lib/$name" ] || cp -L "$path" "$dest/lib/$name"
done
strip --strip-unneeded "$dest"/tests/* "$dest"/service/* "$dest"/lib/* 2>/dev/null || true
du -sh "$dest"
