# Page codecs (store/format/codec.c): INT2/INT4 sections, decoding, attention on pages.
add_executable(test_codec ${CMAKE_SOURCE_DIR}/tests/unit/test_codec.c)
target_link_libraries(test_codec PRIVATE kvd_store m)
add_test(NAME store_codec COMMAND test_codec)
set_tests_properties(store_codec PROPERTIES LABELS unit TIMEOUT 60)

# Sealing pages coded together on the CPU emulation of the CUDA backend, from
# host and from device memory: the CPU's bytes, page for page.
if(TARGET kvd_kernels_cuda_emu)
  add_executable(test_pages_encode_emu ${CMAKE_SOURCE_DIR}/tests/unit/test_pages_encode.c)
  target_link_libraries(test_pages_encode_emu PRIVATE kvd_kernels_cuda_emu kvd_store)
  set_target_properties(test_pages_encode_emu PROPERTIES LINKER_LANGUAGE CXX)
  add_test(NAME store_pages_encode_emu COMMAND test_pages_encode_emu)
  set_tests_properties(store_pages_encode_emu PROPERTIES LABELS unit TIMEOUT 120)
endif()
