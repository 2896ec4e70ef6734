#define _GNU_SOURCE
#include "CSignerShim.h"

#include <errno.h>
#include <malloc.h>
#include <signal.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/xattr.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/core_names.h>
#include <openssl/ec.h>
#include <openssl/params.h>

int CSignerShim_peer_credentials(int fd, uid_t *uid, gid_t *gid, pid_t *pid) {
    struct ucred cred;
    socklen_t len = sizeof(cred);
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        return -1;
    }
    if (len != sizeof(cred)) {
        errno = EINVAL;
        return -1;
    }
    *uid = cred.uid;
    *gid = cred.gid;
    *pid = cred.pid;
    return 0;
}

#ifndef SO_PEERGROUPS
#define SO_PEERGROUPS 59  // Linux 4.13, asm-generic/socket.h
#endif

int CSignerShim_peer_groups(int fd, gid_t *groups, int capacity) {
    socklen_t len = (socklen_t)((size_t)capacity * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) != 0) {
        // Too small a buffer: the kernel says how much it needs (a length
        // it did not raise would be read as `capacity` groups of gid 0).
        if (errno == ERANGE && len > (socklen_t)((size_t)capacity * sizeof(gid_t))) {
            return (int)(len / sizeof(gid_t));
        }
        return -1;
    }
    return (int)(len / sizeof(gid_t));
}

int CSignerShim_disable_core_dumps(void) {
    struct rlimit none = {0, 0};
    if (setrlimit(RLIMIT_CORE, &none) != 0) {
        return -1;
    }
    return prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
}

const char *CSignerShim_errno_name(int code) {
    return strerrorname_np(code);
}

int CSignerShim_malloc_thresholds(int mmap_threshold, int trim_threshold) {
    return mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 && mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1 ? 0 : -1;
}

static const int held_signals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
#define HELD_SIGNAL_COUNT (sizeof(held_signals) / sizeof(held_signals[0]))
static struct sigaction saved_actions[HELD_SIGNAL_COUNT];
static int held_installed[HELD_SIGNAL_COUNT];
static int hold_depth = 0;  // holds are made and released on one thread, nested ones inside the outer
static volatile sig_atomic_t held_signal = 0;
static volatile sig_atomic_t hold_before_write = 0;  // the held command is still waiting (for a lock)

void CSignerShim_set_hold_before_write(int before_write) {
    hold_before_write = before_write ? 1 : 0;
}

static void set_default(int number) {
    struct sigaction fallback;
    memset(&fallback, 0, sizeof(fallback));
    fallback.sa_handler = SIG_DFL;
    sigemptyset(&fallback.sa_mask);
    sigaction(number, &fallback, NULL);
}

// When the first held signal came (CLOCK_MONOTONIC).
static struct timespec first_held_at;

// Async-signal-safe: only clock_gettime(2), write(2), sigaction(2) and raise(3).
static void hold_signal(int number) {
    int saved_errno = errno;  // the interrupted code may be reading errno
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (held_signal == 0) {
        // The time first: a signal handled on another thread that sees
        // held_signal set must see the time too.
        first_held_at = now;
        atomic_signal_fence(memory_order_seq_cst);
        held_signal = number;
        static const char note[] = "writing to the token: stopping once the write is done (signal again, 3 s or more from now, to stop at once, which can leave a SoftHSM token unusable)\n";
        static const char waiting[] = "stopping: nothing was written yet\n";
        ssize_t ignored = hold_before_write ? write(STDERR_FILENO, waiting, sizeof(waiting) - 1) : write(STDERR_FILENO, note, sizeof(note) - 1);
        (void)ignored;
        errno = saved_errno;
        return;
    }
    // A second signal soon after the first is a double Ctrl-C, not an
    // operator giving up on a call that hangs: one that ended signctl then
    // emptied SoftHSM's token file in 6 of 30 PIN changes.
    long elapsed_ms = (long)(now.tv_sec - first_held_at.tv_sec) * 1000 + (now.tv_nsec - first_held_at.tv_nsec) / 1000000;
    if (elapsed_ms < 3000) {
        if (hold_before_write) {
            errno = saved_errno;
            return;  // the wait is already stopping, and nothing is being written
        }
        static const char wait[] = "still writing to the token: a second signal stops signctl at once only 3 s or more after the first\n";
        ssize_t ignored = write(STDERR_FILENO, wait, sizeof(wait) - 1);
        (void)ignored;
        errno = saved_errno;
        return;
    }
    static const char stopped[] = "stopped in the middle of a token write: check the token with signctl keys list (it counts key objects left incomplete)\n";
    ssize_t ignored = write(STDERR_FILENO, stopped, sizeof(stopped) - 1);
    (void)ignored;
    set_default(number);
    raise(number);
}

