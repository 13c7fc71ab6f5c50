# The Python package (client/python) against a real kvdepotd: a wheel built
# from a copy of the package in a virtual environment of the build tree
# (Debian's python3-cffi, python3-numpy and python3-pytest through
# --system-site-packages: nothing is fetched), installed there, then its
# pytest suite. Label python: not in the sanitizer pass (an ASan
# libkvdepot cannot load into an uninstrumented interpreter).
find_program(KVD_PYTHON_DEBIAN python3 PATHS /usr/bin NO_DEFAULT_PATH)
if(TARGET kvdepot_shared AND TARGET kvdepotd)
  if(KVD_PYTHON_DEBIAN)
    add_test(NAME python_client
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/run_python_client.sh ${KVD_PYTHON_DEBIAN}
                     ${PROJECT_SOURCE_DIR}/client $<TARGET_FILE_DIR:kvdepot_shared>
                     $<TARGET_FILE:kvdepotd> ${CMAKE_CURRENT_BINARY_DIR}/python_client)
  else()
    add_test(NAME python_client COMMAND sh -c
             "echo 'python_client: FATAL: /usr/bin/python3 not found (deploy/dev.sh test installs it)' >&2; exit 1")
  endif()
  set_tests_properties(python_client PROPERTIES LABELS python TIMEOUT 600)

  # kvdepot.integrations.transformers with a small random Llama: in the
  # virtual environment deploy/dev.sh test prepares (Debian's python3-torch,
  # transformers and its dependencies pinned in engine-requirements.txt).
  set(KVD_PY_ENGINES_VENV ${CMAKE_BINARY_DIR}/py-engines
      CACHE PATH "virtual environment of the python_transformers test")
  if(KVD_PYTHON_DEBIAN)
    add_test(NAME python_transformers
             COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/run_python_client.sh ${KVD_PYTHON_DEBIAN}
                     ${PROJECT_SOURCE_DIR}/client $<TARGET_FILE_DIR:kvdepot_shared>
                     $<TARGET_FILE:kvdepotd> ${CMAKE_CURRENT_BINARY_DIR}/python_transformers
                     test_transformers.py ${KVD_PY_ENGINES_VENV})
    set_tests_properties(python_transformers PROPERTIES LABELS python TIMEOUT 600)
  endif()
endif()
