#if canImport(Glibc)
import Glibc
#endif

/// A mutex with a condition variable whose timed waits use
/// `CLOCK_MONOTONIC`, so a wall-clock step cannot stretch or cut a timeout
/// (swift-nio's `ConditionLock` is the model).
///
/// Used where a thread must wait for state another thread changes (a free
/// PKCS#11 session, a finished signing job); plain shared state uses
/// `Mutex` from Synchronization.
public final class ConditionLock: @unchecked Sendable {
    // The pthread objects live on the heap at a fixed address for the lock's
    // whole life, as POSIX requires; all access goes through pthread calls.
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>
    private let condition = Condition()

    /// Makes an unlocked lock.
    public init() {
        mutex = .allocate(capacity: 1)
        pthread_mutex_init(mutex, nil)
    }

    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
    }

    /// Runs `body` with the lock held.
    /// - Parameter body: the critical section; it may call ``wait(untilMonotonic:)``.
    /// - Returns: what `body` returns.
    public func withLock<R, E: Error>(_ body: () throws(E) -> R) throws(E) -> R {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body()
    }

    /// Waits for a signal, with the lock held by the caller (inside
    /// ``withLock(_:)``), until `deadline`.
    /// - Parameter deadline: a ``MonotonicClock`` instant in nanoseconds.
    /// - Returns: false when the deadline passed.
    @discardableResult
    public func wait(untilMonotonic deadline: UInt64) -> Bool {
        wait(on: condition, untilMonotonic: deadline)
    }

    /// Waits for a signal with no deadline (the caller holds the lock).
    public func wait() {
        pthread_cond_wait(condition.condition, mutex)
    }

    /// Wakes one waiter.
    public func signal() {
        signal(condition)
    }

    /// Wakes every waiter.
    public func broadcast() {
        pthread_cond_broadcast(condition.condition)
    }

    /// A condition variable for this lock's mutex. The lock has one of its
    /// own; further ones let a caller wake one chosen waiter (a FIFO
    /// hand-off) rather than any of them.
    public final class Condition: @unchecked Sendable {
        // Heap-allocated at a fixed address for its whole life (POSIX).
        fileprivate let condition: UnsafeMutablePointer<pthread_cond_t>

        /// Makes a condition whose timed waits use `CLOCK_MONOTONIC`.
        public init() {
            condition = .allocate(capacity: 1)
            var attributes = pthread_condattr_t()
            pthread_condattr_init(&attributes)
            pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC)
            pthread_cond_init(condition, &attributes)
            pthread_condattr_destroy(&attributes)
        }

        deinit {
            pthread_cond_destroy(condition)
            condition.deallocate()
        }
    }

    /// Waits on `condition` with the lock held by the caller, until `deadline`.
    /// - Parameters:
    ///   - condition: a condition only this lock's mutex is used with.
    ///   - deadline: a ``MonotonicClock`` instant in nanoseconds.
    /// - Returns: false when the deadline passed.
    @discardableResult
    public func wait(on condition: Condition, untilMonotonic deadline: UInt64) -> Bool {
        var time = timespec(tv_sec: Int(deadline / 1_000_000_000), tv_nsec: Int(deadline % 1_000_000_000))
        return pthread_cond_timedwait(condition.condition, mutex, &time) == 0
    }

    /// Wakes the thread waiting on `condition` (the caller holds the lock).
    public func signal(_ condition: Condition) {
        pthread_cond_signal(condition.condition)
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: for durations and deadlines, never
/// for timestamps that leave the process.
public enum MonotonicClock {
    /// Nanoseconds since an arbitrary fixed point (boot).
    public static func now() -> UInt64 {
        var time = timespec()
        clock_gettime(CLOCK_MONOTONIC, &time)
        return UInt64(time.tv_sec) * 1_000_000_000 + UInt64(time.tv_nsec)
    }

    /// Nanoseconds from `start` to `end`, 0 when `end` is earlier. Two
    /// threads that read the clock and then take a lock can store their
    /// instants out of order, so `end - start` on `UInt64` would trap.
    /// - Parameters:
    ///   - start: an earlier ``now()`` reading.
    ///   - end: a later ``now()`` reading (usually).
    /// - Returns: the non-negative difference.
    public static func nanoseconds(from start: UInt64, to end: UInt64) -> UInt64 {
        end > start ? end - start : 0
    }

    /// The instant `seconds` from now, in nanoseconds.
    /// - Parameter seconds: a non-negative duration.
    public static func deadline(after seconds: Double) -> UInt64 {
        now() + UInt64(max(0, seconds) * 1e9)
    }
}

/// Starts detached OS threads for blocking work (PKCS#11 calls, recovery),
/// which must never run on Swift's cooperative pool.
public enum OSThread {
    private final class Box {
        let body: () -> Void
        init(_ body: @escaping () -> Void) { self.body = body }
    }

    /// Runs `body` on a new detached thread (`pthread_create`).
    ///
    /// When the system has no thread to give (`EAGAIN`: `RLIMIT_NPROC`,
    /// systemd's `TasksMax=`, the kernel's thread limit), `body` does not
    /// run at all, and the caller decides what to do: running it inline
    /// instead would run long work (token recovery, a load loop) on a
    /// thread that may hold locks others wait for.
    /// - Parameter body: the work; it owns the thread until it returns.
    /// - Returns: false when no thread could be made; `body` was not run.
    @discardableResult
    public static func start(_ body: @escaping @Sendable () -> Void) -> Bool {
        if failuresToInject.withLock({ count in
            guard count > 0 else { return false }
            count -= 1
            return true
        }) {
            return false
        }
        let box = Unmanaged.passRetained(Box(body)).toOpaque()
        var thread = pthread_t()
        var attributes = pthread_attr_t()
        pthread_attr_init(&attributes)
        pthread_attr_setdetachstate(&attributes, Int32(PTHREAD_CREATE_DETACHED))
        let result = pthread_create(&thread, &attributes, { argument in
            let box = Unmanaged<Box>.fromOpaque(argument!).takeRetainedValue()  // passed below, never nil
            box.body()
            return nil
        }, box)
        pthread_attr_destroy(&attributes)
        guard result == 0 else {
            Unmanaged<Box>.fromOpaque(box).release()
            return false
        }
        return true
    }

    /// How many of the next ``start(_:)`` calls fail as if `pthread_create`
    /// had returned `EAGAIN`: the seam through which tests give a process
    /// that is out of threads (root, which the tests run as, is not held to
    /// `RLIMIT_NPROC`).
    package static let failuresToInject = Locked(0)
}

/// A value guarded by a plain pthread mutex, with the `withLock` shape of
/// Synchronization's `Mutex`.
///
/// On Linux, `Synchronization.Mutex` is a priority-inheritance futex: every
/// unlock with a waiter hands the lock over inside the kernel, so when many
/// threads take the same lock briefly (one thread per connection, each
/// reading the token's state a few times per request) they queue behind each
/// other in a lock convoy. glibc's default mutex lets a running thread take a
/// free lock at once. Measured here at 128 connections: 21 % of the daemon's
/// CPU in `Mutex._lockSlow` and half the throughput, gone with this lock.
public final class Locked<Value>: @unchecked Sendable {
    // `value` is only touched with `mutex` held; the mutex lives on the heap
    // at a fixed address for the object's whole life, as POSIX requires.
    private let mutex: UnsafeMutablePointer<pthread_mutex_t>
    private var value: Value

    /// Guards `value`.
    /// - Parameter value: the initial value.
    public init(_ value: Value) {
        self.value = value
        mutex = .allocate(capacity: 1)
        pthread_mutex_init(mutex, nil)
    }

    deinit {
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
    }

    /// Runs `body` with the lock held and the value open for change.
    /// - Parameter body: the critical section; it must not take this lock again.
    /// - Returns: what `body` returns.
    public func withLock<R, E: Error>(_ body: (inout Value) throws(E) -> R) throws(E) -> R {
        pthread_mutex_lock(mutex)
        defer { pthread_mutex_unlock(mutex) }
        return try body(&value)
    }
}