int CSignerShim_hold_termination_signals(void) {
    if (hold_depth++ > 0) {
        return 0;  // the outer hold already holds them
    }
    held_signal = 0;
    struct sigaction holder;
    memset(&holder, 0, sizeof(holder));
    holder.sa_handler = hold_signal;
    holder.sa_flags = SA_RESTART;
    sigemptyset(&holder.sa_mask);
    for (size_t index = 0; index < HELD_SIGNAL_COUNT; index++) {
        sigaddset(&holder.sa_mask, held_signals[index]);
    }
    for (size_t index = 0; index < HELD_SIGNAL_COUNT; index++) {
        held_installed[index] = 0;
        if (sigaction(held_signals[index], NULL, &saved_actions[index]) != 0) {
            continue;
        }
        // An ignored signal (nohup, a background job) stays ignored: it
        // must neither take the held slot nor make a later one "the second".
        if (saved_actions[index].sa_handler == SIG_IGN) {
            continue;
        }
        if (sigaction(held_signals[index], &holder, NULL) != 0) {
            int saved = errno;
            while (index-- > 0) {
                if (held_installed[index]) {
                    sigaction(held_signals[index], &saved_actions[index], NULL);
                }
            }
            hold_depth = 0;
            errno = saved;
            return -1;
        }
        held_installed[index] = 1;
    }
    return 0;
}

int CSignerShim_held_termination_signal(void) {
    return held_signal;
}

int CSignerShim_release_termination_signals(void) {
    if (hold_depth == 0 || --hold_depth > 0) {
        return 0;  // an inner hold: the outer one releases
    }
    for (size_t index = 0; index < HELD_SIGNAL_COUNT; index++) {
        if (held_installed[index]) {
            sigaction(held_signals[index], &saved_actions[index], NULL);
        }
    }
    int number = held_signal;
    held_signal = 0;
    if (number != 0) {
        // The default action, not a handler installed before the hold
        // (the Swift runtime's SIGQUIT backtracer returns and the process
        // would carry on): the operator asked the process to stop.
        set_default(number);
        raise(number);
    }
    return number;
}

int CSignerShim_is_dumpable(void) {
    return prctl(PR_GET_DUMPABLE, 0, 0, 0, 0);
}

// The log callback: one function for every daemon of the process (signerd
// passes the same one each time), set at each start. Each daemon's own
// context is MHD's logger closure, so it lives exactly as long as the
// daemon's other callback contexts. (A fixed ring of 16 closures, used
// before, wrapped in a test process that starts hundreds of servers: a
// server left running, its connection thread inside a hung call, then
// called the context of a server freed since.)
static CSignerShim_log_callback shim_log_callback;

static void shim_mhd_log(void *cls, const char *fmt, va_list ap) {
    char message[512];
    vsnprintf(message, sizeof(message), fmt, ap);
    size_t n = strlen(message);
    while (n > 0 && (message[n - 1] == '\n' || message[n - 1] == '\r')) {
        message[--n] = '\0';
    }
    CSignerShim_log_callback callback = __atomic_load_n(&shim_log_callback, __ATOMIC_ACQUIRE);
    if (callback != NULL) {
        callback(cls, message);
    }
}

