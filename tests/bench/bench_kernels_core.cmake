# Encode throughput of the CPU core ops (a program that prints a table; not a
# test): cmake --build <dir> --target bench_encode && <dir>/tests/bench_encode
add_executable(bench_encode EXCLUDE_FROM_ALL ${CMAKE_CURRENT_LIST_DIR}/bench_encode.c)
target_link_libraries(bench_encode PRIVATE kvd_testutil kvd_kernels m)
