# The CUDA backend on a CPU emulation of CUDA (tests/backend/cuda_emu, emu.h):
# every kernels/cuda/*.cu is translated at build time (launch syntax and
# dynamic shared memory only; translate.py) and compiled as C++ against the
# emulated runtime, cuBLAS and device, so the backend's host code and every
# kernel run on any Linux machine, GPU or nvcc or not. The GPU comparison
# tests then run against it: the emulated device is the device under test.
# Needs Python 3 and a C++17 compiler.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
  set(KVD_EMU_DIR ${CMAKE_CURRENT_LIST_DIR}/cuda_emu)
  file(GLOB KVD_EMU_CU CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/kernels/cuda/*.cu)
  set(KVD_EMU_GEN "")
  foreach(cu ${KVD_EMU_CU})
    get_filename_component(stem ${cu} NAME_WE)
    set(out ${CMAKE_CURRENT_BINARY_DIR}/cuda_emu/${stem}_emu.cpp)
    add_custom_command(
      OUTPUT ${out}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_BINARY_DIR}/cuda_emu
      COMMAND ${Python3_EXECUTABLE} ${KVD_EMU_DIR}/translate.py ${cu} ${out}
      DEPENDS ${cu} ${KVD_EMU_DIR}/translate.py
      COMMENT "Translating ${stem}.cu for the CPU emulation of CUDA")
    list(APPEND KVD_EMU_GEN ${out})
  endforeach()
  add_library(kvd_kernels_cuda_emu STATIC ${KVD_EMU_DIR}/emu.cpp ${KVD_EMU_GEN})
  target_include_directories(kvd_kernels_cuda_emu PRIVATE ${KVD_EMU_DIR}
                                                           ${PROJECT_SOURCE_DIR}/kernels/cuda)
  # No contraction of a*b+c into one rounding, like nvcc --fmad=false.
  target_compile_options(kvd_kernels_cuda_emu PRIVATE -ffp-contract=off)
  set_target_properties(kvd_kernels_cuda_emu PROPERTIES CXX_STANDARD 17)
  target_link_libraries(kvd_kernels_cuda_emu PUBLIC kvd_kernels Threads::Threads)

  # The comparison tests of cuda.cmake, cuda_ops.cmake and cuda_attn.cmake
  # with the emulated device under test.
  foreach(t cuda_backend cuda_ops cuda_attn)
    if(t STREQUAL "cuda_backend")
      set(src ${CMAKE_CURRENT_LIST_DIR}/test_cuda_backend.c)
    else()
      set(src ${CMAKE_CURRENT_LIST_DIR}/${t}.c)
    endif()
    add_executable(test_${t}_emu ${src})
    target_compile_definitions(test_${t}_emu PRIVATE KVD_CUDA_EMU=1)
    target_link_libraries(test_${t}_emu PRIVATE kvd_kernels_cuda_emu kvd_testutil Threads::Threads m)
    set_target_properties(test_${t}_emu PROPERTIES LINKER_LANGUAGE CXX)
    add_test(NAME ${t}_emu COMMAND test_${t}_emu)
    set_tests_properties(${t}_emu PROPERTIES LABELS "backend;unit" TIMEOUT 1800)
    if(t STREQUAL "cuda_ops")
      # minutes on the emulation: left out of the sanitizer pass
      set_tests_properties(${t}_emu PROPERTIES LABELS "backend;unit;slow")
    endif()
  endforeach()
  # the threads of each phase in the other order: a missing barrier shows
  add_test(NAME cuda_attn_emu_reverse COMMAND test_cuda_attn_emu)
  set_tests_properties(cuda_attn_emu_reverse PROPERTIES LABELS "backend;unit" TIMEOUT 1800
                                                        ENVIRONMENT KVD_EMU_REVERSE=1)
endif()

# kvdepotd on the emulated device: with --device cuda (KVDEPOT_DEVICE=cuda)
# its device tier lies in emulated device memory and Attend runs the CUDA
# kernels on the pages there (tests/e2e/e2e_compute.cmake runs the compute
# tests against it).
if(TARGET kvd_kernels_cuda_emu AND TARGET kvd_service)
  add_executable(kvdepotd_cuda_emu ${PROJECT_SOURCE_DIR}/service/main.c
                                   ${PROJECT_SOURCE_DIR}/service/conncap.c)
  target_compile_definitions(kvdepotd_cuda_emu PRIVATE KVD_VERSION="${PROJECT_VERSION}")
  target_link_libraries(kvdepotd_cuda_emu PRIVATE kvd_kernels_cuda_emu kvd_service)
  set_target_properties(kvdepotd_cuda_emu PROPERTIES LINKER_LANGUAGE CXX)
endif()
