# Backend comparison tests: every CUDA op against the CPU reference. Built
# whenever nvcc is present; without a GPU the harness runs CPU-vs-CPU
# (self-check) and the test reports skipped (exit 77). On a GPU machine:
#   ctest -L gpu --output-on-failure     (see kernels/cuda/README.md)
if(KVD_HAVE_CUDA)
  add_executable(test_cuda_ops ${CMAKE_CURRENT_LIST_DIR}/cuda_ops.c)
  target_link_libraries(test_cuda_ops PRIVATE kvd_kernels_cuda kvd_testutil Threads::Threads m)
  set_target_properties(test_cuda_ops PROPERTIES LINKER_LANGUAGE CUDA)
  add_test(NAME cuda_ops COMMAND test_cuda_ops)
  set_tests_properties(cuda_ops PROPERTIES LABELS "backend;gpu" SKIP_RETURN_CODE 77 TIMEOUT 600)
  # The harness on its own (CPU fast path as the device): runs everywhere.
  add_test(NAME cuda_ops_selfcheck COMMAND test_cuda_ops --self-check)
  set_tests_properties(cuda_ops_selfcheck PROPERTIES LABELS "backend;unit" TIMEOUT 600)
endif()
