// The deadline of the request a thread is serving, for the PKCS#11 session queue.
import Synchronization

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

/// How far the request a thread is serving has gone toward the token: set
/// when it first asks ``HSMToken`` for anything (a signature, a key, a
/// PKCS#11 session). A watchdog that answers a request at its deadline
/// reads it to tell a request that waited on the HSM (for a session, a
/// lock, or inside a call) from one that was still being read and checked,
/// whose lateness says nothing about the token.
/// Bound like ``RequestDeadline/current``, with
/// `RequestDeadline.$progress.withValue(_:operation:)`.
public final class RequestProgress: Sendable {
    private let reached = Atomic<Bool>(false)

    /// Makes one for a request that has not reached the token yet.
    public init() {}

    /// Whether the request has asked the token for anything.
    public var hasReachedToken: Bool { reached.load(ordering: .acquiring) }

    /// Records that the request asked the token for something.
    public func markReachedToken() {
        reached.store(true, ordering: .releasing)
    }
}

extension RequestDeadline {
    /// The progress of the request the current thread or task serves; nil outside one.
    @TaskLocal public static var progress: RequestProgress?
}
