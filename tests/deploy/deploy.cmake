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

# The Helm chart (deploy/helm/kvdepot): helm is not packaged for Debian, so
# tests/deploy/helmrender renders it as `helm template` does (Go's
# text/template and sprig, Helm's own template language, from Debian's
# golang-go and golang-github-masterminds-sprig-dev, built offline in GOPATH
# mode); kubernetes-validate (PyPI, build/py-deploy, made by deploy/dev.sh
# test) checks the renders against the Kubernetes schemas.
find_program(KVD_GO_TOOL go PATHS /usr/lib/go/bin)
set(KVD_SPRIG_DIR /usr/share/gocode/src/github.com/Masterminds/sprig)
if(KVD_GO_TOOL AND EXISTS ${KVD_SPRIG_DIR} AND TARGET kvdepotd AND TARGET kvdepot)
  set(kvd_helmrender_gopath ${CMAKE_CURRENT_BINARY_DIR}/helmrender-go)
  set(kvd_helmrender_bin ${CMAKE_CURRENT_BINARY_DIR}/helmrender)
  add_custom_command(
    OUTPUT ${kvd_helmrender_bin}
    COMMAND ${CMAKE_COMMAND} -E env GO111MODULE=off GOFLAGS= GOPROXY=off
            GOPATH=${kvd_helmrender_gopath}:/usr/share/gocode GOCACHE=${kvd_helmrender_gopath}/cache
            CGO_ENABLED=0 ${KVD_GO_TOOL} build -o ${kvd_helmrender_bin} .
    WORKING_DIRECTORY ${CMAKE_CURRENT_LIST_DIR}/helmrender
    DEPENDS ${CMAKE_CURRENT_LIST_DIR}/helmrender/main.go
    COMMENT "Building helmrender (Helm chart rendering for deploy_helm)"
    VERBATIM)
  add_custom_target(kvd_helmrender ALL DEPENDS ${kvd_helmrender_bin})
  add_test(NAME deploy_helm
           COMMAND bash ${CMAKE_CURRENT_LIST_DIR}/helm_test.sh ${kvd_helmrender_bin}
                   ${CMAKE_BINARY_DIR}/py-deploy/bin/kubernetes-validate ${PROJECT_SOURCE_DIR}
                   $<TARGET_FILE:kvdepotd> $<TARGET_FILE:kvdepot>)
  # Label deploy: no C code runs, so the sanitizer pass (unit, backend, e2e)
  # leaves it out (its build tree has no py-deploy).
  set_tests_properties(deploy_helm PROPERTIES LABELS deploy TIMEOUT 120)
else()
  add_test(NAME deploy_helm
           COMMAND sh -c "echo 'deploy_helm: needs go (golang-go) and sprig (golang-github-masterminds-sprig-dev): deploy/dev.sh deps --test' >&2; exit 1")
  set_tests_properties(deploy_helm PROPERTIES LABELS deploy)
endif()
