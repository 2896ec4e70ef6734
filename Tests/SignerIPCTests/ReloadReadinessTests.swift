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
        let daemon = try InProcessDaemon(signTimeoutMs: 3000)
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

/// A readiness check whose `C_Sign` hangs is written off like any hung call;
/// the probes after it must not wait behind it until their own deadline,
/// since each such timeout marks the token down again.
@Suite("Readiness behind a hung check", .serialized)
struct HungReadinessTests {
    /// Probes after the recovery answered "a readiness check has been
    /// running …" for as long as the hung call lasted, for good with a call
    /// that never returns, though the token had recovered and signed.
    @Test("a readiness check hung in C_Sign: the token goes down once and recovers; later /readyz probes check again at once and say ready")
    func probesBehindHungCheck() throws {
        // 2 s, not 1: on a busy 2-core runner a sound check or signature
        // once took past 1 s, was written off too, and took the token down again.
        let daemon = try InProcessDaemon(signTimeoutMs: 2000)
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath, timeout: 10)
        let body = daemon.offerBody
        daemon.faults.hang(.sign, seconds: 8)
        let hung = try client.send("GET", "/readyz")
        #expect(hung.status == 503)
        #expect(poll(seconds: 5) { daemon.logged("token_up") == 1 }, "recovered from the written-off call")
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: body)))
        for _ in 0..<3 {
            let started = MonotonicClock.now()
            let probe = try SignerClient(socketPath: daemon.socketPath, timeout: 10).send("GET", "/readyz")
            let seconds = Double(MonotonicClock.now() - started) / 1e9
            #expect(probe.status == 200, "a new check, not the hung one's: \(String(decoding: probe.body, as: UTF8.self))")
            // A probe behind the hung check would wait at least its 2-s sign_timeout_ms.
            #expect(seconds < 1.0, "answered after \(seconds) s")
            #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: body)), "signing goes on")
        }
        #expect(daemon.logged("token_down") == 1, "only the hung call took the token down: \(daemon.logLines.lines.suffix(6))")
    }
}

/// Probes that arrive while a readiness check runs wait for it and share its
/// answer: the check signs once, however many probes came.
@Suite("Readiness shared by waiting probes", .serialized)
struct SharedReadinessTests {
    /// The check that finished ended its run (waking the probes behind it)
    /// before it cached its answer: a woken probe found no answer yet and
    /// ran a check of its own, one after another.
    @Test("probes waiting behind a running check get its answer: one C_Sign per check, not one per probe")
    func waitersShareTheCheck() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 3000)
        defer { daemon.stop() }
        var config = daemon.service.configuration
        // Long enough that a probe slow to arrive on a busy machine still finds the answer cached.
        config.readinessCacheSeconds = 1
        try daemon.service.reload(config)
        var extra: [Int] = []
        for _ in 0..<8 {
            usleep(1_100_000)  // the last round's answer has aged out
            let before = daemon.faults.calls(.sign)
            daemon.faults.inject(.sign, .ok, count: 1, delay: 0.2)
            let done = DispatchGroup()
            let statuses = Mutex<[Int]>([])
            for _ in 0..<12 {
                done.enter()
                OSThread.start {
                    let status = (try? SignerClient(socketPath: daemon.socketPath, timeout: 10).send("GET", "/readyz").status) ?? 0
                    statuses.withLock { $0.append(status) }
                    done.leave()
                }
            }
            #expect(done.wait(timeout: .now() + 10) == .success)
            #expect(statuses.withLock { $0 }.allSatisfy { $0 == 200 })
            extra.append(daemon.faults.calls(.sign) - before - 1)
        }
        #expect(extra.allSatisfy { $0 == 0 }, "C_Sign calls beyond the one check, per round: \(extra)")
    }
}

/// A readiness check whose own `C_Sign` takes the token down answers 503;
/// once recovery brings the token back, that answer is about a token state
/// that has passed.
@Suite("Readiness after the check took the token down", .serialized)
struct ReadinessAcrossOutageTests {
    /// The answer was cached under the state the token had when the check
    /// began (up), so after recovery it matched again and /readyz kept
    /// saying 503 for `readiness_cache_seconds` while metrics said token_up.
    @Test("a check whose C_Sign got CKR_DEVICE_ERROR: after token_up the next /readyz checks again and says ready")
    func answerFromBeforeRecoveryIsNotReused() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 3000)
        defer { daemon.stop() }
        var config = daemon.service.configuration
        config.readinessCacheSeconds = 60
        try daemon.service.reload(config)
        let client = SignerClient(socketPath: daemon.socketPath, timeout: 10)
        daemon.faults.inject(.sign, .deviceError, count: 1)
        let failed = try client.send("GET", "/readyz")
        #expect(failed.status == 503, "\(String(decoding: failed.body, as: UTF8.self))")
        #expect(poll(seconds: 10) { daemon.logged("token_up") == 1 }, "recovered: \(daemon.logLines.lines.suffix(4))")
        let before = daemon.faults.calls(.sign)
        let after = try client.send("GET", "/readyz")
        #expect(after.status == 200, "\(String(decoding: after.body, as: UTF8.self))")
        #expect(daemon.faults.calls(.sign) == before + 1, "a new check signed")
        // The new answer is cached as usual: a second probe does not sign.
        #expect(try client.send("GET", "/readyz").status == 200)
        #expect(daemon.faults.calls(.sign) == before + 1, "the fresh answer is reused")
    }
}
