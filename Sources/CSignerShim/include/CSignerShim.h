// CSignerShim: the few C calls Swift cannot make directly (variadic
// functions, macros, `struct ucred`). Every symbol carries the target's
// prefix, as swift-nio's CNIOLinux_* shims do.
#ifndef CSIGNERSHIM_H
#define CSIGNERSHIM_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <microhttpd.h>
#include <openssl/evp.h>

/// Peer credentials of a connected Unix socket (`SO_PEERCRED`, socket(7)).
/// Returns 0 on success, else -1 with errno set.
int CSignerShim_peer_credentials(int fd, uid_t *uid, gid_t *gid, pid_t *pid);

/// Supplementary groups of the peer of a connected Unix socket when it
/// connected (`SO_PEERGROUPS`, Linux 4.13, socket(7)), into `groups` (room
/// for `capacity`). Returns how many the peer has (more than `capacity`:
/// call again with a larger buffer), or -1 with errno set.
int CSignerShim_peer_groups(int fd, gid_t *groups, int capacity);

/// `prctl(PR_SET_DUMPABLE, 0)` and `RLIMIT_CORE` 0: no core dump of the
/// process memory, no ptrace attach by same-uid processes. Returns 0 or -1.
int CSignerShim_disable_core_dumps(void);

/// The symbolic name of an `errno` value (`"ECONNREFUSED"`), from glibc's
/// `strerrorname_np` (glibc 2.32, `<string.h>` under `_GNU_SOURCE`, which
/// Swift's Glibc module does not define), or NULL for a value glibc does
/// not name. The string is static; do not free it.
const char *CSignerShim_errno_name(int code);

/// Whether the process is dumpable (`prctl(PR_GET_DUMPABLE)`), for tests.
int CSignerShim_is_dumpable(void);

/// `mallopt(M_MMAP_THRESHOLD, mmap_threshold)` and
/// `mallopt(M_TRIM_THRESHOLD, trim_threshold)` (bytes; `<malloc.h>`, which
/// Swift's Glibc module does not import). Returns 0, or -1 when glibc
/// refused either.
int CSignerShim_malloc_thresholds(int mmap_threshold, int trim_threshold);

/// Whether `path` carries an extended POSIX access ACL (the
/// `system.posix_acl_access` attribute, `getxattr(2)` of `<sys/xattr.h>`,
/// which Swift's Glibc module does not import): 1 yes, 0 no, -1 with errno
/// set when it cannot be read.
int CSignerShim_has_access_acl(const char *path);

/// Holds SIGINT, SIGTERM, SIGHUP and SIGQUIT (process-wide, `sigaction`):
/// the first one that arrives is remembered and a note is written to
/// stderr; a second one 3 s or more after the first ends the process at
/// once with its default action (one sooner is noted and held).
/// A signal ignored before (`SIG_IGN`) stays ignored. Nested holds (on the
/// same thread) count: only the outermost installs and releases.
/// Returns 0, or -1 with errno when a disposition could not be changed
/// (those already changed are restored).
int CSignerShim_hold_termination_signals(void);

/// Ends a hold: the outermost restores the dispositions
/// `CSignerShim_hold_termination_signals` saved and, when a signal arrived
/// meanwhile, raises it again with its default action (so it ends the
/// process now, whatever handler was installed before). Returns that
/// signal's number, or 0.
int CSignerShim_release_termination_signals(void);

/// The signal a hold has taken and not yet raised again, or 0: a command
/// still waiting to start its write can give up at once.
int CSignerShim_held_termination_signal(void);

/// Says whether the held command has written nothing yet (1: it is still
/// waiting, for a lock), so that the note the signal handler writes for a
/// held signal says that rather than "writing to the token". The handler
/// reads it as a `volatile sig_atomic_t`.
void CSignerShim_set_hold_before_write(int before_write);

/// A log callback receiving a formatted, NUL-terminated message.
typedef void (*CSignerShim_log_callback)(void *context, const char *message);

/// Options for `CSignerShim_mhd_start`, mirroring the `MHD_OPTION_*` values
/// signerd sets. Zero means "library default" for the numeric fields.
typedef struct CSignerShim_mhd_options {
    unsigned int flags;                 // MHD_USE_* flags
    int listen_fd;                      // MHD_OPTION_LISTEN_SOCKET
    unsigned int thread_pool_size;      // MHD_OPTION_THREAD_POOL_SIZE
    unsigned int connection_limit;      // MHD_OPTION_CONNECTION_LIMIT
    unsigned int connection_timeout_s;  // MHD_OPTION_CONNECTION_TIMEOUT
    size_t connection_memory_limit;     // MHD_OPTION_CONNECTION_MEMORY_LIMIT
    MHD_AccessHandlerCallback access_handler;
    void *access_context;
    MHD_RequestCompletedCallback completed_callback;    // MHD_OPTION_NOTIFY_COMPLETED
    void *completed_context;
    MHD_NotifyConnectionCallback connection_callback;   // MHD_OPTION_NOTIFY_CONNECTION
    void *connection_context;
    void *(*uri_log_callback)(void *cls, const char *uri, struct MHD_Connection *con); // MHD_OPTION_URI_LOG_CALLBACK
    void *uri_log_context;
    CSignerShim_log_callback log_callback;              // MHD_OPTION_EXTERNAL_LOGGER
    void *log_context;
} CSignerShim_mhd_options;

/// Calls the variadic `MHD_start_daemon` with the options above (port 0, no
/// accept policy; the listening socket is always given).
struct MHD_Daemon *CSignerShim_mhd_start(const CSignerShim_mhd_options *options);

/// The socket descriptor of an MHD connection, or -1
/// (`MHD_get_connection_info(MHD_CONNECTION_INFO_CONNECTION_FD)`).
int CSignerShim_mhd_connection_fd(struct MHD_Connection *connection);

/// The socket context set in the connection-started notification, or NULL
/// (`MHD_get_connection_info(MHD_CONNECTION_INFO_SOCKET_CONTEXT)`, variadic).
void *CSignerShim_mhd_socket_context(struct MHD_Connection *connection);

/// An EC public key from a group name (`prime256v1`, …) and an uncompressed
/// point, via `EVP_PKEY_fromdata` with the parameter names as static C
/// strings (OSSL_PARAM keeps pointers to them), then `EVP_PKEY_public_check`.
/// Returns NULL when the point is not on the curve.
EVP_PKEY *CSignerShim_ec_public_key(const char *group, const unsigned char *point, size_t length);

/// `BIO_get_mem_data` (a macro over `BIO_ctrl`): length of a memory BIO's
/// contents, with `*data` pointing at them.
long CSignerShim_bio_mem_data(BIO *bio, char **data);

/// `EVP_PKEY_PUBLIC_KEY`, the selection for `EVP_PKEY_fromdata` (a composite macro).
static inline int CSignerShim_evp_pkey_public_key_selection(void) { return EVP_PKEY_PUBLIC_KEY; }

#endif
