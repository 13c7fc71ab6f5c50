# Compute RPCs end to end (Attend, PlanFetch) through libkvdepot against a
# real kvdepotd; each case is its own ctest entry with its own server.
# (Included after e2e.cmake, which defines the harness and KVD_E2E_SERVER.)
if(TARGET kvd_e2e_harness)
  add_executable(e2e_compute ${CMAKE_CURRENT_LIST_DIR}/e2e_compute.c)
  target_link_libraries(e2e_compute PRIVATE kvd_e2e_harness kvd_kernels m)
  foreach(name attend attend_long lse_merge plan_fetch errors codecs bad_codecs search append_pages
               read_pages)
    add_test(NAME compute_${name} COMMAND e2e_compute ${KVD_E2E_SERVER} ${name})
    set_tests_properties(compute_${name} PROPERTIES LABELS e2e TIMEOUT 300)
  endforeach()
endif()

# The compressed-cache and compute benchmark (prints tables; build target only):
#   cmake --build <dir> --target bench_compute
#   <dir>/tests/bench_compute <dir>/service/kvdepotd [max_tokens]
if(TARGET kvd_e2e_harness)
  add_executable(bench_compute EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/tests/bench/bench_compute.c)
  target_link_libraries(bench_compute PRIVATE kvd_e2e_harness kvd_store m)
endif()

add_test(NAME compute_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli_compute.sh ${KVD_E2E_SERVER}
                                  $<TARGET_FILE:kvdepot>)
set_tests_properties(compute_cli PROPERTIES LABELS e2e TIMEOUT 120)
