# K-means, VQ and PQ kernels: fast paths against the scalar references and
# brute force. Uses kvd_testutil from kernels_core.cmake (included before
# this fragment: fragments are included in sorted order).
foreach(t kernels_kmeans kernels_vq kernels_pq)
  if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/${t}.c)
    add_executable(${t} ${CMAKE_CURRENT_LIST_DIR}/${t}.c)
    target_link_libraries(${t} PRIVATE kvd_testutil kvd_kernels)
    add_test(NAME ${t} COMMAND ${t})
    set_tests_properties(${t} PROPERTIES LABELS "unit;backend" TIMEOUT 120)
  endif()
endforeach()
