# Kernel test utilities (PRNG, LLM-like generators, NMSE, NaN/Inf parity,
# guard-byte buffers), shared by every kernel test and benchmark:
#   target_link_libraries(my_test PRIVATE kvd_testutil)
if(NOT TARGET kvd_testutil)
  add_library(kvd_testutil STATIC ${CMAKE_CURRENT_LIST_DIR}/testutil.c)
  target_include_directories(kvd_testutil PUBLIC ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(kvd_testutil PUBLIC kvd_kernels m)
endif()

# CPU backend core: conversion, Hadamard, channel scaling, INT2/INT4 codecs,
# every fast path against its reference.
add_executable(test_kernels_convert_quant ${CMAKE_CURRENT_LIST_DIR}/kernels_convert_quant.c)
target_link_libraries(test_kernels_convert_quant PRIVATE kvd_testutil kvd_kernels m)
add_test(NAME kernels_convert_quant COMMAND test_kernels_convert_quant)
set_tests_properties(kernels_convert_quant PROPERTIES LABELS "unit;backend" TIMEOUT 120)
