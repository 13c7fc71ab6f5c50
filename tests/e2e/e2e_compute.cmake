# Compute RPCs end to end (Attend, PlanFetch) through libkvdepot against a
# real kvdepotd; each case is its own ctest entry with its own server.
# (Included after e2e.cmake, which defines the harness and KVD_E2E_SERVER.)
if(TARGET kvd_e2e_harness)
  add_executable(e2e_compute ${CMAKE_CURRENT_LIST_DIR}/e2e_compute.c)
  target_link_libraries(e2e_compute PRIVATE kvd_e2e_harness kvd_kernels m)
  foreach(name attend attend_long lse_merge plan_fetch errors batch_limit attend_half codecs
               bad_codecs small_heads search append_pages read_pages)
    add_test(NAME compute_${name} COMMAND e2e_compute ${KVD_E2E_SERVER} ${name})
    set_tests_properties(compute_${name} PROPERTIES LABELS e2e TIMEOUT 300)
  endforeach()
  add_test(NAME compute_device COMMAND e2e_compute ${KVD_E2E_SERVER} device)
  set_tests_properties(compute_device PROPERTIES LABELS e2e TIMEOUT 300
                                                 ENVIRONMENT KVDEPOT_DEVICE=cpu)
  # The same tests against kvdepotd on the CPU emulation of a GPU
  # (tests/backend/cuda_emu.cmake): pages held in emulated device memory,
  # Attend through the CUDA backend's host code and kernels.
  if(TARGET kvdepotd_cuda_emu)
    # device and search run the emulated VQ coding and K-means, minutes
    # under the sanitizers: "slow" keeps them to the first pass.
    foreach(name device attend codecs small_heads lse_merge search append_pages read_pages)
      set(labels e2e)
      if(name STREQUAL "device" OR name STREQUAL "search")
        set(labels "e2e;slow")
      endif()
      add_test(NAME compute_emu_${name} COMMAND e2e_compute $<TARGET_FILE:kvdepotd_cuda_emu> ${name})
      set_tests_properties(compute_emu_${name} PROPERTIES LABELS "${labels}" TIMEOUT 600
                           ENVIRONMENT "KVDEPOT_DEVICE=cuda;KVDEPOT_DEVICE_TIER_BYTES=256MiB")
    endforeach()
    add_test(NAME compute_emu_device_fault
             COMMAND e2e_compute $<TARGET_FILE:kvdepotd_cuda_emu> device_fault)
    set_tests_properties(compute_emu_device_fault PROPERTIES LABELS e2e TIMEOUT 300
                         ENVIRONMENT "KVDEPOT_DEVICE=cuda;KVD_EMU_FAULT_AT_LAUNCH=1")
    add_test(NAME compute_emu_device_fault_append
             COMMAND e2e_compute $<TARGET_FILE:kvdepotd_cuda_emu> device_fault_append)
    set_tests_properties(compute_emu_device_fault_append PROPERTIES LABELS e2e TIMEOUT 300
                         ENVIRONMENT "KVDEPOT_DEVICE=cuda;KVD_EMU_FAULT_AT_LAUNCH=1")
    add_test(NAME compute_emu_device_oom
             COMMAND e2e_compute $<TARGET_FILE:kvdepotd_cuda_emu> device_oom)
    set_tests_properties(compute_emu_device_oom PROPERTIES LABELS e2e TIMEOUT 300
      ENVIRONMENT "KVDEPOT_DEVICE=cuda;KVD_EMU_DEVICE_MIB=2;KVDEPOT_DEVICE_TIER_BYTES=2MiB")
  endif()
endif()

# The compressed-cache and compute benchmark (prints tables; build target only):
#   cmake --build <dir> --target bench_compute
#   <dir>/tests/bench_compute <dir>/service/kvdepotd [max_tokens]
if(TARGET kvd_e2e_harness)
  add_executable(bench_compute EXCLUDE_FROM_ALL ${PROJECT_SOURCE_DIR}/tests/bench/bench_compute.c)
  target_link_libraries(bench_compute PRIVATE kvd_e2e_harness kvd_store m)
endif()

# Attend over gRPC on the device kvdepotd serves from, 4K..128K tokens x
# batch 1..64, fp16 / INT4 / INT2 / VQ (prints a table; built with the
# tests so it keeps compiling, run by tests/bench/bench_attend_e2e.sh).
if(TARGET kvd_e2e_harness)
  add_executable(bench_attend_e2e ${PROJECT_SOURCE_DIR}/tests/bench/bench_attend_e2e.c)
  target_link_libraries(bench_attend_e2e PRIVATE kvd_e2e_harness kvd_kernels m)
endif()

# Attend latency (p50/p99) with 1/4/16 concurrent clients, fp16 and INT2,
# optionally beside busy processes (prints a table; built with the tests so
# it keeps compiling): <dir>/tests/bench_attend_load <dir>/service/kvdepotd
if(TARGET kvd_e2e_harness)
  add_executable(bench_attend_load ${PROJECT_SOURCE_DIR}/tests/bench/bench_attend_load.c)
  target_link_libraries(bench_attend_load PRIVATE kvd_e2e_harness kvd_kernels m Threads::Threads)
endif()

add_test(NAME compute_cli COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/cli_compute.sh ${KVD_E2E_SERVER}
                                  $<TARGET_FILE:kvdepot>)
set_tests_properties(compute_cli PROPERTIES LABELS e2e TIMEOUT 120)
