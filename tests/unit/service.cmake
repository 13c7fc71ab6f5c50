# Unit tests of the server module (service/): settings table and flag parser,
# request field checks, log quoting, method table; and the handlers against a
# store in a temporary directory (no network).
foreach(t config handlers)
  add_executable(test_service_${t} ${CMAKE_SOURCE_DIR}/tests/unit/test_service_${t}.c)
  target_link_libraries(test_service_${t} PRIVATE kvd_service)
  add_test(NAME service_${t} COMMAND test_service_${t})
  set_tests_properties(service_${t} PROPERTIES LABELS unit TIMEOUT 60)
endforeach()

# The connection cap: the test links kvdepotd's accept4 and close.
add_executable(test_conncap ${CMAKE_SOURCE_DIR}/tests/unit/test_conncap.c
                            ${CMAKE_SOURCE_DIR}/service/conncap.c)
target_link_libraries(test_conncap PRIVATE kvd_service)
add_test(NAME service_conncap COMMAND test_conncap)
set_tests_properties(service_conncap PROPERTIES LABELS unit TIMEOUT 60)
