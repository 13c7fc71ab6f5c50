# Backend comparison of decode attention: every attention op of the CUDA
# backend against the CPU reference (tests/backend/cuda_attn.c). Built
# whenever nvcc is present; without a GPU the harness runs CPU-vs-CPU
# (self-check) and the test reports skipped (exit 77). On a GPU machine:
#   ctest -L gpu --output-on-failure     (see kernels/cuda/README.md)
if(KVD_HAVE_CUDA)
  add_executable(test_cuda_attn ${CMAKE_CURRENT_LIST_DIR}/cuda_attn.c)
  target_link_libraries(test_cuda_attn PRIVATE kvd_kernels_cuda kvd_testutil Threads::Threads m)
  set_target_properties(test_cuda_attn PROPERTIES LINKER_LANGUAGE CUDA)
  add_test(NAME cuda_attn COMMAND test_cuda_attn)
  set_tests_properties(cuda_attn PROPERTIES LABELS "backend;gpu" SKIP_RETURN_CODE 77 TIMEOUT 900)
  # The harness on its own (CPU fast path as the device): runs everywhere.
  add_test(NAME cuda_attn_selfcheck COMMAND test_cuda_attn --self-check)
  set_tests_properties(cuda_attn_selfcheck PROPERTIES LABELS "backend;unit" TIMEOUT 900)
endif()

# The same comparison with the kernels of kernels/cuda/attn.cu running on a
# CPU emulation of CUDA (tests/backend/cuda_attn_emu: fibers for threads,
# barriers for __syncthreads and shuffles, host memory): the kernels' logic
# is checked on every machine, GPU or not. attn.cu is translated at build
# time (launch syntax and dynamic shared memory only); needs Python 3.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
  set(KVD_ATTN_EMU_DIR ${CMAKE_CURRENT_LIST_DIR}/cuda_attn_emu)
  set(KVD_ATTN_EMU_SRC ${CMAKE_CURRENT_BINARY_DIR}/cuda_attn_emu/attn_emu.cpp)
  add_custom_command(
    OUTPUT ${KVD_ATTN_EMU_SRC}
    COMMAND ${CMAKE_COMMAND} -E make_directory ${CMAKE_CURRENT_BINARY_DIR}/cuda_attn_emu
    COMMAND ${Python3_EXECUTABLE} ${KVD_ATTN_EMU_DIR}/translate.py
            ${PROJECT_SOURCE_DIR}/kernels/cuda/attn.cu ${KVD_ATTN_EMU_SRC}
    DEPENDS ${PROJECT_SOURCE_DIR}/kernels/cuda/attn.cu ${KVD_ATTN_EMU_DIR}/translate.py
    COMMENT "Translating attn.cu for the CPU emulation")
  add_executable(test_cuda_attn_emu ${CMAKE_CURRENT_LIST_DIR}/cuda_attn.c ${KVD_ATTN_EMU_DIR}/emu.cpp
                                    ${KVD_ATTN_EMU_SRC})
  set_source_files_properties(${KVD_ATTN_EMU_SRC} PROPERTIES HEADER_FILE_ONLY ON)
  target_compile_definitions(test_cuda_attn_emu PRIVATE KVD_ATTN_EMU=1)
  target_include_directories(test_cuda_attn_emu PRIVATE ${KVD_ATTN_EMU_DIR} ${CMAKE_CURRENT_BINARY_DIR}/cuda_attn_emu
                                                        ${PROJECT_SOURCE_DIR}/kernels/cuda
                                                        ${PROJECT_SOURCE_DIR}/kernels)
  set_target_properties(test_cuda_attn_emu PROPERTIES CXX_STANDARD 17)
  target_link_libraries(test_cuda_attn_emu PRIVATE kvd_testutil kvd_kernels Threads::Threads m)
  add_test(NAME cuda_attn_emu COMMAND test_cuda_attn_emu)
  set_tests_properties(cuda_attn_emu PROPERTIES LABELS "backend;unit" TIMEOUT 1800)
  # the threads of each phase in the other order: a missing barrier shows
  add_test(NAME cuda_attn_emu_reverse COMMAND test_cuda_attn_emu)
  set_tests_properties(cuda_attn_emu_reverse PROPERTIES LABELS "backend;unit" TIMEOUT 1800
                                                        ENVIRONMENT KVD_EMU_REVERSE=1)
endif()
