# Page decoder fuzzing. The corpus in tests/fuzz/corpus/page is replayed under
# ctest with any compiler; with clang a libFuzzer binary is built as well:
#   build/tests/fuzz_page tests/fuzz/corpus/page
set(KVD_FUZZ_PAGE_CORPUS ${CMAKE_SOURCE_DIR}/tests/fuzz/corpus/page)
add_executable(fuzz_page_replay ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_page.c
                                ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_page_replay.c)
target_link_libraries(fuzz_page_replay PRIVATE kvd_store)
add_test(NAME fuzz_page_corpus COMMAND fuzz_page_replay ${KVD_FUZZ_PAGE_CORPUS})
set_tests_properties(fuzz_page_corpus PROPERTIES LABELS "fuzz;unit" TIMEOUT 60)

if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  # The decoder and the status/dtype helpers it uses are compiled into the
  # target, so they carry the coverage instrumentation and the fuzzer does
  # not depend on the rest of the kernels library.
  add_executable(fuzz_page ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_page.c
                           ${CMAKE_SOURCE_DIR}/store/format/page.c
                           ${CMAKE_SOURCE_DIR}/kernels/common/status.c
                           ${CMAKE_SOURCE_DIR}/kernels/common/tensor.c)
  target_include_directories(fuzz_page PRIVATE ${CMAKE_SOURCE_DIR}/store/format
                                               ${CMAKE_SOURCE_DIR}/kernels/include)
  target_compile_options(fuzz_page PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_page PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_page PRIVATE PkgConfig::XXHASH)
endif()
