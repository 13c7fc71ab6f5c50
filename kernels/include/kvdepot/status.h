/*
 * kvdepot status codes.
 *
 * Every fallible kvdepot function returns 0 on success or a negative status.
 * A status is the negated gRPC status code it maps to, so the server turns an
 * error into a gRPC status with `-rc` and the client library turns a gRPC
 * status back into a return value with `-code`. The table below is the single
 * source: it gives the C name, the gRPC code and the generic message.
 */
#ifndef KVDEPOT_STATUS_H
#define KVDEPOT_STATUS_H

#include <stdarg.h>
#include <stddef.h>

#define KVD_STATUS_MAP(X)                                                  \
    X(CANCELLED, 1, "CANCELLED", "cancelled")                              \
    X(EUNKNOWN, 2, "UNKNOWN", "unknown error")                             \
    X(EINVAL, 3, "INVALID_ARGUMENT", "invalid argument")                   \
    X(ETIMEDOUT, 4, "DEADLINE_EXCEEDED", "deadline exceeded")              \
    X(ENOTFOUND, 5, "NOT_FOUND", "not found")                              \
    X(EEXIST, 6, "ALREADY_EXISTS", "already exists")                       \
    X(EPERM, 7, "PERMISSION_DENIED", "permission denied")                  \
    X(ENOMEM, 8, "RESOURCE_EXHAUSTED", "resource exhausted")               \
    X(EPRECOND, 9, "FAILED_PRECONDITION", "failed precondition")           \
    X(EABORTED, 10, "ABORTED", "aborted")                                  \
    X(ERANGE, 11, "OUT_OF_RANGE", "out of range")                          \
    X(EUNSUPP, 12, "UNIMPLEMENTED", "not supported")                       \
    X(EINTERNAL, 13, "INTERNAL", "internal error")                         \
    X(EUNAVAIL, 14, "UNAVAILABLE", "unavailable")                          \
    X(ECORRUPT, 15, "DATA_LOSS", "checksum mismatch or corrupt data")      \
    X(EAUTH, 16, "UNAUTHENTICATED", "unauthenticated")

enum kvd_status {
    KVD_OK = 0,
#define KVD__STATUS_ENUM(name, grpc, gname, msg) KVD_##name = -(grpc),
    KVD_STATUS_MAP(KVD__STATUS_ENUM)
#undef KVD__STATUS_ENUM
};

/* Generic message for a status ("invalid argument"); never NULL. */
const char *kvd_strerror(int status);

/* gRPC status name for a status ("INVALID_ARGUMENT"); "OK" for 0. */
const char *kvd_status_name(int status);

/* gRPC status code (0..16) for a status. */
static inline int kvd_status_to_grpc(int status) { return status < 0 ? -status : 0; }

/*
 * An error with a message naming the problem, filled by the function that
 * detects it and passed up unchanged. Functions take `kvd_error *err`, which
 * may be NULL when the caller only wants the return code.
 */
typedef struct kvd_error {
    int code;       /* a kvd_status, 0 when no error */
    char msg[512];  /* NUL-terminated, empty when no error */
} kvd_error;

/* Set err (if not NULL) to code and a printf-formatted message; returns code
 * so callers can write `return kvd_error_set(err, KVD_EINVAL, "...")`. */
int kvd_error_set(kvd_error *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
int kvd_error_setv(kvd_error *err, int code, const char *fmt, va_list ap);

/* Reset err to "no error". */
static inline void kvd_error_clear(kvd_error *err)
{
    if (err) {
        err->code = 0;
        err->msg[0] = '\0';
    }
}

#endif /* KVDEPOT_STATUS_H */
