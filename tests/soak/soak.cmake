# The soak program (tests/soak/soak.c): mixed load for a given time with the
# server's memory, descriptors and threads sampled, exact read-back at the
# end. Built with the tests so it keeps compiling; not a test (it runs for
# as long as it is told): tests/soak/run_soak.sh BUILD_DIR [SECONDS] [THREADS].
if(TARGET kvd_e2e_harness)
  add_executable(soak ${CMAKE_CURRENT_LIST_DIR}/soak.c)
  target_link_libraries(soak PRIVATE kvd_e2e_harness kvd_kernels Threads::Threads)
endif()
