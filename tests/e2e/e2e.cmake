# End-to-end tests: a real kvdepotd on a free port with a temporary data
# directory, driven through libkvdepot (e2e_client, e2e_big) and the kvdepot
# CLI (cli_test.sh). Each test case is its own ctest entry with its own server.

set(KVD_E2E_DIR ${CMAKE_CURRENT_LIST_DIR})

if(TARGET kvdepotd)
  set(KVD_E2E_SERVER $<TARGET_FILE:kvdepotd>)
else()
  # The test then fails at once, saying the server binary is missing.
  set(KVD_E2E_SERVER ${CMAKE_BINARY_DIR}/service/kvdepotd)
endif()

add_library(kvd_e2e_harness STATIC ${KVD_E2E_DIR}/harness.c)
target_include_directories(kvd_e2e_harness PUBLIC ${KVD_E2E_DIR})
target_link_libraries(kvd_e2e_harness PUBLIC kvdepot_static)

add_executable(e2e_client ${KVD_E2E_DIR}/e2e_client.c)
# The bad-stream cases use the library's internal raw-call entry point.
target_include_directories(e2e_client PRIVATE ${PROJECT_SOURCE_DIR}/client)
target_link_libraries(e2e_client PRIVATE kvd_e2e_harness kvd_proto Threads::Threads PkgConfig::XXHASH)

add_executable(e2e_big ${KVD_E2E_DIR}/e2e_big.c)
target_link_libraries(e2e_big PRIVATE kvd_e2e_harness PkgConfig::XXHASH)

foreach(name models chunks reconnect dtypes layers prefix engine transfers progress create_append bad_models bad_sequences bad_appends
             bad_streams bad_reads bad_pages threads race many crash limit append_memory errors)
  add_test(NAME e2e_${name} COMMAND e2e_client ${KVD_E2E_SERVER} ${name})
  set_tests_properties(e2e_${name} PROPERTIES LABELS e2e TIMEOUT 300)
endforeach()

add_test(NAME e2e_big_512mib COMMAND e2e_big ${KVD_E2E_SERVER} big)
set_tests_properties(e2e_big_512mib PROPERTIES LABELS "e2e;slow" TIMEOUT 600)

add_test(NAME e2e_cli COMMAND bash ${KVD_E2E_DIR}/cli_test.sh ${KVD_E2E_SERVER} $<TARGET_FILE:kvdepot>)
set_tests_properties(e2e_cli PROPERTIES LABELS e2e TIMEOUT 300)
# SIGTERM at the moment the server starts serving, repeatedly.
add_test(NAME e2e_term_at_start COMMAND bash ${KVD_E2E_DIR}/term_at_start.sh ${KVD_E2E_SERVER})
set_tests_properties(e2e_term_at_start PROPERTIES LABELS e2e TIMEOUT 300)

# The CLI's --json output, global options after the command, progress of
# put and get, and its bash completion (client/cli/kvdepot.bash).
add_test(NAME e2e_cli_json COMMAND bash ${KVD_E2E_DIR}/cli_json.sh ${KVD_E2E_SERVER}
                                   $<TARGET_FILE:kvdepot> ${PROJECT_SOURCE_DIR}/client/cli/kvdepot.bash)
set_tests_properties(e2e_cli_json PROPERTIES LABELS e2e TIMEOUT 300)
