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
        _ = try SessionFaultTests.signAndVerify(setup)  // the one session is open and idle
        faults.inject(.sign, .ok, count: 1, delay: 1.0)  // the next C_Sign holds it for 1 s

        let order = Mutex<[Int]>([])
        let verified = Mutex<[Bool]>([])
        let done = DispatchGroup()
        func signer(_ index: Int) {
            done.enter()
            OSThread.start {
                let ok = (try? SessionFaultTests.signAndVerify(setup, "waiter \(index)")) ?? false
                order.withLock { $0.append(index) }
                verified.withLock { $0.append(ok) }
                done.leave()
            }
        }
        signer(0)  // takes the session and sits in the slow C_Sign
        usleep(150_000)
        for index in 1...5 {
            signer(index)  // each starts waiting after the one before it
            usleep(100_000)
        }
        #expect(done.wait(timeout: .now() + 10) == .success)
        #expect(verified.withLock { $0 } == Array(repeating: true, count: 6))
        #expect(order.withLock { $0 } == [0, 1, 2, 3, 4, 5], "the session went to the longest waiter each time")
    }
}
