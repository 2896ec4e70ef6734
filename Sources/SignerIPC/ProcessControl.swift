internal import CSignerShim

#if canImport(Glibc)
import Glibc
#endif

/// Process-wide settings a daemon holding secrets makes at start.
public enum ProcessControl {
    /// No core dumps and no ptrace attach by same-uid processes
    /// (`prctl(PR_SET_DUMPABLE, 0)`, `RLIMIT_CORE` 0): a PIN or key bytes in
    /// memory never land in a core file.
    /// - Returns: false when the kernel refused.
    @discardableResult
    public static func disableCoreDumps() -> Bool {
        CSignerShim_disable_core_dumps() == 0
    }

    /// Puts `/dev/null` on each of standard input, output and error that
    /// is closed (started with `2>&-`, say). Otherwise the next file the
    /// process opens takes that number: the listening socket, or a token
    /// file SoftHSM opens for writing, and log lines written to
    /// descriptor 2 would land in it.
    /// - Returns: the descriptors (0, 1, 2) that were closed. One that
    ///   `/dev/null` could not be put on is still closed:
    ///   ``standardDescriptorsOpen`` says so.
    @discardableResult
    public static func openClosedStandardDescriptors() -> [Int32] {
        var closed: [Int32] = []
        for descriptor in Int32(0)...2 where fcntl(descriptor, F_GETFD) == -1 && errno == EBADF {
            closed.append(descriptor)
            // The lowest free number: this one, as the ones below it are open.
            let opened = open("/dev/null", O_RDWR)
            if opened >= 0 && opened != descriptor {
                _ = dup2(opened, descriptor)
                close(opened)
            }
        }
        return closed
    }

    /// Whether descriptors 0, 1 and 2 are all open (`fcntl(F_GETFD)`).
    public static var standardDescriptorsOpen: Bool {
        (Int32(0)...2).allSatisfy { fcntl($0, F_GETFD) != -1 }
    }

    /// Whether standard error is the null device (`StandardError=null`,
    /// `2>/dev/null`): the same character device as `/dev/null` (`fstat`).
    public static var standardErrorIsNullDevice: Bool {
        var error = stat()
        var null = stat()
        guard fstat(2, &error) == 0, stat("/dev/null", &null) == 0 else { return false }
        return error.st_mode & S_IFMT == S_IFCHR && null.st_mode & S_IFMT == S_IFCHR && error.st_rdev == null.st_rdev
    }

    /// Whether the process may be dumped (`prctl(PR_GET_DUMPABLE)`).
    public static var isDumpable: Bool { CSignerShim_is_dumpable() != 0 }

    /// The allocation size, in bytes, from which glibc's `malloc` maps
    /// memory of its own (``returnLargeAllocationsToTheSystem()``).
    public static let largeAllocationBytes: Int32 = 32 * 1024
    /// Free memory at the top of a `malloc` heap, in bytes, above which
    /// glibc gives it back to the kernel (``returnLargeAllocationsToTheSystem()``).
    public static let trimThresholdBytes: Int32 = 128 * 1024

    /// Makes glibc's `malloc` give large blocks back to the kernel when they
    /// are freed (`mallopt(M_MMAP_THRESHOLD, 32 KiB)` and
    /// `mallopt(M_TRIM_THRESHOLD, 128 KiB)`, which also turn off glibc's
    /// adjustment of both after the first large free).
    ///
    /// With a thread per connection, glibc spreads allocations over up to
    /// 8 arenas per CPU, and by default keeps what a burst of large request
    /// bodies freed in them: 1,000 connections sending 64 KiB Advanced
    /// Commerce requests left the daemon at 145–235 MiB resident after they
    /// were answered, 531 MiB held by `malloc` with 34 MiB in use
    /// (docs/BENCHMARKS.md, twenty-fourth round). An ordinary request
    /// allocates only small blocks, which these settings do not touch.
    /// - Returns: false when glibc refused a setting.
    @discardableResult
    public static func returnLargeAllocationsToTheSystem() -> Bool {
        CSignerShim_malloc_thresholds(largeAllocationBytes, trimThresholdBytes) == 0
    }

