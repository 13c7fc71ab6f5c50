# Unit tests of the server module (service/): settings table and flag parser,
# request field checks, log quoting, method table.
add_executable(test_service_config ${CMAKE_SOURCE_DIR}/tests/unit/test_service_config.c)
target_link_libraries(test_service_config PRIVATE kvd_service)
add_test(NAME service_config COMMAND test_service_config)
set_tests_properties(service_config PROPERTIES LABELS unit TIMEOUT 60)
