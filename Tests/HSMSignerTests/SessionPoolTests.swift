import Foundation
@testable import HSMSigner
import TestSupport
import Synchronization
import Testing

/// The session pool's waiting order, on a real SoftHSM token with one
/// session, a slow `C_Sign` injected through the seam holding it.
@Suite("Session pool")
struct SessionPoolTests {
    @Test("callers waiting for the only session get it first come, first served")
    func firstComeFirstServed() throws {
        let faults = FaultInjector()
        let setup = try SessionFaultTests.setUp("pool-fifo", faults: faults, poolSize: 1)
        defer { setup.hsm.close() }
        #expect(try SessionFaultTests.signAndVerify(setup))  // the one session is open and idle
        faults.inject(.sign, .ok, count: 1, delay: 1.0)  // the next C_Sign holds it for 1 s
        faults.inject(.sign, .ok, count: nil, delay: 0.05)  // each later one for 50 ms, so grants are far apart

        let order = Mutex<[Int]>([])
        let verified = Mutex<[Bool]>([])
        let done = DispatchGroup()
        func signer(_ index: Int) {
            done.enter()
            OSThread.start {
                let digest = SHA256.hash(Array("waiter \(index)".utf8))
                let signature = try? setup.hsm.sign(digest: digest, keyID: setup.keyID)
                order.withLock { $0.append(index) }  // at once: the next grant is 50 ms away
                verified.withLock { $0.append(signature.map { setup.publicKey.verify(rawSignature: $0.raw, digest: digest) } ?? false) }
                done.leave()
            }
        }
        signer(0)  // takes the session and sits in the slow C_Sign
        #expect(poll(seconds: 5) { setup.hsm.sessionUsage.inUse == 1 })
        for index in 1...5 {
            signer(index)
            // The next waiter starts only once this one is queued: the arrival order is fixed.
            #expect(poll(seconds: 5) { setup.hsm.sessionUsage.waiting == index })
        }
        #expect(done.wait(timeout: .now() + 10) == .success)
        #expect(verified.withLock { $0 } == Array(repeating: true, count: 6))
        #expect(order.withLock { $0 } == [0, 1, 2, 3, 4, 5], "the session went to the longest waiter each time")
    }

    /// Counts what a pool opens and closes: its sessions are numbers here,
    /// since the accounting under test is the pool's own.
    final class SessionLedger: Sendable {
        let next = Atomic<UInt>(1)
        let closed = Mutex<[UInt]>([])
        func pool(capacity: Int) -> SessionPool {
            SessionPool(capacity: capacity, slot: 0, open: { _ in (.ok, self.next.add(1, ordering: .relaxed).oldValue) },
                        close: { handle in self.closed.withLock { $0.append(handle) } })
        }
    }

