# Interop tests: clients built from independent gRPC implementations against a
# real kvdepotd. Each generates what it needs from proto/kvdepot/v1/kvdepot.proto
# at test time (nothing generated is kept in the tree).
#
#   interop_python        Debian python3-grpcio + python3-protobuf, protoc
#   interop_node          @grpc/grpc-js + @grpc/proto-loader (npm ci in
#                         tests/interop/node), Node >= 18
#   interop_*_security    TLS, mTLS (certificates made with the openssl CLI) and
#                         bearer tokens against a server with a tokens file
#   interop_*_512mib      the 4096-token x 32-layer x 8-head x 128-dim f16
#                         sequence (512 MiB of K+V) appended, read back, read
#                         again after a restart; label slow
#
# A missing prerequisite makes a test FAIL with a message saying what to
# install; it never passes or skips silently (deploy/dev.sh test installs all).

set(KVD_INTEROP_DIR ${CMAKE_CURRENT_LIST_DIR})
if(NOT KVD_PROTO_SRC_DIR)
  set(KVD_PROTO_SRC_DIR ${PROJECT_SOURCE_DIR}/proto)
endif()

# The prefix hash documented in the .proto, straight from libxxhash, for
# clients that have no xxh3 binding of their own.
add_executable(kvd_prefix_hash ${KVD_INTEROP_DIR}/prefix_hash.c)
target_link_libraries(kvd_prefix_hash PRIVATE PkgConfig::XXHASH)

# Debian's interpreter: that is where python3-grpcio installs.
find_program(KVD_INTEROP_PYTHON python3 PATHS /usr/bin NO_DEFAULT_PATH)
find_program(KVD_INTEROP_PYTHON python3)
find_program(KVD_INTEROP_PROTOC protoc)
find_program(KVD_INTEROP_NODE node)

# Registers a test that fails at once, saying why.
function(kvd_interop_missing name why)
  message(WARNING "kvdepot: ${name} will fail: ${why}")
  add_test(NAME ${name} COMMAND sh -c "echo '${name}: FATAL: ${why}' >&2; exit 1")
  set_tests_properties(${name} PROPERTIES LABELS interop)
endfunction()

if(NOT TARGET kvdepotd)
  kvd_interop_missing(interop_python "the kvdepotd target does not exist")
  kvd_interop_missing(interop_node "the kvdepotd target does not exist")
  return()
endif()

if(KVD_INTEROP_PROTOC)
  set(kvd_interop_protoc ${KVD_INTEROP_PROTOC})
else()
  # The test itself reports the missing protoc (package protobuf-compiler).
  set(kvd_interop_protoc protoc)
endif()

foreach(mib 64 512)
  if(mib EQUAL 64)
    set(suffix "")
    set(labels interop)
    set(timeout 900)
    set(only "")
  else()
    set(suffix _${mib}mib)
    set(labels "interop;slow")
    set(timeout 1800)
    set(only --large-only)
  endif()

  if(KVD_INTEROP_PYTHON)
    add_test(NAME interop_python${suffix}
             COMMAND ${KVD_INTEROP_PYTHON} ${KVD_INTEROP_DIR}/python/test_interop.py
                     --kvdepotd $<TARGET_FILE:kvdepotd>
                     --proto-dir ${KVD_PROTO_SRC_DIR}
                     --health-proto-dir ${KVD_GRPC_PROTO_DIR}
                     --protoc ${kvd_interop_protoc}
                     --large-mib ${mib} ${only})
    set_tests_properties(interop_python${suffix} PROPERTIES LABELS "${labels}"
                         TIMEOUT ${timeout} ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
  else()
    kvd_interop_missing(interop_python${suffix} "python3 not found (Debian package python3)")
  endif()

  if(KVD_INTEROP_NODE)
    add_test(NAME interop_node${suffix}
             COMMAND ${KVD_INTEROP_NODE} ${KVD_INTEROP_DIR}/node/test.js
                     --kvdepotd $<TARGET_FILE:kvdepotd>
                     --proto-dir ${KVD_PROTO_SRC_DIR}
                     --health-proto-dir ${KVD_GRPC_PROTO_DIR}
                     --hash-tool $<TARGET_FILE:kvd_prefix_hash>
                     --large-mib ${mib} ${only})
    set_tests_properties(interop_node${suffix} PROPERTIES LABELS "${labels}"
                         TIMEOUT ${timeout})
  else()
    kvd_interop_missing(interop_node${suffix}
                        "node not found (Node >= 18 and npm ci in tests/interop/node)")
  endif()
endforeach()

# TLS, mTLS and tokens from the same clients (each starts its own server).
if(KVD_INTEROP_PYTHON)
  add_test(NAME interop_python_security
           COMMAND ${KVD_INTEROP_PYTHON} ${KVD_INTEROP_DIR}/python/test_interop.py
                   --kvdepotd $<TARGET_FILE:kvdepotd>
                   --proto-dir ${KVD_PROTO_SRC_DIR}
                   --health-proto-dir ${KVD_GRPC_PROTO_DIR}
                   --protoc ${kvd_interop_protoc} --security-only)
  set_tests_properties(interop_python_security PROPERTIES LABELS interop TIMEOUT 120
                       ENVIRONMENT "PYTHONDONTWRITEBYTECODE=1")
endif()
if(KVD_INTEROP_NODE)
  add_test(NAME interop_node_security
           COMMAND ${KVD_INTEROP_NODE} ${KVD_INTEROP_DIR}/node/test.js
                   --kvdepotd $<TARGET_FILE:kvdepotd>
                   --proto-dir ${KVD_PROTO_SRC_DIR}
                   --health-proto-dir ${KVD_GRPC_PROTO_DIR}
                   --hash-tool $<TARGET_FILE:kvd_prefix_hash> --security-only)
  set_tests_properties(interop_node_security PROPERTIES LABELS interop TIMEOUT 120)
endif()
