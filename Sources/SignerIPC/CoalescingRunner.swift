import HSMSigner

/// Runs one piece of work on a thread of its own, one run at a time, and
/// coalesces the requests that come while it runs into one more run.
/// signerd has two: configuration reloads (`SIGHUP`), and the key
/// self-tests that follow them. The thread waiting for signals is never
/// held up by either, and a storm of `SIGHUP`s makes one thread, not one
/// per signal.
///
/// A reload may block for as long as the token does: it waits for a login
/// in progress (recovery, or a request's re-login, holds the PIN for its
/// `C_Login`), and it logs in itself when the token had refused the old
/// PIN. On a network HSM that hangs, a reload run on the signal thread kept
/// signerd from ever taking the `SIGTERM` that followed. Here a request returns at once;
/// requests made during a run are merged into one more run after it,
/// which (for a reload) reads the file as it then is.
public final class CoalescingRunner: @unchecked Sendable {
    /// What ``request()`` did.
    public enum Outcome: Equatable, Sendable {
        /// A run began on a new thread.
        case started
        /// A run is going on; one more runs after it.
        case queued
        /// A run is going on and one more is already queued: this request
        /// is merged into that one.
        case merged
        /// ``refuseNewRuns()`` or ``stop(waitingSeconds:)`` was called:
        /// nothing runs any more.
        case stopping
        /// No thread could be made for it (the process is out of threads).
        case noThread
    }

    // `running`, `pending` and `stopping` are only touched with `lock` held.
    private let lock = ConditionLock()
    private var running = false
    private var pending = false
    private var stopping = false
    private let work: @Sendable () -> Void

    /// Makes a runner; nothing runs until ``request()``.
    /// - Parameter work: one run of the work (for a reload: read the file,
    ///   apply it, report). Runs on the runner's thread, never two at once.
    public init(_ work: @escaping @Sendable () -> Void) {
        self.work = work
    }

    /// Asks for a run without waiting for it.
    /// - Returns: whether it started, was queued behind a running one, or
    ///   was refused (stopping, or no thread).
    @discardableResult
    public func request() -> Outcome {
        let outcome: Outcome = lock.withLock {
            if stopping { return .stopping }
            if running {
                defer { pending = true }
                return pending ? .merged : .queued
            }
            running = true
            return .started
        }
        guard outcome == .started else { return outcome }
        let started = OSThread.start { [self] in
            while true {
                work()
                let again = lock.withLock {
                    if pending && !stopping {
                        pending = false
                        return true
                    }
                    running = false
                    lock.broadcast()
                    return false
                }
                if !again { return }
            }
        }
        if started { return .started }
        lock.withLock {
            running = false
            lock.broadcast()
        }
        return .noThread
    }

    /// Lets no run begin from now on and drops a queued one, without
    /// waiting: a reload must not apply a file once shutdown has begun.
    public func refuseNewRuns() {
        lock.withLock {
            stopping = true
            pending = false
        }
    }

    /// Lets no run begin, then waits for the one going on.
    /// - Parameter seconds: how long to wait at most.
    /// - Returns: false when a run was still going on at the deadline
    ///   (stuck in the token); the caller must not finalize the module
    ///   under it, nor run exit handlers.
    public func stop(waitingSeconds seconds: Double) -> Bool {
        let deadline = MonotonicClock.deadline(after: seconds)
        return lock.withLock {
            stopping = true
            pending = false
            while running {
                if !lock.wait(untilMonotonic: deadline) { return !running }
            }
            return true
        }
    }
}
