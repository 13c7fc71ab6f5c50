# Model artifacts end to end (UploadArtifacts, GetArtifacts) through
# libkvdepot against a real kvdepotd; each case its own ctest entry.
# (Sorted after e2e.cmake, which defines the harness and KVD_E2E_SERVER.)
if(TARGET kvd_e2e_harness)
  add_executable(e2e_artifacts ${CMAKE_CURRENT_LIST_DIR}/e2e_artifacts.c)
  target_link_libraries(e2e_artifacts PRIVATE kvd_e2e_harness m)
  foreach(name roundtrip errors calibrate advise memory)
    add_test(NAME artifacts_${name} COMMAND e2e_artifacts ${KVD_E2E_SERVER} ${name})
    set_tests_properties(artifacts_${name} PROPERTIES LABELS e2e TIMEOUT 120)
  endforeach()
endif()

add_test(NAME artifacts_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli_calibrate.sh ${KVD_E2E_SERVER}
                                    $<TARGET_FILE:kvdepot>)
set_tests_properties(artifacts_cli PROPERTIES LABELS e2e TIMEOUT 120)
