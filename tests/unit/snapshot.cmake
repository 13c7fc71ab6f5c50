# Artifact snapshots shared on disk by content with reference counts
# (store/seqcodec.h), and stored sizes across a restart (store/sequence.c),
# in-process against a store in a temporary directory.
add_executable(test_snapshot ${CMAKE_SOURCE_DIR}/tests/unit/test_snapshot.c)
target_link_libraries(test_snapshot PRIVATE kvd_store)
add_test(NAME store_snapshot COMMAND test_snapshot)
set_tests_properties(store_snapshot PROPERTIES LABELS unit TIMEOUT 120)
