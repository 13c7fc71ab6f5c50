# PQ search benchmark (a program, not a test): build with
#   cmake --build <dir> --target bench_pq
# and run tests/bench/run_pq_bench.sh <dir> for the table against FAISS.
add_executable(bench_pq EXCLUDE_FROM_ALL ${CMAKE_CURRENT_LIST_DIR}/bench_pq.c)
target_link_libraries(bench_pq PRIVATE kvd_testutil kvd_kernels)
