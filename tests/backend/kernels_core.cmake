# Kernel test utilities (PRNG, LLM-like generators, NMSE, NaN/Inf parity,
# guard-byte buffers), shared by every kernel test and benchmark:
#   target_link_libraries(my_test PRIVATE kvd_testutil)
if(NOT TARGET kvd_testutil)
  add_library(kvd_testutil STATIC ${CMAKE_CURRENT_LIST_DIR}/testutil.c)
  target_include_directories(kvd_testutil PUBLIC ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(kvd_testutil PUBLIC kvd_kernels m)
endif()
