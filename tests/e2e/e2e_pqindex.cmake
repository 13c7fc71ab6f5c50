# The stored PQ index end to end (Search over stored codes, centroids on disk,
# AppendPages with PQ sections); each case is its own ctest entry with its own
# server. (Included after e2e.cmake, which defines the harness and
# KVD_E2E_SERVER.) The centroids are read in-process from the stopped
# server's data directory, hence kvd_store.
if(TARGET kvd_e2e_harness)
  add_executable(e2e_pqindex ${CMAKE_CURRENT_LIST_DIR}/e2e_pqindex.c)
  target_link_libraries(e2e_pqindex PRIVATE kvd_e2e_harness kvd_store kvd_kernels m)
  foreach(name stored pages sparse prefix errors chunked rebuild)
    add_test(NAME pqindex_${name} COMMAND e2e_pqindex ${KVD_E2E_SERVER} ${name})
    set_tests_properties(pqindex_${name} PROPERTIES LABELS e2e TIMEOUT 300
                         ENVIRONMENT KVDEPOT_DEVICE=cpu)
  endforeach()
  # Against kvdepotd on the CPU emulation of a GPU, which trains the
  # centroids with the GPU's K-means and codes the pages there (minutes
  # under the sanitizers: "slow" keeps them to the first pass).
  if(TARGET kvdepotd_cuda_emu)
    foreach(name stored pages sparse chunked)
      add_test(NAME pqindex_emu_${name}
               COMMAND e2e_pqindex $<TARGET_FILE:kvdepotd_cuda_emu> ${name})
      set_tests_properties(pqindex_emu_${name} PROPERTIES LABELS "e2e;slow" TIMEOUT 600
                           ENVIRONMENT "KVDEPOT_DEVICE=cuda")
    endforeach()
  endif()
endif()
