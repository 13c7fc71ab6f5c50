# VQ codec and SVD reduction end to end (calibrate, create, seal, Read,
# Attend, AppendPages of client-encoded pages, errors) through libkvdepot
# against a real kvdepotd; each case is its own ctest entry with its own
# server. (Included after e2e.cmake, which defines the harness and
# KVD_E2E_SERVER.)
if(TARGET kvd_e2e_harness)
  add_executable(e2e_codecs ${CMAKE_CURRENT_LIST_DIR}/e2e_codecs.c)
  target_link_libraries(e2e_codecs PRIVATE kvd_e2e_harness kvd_kernels m)
  foreach(name vq svd append_pages errors prefix)
    add_test(NAME codecs_${name} COMMAND e2e_codecs ${KVD_E2E_SERVER} ${name})
    set_tests_properties(codecs_${name} PROPERTIES LABELS e2e TIMEOUT 300)
  endforeach()
  # SVD + raw pages attended in (emulated) GPU memory by the reduced-dimension
  # kernel, with the same answers.
  if(TARGET kvdepotd_cuda_emu)
    add_test(NAME codecs_emu_svd COMMAND e2e_codecs $<TARGET_FILE:kvdepotd_cuda_emu> svd)
    set_tests_properties(codecs_emu_svd PROPERTIES LABELS e2e TIMEOUT 300
                         ENVIRONMENT "KVDEPOT_DEVICE=cuda;KVDEPOT_DEVICE_TIER_BYTES=256MiB")
  endif()
endif()
