# Several kvdepotd behind one sharded libkvdepot client (e2e_shard.c). Sorted
# after e2e.cmake, so the harness library and KVD_E2E_SERVER exist.
add_executable(e2e_shard ${CMAKE_CURRENT_LIST_DIR}/e2e_shard.c)
target_link_libraries(e2e_shard PRIVATE kvd_e2e_harness kvd_kernels)

foreach(name spread kill add tls compute)
  add_test(NAME e2e_shard_${name} COMMAND e2e_shard ${KVD_E2E_SERVER} ${name})
  set_tests_properties(e2e_shard_${name} PROPERTIES LABELS e2e TIMEOUT 300)
endforeach()
