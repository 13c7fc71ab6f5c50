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

# Building the CPU image for real (deploy/build-images.sh --bootstrap-base
# --smoke: podman or buildah with chroot isolation, Debian base images made by
# debootstrap). Minutes of work and root for debootstrap, so it runs only when
# asked: KVD_IMAGE_TEST=1 (deploy/dev.sh test sets it when run as root).
# Otherwise, and without a builder, it reports "skipped".
add_test(NAME deploy_image_cpu
         COMMAND sh -c "[ \"$KVD_IMAGE_TEST\" = 1 ] || { echo 'set KVD_IMAGE_TEST=1 to build the image'; exit 77; }; exec \"$0\" --bootstrap-base --smoke"
                 ${PROJECT_SOURCE_DIR}/deploy/build-images.sh)
set_tests_properties(deploy_image_cpu PROPERTIES LABELS "slow" SKIP_RETURN_CODE 77 TIMEOUT 3600)

# The install tree (cmake --install into a temporary prefix) and a program
# built against it with pkg-config and find_package, shared and static. Not
# in the sanitizer pass (its archive needs the sanitizer runtime to link).
add_test(NAME deploy_install
         COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/install_test.sh ${CMAKE_BINARY_DIR})
set_tests_properties(deploy_install PROPERTIES LABELS install TIMEOUT 300)

# deploy/monitoring (alerting rules, Grafana dashboard) against a live
# kvdepotd's /metrics, with promtool (Debian's prometheus package).
if(TARGET kvdepotd AND TARGET kvdepot)
  add_test(NAME deploy_monitoring
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/monitoring_test.sh $<TARGET_FILE:kvdepotd>
                   $<TARGET_FILE:kvdepot> ${PROJECT_SOURCE_DIR})
  set_tests_properties(deploy_monitoring PROPERTIES LABELS e2e TIMEOUT 120)
endif()
