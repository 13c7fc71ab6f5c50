# Operating kvdepotd (TLS, tokens, quotas and limits, deadlines, config file,
# metrics), driven through the kvdepot CLI, i.e. libkvdepot. Certificates are
# made by each test with the openssl CLI; /metrics is scraped with curl.

if(TARGET kvdepotd)
  set(KVD_OPS_SERVER $<TARGET_FILE:kvdepotd>)
else()
  set(KVD_OPS_SERVER ${CMAKE_BINARY_DIR}/service/kvdepotd)
endif()

foreach(name tls mtls auth reload quota limits deadline config metrics)
  add_test(NAME ops_${name}
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/ops_test.sh ${KVD_OPS_SERVER}
                   $<TARGET_FILE:kvdepot> ${name})
  set_tests_properties(ops_${name} PROPERTIES LABELS e2e TIMEOUT 120)
endforeach()

# The same pieces without a network: tokens file, quotas, config file,
# loopback rule, metrics rendering.
add_executable(test_ops_unit ${CMAKE_CURRENT_LIST_DIR}/test_ops_unit.c)
target_link_libraries(test_ops_unit PRIVATE kvd_service)
add_test(NAME ops_unit COMMAND test_ops_unit)
set_tests_properties(ops_unit PROPERTIES LABELS unit TIMEOUT 60)