    /// 1,000 `/v1/offers` batches sent at once all reached their deadline
    /// together (an attack round found it): each offer queued for a session
    /// behind offers of batches that arrived later, so every batch was half
    /// done when time ran out. Waiters now line up by their request's deadline.
    @Test("waiters are served earliest request deadline first, and in arrival order among equal deadlines")
    func earliestDeadlineFirst() throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 1)
        let held = try pool.checkout(deadline: MonotonicClock.deadline(after: 10))
        let base = MonotonicClock.now() + 60_000_000_000
        // Arrival order 0…5; priorities put 3 first, then 1 and 4 (equal, in arrival order), then 0, 5, 2.
        let priorities: [UInt64] = [base + 3, base + 2, base + 9, base, base + 2, base + 4]
        let order = Mutex<[Int]>([])
        let done = DispatchGroup()
        for (index, priority) in priorities.enumerated() {
            done.enter()
            OSThread.start {
                defer { done.leave() }
                guard let lease = try? pool.checkout(deadline: MonotonicClock.deadline(after: 20), priority: priority) else {
                    order.withLock { $0.append(-1) }
                    return
                }
                order.withLock { $0.append(index) }
                pool.checkin(lease)
            }
            #expect(poll(seconds: 5) { pool.usage.waiting == index + 1 }, "waiter \(index) did not queue")
        }
        pool.checkin(held)
        #expect(done.wait(timeout: .now() + 20) == .success)
        #expect(order.withLock { $0 } == [3, 1, 4, 0, 5, 2])
        // No priority given: the checkout's own deadline stands for it.
        let plain = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        pool.checkin(plain)
        #expect(pool.usage.inUse == 0 && pool.usage.waiting == 0)
    }

    /// The supervisor found a call overdue, and the call returned before it
    /// quarantined the lease: the quarantine took a second place off the
    /// pool's count (in use -1), and the pool then opened more sessions
    /// than its capacity. A review found it; `HSMToken.abandonCalls` now
    /// writes off only leases the pool had not got back.
    @Test("a lease given back before its quarantine is not written off: the count stays right and the capacity holds",
          arguments: ["checkin", "discard"])
    func quarantineAfterReturn(giveBack: String) throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 1)
        let lease = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        if giveBack == "checkin" { pool.checkin(lease) } else { pool.discard(lease) }
        #expect(!pool.quarantine(lease), "a returned lease has nothing to write off")
        #expect(pool.usage.inUse == 0)
        #expect(pool.usage.idle == (giveBack == "checkin" ? 1 : 0))
        let held = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(throws: HSMError.self, "a second session at capacity 1") {
            try pool.checkout(deadline: MonotonicClock.deadline(after: 0.1))
        }
        pool.checkin(held)
        #expect(pool.usage.inUse == 0)
    }

    @Test("a lease quarantined while out frees its place at once and is closed, not reused, when it comes back")
    func quarantineBeforeReturn() throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 1)
        let hung = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(pool.quarantine(hung))
        #expect(!pool.quarantine(hung), "once")
        #expect(pool.usage.inUse == 0)
        let replacement = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(replacement.handle != hung.handle)
        pool.checkin(hung)  // the hung call returned
        #expect(ledger.closed.withLock { $0 } == [hung.handle])
        #expect(pool.usage.idle == 0, "the quarantined session is not reused")
        pool.checkin(replacement)
        #expect(pool.usage.inUse == 0 && pool.usage.idle == 1)
    }

    /// Recovery finalized the module when the pool showed no session in
    /// use, but a reset had already made it forget the leases still out: a
    /// holder's next call then used handle numbers a reinitialized module
    /// may have given to other sessions or keys. A review found it.
    @Test("leases out are counted across a reset, until each is back and closed")
    func leasesOutAcrossReset() throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 2)
        let old = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        pool.reset(moduleReinitialized: false)
        #expect(pool.usage.inUse == 0, "the new generation has none in use")
        #expect(pool.leasesOut == 1, "the old lease is still out")
        let fresh = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(pool.leasesOut == 2)
        pool.checkin(old)
        #expect(ledger.closed.withLock { $0 } == [old.handle], "an old generation's session is closed on return")
        #expect(pool.leasesOut == 1)
        pool.discard(fresh)
        #expect(pool.leasesOut == 0)
    }

    /// Requests waiting for a session when a hung call took the token down
    /// were woken by recovery's reset and opened fresh sessions into the
    /// hanging module: 16 sessions hung with a pool of 4 (an attack round).
    @Test("a waiter woken by a reset asks afterReset first: it gives up when that throws (the token is down), and gets a fresh session when not (sessions merely died)")
    func waiterAfterReset() throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 1)
        for tokenDown in [true, false] {
            let held = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
            let opened = ledger.next.load(ordering: .relaxed)
            let outcome = Mutex<Result<SessionLease, HSMError>?>(nil)
            let waiter = Thread {
                let result = Result { () throws(HSMError) -> SessionLease in
                    try pool.checkout(deadline: MonotonicClock.deadline(after: 5)) { () throws(HSMError) in
                        if tokenDown { throw HSMError(.tokenUnavailable, "down") }
                    }
                }
                outcome.withLock { $0 = result }
            }
            waiter.start()
            let waiting = MonotonicClock.deadline(after: 2)
            while pool.usage.waiting == 0 && MonotonicClock.now() < waiting { usleep(1_000) }
            try #require(pool.usage.waiting == 1)
            pool.reset(moduleReinitialized: false)
            let answered = MonotonicClock.deadline(after: 2)
            while outcome.withLock({ $0 }) == nil && MonotonicClock.now() < answered { usleep(1_000) }
            switch outcome.withLock({ $0 }) {
            case .failure(let error)?:
                #expect(tokenDown && error.code == .tokenUnavailable, "\(error)")
                #expect(ledger.next.load(ordering: .relaxed) == opened, "a session was opened for a waiter that gave up")
            case .success(let lease)?:
                #expect(!tokenDown, "the waiter took a fresh session while the token was down")
                pool.discard(lease)
            case nil:
                Issue.record("the waiter was not answered after the reset")
            }
            pool.discard(held)
        }
    }

    @Test("freezeIfIdle refuses while a lease is out; once frozen no lease is granted until unfreeze")
    func freezeForReinitialization() throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 2)
        let lease = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(!pool.freezeIfIdle(), "a lease is out")
        pool.checkin(lease)
        #expect(pool.freezeIfIdle())
        let refused = #expect(throws: HSMError.self) { try pool.checkout(deadline: MonotonicClock.deadline(after: 0.1)) }
        #expect(refused?.code == .sessionUnavailable)
        // A request thread's own reset meanwhile closes nothing: the
        // reinitialization ends these sessions, and a close landing after
        // it could hit a new session with the same number.
        pool.reset(moduleReinitialized: false)
        #expect(ledger.closed.withLock { $0 }.isEmpty, "no close while frozen")
        pool.reset(moduleReinitialized: true)
        pool.unfreeze()
        let after = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(after.handle != lease.handle, "a new session on the reinitialized module")
        pool.checkin(after)
        #expect(pool.leasesOut == 0)
    }

    /// A lease handed to a waiting thread was counted only once that thread
    /// woke, so recovery could freeze the pool in between and the waiter
    /// then used an old session number across the module's
    /// reinitialization. A review found it.
    @Test("a session handed to a waiter counts as out before the waiter wakes: freezeIfIdle refuses", arguments: ["checkin", "discard"])
    func handedOverLeaseCounts(giveBack: String) throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 1)
        let first = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        let waiterLease = Mutex<SessionLease?>(nil)
        let waiter = Thread { waiterLease.withLock { $0 = try? pool.checkout(deadline: MonotonicClock.deadline(after: 5)) } }
        waiter.start()
        let deadline = MonotonicClock.deadline(after: 2)
        while pool.usage.waiting == 0 && MonotonicClock.now() < deadline { usleep(1_000) }
        try #require(pool.usage.waiting == 1)
        // checkin hands the session itself over; discard hands over its place.
        if giveBack == "checkin" { pool.checkin(first) } else { pool.discard(first) }
        #expect(!pool.freezeIfIdle(), "the waiter's lease is out, woken or not")
        while waiterLease.withLock({ $0 }) == nil && MonotonicClock.now() < deadline { usleep(1_000) }
        let lease = try #require(waiterLease.withLock { $0 })
        #expect(pool.leasesOut == 1)
        pool.checkin(lease)
        #expect(pool.leasesOut == 0)
        #expect(pool.freezeIfIdle())
    }

    @Test("onlyWrittenOffLeasesOut: true while every lease out was quarantined, false once one is not, or none is out")
    func writtenOffLeases() throws {
        let ledger = SessionLedger()
        let pool = ledger.pool(capacity: 2)
        #expect(!pool.onlyWrittenOffLeasesOut, "nothing is out")
        let hung = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        let other = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(pool.quarantine(hung))
        #expect(!pool.onlyWrittenOffLeasesOut, "another lease is out and may come back")
        pool.checkin(other)
        #expect(pool.onlyWrittenOffLeasesOut)
        // A new lease out that was not written off may come back: worth waiting for.
        let again = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(!pool.onlyWrittenOffLeasesOut)
        pool.discard(again)
        #expect(pool.onlyWrittenOffLeasesOut)
        pool.checkin(hung)  // the hung call returned: closed, and no longer out
        #expect(ledger.closed.withLock { $0 }.contains(hung.handle))
        #expect(!pool.onlyWrittenOffLeasesOut)
        #expect(pool.leasesOut == 0)
        #expect(pool.freezeIfIdle())
    }

    /// Recovery stops waiting for leases once only written-off ones are out;
    /// a written-off session whose C_CloseSession hangs on a dead device
    /// stopped counting as written off before its close had returned, and
    /// kept the wait going (a review found it).
    @Test("a written-off lease stays written off while its close hangs")
    func writtenOffWhileClosing() throws {
        let closing = DispatchSemaphore(value: 0)
        let release = DispatchSemaphore(value: 0)
        let next = Atomic<UInt>(1)
        let pool = SessionPool(capacity: 1, slot: 0, open: { _ in (.ok, next.add(1, ordering: .relaxed).oldValue) },
                               close: { _ in closing.signal(); release.wait() })
        let hung = try pool.checkout(deadline: MonotonicClock.deadline(after: 1))
        #expect(pool.quarantine(hung))
        let returned = DispatchSemaphore(value: 0)
        Thread { pool.checkin(hung); returned.signal() }.start()  // the call returned; its close hangs
        #expect(closing.wait(timeout: .now() + 5) == .success)
        #expect(pool.leasesOut == 1, "out until its close returns")
        #expect(pool.onlyWrittenOffLeasesOut, "still the written-off lease alone")
        release.signal()
        #expect(returned.wait(timeout: .now() + 5) == .success)
        #expect(pool.leasesOut == 0 && !pool.onlyWrittenOffLeasesOut)
    }
}
