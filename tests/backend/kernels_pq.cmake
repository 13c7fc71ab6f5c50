# K-means, VQ and PQ kernels: fast paths against the scalar references and
# brute force (labels unit;backend; each runs in seconds).
foreach(t kernels_kmeans kernels_vq kernels_pq)
  add_executable(test_${t} ${CMAKE_CURRENT_LIST_DIR}/${t}.c)
  target_link_libraries(test_${t} PRIVATE kvd_testutil kvd_kernels)
  add_test(NAME ${t} COMMAND test_${t})
  set_tests_properties(${t} PROPERTIES LABELS "unit;backend" TIMEOUT 120)
endforeach()
