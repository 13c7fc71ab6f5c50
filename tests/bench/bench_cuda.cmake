# bench_cuda: GPU benchmarks of the CUDA backend (PQ search and its HBM
# bandwidth, K-means per (layer, head), encode throughput). A build target,
# not a test: run tests/bench/bench_cuda_run.sh on an H100/H200 (it adds the
# plain-PyTorch PQ search of bench_pq_torch.py to the table). Without a GPU
# the program says so and exits 0.
if(KVD_HAVE_CUDA)
  add_executable(bench_cuda ${CMAKE_CURRENT_LIST_DIR}/bench_cuda.c)
  target_link_libraries(bench_cuda PRIVATE kvd_kernels_cuda kvd_testutil CUDA::cudart_static
                                           CUDA::cublas m)
  set_target_properties(bench_cuda PROPERTIES LINKER_LANGUAGE CUDA)
endif()
