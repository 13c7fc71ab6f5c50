# Tiers end to end: working set 4x the memory tiers under a bounded RSS,
# kill -9 under each durability setting, a page corrupted on disk, concurrent
# readers and writers with eviction, TTL and the disk limit.

add_executable(e2e_tier ${CMAKE_CURRENT_LIST_DIR}/e2e_tier.c)
target_link_libraries(e2e_tier PRIVATE kvd_e2e_harness PkgConfig::ROCKSDB
                                       Threads::Threads)

if(TARGET kvdepotd)
  set(KVD_TIER_SERVER $<TARGET_FILE:kvdepotd>)
else()
  set(KVD_TIER_SERVER ${CMAKE_BINARY_DIR}/service/kvdepotd)
endif()

foreach(name working_set crash_sync crash_spill crash_none corrupt concurrent expiry)
  add_test(NAME e2e_tier_${name} COMMAND e2e_tier ${KVD_TIER_SERVER} ${name})
  set_tests_properties(e2e_tier_${name} PROPERTIES LABELS e2e TIMEOUT 300)
endforeach()

add_test(NAME e2e_tier_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/tier_cli.sh ${KVD_TIER_SERVER}
                                   $<TARGET_FILE:kvdepot>)
set_tests_properties(e2e_tier_cli PROPERTIES LABELS e2e TIMEOUT 120)
