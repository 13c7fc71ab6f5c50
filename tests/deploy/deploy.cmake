# Static checks of deploy/: Kubernetes manifests (base and GPU overlay),
# Dockerfiles, compose file, .dockerignore (check_deploy.py). With the
# binaries at hand, config keys are checked against `kvdepotd --help` and
# probe flags against the kvdepot CLI's usage.
find_program(KVD_PYTHON3 NAMES python3)
if(KVD_PYTHON3)
  set(_kvd_deploy_args ${PROJECT_SOURCE_DIR})
  if(TARGET kvdepotd)
    list(APPEND _kvd_deploy_args --kvdepotd $<TARGET_FILE:kvdepotd>)
  endif()
  if(TARGET kvdepot)
    list(APPEND _kvd_deploy_args --kvdepot $<TARGET_FILE:kvdepot>)
  endif()
  add_test(NAME deploy_manifests
           COMMAND ${KVD_PYTHON3} ${CMAKE_CURRENT_LIST_DIR}/check_deploy.py ${_kvd_deploy_args})
  set_tests_properties(deploy_manifests PROPERTIES LABELS unit TIMEOUT 120)
endif()
