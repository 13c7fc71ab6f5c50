# Operating kvdepotd (TLS, tokens, quotas and limits, deadlines, config file,
# metrics), driven through the kvdepot CLI, i.e. libkvdepot. Certificates are
# made by each test with the openssl CLI; /metrics is scraped with curl.

if(TARGET kvdepotd)
  set(KVD_OPS_SERVER $<TARGET_FILE:kvdepotd>)
else()
  set(KVD_OPS_SERVER ${CMAKE_BINARY_DIR}/service/kvdepotd)
endif()

foreach(name tls mtls auth reload quota limits deadline config metrics modes wal damage nofile
             emfile listen_emfile maxconn backup logjson)
  add_test(NAME ops_${name}
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/ops_test.sh ${KVD_OPS_SERVER}
                   $<TARGET_FILE:kvdepot> ${name})
  set_tests_properties(ops_${name} PROPERTIES LABELS e2e TIMEOUT 120)
endforeach()

# The same pieces without a network: tokens file, quotas, config file,
# loopback rule, metrics rendering.
add_executable(test_ops_unit ${CMAKE_CURRENT_LIST_DIR}/test_ops_unit.c)
target_link_libraries(test_ops_unit PRIVATE kvd_service)
add_test(NAME ops_unit COMMAND test_ops_unit)
set_tests_properties(ops_unit PROPERTIES LABELS unit TIMEOUT 60)

# Config and tokens files through their parsers: the corpus is replayed under
# ctest with any compiler; with clang a libFuzzer binary is built as well
# (build/tests/fuzz_ops_files tests/ops/corpus).
add_executable(fuzz_ops_files_replay ${CMAKE_CURRENT_LIST_DIR}/fuzz_ops_files.c
                                     ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_page_replay.c)
target_link_libraries(fuzz_ops_files_replay PRIVATE kvd_service)
add_test(NAME fuzz_ops_files_corpus
         COMMAND fuzz_ops_files_replay ${CMAKE_CURRENT_LIST_DIR}/corpus)
set_tests_properties(fuzz_ops_files_corpus PROPERTIES LABELS "fuzz;unit" TIMEOUT 60)
if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  add_executable(fuzz_ops_files ${CMAKE_CURRENT_LIST_DIR}/fuzz_ops_files.c)
  target_compile_options(fuzz_ops_files PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_ops_files PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_ops_files PRIVATE kvd_service)
endif()
