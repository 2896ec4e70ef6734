// The deadline of the request a thread is serving, for the PKCS#11 session queue.

/// The instant by which the work running now must be answered, in
/// ``MonotonicClock`` nanoseconds, or nil when nothing is waiting for it.
/// signerd binds it for a request (its arrival plus `sign_timeout_ms`);
/// ``HSMToken`` then waits for a PKCS#11 session no later than that, and
/// starts no call after it: a request already answered with a timeout
/// would otherwise keep its place in the queue and sign for nobody,
/// delaying every request behind it. A task-local value, which a
/// synchronous caller on a plain thread binds with
/// `RequestDeadline.$current.withValue(_:operation:)`.
public enum RequestDeadline {
    /// The deadline bound for the current thread or task; nil outside a request.
    @TaskLocal public static var current: UInt64?
}
