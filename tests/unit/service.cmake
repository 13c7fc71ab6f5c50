# Unit tests of the server module (service/): settings table and flag parser,
# request field checks, log quoting, method table; and the handlers against a
# store in a temporary directory (no network).
foreach(t config handlers)
  add_executable(test_service_${t} ${CMAKE_SOURCE_DIR}/tests/unit/test_service_${t}.c)
  target_link_libraries(test_service_${t} PRIVATE kvd_service)
  add_test(NAME service_${t} COMMAND test_service_${t})
  set_tests_properties(service_${t} PROPERTIES LABELS unit TIMEOUT 60)
endforeach()
