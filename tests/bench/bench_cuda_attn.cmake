# bench_cuda_attn: GPU benchmark of decode attention on the CUDA backend
# (fp16, INT2, INT4, VQ d4b8; 1K..128K tokens and 1M for batch 1; batch
# 1..64; time, % of HBM bandwidth, speed-up over fp16). A build target, not
# a test: tests/bench/bench_cuda_run.sh runs it next to PyTorch SDPA
# (bench_attn_torch.py). Without a GPU the program says so and exits 0.
if(KVD_HAVE_CUDA)
  add_executable(bench_cuda_attn ${CMAKE_CURRENT_LIST_DIR}/bench_cuda_attn.c)
  target_link_libraries(bench_cuda_attn PRIVATE kvd_kernels_cuda kvd_testutil m)
  set_target_properties(bench_cuda_attn PROPERTIES LINKER_LANGUAGE CUDA)
endif()
