import Foundation
import HSMSigner
import SignerIPC
import Synchronization
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The real thing: SoftHSM's token directory taken away and put back while
/// the real signerd binary serves 8 signing clients.
@Suite("signerd recovers from a real SoftHSM outage", .serialized)
struct RecoveryTests {
    @Test("token directory moved away and back under 8 clients: no restart, only 503s meanwhile, no wrong signature")
    func tokenDirectoryAwayAndBack() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let pid = daemon.process?.processIdentifier
        let load = try SigningLoad(daemon, clients: 8, publicKeyPEM: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM)
        let tokens = daemon.directory + "/hsm/tokens"
        usleep(1_000_000)
        let away = Date()
        try FileManager.default.moveItem(atPath: tokens, toPath: tokens + ".away")
        usleep(3_000_000)
        let readyWhileAway = try daemon.client().send("GET", "/readyz").status
        let keysWhileAway = try daemon.client().send("GET", "/v1/keys").decode(KeysResponse.self).keys
        try FileManager.default.moveItem(atPath: tokens + ".away", toPath: tokens)
        let back = Date()
        // Until signatures flow again (20 good ones after the last failure), at most 20 s.
        while Date().timeIntervalSince(back) < 20 {
            usleep(100_000)
            let recent = load.recorded.filter { $0.at > back }
            let lastFailure = recent.filter { $0.status != 200 }.map(\.at).max() ?? back
            if recent.filter({ $0.at > lastFailure && $0.status == 200 }).count >= 20 { break }
        }
        let all = load.stop()
        let during = all.filter { $0.at >= away }
        let failures = during.filter { $0.status != 200 }
        let lastFailure = failures.map(\.at).max() ?? back
        let flowing = during.filter { $0.at > lastFailure && $0.status == 200 }.map(\.at).min()
        print("FAULT-OUTCOME SoftHSM token directory away 3 s (real SoftHSM, signerd binary, 8 clients): \(during.count) requests, \(failures.count) failed \(Set(failures.map(\.status)).sorted()), \(all.filter { $0.status == 200 && !$0.valid }.count) wrong signatures, flowing again \(String(format: "%.2f", (flowing ?? Date()).timeIntervalSince(back))) s after the directory came back")
        #expect(all.filter { $0.status == 200 && !$0.valid }.isEmpty, "no wrong signature, ever")
        #expect(all.filter { $0.status == 200 && $0.at < away }.count > 20, "signing before the outage")
        #expect(!failures.isEmpty, "the outage was felt")
        #expect(Set(failures.map(\.status)) == [503], "failures are 503 hsm_unavailable")
        #expect(flowing != nil, "signatures flow again")
        #expect(readyWhileAway == 503)
        #expect(keysWhileAway.count == 1 && keysWhileAway.allSatisfy { $0.publicKeyPEM == nil }, "no public key shown while the token is away")
        #expect(try daemon.client().send("GET", "/v1/keys").decode(KeysResponse.self).keys.first?.publicKeyPEM != nil, "and shown again after")
        #expect(daemon.process?.isRunning == true && daemon.process?.processIdentifier == pid, "no restart")
        let ready = try daemon.client().send("GET", "/readyz")
        #expect(ready.status == 200, "\(String(decoding: ready.body, as: UTF8.self)) \(daemon.log.suffix(5))")
        #expect(daemon.logged { $0.contains("\"token_down\"") }.count == 1)
        #expect(daemon.logged { $0.contains("\"token_up\"") }.count == 1)
    }

    /// An operations audit found `signerd_token_up` at 1 for as long as the
    /// token was gone, while no request came: only a request or a `/readyz`
    /// probe found the outage, so the suggested alert (`token_up == 0` for a
    /// minute) missed an outage of an idle daemon, and recovery waited.
    @Test("an idle daemon finds the token gone within token_check_seconds, shows token_up 0, and recovers by itself with no request")
    func idleTokenChecked() throws {
        let daemon = try DaemonHarness()
        // A readiness cache much longer than the check: the check must not be answered from it.
        try daemon.writeConfig(["token_check_seconds": 1, "readiness_cache_seconds": 60])
        try daemon.start()
        defer { daemon.stop() }
        // GET /metrics reads no token state from the module: the only PKCS#11 calls are signerd's own.
        func tokenUp() throws -> String? {
            let metrics = String(decoding: try daemon.client().send("GET", "/metrics").body, as: UTF8.self)
            return metrics.split(separator: "\n").first { $0.hasPrefix("signerd_token_up ") }.map { String($0.dropFirst("signerd_token_up ".count)) }
        }
        func waitFor(_ value: String, seconds: Double) throws -> Bool {
            let until = Date().addingTimeInterval(seconds)
            while Date() < until {
                if try tokenUp() == value { return true }
                usleep(200_000)
            }
            return false
        }
        #expect(try tokenUp() == "1")
        #expect(try daemon.client().send("GET", "/readyz").status == 200, "the cache filled")
        let tokens = daemon.directory + "/hsm/tokens"
        try FileManager.default.moveItem(atPath: tokens, toPath: tokens + ".away")
        var back = false
        defer { if !back { try? FileManager.default.moveItem(atPath: tokens + ".away", toPath: tokens) } }
        #expect(try waitFor("0", seconds: 10), "token_up 0 within a few token_check_seconds, with no request: \(daemon.log.suffix(5))")
        #expect(daemon.logged { $0.contains("\"token_down\"") }.count == 1)
        try FileManager.default.moveItem(atPath: tokens + ".away", toPath: tokens)
        back = true
        #expect(try waitFor("1", seconds: 20), "recovered with no request: \(daemon.log.suffix(5))")
        #expect(daemon.logged { $0.contains("\"token_up\"") }.count == 1)
        let body = try JSONSerialization.data(withJSONObject: ["bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"])
        let signed = try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Array(body))
        #expect(signed.status == 200, "\(String(decoding: signed.body, as: UTF8.self))")
        let signing = daemon.logged { $0.contains("\"token_down\"") }.count
        #expect(signing == 1, "one outage, found once")
    }

}
