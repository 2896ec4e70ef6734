import HSMSigner

#if canImport(Glibc)
import Glibc
#endif

/// Bounds how many large request bodies are read into JSON values at once.
///
/// Reading a body into values takes far more memory than the body itself:
/// about 20 bytes of heap per body byte for a body of many small objects
/// (`[{"a":0},{"a":0},…]`). signerd serves each connection on its own
/// thread, so without a bound 1,000 connections that send a 64 KiB body
/// at the same instant are read all at once: 1.4 GiB of heap was measured
/// for Advanced Commerce requests of that shape (docs/BENCHMARKS.md,
/// twenty-fourth round). Reading is CPU work, so more readers than CPUs
/// finish no sooner; bodies over ``thresholdBytes`` are read at most
/// ``slots`` at a time, and the rest wait their turn. Smaller bodies (every
/// ordinary request of the contract is well under 1 KiB) never wait.
final class BodyReadingGate: @unchecked Sendable {
    /// Large bodies read at once.
    let slots: Int
    /// Bodies of at most this many bytes pass without waiting.
    let thresholdBytes: Int
    private let lock = ConditionLock()
    /// Large bodies being read now; guarded by `lock`.
    private var reading = 0

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

    /// Runs `read` (the reading of a body of `bodyBytes` bytes into the
    /// values a request is served from) when a slot is free, waiting for
    /// one until `deadline`.
    ///
    /// `read` should return only what the request needs afterwards (fields,
    /// a compact serialization), so that the values read are released when
    /// the slot is: a request holds its slot while it reads, never while it
    /// waits for the token.
    /// - Parameters:
    ///   - bodyBytes: the body's length in bytes.
    ///   - deadline: ``MonotonicClock`` nanoseconds by which the request
    ///     must be answered (``RequestDeadline/current``); nil waits as long
    ///     as it takes. Evaluated only for a body over ``thresholdBytes``.
    ///   - read: the reading, which may throw the request's error.
    /// - Returns: what `read` returns.
    /// - Throws: what `read` throws; `hsm_unavailable` (503, the
    ///   still-reading answer of ``SignerService``) when the deadline passed
    ///   before a slot came free.
    func run<R>(bodyBytes: Int, deadline: @autoclosure () -> UInt64?, _ read: () throws(APIError) -> R) throws(APIError) -> R {
        guard bodyBytes > thresholdBytes else { return try read() }
        let deadline = deadline()  // read only for a large body: a task-local lookup is not free
        let admitted: Bool = lock.withLock {
            while reading >= slots {
                if let deadline {
                    if !lock.wait(untilMonotonic: deadline) && MonotonicClock.now() >= deadline {
                        // A wake-up meant for a waiter may have ended this
                        // wait as it timed out: pass it on if a slot is free.
                        if reading < slots { lock.signal() }
                        return false
                    }
                } else {
                    lock.wait()
                }
            }
            reading += 1
            return true
        }
        guard admitted else { throw SignerService.stillCheckingError }
        defer {
            lock.withLock {
                reading -= 1
                lock.signal()
            }
        }
        return try read()
    }

    /// Large bodies being read now, for tests.
    var readingNow: Int { lock.withLock { reading } }
}
