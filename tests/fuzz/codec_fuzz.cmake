# Coded-section fuzzing (VQ, SVD, INT sections of store/format/codec.c against a
# fixed artifact snapshot). The corpus in tests/fuzz/corpus/codec is
# replayed under ctest with any compiler; with clang a libFuzzer binary is
# built as well:   build/tests/fuzz_codec tests/fuzz/corpus/codec
set(KVD_FUZZ_CODEC_CORPUS ${CMAKE_SOURCE_DIR}/tests/fuzz/corpus/codec)
add_executable(fuzz_codec_replay ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_codec.c
                                 ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_page_replay.c)
target_link_libraries(fuzz_codec_replay PRIVATE kvd_store m)
add_test(NAME fuzz_codec_corpus COMMAND fuzz_codec_replay ${KVD_FUZZ_CODEC_CORPUS})
set_tests_properties(fuzz_codec_corpus PROPERTIES LABELS "fuzz;unit" TIMEOUT 120)

if(CMAKE_C_COMPILER_ID MATCHES "Clang")
  # The codec and page code are compiled into the target so they carry the
  # coverage instrumentation; the kernels come from the library.
  add_executable(fuzz_codec ${CMAKE_SOURCE_DIR}/tests/fuzz/fuzz_codec.c
                            ${CMAKE_SOURCE_DIR}/store/format/codec.c ${CMAKE_SOURCE_DIR}/store/format/page.c)
  target_include_directories(fuzz_codec PRIVATE ${CMAKE_SOURCE_DIR}/store/format)
  target_compile_options(fuzz_codec PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_options(fuzz_codec PRIVATE -fsanitize=fuzzer,address,undefined)
  target_link_libraries(fuzz_codec PRIVATE kvd_kernels PkgConfig::XXHASH m)
endif()
