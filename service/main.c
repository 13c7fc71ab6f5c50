/*
 * kvdepotd: settings, store, server, and the wait for SIGTERM/SIGINT.
 *
 * Signals are blocked in every thread (the mask is set before gRPC or the
 * store start theirs) and read synchronously from a signalfd by the main
 * thread, so shutdown work never runs inside a signal handler.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <grpc/grpc.h>

#include "config.h"
#include "log.h"
#include "rpc.h"
#include "server.h"
#include "store.h"

#ifndef KVD_VERSION
#define KVD_VERSION "unknown"
#endif

static int write_port_file(const char *path, int port)
{
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= sizeof tmp)
        return -1;
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -1;
    int ok = fprintf(f, "%d\n", port) > 0;
    ok = (fclose(f) == 0) && ok;
    /* rename makes the file appear complete or not at all. */
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *prog = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
    kvd_config cfg;
    char err[512];
    if (kvd_config_defaults(&cfg) != 0) {
        fprintf(stderr, "%s: out of memory\n", prog);
        return 1;
    }
    int action = KVD_CONFIG_RUN;
    if (kvd_config_apply_env(&cfg, getenv, err, sizeof err) != 0 ||
        kvd_config_parse_args(&cfg, argc, argv, &action, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        kvd_config_free(&cfg);
        return 2;
    }
    if (action == KVD_CONFIG_HELP) {
        kvd_config_usage(stdout, prog);
        kvd_config_free(&cfg);
        return 0;
    }
    if (action == KVD_CONFIG_VERSION) {
        printf("kvdepotd %s\n", KVD_VERSION);
        kvd_config_free(&cfg);
        return 0;
    }
    if (cfg.threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        cfg.threads = n > 0 ? (uint64_t)n : 1;
        if (cfg.threads > 256)
            cfg.threads = 256;
    }
    kvd_log_threshold = cfg.log_level;

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    pthread_sigmask(SIG_BLOCK, &mask, NULL);
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC);
    if (sfd < 0) {
        fprintf(stderr, "%s: signalfd: %s\n", prog, strerror(errno));
        kvd_config_free(&cfg);
        return 1;
    }

    kvd_store_options sopt = {
        .data_dir = cfg.data_dir,
        .page_tokens = (uint32_t)cfg.page_tokens,
        .sync_writes = cfg.sync,
    };
    kvd_store *store = NULL;
    kvd_error serr;
    kvd_error_clear(&serr);
    int rc = kvd_store_open(&sopt, &store, &serr);
    if (rc) {
        fprintf(stderr, "%s: cannot open the store in %s: %s\n", prog, cfg.data_dir,
                serr.msg[0] ? serr.msg : kvd_strerror(rc));
        close(sfd);
        kvd_config_free(&cfg);
        return 1;
    }

    kvd_service svc = {
        .store = store,
        .cfg = &cfg,
        .page_tokens = kvd_store_page_tokens(store),
    };
    atomic_init(&svc.serving, 1);

    grpc_init();
    kvd_server *srv = NULL;
    int port = 0;
    if (kvd_server_start(&svc, &srv, &port, err, sizeof err) != 0) {
        fprintf(stderr, "%s: %s\n", prog, err);
        kvd_store_close(store);
        grpc_shutdown();
        close(sfd);
        kvd_config_free(&cfg);
        return 1;
    }
    int exit_code = 0;
    if (cfg.port_file && write_port_file(cfg.port_file, port) != 0) {
        fprintf(stderr, "%s: cannot write the port file %s: %s\n", prog, cfg.port_file,
                strerror(errno));
        exit_code = 1;
    } else {
        char qlisten[300], qdir[1100];
        kvd_log_quote(qlisten, sizeof qlisten, cfg.listen, strlen(cfg.listen));
        kvd_log_quote(qdir, sizeof qdir, cfg.data_dir, strlen(cfg.data_dir));
        KVD_LOG(KVD_LOG_INFO, "serving",
                "listen=%s port=%d data_dir=%s threads=%llu page_tokens=%u sync=%d "
                "max_message_bytes=%llu version=%s",
                qlisten, port, qdir, (unsigned long long)cfg.threads,
                svc.page_tokens, cfg.sync, (unsigned long long)cfg.max_message_bytes,
                KVD_VERSION);
        for (;;) {
            struct signalfd_siginfo si;
            ssize_t n = read(sfd, &si, sizeof si);
            if (n == (ssize_t)sizeof si) {
                KVD_LOG(KVD_LOG_INFO, "shutting down", "signal=%s",
                        si.ssi_signo == SIGTERM ? "SIGTERM" : "SIGINT");
                break;
            }
            if (n < 0 && errno != EINTR) {
                KVD_LOG(KVD_LOG_ERROR, "reading the signalfd failed", "errno=%d", errno);
                exit_code = 1;
                break;
            }
        }
    }

    atomic_store(&svc.serving, 0);
    kvd_server_shutdown(srv, cfg.shutdown_grace_ms);
    kvd_store_close(store);
    grpc_shutdown();
    close(sfd);
    KVD_LOG(KVD_LOG_INFO, "stopped", "exit=%d", exit_code);
    kvd_config_free(&cfg);
    return exit_code;
}
