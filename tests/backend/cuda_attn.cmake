# Backend comparison of decode attention: every attention op of the CUDA
# backend against the CPU reference (tests/backend/cuda_attn.c). Built
# whenever nvcc is present; without a GPU the harness runs CPU-vs-CPU
# (self-check) and the test reports skipped (exit 77). On a GPU machine:
#   ctest -L gpu --output-on-failure     (see kernels/cuda/README.md)
if(KVD_HAVE_CUDA)
  add_executable(test_cuda_attn ${CMAKE_CURRENT_LIST_DIR}/cuda_attn.c)
  target_link_libraries(test_cuda_attn PRIVATE kvd_kernels_cuda kvd_testutil Threads::Threads m)
  set_target_properties(test_cuda_attn PROPERTIES LINKER_LANGUAGE CUDA)
  add_test(NAME cuda_attn COMMAND test_cuda_attn)
  set_tests_properties(cuda_attn PROPERTIES LABELS "backend;gpu" SKIP_RETURN_CODE 77 TIMEOUT 900)
  # The harness on its own (CPU fast path as the device): runs everywhere.
  add_test(NAME cuda_attn_selfcheck COMMAND test_cuda_attn --self-check)
  set_tests_properties(cuda_attn_selfcheck PROPERTIES LABELS "backend;unit" TIMEOUT 900)
endif()
