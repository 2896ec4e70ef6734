import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Synchronization
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// `/readyz` and `SIGHUP` at once, on a real SoftHSM token and socket: a
/// readiness check that began under the old configuration must not answer
/// for the new one.
@Suite("Readiness across a reload", .serialized)
struct ReloadReadinessTests {
    @Test("a /readyz check still running when a reload adds a key is not served as the new configuration's answer")
    func checkRunningAcrossReload() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        // The old configuration's check takes 1 s inside C_Sign.
        daemon.faults.inject(.sign, .ok, count: 1, delay: 1)
        let old = Mutex<ReadinessResponse?>(nil)
        let done = DispatchGroup()
        done.enter()
        OSThread.start {
            old.withLock { $0 = try? SignerClient(socketPath: daemon.socketPath).send("GET", "/readyz").decode(ReadinessResponse.self) }
            done.leave()
        }
        usleep(300_000)
        // Meanwhile a reload adds a key that is not on the token, and caches readiness for a while.
        var config = daemon.service.configuration
        config.keys.append(KeyConfiguration(keyID: "NOTONTOKEN", bundleIDs: ["com.example.other"]))
        config.readinessCacheSeconds = 30
        try daemon.service.reload(config)
        let after = try SignerClient(socketPath: daemon.socketPath).send("GET", "/readyz")
        #expect(done.wait(timeout: .now() + 5) == .success)
        #expect(old.withLock { $0?.keys.map(\.keyID) } == [daemon.keyID], "the check that began before the reload covers the old keys")
        let readiness = try after.decode(ReadinessResponse.self)
        #expect(after.status == 503, "\(String(decoding: after.body, as: UTF8.self))")
        #expect(readiness.keys.map(\.keyID) == [daemon.keyID, "NOTONTOKEN"])
        #expect(readiness.reason?.contains("NOTONTOKEN: key missing from token") == true, "\(readiness.reason ?? "ready")")
    }
}
