# Unit tests of the store module (store/): page format and store.
foreach(t page store)
  add_executable(test_${t} ${CMAKE_SOURCE_DIR}/tests/unit/test_${t}.c)
  target_link_libraries(test_${t} PRIVATE kvd_store)
  add_test(NAME store_${t} COMMAND test_${t})
  set_tests_properties(store_${t} PROPERTIES LABELS unit TIMEOUT 60)
endforeach()
