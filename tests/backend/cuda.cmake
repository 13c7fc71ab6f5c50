# CUDA backend tests: built whenever nvcc is present, skipped (exit 77)
# when no GPU is found at run time.
if(KVD_HAVE_CUDA)
  add_executable(test_cuda_backend ${CMAKE_CURRENT_LIST_DIR}/test_cuda_backend.c)
  target_link_libraries(test_cuda_backend PRIVATE kvd_kernels_cuda)
  set_target_properties(test_cuda_backend PROPERTIES LINKER_LANGUAGE CUDA)
  add_test(NAME cuda_backend COMMAND test_cuda_backend)
  set_tests_properties(cuda_backend PROPERTIES LABELS "backend;gpu" SKIP_RETURN_CODE 77)
endif()

# cuBLAS is loaded with the device, not at start (runs without a GPU).
if(KVD_HAVE_CUDA)
  add_executable(test_cuda_blas ${CMAKE_CURRENT_LIST_DIR}/test_cuda_blas.c)
  target_link_libraries(test_cuda_blas PRIVATE kvd_kernels_cuda)
  set_target_properties(test_cuda_blas PROPERTIES LINKER_LANGUAGE CUDA)
  add_test(NAME cuda_blas_load COMMAND test_cuda_blas)
  set_tests_properties(cuda_blas_load PROPERTIES LABELS "backend")
endif()
