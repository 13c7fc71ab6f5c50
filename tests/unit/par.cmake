# The process's compute pool (kernels/cpu/par.c): every item once, help for
# a caller alone, no wait for helpers busy elsewhere.
add_executable(test_par ${CMAKE_SOURCE_DIR}/tests/unit/test_par.c)
target_include_directories(test_par PRIVATE ${CMAKE_SOURCE_DIR}/kernels)
target_link_libraries(test_par PRIVATE kvd_kernels Threads::Threads)
add_test(NAME kernels_par COMMAND test_par)
set_tests_properties(kernels_par PROPERTIES LABELS unit TIMEOUT 120)
