import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The idle token check (`token_check_seconds`): an attack round found it
/// answered from the readiness cache (so `readiness_cache_seconds` set the
/// real interval), and due while a slow call was still in the module (so
/// it pushed a second call into a hanging HSM).
@Suite("idle token check", .serialized)
struct TokenCheckTests {
    @Test("due only with no session out and none back for token_check_seconds; it signs even with a fresh readiness cache")
    func dueAndUncached() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 5000) {
            $0.tokenCheckSeconds = 1
            $0.readinessCacheSeconds = 60
        }
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath)
        // One signing call that stays 2.5 s in the module.
        daemon.faults.inject(.sign, .ok, count: 1, delay: 2.5)
        let answered = DispatchSemaphore(value: 0)
        let slow = OSThread.start {
            _ = try? SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
            answered.signal()
        }
        try #require(slow)
        usleep(1_500_000)
        #expect(!daemon.service.tokenCheckDue, "a call is in the module: the token is slow, not idle")
        answered.wait()
        #expect(!daemon.service.tokenCheckDue, "a call just came back")
        usleep(1_200_000)
        #expect(daemon.service.tokenCheckDue, "nothing out, nothing back for 1 s")

        // /readyz fills the 60 s readiness cache; the idle check must sign all the same.
        #expect(try client.send("GET", "/readyz").status == 200)
        usleep(1_200_000)
        let before = daemon.faults.calls(.sign)
        #expect(daemon.service.checkTokenIfIdle())
        #expect(daemon.faults.calls(.sign) == before + 1, "a signature made, not the cached answer")
        #expect(!daemon.service.tokenCheckDue, "and not due again at once")
    }

    @Test("never due with token_check_seconds 0")
    func off() throws {
        let daemon = try InProcessDaemon { $0.tokenCheckSeconds = 0 }
        defer { daemon.stop() }
        usleep(1_200_000)
        #expect(!daemon.service.tokenCheckDue)
        #expect(!daemon.service.checkTokenIfIdle())
    }
}
