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
}
