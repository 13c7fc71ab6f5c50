# Unit tests of the store's memory tiers (LRU, limits, pinning, 8 threads
# with eviction). Also the test of the ThreadSanitizer pass in deploy/dev.sh.
add_executable(test_tier ${CMAKE_SOURCE_DIR}/tests/unit/test_tier.c)
target_link_libraries(test_tier PRIVATE kvd_store Threads::Threads)
add_test(NAME store_tier COMMAND test_tier)
set_tests_properties(store_tier PROPERTIES LABELS unit TIMEOUT 120)

# The same with the device tier in the memory of the CUDA backend on its CPU
# emulation (tests/backend/cuda_emu.cmake): pages go up and down by copies.
if(TARGET kvd_kernels_cuda_emu)
  add_executable(test_tier_cuda_emu ${CMAKE_SOURCE_DIR}/tests/unit/test_tier.c)
  target_link_libraries(test_tier_cuda_emu PRIVATE kvd_kernels_cuda_emu kvd_store Threads::Threads)
  set_target_properties(test_tier_cuda_emu PROPERTIES LINKER_LANGUAGE CXX)
  add_test(NAME store_tier_emu COMMAND test_tier_cuda_emu)
  set_tests_properties(store_tier_emu PROPERTIES LABELS unit TIMEOUT 300
                       ENVIRONMENT KVD_TEST_DEVICE=cuda)
endif()
