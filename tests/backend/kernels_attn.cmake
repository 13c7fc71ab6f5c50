# Decode attention (dense, sparse, INT2/INT4 homomorphic, VQ fused, SVD
# reduced, LSE merge) and the SVD reduction: fast paths against references.
if(NOT TARGET kvd_testutil)
  add_library(kvd_testutil STATIC ${CMAKE_CURRENT_LIST_DIR}/testutil.c)
  target_include_directories(kvd_testutil PUBLIC ${CMAKE_CURRENT_LIST_DIR})
  target_link_libraries(kvd_testutil PUBLIC kvd_kernels m)
endif()

add_executable(test_kernels_attn ${CMAKE_CURRENT_LIST_DIR}/kernels_attn.c)
target_link_libraries(test_kernels_attn PRIVATE kvd_testutil kvd_kernels m)
add_test(NAME kernels_attn COMMAND test_kernels_attn)
set_tests_properties(kernels_attn PROPERTIES LABELS "unit;backend" TIMEOUT 120)

add_executable(test_kernels_svd ${CMAKE_CURRENT_LIST_DIR}/kernels_svd.c)
target_link_libraries(test_kernels_svd PRIVATE kvd_testutil kvd_kernels m)
add_test(NAME kernels_svd COMMAND test_kernels_svd)
set_tests_properties(kernels_svd PROPERTIES LABELS "unit;backend" TIMEOUT 60)
# A second draw of the random data: the tolerances hold for any seed (30
# were checked), and data-dependent faults show up on more than one.
add_test(NAME kernels_attn_seed2 COMMAND test_kernels_attn)
set_tests_properties(kernels_attn_seed2 PROPERTIES LABELS "unit;backend" TIMEOUT 120
                     ENVIRONMENT "KVD_TEST_SEED=1240")
