# bench_tier: Read throughput from each tier, promotion latency per page, and
# Append throughput under each durability setting, in process. A benchmark,
# not a test: run build/tests/bench_tier [SCRATCH_DIR].
add_executable(bench_tier ${CMAKE_CURRENT_LIST_DIR}/bench_tier.c)
target_link_libraries(bench_tier PRIVATE kvd_store)
