# bench_stream: put/get of KV-cache objects over loopback, kvdepot (raw, INT2,
# client-coded INT2 pages) next to Redis SET/GET of the same bytes: latency
# percentiles, throughput, error, server memory. A benchmark, not a test: run
# it with tests/bench/run_stream_bench.sh (kvdepot and Redis) or
# tests/bench/peers/run_peers.sh (with Mooncake Store, LMCache and FAISS too).
# Needs hiredis (Debian package libhiredis-dev); left out without it.
pkg_check_modules(HIREDIS IMPORTED_TARGET hiredis)
if(HIREDIS_FOUND AND TARGET kvdepot_static)
  add_executable(bench_stream ${CMAKE_CURRENT_LIST_DIR}/bench_stream.c)
  target_link_libraries(bench_stream PRIVATE kvdepot_static PkgConfig::HIREDIS)
else()
  message(STATUS "kvdepot: bench_stream not built (needs libhiredis-dev and kvdepot_static)")
endif()

# bench_layerwise: a simulated forward pass putting each layer's K/V as it is
# computed, blocking and overlapped (kvdepot_append_start). A benchmark, not
# a test: run it with tests/bench/run_layerwise_bench.sh.
if(TARGET kvdepot_static)
  add_executable(bench_layerwise ${CMAKE_CURRENT_LIST_DIR}/bench_layerwise.c)
  target_link_libraries(bench_layerwise PRIVATE kvdepot_static)
endif()

# bench_read_c: the C client's Read, next to the Python package's in
# tests/bench/bench_python_read.py (run_python_bench.sh).
if(TARGET kvdepot_static)
  add_executable(bench_read_c ${CMAKE_CURRENT_LIST_DIR}/bench_read_c.c)
  target_link_libraries(bench_read_c PRIVATE kvdepot_static)
endif()
