/*
 * Fuzz target for the two files an operator hands kvdepotd: the config file
 * and the tokens file. The bytes go to a memfd and are loaded through its
 * /proc path, exactly as kvdepotd reads them; anything is allowed to fail,
 * nothing may crash, leak or read out of bounds.
 */
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <unistd.h>

#include "auth.h"
#include "config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int fd = memfd_create("kvd-fuzz", MFD_CLOEXEC);
    if (fd < 0)
        return 0;
    if (write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    char err[512];

    kvd_config c;
    if (kvd_config_defaults(&c) == 0) {
        if (kvd_config_apply_file(&c, path, err, sizeof err) == 0) {
            FILE *null = fopen("/dev/null", "w");
            if (null) {
                kvd_config_print(null, &c);
                fclose(null);
            }
        }
        kvd_config_free(&c);
    }

    kvd_auth *a = NULL;
    if (kvd_auth_load(path, 3, 1024, &a, err, sizeof err) == 0) {
        kvd_error e;
        /* Exercise the namespaces and quotas the file set up. */
        if (kvd_quota_reserve(a, "m", 1, 10, &e) == 0)
            kvd_quota_release(a, "m", 1, 10);
        for (size_t i = 0; i < a->n_tokens; i++)
            (void)kvd_auth_model_allowed(&a->tokens[i], "team-a-model");
        kvd_auth_unref(a);
    }
    close(fd);
    return 0;
}
