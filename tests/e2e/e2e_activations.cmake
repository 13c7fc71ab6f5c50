# Activation storage and activation-first Read (KVPR) end to end through
# libkvdepot against a real kvdepotd; each case is its own ctest entry with
# its own server. (Included after e2e.cmake, which defines the harness and
# KVD_E2E_SERVER.)
if(TARGET kvd_e2e_harness)
  add_executable(e2e_activations ${CMAKE_CURRENT_LIST_DIR}/e2e_activations.c)
  target_link_libraries(e2e_activations PRIVATE kvd_e2e_harness PkgConfig::ROCKSDB m)
  foreach(name roundtrip restart errors delete corrupt crash merge)
    add_test(NAME activations_${name} COMMAND e2e_activations ${KVD_E2E_SERVER} ${name})
    set_tests_properties(activations_${name} PROPERTIES LABELS e2e TIMEOUT 300)
  endforeach()
endif()

add_test(NAME activations_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli_activations.sh
                                      ${KVD_E2E_SERVER} $<TARGET_FILE:kvdepot>)
set_tests_properties(activations_cli PROPERTIES LABELS e2e TIMEOUT 120)

# Activation-first Read throughput (prints a table; build target only):
#   cmake --build <dir> --target bench_activations
#   <dir>/tests/bench_activations <dir>/service/kvdepotd [tokens]
if(TARGET kvd_e2e_harness)
  add_executable(bench_activations EXCLUDE_FROM_ALL
                 ${PROJECT_SOURCE_DIR}/tests/bench/bench_activations.c)
  target_link_libraries(bench_activations PRIVATE kvd_e2e_harness)
endif()
