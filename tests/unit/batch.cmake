# Write batches built in kvdepot's buffers (store/batch.c): RocksDB's format
# byte for byte, writes, buffer reuse, raw pages built in place.
add_executable(test_batch ${CMAKE_SOURCE_DIR}/tests/unit/test_batch.c)
target_link_libraries(test_batch PRIVATE kvd_store)
add_test(NAME store_batch COMMAND test_batch)
set_tests_properties(store_batch PROPERTIES LABELS unit TIMEOUT 120)
