# Unit tests of the store's memory tiers (LRU, limits, pinning, 8 threads
# with eviction). Also the test of the ThreadSanitizer pass in deploy/dev.sh.
add_executable(test_tier ${CMAKE_SOURCE_DIR}/tests/unit/test_tier.c)
target_link_libraries(test_tier PRIVATE kvd_store Threads::Threads)
add_test(NAME store_tier COMMAND test_tier)
set_tests_properties(store_tier PROPERTIES LABELS unit TIMEOUT 120)
