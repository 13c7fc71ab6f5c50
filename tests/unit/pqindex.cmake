# Unit test of the stored PQ index (store/pqindex.h) and the page's PQ-codes
# section (store/format/page.h), in-process against a store in a temporary directory.
add_executable(test_pqindex ${CMAKE_SOURCE_DIR}/tests/unit/test_pqindex.c)
target_link_libraries(test_pqindex PRIVATE kvd_store)
add_test(NAME store_pqindex COMMAND test_pqindex)
set_tests_properties(store_pqindex PROPERTIES LABELS unit TIMEOUT 120)