struct MHD_Daemon *CSignerShim_mhd_start(const CSignerShim_mhd_options *o) {
    if (o->log_callback != NULL) {
        __atomic_store_n(&shim_log_callback, o->log_callback, __ATOMIC_RELEASE);
    }
    struct MHD_OptionItem items[16];
    int i = 0;
    items[i++] = (struct MHD_OptionItem){MHD_OPTION_LISTEN_SOCKET, o->listen_fd, NULL};
    if (o->thread_pool_size > 1) {
        items[i++] = (struct MHD_OptionItem){MHD_OPTION_THREAD_POOL_SIZE, o->thread_pool_size, NULL};
    }
    if (o->connection_limit > 0) {
        items[i++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_LIMIT, o->connection_limit, NULL};
    }
    if (o->connection_timeout_s > 0) {
        items[i++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_TIMEOUT, o->connection_timeout_s, NULL};
    }
    if (o->connection_memory_limit > 0) {
        items[i++] = (struct MHD_OptionItem){MHD_OPTION_CONNECTION_MEMORY_LIMIT, (intptr_t)o->connection_memory_limit, NULL};
    }
    if (o->completed_callback != NULL) {
        items[i++] = (struct MHD_OptionItem){MHD_OPTION_NOTIFY_COMPLETED, (intptr_t)o->completed_callback, o->completed_context};
    }
    if (o->connection_callback != NULL) {
        items[i++] = (struct MHD_OptionItem){MHD_OPTION_NOTIFY_CONNECTION, (intptr_t)o->connection_callback, o->connection_context};
    }
    if (o->uri_log_callback != NULL) {
        items[i++] = (struct MHD_OptionItem){MHD_OPTION_URI_LOG_CALLBACK, (intptr_t)o->uri_log_callback, o->uri_log_context};
    }
    items[i++] = (struct MHD_OptionItem){MHD_OPTION_END, 0, NULL};
    if (o->log_callback == NULL) {
        return MHD_start_daemon(o->flags, 0, NULL, NULL,
                                o->access_handler, o->access_context,
                                MHD_OPTION_ARRAY, items,
                                MHD_OPTION_END);
    }
    // The logger must be the first option so that messages about the
    // others reach it.
    return MHD_start_daemon(o->flags, 0, NULL, NULL,
                            o->access_handler, o->access_context,
                            MHD_OPTION_EXTERNAL_LOGGER, shim_mhd_log, o->log_context,
                            MHD_OPTION_ARRAY, items,
                            MHD_OPTION_END);
}

int CSignerShim_mhd_connection_fd(struct MHD_Connection *connection) {
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    return info == NULL ? -1 : info->connect_fd;
}

void *CSignerShim_mhd_socket_context(struct MHD_Connection *connection) {
    const union MHD_ConnectionInfo *info =
        MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return info == NULL ? NULL : info->socket_context;
}

long CSignerShim_bio_mem_data(BIO *bio, char **data) {
    return BIO_get_mem_data(bio, data);
}

EVP_PKEY *CSignerShim_ec_public_key(const char *group, const unsigned char *point, size_t length) {
    OSSL_PARAM params[3];
    params[0] = OSSL_PARAM_construct_utf8_string(OSSL_PKEY_PARAM_GROUP_NAME, (char *)group, 0);
    params[1] = OSSL_PARAM_construct_octet_string(OSSL_PKEY_PARAM_PUB_KEY, (void *)point, length);
    params[2] = OSSL_PARAM_construct_end();
    EVP_PKEY_CTX *context = EVP_PKEY_CTX_new_from_name(NULL, "EC", NULL);
    if (context == NULL) {
        return NULL;
    }
    EVP_PKEY *key = NULL;
    if (EVP_PKEY_fromdata_init(context) != 1 ||
        EVP_PKEY_fromdata(context, &key, EVP_PKEY_PUBLIC_KEY, params) != 1) {
        EVP_PKEY_CTX_free(context);
        return NULL;
    }
    EVP_PKEY_CTX_free(context);
    EVP_PKEY_CTX *check = EVP_PKEY_CTX_new_from_pkey(NULL, key, NULL);
    int ok = check != NULL && EVP_PKEY_public_check(check) == 1;
    EVP_PKEY_CTX_free(check);
    if (!ok) {
        EVP_PKEY_free(key);
        return NULL;
    }
    return key;
}

int CSignerShim_has_access_acl(const char *path) {
    ssize_t size = getxattr(path, "system.posix_acl_access", NULL, 0);
    if (size >= 0) {
        return size > 0 ? 1 : 0;
    }
    return (errno == ENODATA || errno == ENOTSUP) ? 0 : -1;
}
