# bench_stream: kvdepot Append/Read throughput over loopback next to Redis
# SET/GET of the same bytes. A benchmark, not a test: run it with
# tests/bench/run_stream_bench.sh, which starts both servers.
# Needs hiredis (Debian package libhiredis-dev); left out without it.
pkg_check_modules(HIREDIS IMPORTED_TARGET hiredis)
if(HIREDIS_FOUND AND TARGET kvdepot_static)
  add_executable(bench_stream ${CMAKE_CURRENT_LIST_DIR}/bench_stream.c)
  target_link_libraries(bench_stream PRIVATE kvdepot_static PkgConfig::HIREDIS)
else()
  message(STATUS "kvdepot: bench_stream not built (needs libhiredis-dev and kvdepot_static)")
endif()
