#include "kvdepot/status.h"

#include <stdio.h>

const char *kvd_strerror(int status)
{
    switch (status) {
    case KVD_OK:
        return "ok";
#define KVD__STATUS_MSG(name, grpc, gname, msg) \
    case KVD_##name:                           \
        return msg;
        KVD_STATUS_MAP(KVD__STATUS_MSG)
#undef KVD__STATUS_MSG
    }
    return "unknown error";
}

const char *kvd_status_name(int status)
{
    switch (status) {
    case KVD_OK:
        return "OK";
#define KVD__STATUS_NAME(name, grpc, gname, msg) \
    case KVD_##name:                            \
        return gname;
        KVD_STATUS_MAP(KVD__STATUS_NAME)
#undef KVD__STATUS_NAME
    }
    return "UNKNOWN";
}

int kvd_error_setv(kvd_error *err, int code, const char *fmt, va_list ap)
{
    if (err) {
        err->code = code;
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    }
    return code;
}

int kvd_error_set(kvd_error *err, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    kvd_error_setv(err, code, fmt, ap);
    va_end(ap);
    return code;
}