    /// Descriptors signerd keeps for everything but its connections: the
    /// standard streams, the listening socket, libmicrohttpd's inter-thread
    /// channels, and the PKCS#11 module's own files (SoftHSM opens its token
    /// files on every call). Without them the token itself goes down.
    public static let descriptorsBesidesConnections = 64

    /// Open descriptors needed for `connections` connections (each holds
    /// two: libmicrohttpd's and the daemon's duplicate for slow-request
    /// cut-off) plus ``descriptorsBesidesConnections``.
    /// - Parameter connections: every connection slot, reserve included.
    public static func descriptorsNeeded(connections: Int) -> Int {
        2 * connections + descriptorsBesidesConnections
    }

    /// How many connection slots fit in `limit` open descriptors, the
    /// inverse of ``descriptorsNeeded(connections:)``; 0 when none do.
    /// - Parameter limit: the soft open-file limit (`RLIMIT_NOFILE`).
    public static func connectionsFitting(openFileLimit limit: Int) -> Int {
        max(0, (limit - descriptorsBesidesConnections) / 2)
    }

    /// The hard open-file limit (`RLIMIT_NOFILE`), which an unprivileged
    /// process cannot raise; nil when unlimited or unreadable.
    public static var hardOpenFileLimit: Int? {
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0, limit.rlim_max != rlim_t.max else { return nil }
        return Int(clamping: limit.rlim_max)
    }

