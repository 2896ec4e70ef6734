import Dispatch
import Foundation
@testable import HSMSigner
import SignerIPC
import Synchronization
import TestSupport
import Testing

/// `HSMToken.close()` called `C_Finalize` under calls still inside the
/// module (signerd's shutdown closes the token after a server `stop()`
/// may have left running), and recovery went on after it. A review
/// crashed the process that way in 5 of 6 runs.
@Suite("HSMToken.close() with calls and recovery in flight", .serialized)
struct TokenCloseTests {
    @Test("close() while four threads sign: no crash, every thread returns, and signing afterwards is token_unavailable")
    func closeUnderSigning() throws {
        for round in 0..<5 {
            let daemon = try InProcessDaemon(signTimeoutMs: 1000, sessions: 4)
            let running = Atomic<Bool>(true)
            let signed = Atomic<Int>(0)
            let group = DispatchGroup()
            for _ in 0..<4 {
                group.enter()
                Thread.detachNewThread {
                    defer { group.leave() }
                    let digest = SHA256.hash(Array("round \(round)".utf8))
                    while running.load(ordering: .acquiring) {
                        if let signature = try? daemon.token.sign(digest: digest, keyID: daemon.keyID), daemon.publicKey.verify(rawSignature: signature.raw, digest: digest) {
                            signed.add(1, ordering: .relaxed)
                        }
                    }
                }
            }
            #expect(poll(seconds: 5) { signed.load(ordering: .relaxed) > 20 }, "round \(round): signing runs before close")
            daemon.token.close()
            let refused = #expect(throws: HSMError.self) { try daemon.token.sign(digest: SHA256.hash([1]), keyID: daemon.keyID) }
            #expect(refused?.code == .tokenUnavailable, "round \(round): \(String(describing: refused))")
            running.store(false, ordering: .releasing)
            #expect(group.wait(timeout: .now() + 5) == .success, "round \(round): a signing thread did not return")
            daemon.stop()
        }
    }

    @Test("close() during recovery's reinitialize: the token stays closed, with no C_Login or token_up after it")
    func recoveryStopsAtClose() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 1000, sessions: 2)
        defer { daemon.stop() }
        // Recovery's C_Finalize + C_Initialize takes a second (a slow module).
        let finalizes = daemon.faults.calls(.finalize)
        daemon.faults.inject(.finalize, .ok, count: 1, delay: 1.0)
        daemon.token.markDown(reason: "CKR_DEVICE_REMOVED")
        // C_Finalize is counted on entry, before its 1-s delay: recovery is inside its reinitialize.
        #expect(poll(seconds: 0.9) { daemon.faults.calls(.finalize) > finalizes }, "recovery reached C_Finalize")
        let logins = daemon.faults.calls(.login), opened = daemon.faults.calls(.openSession)
        daemon.token.close()
        usleep(2_000_000)
        #expect(daemon.token.status != .up, "a closed token came back up")
        #expect(daemon.faults.calls(.login) == logins, "C_Login after close()")
        #expect(daemon.faults.calls(.openSession) == opened, "C_OpenSession after close()")
        #expect(daemon.logged("token_up") == 0)
    }
}
