import Dispatch
import Foundation
import HSMSigner
@testable import SignerIPC
import TestSupport
import Testing

/// The bound on large bodies read at once (`BodyReadingGate`): slots are
/// held by threads parked inside `read` on a semaphore, so every step is
/// ordered by the test, not by timing.
@Suite("Body reading gate")
struct BodyReadingGateTests {
    /// Readers parked inside `read` until released, and what became of them.
    private struct ParkedReaders {
        let gate: BodyReadingGate
        /// Signalled by each reader once it is inside `read`.
        let entered = DispatchSemaphore(value: 0)
        /// Signalled by the test to let one reader out of `read`.
        let release = DispatchSemaphore(value: 0)
        let finished = DispatchGroup()
        /// "read", or the code of the error a reader got.
        let outcome = Locked<[String]>([])

        /// Starts a thread that reads a `bytes`-byte body through the gate
        /// and parks inside `read` until ``release`` is signalled.
        func start(bytes: Int) {
            finished.enter()
            OSThread.start { [self] in
                defer { finished.leave() }
                do throws(APIError) {
                    try gate.run(bodyBytes: bytes, deadline: nil) { () throws(APIError) in
                        entered.signal()
                        release.wait()
                    }
                    outcome.withLock { $0.append("read") }
                } catch {
                    outcome.withLock { $0.append(error.code.rawValue) }
                }
            }
        }
    }

    @Test("no more large bodies than slots are read at once; the next one waits for a slot, then is read")
    func largeBodiesWaitForASlot() throws {
        let gate = BodyReadingGate(slots: 2, thresholdBytes: 100)
        let readers = ParkedReaders(gate: gate)
        let (entered, release, finished) = (readers.entered, readers.release, readers.finished)
        for _ in 0..<3 { readers.start(bytes: 101) }
        // Two get in; the third does not within a second (it waits for a slot).
        #expect(entered.wait(timeout: .now() + 10) == .success)
        #expect(entered.wait(timeout: .now() + 10) == .success)
        #expect(entered.wait(timeout: .now() + 1) == .timedOut, "a third large body was read while both slots were held")
        #expect(gate.readingNow == 2)
        // A small body passes while the slots are full.
        let small = try gate.run(bodyBytes: 100, deadline: nil) { () throws(APIError) in "small" }
        #expect(small == "small")
        // One slot comes free: the waiting reader gets it.
        release.signal()
        #expect(entered.wait(timeout: .now() + 10) == .success, "the waiting reader never got the freed slot")
        release.signal()
        release.signal()
        #expect(finished.wait(timeout: .now() + 10) == .success)
        #expect(readers.outcome.withLock { $0 } == ["read", "read", "read"])
        #expect(gate.readingNow == 0)
    }

    @Test("a large body still waiting at the request's deadline gets the 503 for a request not yet at the token, and reads nothing")
    func deadlinePassesWhileWaiting() throws {
        let gate = BodyReadingGate(slots: 1, thresholdBytes: 0)
        let readers = ParkedReaders(gate: gate)
        let (entered, release, finished) = (readers.entered, readers.release, readers.finished)
        readers.start(bytes: 1)
        #expect(entered.wait(timeout: .now() + 10) == .success)
        var ran = false
        let expected = SignerService.stillCheckingError
        let thrown = #expect(throws: APIError.self) {
            try gate.run(bodyBytes: 1, deadline: MonotonicClock.deadline(after: 0.2)) { () throws(APIError) in ran = true }
        }
        #expect(!ran)
        #expect(thrown?.code == .hsmUnavailable)
        #expect(thrown?.message == expected.message)
        #expect(thrown?.retryAfter == 1)
        release.signal()
        #expect(finished.wait(timeout: .now() + 10) == .success)
        #expect(gate.readingNow == 0, "the reader that gave up took no slot")
    }

    /// An attack round found the first version of the gate woke any
    /// waiter: requests that arrived later overtook ones that had waited,
    /// and some ran out their time in line.
    @Test("waiters get a freed slot earliest deadline first, and in arrival order among equal deadlines")
    func earliestDeadlineFirst() throws {
        let gate = BodyReadingGate(slots: 1, thresholdBytes: 0)
        let holder = ParkedReaders(gate: gate)
        holder.start(bytes: 1)
        #expect(holder.entered.wait(timeout: .now() + 10) == .success)
        let base = MonotonicClock.now() + 60_000_000_000
        let deadlines: [UInt64] = [base + 3, base + 2, base + 9, base, base + 2]
        let order = Locked<[Int]>([])
        let done = DispatchGroup()
        for (index, deadline) in deadlines.enumerated() {
            done.enter()
            OSThread.start {
                defer { done.leave() }
                do throws(APIError) {
                    try gate.run(bodyBytes: 1, deadline: deadline) { () throws(APIError) in order.withLock { $0.append(index) } }
                } catch {
                    order.withLock { $0.append(-1) }
                }
            }
            #expect(poll(seconds: 5) { gate.waitingNow == index + 1 }, "waiter \(index) did not queue")
        }
        holder.release.signal()
        #expect(done.wait(timeout: .now() + 10) == .success)
        #expect(holder.finished.wait(timeout: .now() + 10) == .success)
        #expect(order.withLock { $0 } == [3, 1, 4, 0, 2])
        #expect(gate.readingNow == 0 && gate.waitingNow == 0)
    }

    @Test("a read that throws frees its slot, and its error is the caller's")
    func throwingReadFreesItsSlot() throws {
        let gate = BodyReadingGate(slots: 1, thresholdBytes: 0)
        let thrown = #expect(throws: APIError.self) {
            try gate.run(bodyBytes: 10, deadline: nil) { () throws(APIError) in throw APIError(.unknownField, "x", field: "x") }
        }
        #expect(thrown?.code == .unknownField)
        #expect(gate.readingNow == 0)
        #expect(try gate.run(bodyBytes: 10, deadline: MonotonicClock.deadline(after: 5)) { () throws(APIError) in 7 } == 7)
    }
}
