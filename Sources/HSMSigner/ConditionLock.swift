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
    private let condition: UnsafeMutablePointer<pthread_cond_t>

    /// Makes an unlocked lock.
    public init() {
        mutex = .allocate(capacity: 1)
        condition = .allocate(capacity: 1)
        pthread_mutex_init(mutex, nil)
        var attributes = pthread_condattr_t()
        pthread_condattr_init(&attributes)
        pthread_condattr_setclock(&attributes, CLOCK_MONOTONIC)
        pthread_cond_init(condition, &attributes)
        pthread_condattr_destroy(&attributes)
    }

    deinit {
        pthread_cond_destroy(condition)
        pthread_mutex_destroy(mutex)
        mutex.deallocate()
        condition.deallocate()
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
        var time = timespec(tv_sec: Int(deadline / 1_000_000_000), tv_nsec: Int(deadline % 1_000_000_000))
        return pthread_cond_timedwait(condition, mutex, &time) == 0
    }

    /// Waits for a signal with no deadline (the caller holds the lock).
    public func wait() {
        pthread_cond_wait(condition, mutex)
    }

    /// Wakes one waiter.
    public func signal() {
        pthread_cond_signal(condition)
    }

    /// Wakes every waiter.
    public func broadcast() {
        pthread_cond_broadcast(condition)
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

    /// Runs `body` on a new detached thread.
    /// - Parameter body: the work; it owns the thread until it returns.
    public static func start(_ body: @escaping @Sendable () -> Void) {
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
        if result != 0 {
            // Out of threads: run inline rather than lose the work.
            Unmanaged<Box>.fromOpaque(box).takeRetainedValue().body()
        }
    }
}