    /// Raises the soft open-file limit to at least `wanted` (within the hard
    /// limit): each connection holds two descriptors (libmicrohttpd's and the
    /// daemon's duplicate for slow-request cut-off).
    /// - Parameter wanted: descriptors needed.
    /// - Returns: the soft limit in effect, or nil when it cannot be read.
    @discardableResult
    public static func raiseOpenFileLimit(to wanted: Int) -> Int? {
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit) == 0 else { return nil }
        if limit.rlim_cur < rlim_t(wanted) {
            limit.rlim_cur = min(limit.rlim_max, rlim_t(wanted))
            setrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
            getrlimit(Int32(RLIMIT_NOFILE.rawValue), &limit)
        }
        return Int(clamping: limit.rlim_cur)
    }

    /// Raises the soft file size limit (`RLIMIT_FSIZE`, `ulimit -f`) to
    /// the hard limit, and ignores `SIGXFSZ`. SoftHSM rewrites its token
    /// file in place at every `C_Login` and token write: a write past the
    /// limit would end the process in the middle of a write (`SIGXFSZ`);
    /// ignored, the write fails (`EFBIG`) and the read-backs report it.
    /// Call before the PKCS#11 module is loaded.
    /// - Returns: the limit in effect afterwards in bytes, or nil when
    ///   there is none (`RLIM_INFINITY`, the usual case).
    @discardableResult
    public static func raiseFileSizeLimit() -> UInt64? {
        signal(SIGXFSZ, SIG_IGN)
        var limit = rlimit()
        guard getrlimit(Int32(RLIMIT_FSIZE.rawValue), &limit) == 0 else { return nil }
        if limit.rlim_cur != limit.rlim_max {
            limit.rlim_cur = limit.rlim_max
            setrlimit(Int32(RLIMIT_FSIZE.rawValue), &limit)
            getrlimit(Int32(RLIMIT_FSIZE.rawValue), &limit)
        }
        return limit.rlim_cur == rlim_t.max ? nil : UInt64(limit.rlim_cur)  // RLIM_INFINITY
    }

    /// What to say about a file size limit ``raiseFileSizeLimit()`` could
    /// not lift, for signctl's warning and signerd's log.
    public static func fileSizeLimitWarning(_ bytes: UInt64) -> String {
        "the file size limit (ulimit -f, LimitFSIZE=) is \(bytes) bytes and cannot be raised: SoftHSM rewrites its token file at every login and write, and a write past the limit cuts the file short and destroys the token; run with no file size limit"
    }

    /// Runs `body` with SIGINT, SIGTERM, SIGHUP and SIGQUIT held, for a
    /// write to the token that must not stop half-way: SoftHSM rewrites its
    /// token file in place (`C_CreateObject`, `C_DestroyObject`, `C_SetPIN`,
    /// `C_InitToken`), and a process ended in the middle leaves it empty
    /// and the token unusable.
    ///
    /// The first of those signals to arrive is remembered, with a note on
    /// stderr, and raised again once `body` returns or throws, so its
    /// default action then ends the process; a second one 3 s or more after
    /// the first ends the process at once (an operator's way out of a call
    /// that hangs; one sooner is a double Ctrl-C, noted and held). A signal that
    /// was ignored before stays ignored and counts for nothing; one with a
    /// handler of its own (the Swift runtime's SIGQUIT backtracer) is
    /// raised with its default action all the same. Holds nest: an inner
    /// one on the same thread changes nothing. SIGKILL cannot be held.
    /// - Parameter body: the token write; it runs on the calling thread.
    /// - Returns: what `body` returns.
    /// - Throws: what `body` throws.
    public static func holdingTerminationSignals<Result>(_ body: () throws -> Result) rethrows -> Result {
        let held = CSignerShim_hold_termination_signals() == 0
        defer { if held { CSignerShim_release_termination_signals() } }
        return try body()
    }

    /// The signal ``holdingTerminationSignals(_:)`` has taken and will
    /// raise when its body returns, or 0: a body that has not started its
    /// write yet (waiting for a lock) can stop at once.
    public static var heldTerminationSignal: Int32 { CSignerShim_held_termination_signal() }

    /// Runs `body`, a wait before any write (for a lock), with the note for a
    /// held signal saying that nothing was written yet instead of
    /// "writing to the token".
    /// - Parameter body: the wait; it should stop once ``heldTerminationSignal`` is set.
    /// - Returns: what `body` returns.
    public static func beforeTokenWrite<Result>(_ body: () throws -> Result) rethrows -> Result {
        CSignerShim_set_hold_before_write(1)
        defer { CSignerShim_set_hold_before_write(0) }
        return try body()
    }

    /// Blocks `signals` in the calling thread and every thread it starts
    /// afterwards, so that only ``waitForSignal(_:)`` receives them. Ignores
    /// `SIGPIPE`, and `SIGUSR1` and `SIGUSR2`, which signerd has no use for
    /// and whose default action would end it without removing its socket.
    /// Call before starting any thread.
    public static func blockSignals(_ signals: [Int32]) {
        signal(SIGPIPE, SIG_IGN)
        signal(SIGUSR1, SIG_IGN)
        signal(SIGUSR2, SIG_IGN)
        var set = sigset_t()
        sigemptyset(&set)
        for number in signals { sigaddset(&set, number) }
        pthread_sigmask(SIG_BLOCK, &set, nil)
    }

    /// The first of `signals` that is pending (blocked, as
    /// ``blockSignals(_:)`` leaves them, and sent), without taking it:
    /// `sigpending(2)`. nil when none is.
    public static func pendingSignal(among signals: [Int32]) -> Int32? {
        var set = sigset_t()
        guard sigpending(&set) == 0 else { return nil }
        return signals.first { sigismember(&set, $0) == 1 }
    }

    /// Waits for one of `signals` (blocked earlier) and returns its number.
    public static func waitForSignal(_ signals: [Int32]) -> Int32 {
        var set = sigset_t()
        sigemptyset(&set)
        for number in signals { sigaddset(&set, number) }
        var received: Int32 = 0
        while sigwait(&set, &received) != 0 {}
        return received
    }
}
