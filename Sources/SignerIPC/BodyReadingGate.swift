import HSMSigner

#if canImport(Glibc)
import Glibc
#endif

/// Bounds how many large request bodies are worked on at once: read into
/// JSON values, or made into a large answer (a JWS's signing input and
/// response), each step under a slot of its own.
///
/// Reading a body into values takes far more memory than the body itself:
/// about 20 bytes of heap per body byte for a body of many small objects
/// (`[{"a":0},{"a":0},…]`). signerd serves each connection on its own
/// thread, so without a bound 1,000 connections that send a 64 KiB body
/// at the same instant are read all at once: 1.4 GiB of heap was measured
/// for Advanced Commerce requests of that shape (docs/BENCHMARKS.md,
/// twenty-fourth round). Reading is CPU work, so more readers than CPUs
/// finish no sooner; bodies over ``thresholdBytes`` are worked on at most
/// ``slots`` at a time, and the rest wait their turn, earliest deadline
/// first (the session queue's order, ``SessionPool`` in HSMSigner). Smaller bodies (every
/// ordinary request of the contract is well under 1 KiB) never wait.
final class BodyReadingGate: @unchecked Sendable {
    /// Large bodies read at once.
    let slots: Int
    /// Bodies of at most this many bytes pass without waiting.
    let thresholdBytes: Int

    /// A thread waiting for a slot.
    private final class Waiter {
        let condition = ConditionLock.Condition()
        /// Its place in line: the request's deadline.
        let priority: UInt64
        /// Set, under the lock, by the thread that handed it a slot.
        var admitted = false
        init(priority: UInt64) { self.priority = priority }
    }

    // All mutable fields are guarded by `lock`.
    private let lock = ConditionLock()
    /// Slots held (a slot handed to a waiter that has not woken yet included).
    private var reading = 0
    /// In the order they are served: earliest deadline first, then oldest.
    private var waiters: [Waiter] = []

    /// - Parameters:
    ///   - slots: large bodies read at once (at least 1).
    ///   - thresholdBytes: the largest body that never waits, in bytes.
    init(slots: Int, thresholdBytes: Int) {
        self.slots = max(1, slots)
        self.thresholdBytes = thresholdBytes
    }

    /// One slot per online CPU (at least 2), for bodies over 4 KiB.
    static func forThisHost() -> BodyReadingGate {
        BodyReadingGate(slots: max(2, sysconf(Int32(_SC_NPROCESSORS_ONLN))), thresholdBytes: 4096)
    }

    /// Runs `read` (work on a body of `bodyBytes` bytes: reading it into
    /// values, or building a large answer from them) when a slot is free,
    /// waiting for one until `deadline`.
    ///
    /// Waiters are served earliest deadline first: every request has the same
    /// time to be answered, so that is the order the requests arrived in, and
    /// a request that already went through one step of its work goes before
    /// requests that arrived after it, rather than behind them all. `read`
    /// should return only what the request needs afterwards (fields, a
    /// compact serialization), so that the values it made are released with
    /// the slot: a request holds no slot while it waits for the token.
    /// - Parameters:
    ///   - bodyBytes: the body's length in bytes.
    ///   - deadline: ``MonotonicClock`` nanoseconds by which the request
    ///     must be answered (``RequestDeadline/current``); nil waits as long
    ///     as it takes. Evaluated only for a body over ``thresholdBytes``.
    ///   - read: the work, which may throw the request's error.
    /// - Returns: what `read` returns.
    /// - Throws: what `read` throws; `hsm_unavailable` (503, the
    ///   still-reading answer of ``SignerService``) when the deadline passed
    ///   before a slot came free.
    func run<R>(bodyBytes: Int, deadline: @autoclosure () -> UInt64?, _ read: () throws(APIError) -> R) throws(APIError) -> R {
        guard bodyBytes > thresholdBytes else { return try read() }
        let deadline = deadline()  // read only for a large body: a task-local lookup is not free
        guard admit(until: deadline) else { throw SignerService.stillCheckingError }
        defer { release() }
        return try read()
    }

    /// Takes a slot, waiting in line until `deadline` (nil: as long as it takes).
    /// - Returns: false, holding nothing, when the deadline passed first.
    private func admit(until deadline: UInt64?) -> Bool {
        let (admitted, late): (Bool, Bool) = lock.withLock {
            if reading < slots && waiters.isEmpty {
                reading += 1
                return (true, false)
            }
            let waiter = Waiter(priority: deadline ?? .max)
            // Behind every waiter of the same or an earlier deadline.
            waiters.insert(waiter, at: (waiters.lastIndex { $0.priority <= waiter.priority } ?? -1) + 1)
            // Without a deadline (tests), a day stands for "as long as it takes".
            let until = deadline ?? MonotonicClock.deadline(after: 86_400)
            while !waiter.admitted {
                if !lock.wait(on: waiter.condition, untilMonotonic: until) && MonotonicClock.now() >= until { break }
            }
            if !waiter.admitted {
                waiters.removeAll { $0 === waiter }
                return (false, true)
            }
            // Handed a slot just as the time ran out: no use starting now.
            return (true, deadline.map { MonotonicClock.now() >= $0 } ?? false)
        }
        if admitted && late {
            release()
            return false
        }
        return admitted
    }

    /// Gives a slot back: to the first waiter in line, or to the pool.
    private func release() {
        lock.withLock {
            if waiters.isEmpty {
                reading -= 1
            } else {
                let next = waiters.removeFirst()
                next.admitted = true
                lock.signal(next.condition)
            }
        }
    }

    /// Slots held now, for tests.
    var readingNow: Int { lock.withLock { reading } }

    /// Threads waiting for a slot now, for tests.
    var waitingNow: Int { lock.withLock { waiters.count } }
}
