# Page codecs (store/format/codec.c): INT2/INT4 sections, decoding, attention on pages.
add_executable(test_codec ${CMAKE_SOURCE_DIR}/tests/unit/test_codec.c)
target_link_libraries(test_codec PRIVATE kvd_store m)
add_test(NAME store_codec COMMAND test_codec)
set_tests_properties(store_codec PROPERTIES LABELS unit TIMEOUT 60)
