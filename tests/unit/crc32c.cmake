# RocksDB's CRC32C computed by ISA-L (store/crc32c.c): RocksDB's calls reach
# it, and its values are RocksDB's own function's.
if(ISAL_FOUND)
  add_executable(test_crc32c ${CMAKE_SOURCE_DIR}/tests/unit/test_crc32c.c)
  target_link_libraries(test_crc32c PRIVATE kvd_store)
  add_test(NAME store_crc32c COMMAND test_crc32c)
  set_tests_properties(store_crc32c PROPERTIES LABELS unit TIMEOUT 60)
endif()
