# Decode-attention benchmark and the accuracy report (programs that print
# tables, not tests; build targets only):
#   cmake --build <dir> --target bench_attn kvd_accuracy
#   <dir>/tests/bench_attn [max_tokens]     <dir>/tests/kvd_accuracy [max_tokens]
add_executable(bench_attn EXCLUDE_FROM_ALL ${CMAKE_CURRENT_LIST_DIR}/bench_attn.c)
target_link_libraries(bench_attn PRIVATE kvd_testutil kvd_kernels m)
if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/accuracy.c)
  add_executable(kvd_accuracy EXCLUDE_FROM_ALL ${CMAKE_CURRENT_LIST_DIR}/accuracy.c)
  target_link_libraries(kvd_accuracy PRIVATE kvd_testutil kvd_kernels m)
endif()
