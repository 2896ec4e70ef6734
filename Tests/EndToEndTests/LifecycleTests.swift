import Foundation
import HSMSigner
import SignerIPC
import Synchronization
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// Signs one classic offer and returns whether the signature verifies with `publicKeyPEM`.
func signAndVerify(_ client: SignerClient, keyID: String, publicKeyPEM: String, bundleID: String = "com.example.app") throws -> Bool {
    let response = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": bundleID, "key_id": keyID, "product_id": "p", "offer_id": "o"]))
    guard response.status == 200 else { return false }
    let offer = try response.decode(PromotionalOfferResponse.self)
    let payload = independentPayload(bundleID: bundleID, keyID: keyID, productID: "p", offerID: "o", token: "", nonce: offer.nonce, timestamp: offer.timestamp)
    guard let der = Data(base64Encoded: offer.signature) else { return false }
    return try ECPublicKey(pem: publicKeyPEM).verify(derSignature: Array(der), digest: SHA256.hash(payload))
}

@Suite("signerd lifecycle: peers, signals, reload", .serialized)
struct LifecycleTests {
    static let isRoot = getuid() == 0
    static let hasSetpriv = FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv")

    /// Runs curl as uid/gid 65534 (nobody) against the socket.
    func curlAsNobody(_ daemon: DaemonHarness, _ json: String) throws -> (status: Int, body: String) {
        let output = try run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                              "curl", "-s", "-w", "\n%{http_code}", "--unix-socket", daemon.socketPath,
                              "-H", "Content-Type: application/json", "-d", json, "http://signerd/v1/sign/promotional-offer"])
        let lines = String(decoding: output, as: UTF8.self).split(separator: "\n", omittingEmptySubsequences: false)
        return (Int(lines.last ?? "") ?? 0, lines.dropLast().joined(separator: "\n"))
    }

    @Test("a peer not allowed gets 403 and a log line; an allowed one succeeds",
          .enabled(if: isRoot && hasSetpriv, "needs root and setpriv(1) to run a client as another uid (uid 65534)"))
    func peerCredentials() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let publicKey = try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM
        let request = #"{"bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"}"#

        let refused = try curlAsNobody(daemon, request)
        #expect(refused.status == 403)
        #expect(refused.body.contains("\"forbidden\""))
        #expect(refused.body.contains("65534"))
        #expect(!daemon.logged { $0.contains("\"peer_forbidden\"") && $0.contains("\"peer.uid\":65534") && $0.contains("\"peer.pid\":") }.isEmpty)
        #expect(try signAndVerify(daemon.client(), keyID: "ABC123DEFG", publicKeyPEM: publicKey), "root is always allowed")

        // Allow uid 65534 by reload: now it signs.
        try daemon.writeConfig(["allowed_uids": [65534]])
        #expect(daemon.reload())
        let allowed = try curlAsNobody(daemon, request)
        #expect(allowed.status == 200, "\(allowed.body)")
        let offer = try JSONDecoder().decode(PromotionalOfferResponse.self, from: Data(allowed.body.utf8))
        let payload = independentPayload(bundleID: "com.example.app", keyID: "ABC123DEFG", productID: "p", offerID: "o", token: "", nonce: offer.nonce, timestamp: offer.timestamp)
        #expect(try opensslVerifies(publicKeyPEM: publicKey, derSignature: Array(try #require(Data(base64Encoded: offer.signature))), message: payload))

        // A per-key allow-list that leaves 65534 out refuses it for that key only.
        var config = daemon.config
        config["keys"] = [["key_id": "ABC123DEFG", "bundle_ids": ["com.example.app"], "allowed_uids": [12345]]]
        try daemon.writeConfig(config)
        #expect(daemon.reload())
        let perKey = try curlAsNobody(daemon, #"{"bundle_id": "com.example.app", "key_id": "ABC123DEFG", "product_id": "p", "offer_id": "o"}"#)
        #expect(perKey.status == 403)
        #expect(perKey.body.contains(#""code":"forbidden""#) && perKey.body.contains("\"field\":\"key_id\""), "\(perKey.body)")
        // Without key_id: told that the keys for the bundle leave it out (it
        // was "no configured key may sign", and nothing was logged).
        let unnamed = try curlAsNobody(daemon, #"{"bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"}"#)
        #expect(unnamed.status == 403, "\(unnamed.body)")
        #expect(unnamed.body.contains(#""code":"forbidden""#) && unnamed.body.contains(#""field":"bundle_id""#), "\(unnamed.body)")
        #expect(unnamed.body.contains("uid 65534 may use none of the keys that serve bundle_id \\\"com.example.app\\\" (ABC123DEFG)"), "\(unnamed.body)")
        #expect(poll(seconds: 3) { daemon.logged { $0.contains("\"peer_forbidden_for_key\"") && $0.contains("\"peer.uid\":65534") }.count >= 2 })
    }

    @Test("signctl bench by a user signerd does not allow: the daemon's 403 and exit 77, not a JSON decoding error and 70",
          .enabled(if: isRoot && hasSetpriv && SignctlHintTests.unprivilegedCallerAvailable, "needs root and setpriv(1) to run signctl as another uid (uid 65534)"))
    func benchForbidden() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let directory = TemporaryDirectory.make(prefix: "signerd-bench-403")
        chmod(directory, 0o755)
        let config = directory + "/signctl.json"
        try #"{"token_uri": "pkcs11:token=x?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/nonexistent", "socket_path": "\#(daemon.socketPath)"}"#
            .write(toFile: config, atomically: false, encoding: .utf8)
        chmod(config, 0o644)
        let bench = SignctlHintTests.runSignctlUnprivileged(["--config", config, "bench", "--requests", "10"])
        #expect(bench.status == 77, "\(bench.stderr)")
        #expect(bench.stderr.contains("GET /v1/keys was refused: 403 forbidden"), "\(bench.stderr)")
    }

    @Test("one uid at max_connections_per_uid: its next connection gets 429 and is closed at once; another uid still gets a slot",
          .enabled(if: isRoot && hasSetpriv, "needs root and setpriv(1) to connect as a second uid (uid 65534)"))
    func connectionsPerUID() throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["max_connections": 6, "max_connections_per_uid": 3])
        try daemon.start()
        defer { daemon.stop() }
        // Three idle connections from this uid (root) fill its share.
        let held = try (0..<3).map { _ in try UnixConnection.connect(path: daemon.socketPath, timeout: 2) }
        defer { held.forEach { $0.close() } }
        // The daemon counts a connection when it accepts it; the next one from this uid is answered and closed unread.
        var text = ""
        _ = poll(seconds: 5) {
            guard let extra = try? UnixConnection.connect(path: daemon.socketPath, timeout: 1) else { return false }
            defer { extra.close() }
            var answer: [UInt8] = []
            while (try? extra.read(appendingTo: &answer)) ?? 0 > 0 {}
            text = String(decoding: answer, as: UTF8.self)
            return !text.isEmpty
        }
        #expect(text.hasPrefix("HTTP/1.1 429 Too Many Requests"), "\(text)")
        #expect(text.contains("\"rate_limited\"") && text.contains("max_connections_per_uid"))
        #expect(!daemon.logged { $0.contains("\"connection_refused\"") && $0.contains("\"uid.limit\":3") }.isEmpty)
        // Another uid is not held back by root's connections: it reaches the handler (403: it is not allowed to sign).
        #expect(try curlAsNobody(daemon, #"{"bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"}"#).status == 403)
        // A connection freed by this uid makes room again at once: a client that
        // closes one and reconnects straight away is not refused for it.
        held[0].close()
        let reconnected = daemon.client()
        defer { reconnected.close() }
        let healthz = try reconnected.send("GET", "/healthz")
        #expect(healthz.status == 200, "\(String(decoding: healthz.body, as: UTF8.self))")
        let answer = try reconnected.send("GET", "/metrics")
        #expect(answer.status == 200)
        let metrics = String(decoding: answer.body, as: UTF8.self)
        #expect(metrics.contains("signerd_refused_connections_total "))
        #expect(!metrics.contains("signerd_refused_connections_total 0\n"))
    }

    @Test("SIGUSR1 and SIGUSR2 are ignored; a socket open to every user and an empty key list are warned about")
    func strayingSignalsAndAdvisories() throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["socket_mode": "0666"])
        try daemon.start()
        defer { daemon.stop() }
        daemon.send(SIGUSR1)
        daemon.send(SIGUSR2)
        usleep(200_000)
        #expect(try daemon.client().send("GET", "/healthz").status == 200, "signerd survived SIGUSR1 and SIGUSR2")
        #expect(!daemon.logged { $0.contains("\"socket_open_to_all_users\"") && $0.contains("666") }.isEmpty)
        try daemon.writeConfig(["socket_mode": "0666"], keys: [])
        #expect(daemon.reload())
        #expect(!daemon.logged { $0.contains("\"no_keys_configured\"") }.isEmpty)
    }

    /// The rate limiter read the clock before taking its lock, and another
    /// thread could store a later instant first: `now - bucket.at` on UInt64
    /// trapped (SIGILL) within seconds under 6 keep-alive clients.
    @Test("8 clients racing through the per-uid rate limiter for 3 s: the daemon stays up and answers every request")
    func rateLimiterUnderConcurrency() throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["rate_limit_per_second": 1_000_000, "rate_limit_burst": 1_000_000])
        try daemon.start()
        defer { daemon.stop() }
        let failures = Atomic<Int>(0)
        let answered = Atomic<Int>(0)
        let group = DispatchGroup()
        let end = Date().addingTimeInterval(3)
        for _ in 0..<8 {
            group.enter()
            OSThread.start {
                defer { group.leave() }
                let client = daemon.client()
                defer { client.close() }
                while Date() < end {
                    if (try? client.send("GET", "/healthz").status) == 200 {
                        answered.add(1, ordering: .relaxed)
                    } else {
                        failures.add(1, ordering: .relaxed)
                    }
                }
            }
        }
        group.wait()
        #expect(daemon.process?.isRunning == true, "signerd died: \(daemon.log.suffix(3))")
        #expect(failures.load(ordering: .relaxed) == 0)
        #expect(answered.load(ordering: .relaxed) > 1000)
    }

    /// Found by an attack run: the caller was checked when the head
    /// arrived, the key chosen when the body arrived, so a reload in
    /// between signed for a uid it had just removed.
    @Test("a uid removed by a reload while its request's body is still arriving gets 403, not a signature",
          .enabled(if: isRoot && hasSetpriv, "needs root and setpriv(1) to run a client as another uid (uid 65534)"))
    func revokedMidRequest() throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["allowed_uids": [65534]])
        try daemon.start()
        defer { daemon.stop() }
        // curl -T - streams the body as it comes (chunked): the head goes now, the body after 3 s.
        let client = Process()
        client.executableURL = URL(fileURLWithPath: "/bin/sh")
        client.arguments = ["-c", """
            (sleep 3; printf '%s' '{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}') | \
            setpriv --reuid=65534 --regid=65534 --clear-groups -- curl -s -w '\\n%{http_code}' -T - -X POST \
              -H 'Content-Type: application/json' --unix-socket \(daemon.socketPath) http://signerd/v1/sign/promotional-offer
            """]
        let output = Pipe()
        client.standardOutput = output
        try client.run()
        usleep(500_000)  // the head is in and was allowed
        try daemon.writeConfig(["allowed_uids": [Int]()])
        #expect(daemon.reload())
        client.waitUntilExit()
        let text = String(decoding: output.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        #expect(text.hasSuffix("\n403"), "\(text)")
        #expect(text.contains("\"forbidden\""), "\(text)")
    }

    @Test("SIGTERM during 8 concurrent request loops: every response carries a valid signature, exit 0, socket removed")
    func sigtermDrains() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        let load = try SigningLoad(daemon, clients: 8, publicKeyPEM: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM, maximumSocketErrors: 3)
        usleep(1_500_000)
        let before = load.recorded.filter { $0.status == 200 }.count
        let terminated = Date()
        let status = daemon.stop()
        let samples = load.stop()
        // A request sent before SIGTERM was in flight when it came: it must be
        // answered. One sent later may find the socket gone (status 0).
        let dropped = samples.filter { $0.status == 0 && $0.sent < terminated }
        #expect(dropped.isEmpty, "\(dropped.count) requests sent before SIGTERM got no answer, at \(dropped.map { $0.at.timeIntervalSince(terminated) }) s after it")
        let answered = samples.filter { $0.status != 0 }
        let final = (invalid: answered.filter { $0.status == 200 && !$0.valid }.count,
                     statuses: Dictionary(grouping: answered.filter { $0.status != 200 }, by: \.status).mapValues(\.count))
        #expect(status == 0)
        #expect(before > 20, "requests flowed before SIGTERM")
        #expect(final.invalid == 0)
        #expect(final.statuses.isEmpty, "\(final.statuses)")
        #expect(!FileManager.default.fileExists(atPath: daemon.socketPath))
        #expect(!daemon.logged { $0.contains("\"signerd_stopped\"") && $0.contains("\"drained\":true") }.isEmpty)
    }

    /// A clean SIGTERM with an idle keep-alive connection open logged
    /// libmicrohttpd's "Connection socket is closed …" as a warning (an
    /// operator audit): closing connections is what stopping does. That
    /// message comes only when libmicrohttpd's stop races its own read, so
    /// this run may not meet it; `LibraryMessageTests` checks the rule itself.
    @Test("SIGTERM with idle keep-alive connections open: exit 0 and no warning from the HTTP library")
    func sigtermWithIdleConnections() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        let connections = try (0..<3).map { _ in try UnixConnection.connect(path: daemon.socketPath, timeout: 10) }
        defer { for connection in connections { connection.close() } }
        for connection in connections {
            try connection.write(Array("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".utf8))
            var received: [UInt8] = []
            while !String(decoding: received, as: UTF8.self).contains("\"ok\"") {
                guard (try connection.read(appendingTo: &received)) > 0 else { break }
            }
            #expect(String(decoding: received, as: UTF8.self).hasPrefix("HTTP/1.1 200"))
        }
        // One more that never sent a request.
        let silent = try UnixConnection.connect(path: daemon.socketPath, timeout: 10)
        defer { silent.close() }
        usleep(200_000)
        #expect(daemon.stop() == 0)
        #expect(daemon.logged(atLeast: 1, within: 2) { $0.contains("\"signerd_stopped\"") }.count == 1)
        let warnings = daemon.log.filter { $0.contains("\"http_library\"") || $0.contains("\"level\":\"error\"") }
        #expect(warnings.isEmpty, "\(warnings)")
    }

    @Test("SIGTERM while a request is still arriving: it is finished, answered with a valid signature, and the drain says so")
    func sigtermFinishesArrivingRequest() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 10)
        defer { connection.close() }
        let json = Array(#"{"bundle_id":"com.example.app","key_id":"ABC123DEFG","product_id":"p","offer_id":"o"}"#.utf8)
        try connection.write(Array("POST /v1/sign/promotional-offer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: \(json.count)\r\n\r\n".utf8) + json.prefix(10))
        usleep(200_000)
        daemon.send(SIGTERM)
        usleep(500_000)
        try connection.write(Array(json.dropFirst(10)))
        let text = connection.readUntilClosed()
        #expect(text.hasPrefix("HTTP/1.1 200"), "\(text)")
        let body = try #require(text.range(of: "\r\n\r\n").map { Array(text[$0.upperBound...].utf8) })
        let offer = try JSONDecoder().decode(PromotionalOfferResponse.self, from: Data(body))
        let key = try ECPublicKey(pem: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM)
        let payload = independentPayload(bundleID: "com.example.app", keyID: "ABC123DEFG", productID: "p", offerID: "o", token: "", nonce: offer.nonce, timestamp: offer.timestamp)
        #expect(key.verify(derSignature: Array(try #require(Data(base64Encoded: offer.signature))), digest: SHA256.hash(payload)))
        #expect(daemon.stop() == 0)
        #expect(!daemon.logged { $0.contains("\"signerd_stopped\"") && $0.contains("\"drained\":true") }.isEmpty)
    }

    @Test("SIGTERM after the socket file was deleted and the path bound again by another process: that socket stays")
    func sigtermLeavesAnotherSocket() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        #expect(unlink(daemon.socketPath) == 0)
        let other = try UnixListener.bind(path: daemon.socketPath, mode: 0o600, group: nil)
        defer { close(other) }
        let otherFile = try #require(UnixListener.fileIdentity(daemon.socketPath))
        #expect(daemon.stop() == 0)
        #expect(UnixListener.fileIdentity(daemon.socketPath) == otherFile, "signerd removed a socket it did not bind")
        #expect(!daemon.logged { $0.contains("\"socket_file_not_removed\"") }.isEmpty)
    }

    @Test("SIGHUP: a key added to the token and the config signs without a restart; a broken config leaves the old one serving")
    func sighupReload() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let client = daemon.client()
        let pid = daemon.process?.processIdentifier
        #expect(try signAndVerify(client, keyID: "ABC123DEFG", publicKeyPEM: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM))

        // Not configured yet: 404.
        let before = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.app", "key_id": "NEWKEY0001", "product_id": "p", "offer_id": "o"]))
        #expect(before.status == 404 && before.error?.code == "key_not_found" && before.error?.field == "key_id", "\(String(decoding: before.body, as: UTF8.self))")

        try daemon.importKey("NEWKEY0001")  // signctl, another process, while signerd runs
        try daemon.writeConfig()
        #expect(daemon.reload())
        #expect(try signAndVerify(client, keyID: "NEWKEY0001", publicKeyPEM: try #require(daemon.keys["NEWKEY0001"]).publicKeyPEM))
        #expect(try signAndVerify(client, keyID: "ABC123DEFG", publicKeyPEM: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM))

        // Broken configurations are refused; the old one keeps serving both keys.
        for broken in ["{ not json", #"{"token_uri": "pkcs11:token=signer", "keyz": []}"#] {
            try broken.write(toFile: daemon.configPath, atomically: false, encoding: .utf8)
            let refusedBefore = daemon.log.filter { $0.contains("\"config_reload_refused\"") }.count
            daemon.send(SIGHUP)
            #expect(daemon.logged(atLeast: refusedBefore + 1) { $0.contains("\"config_reload_refused\"") }.count == refusedBefore + 1)
            #expect(try signAndVerify(client, keyID: "NEWKEY0001", publicKeyPEM: try #require(daemon.keys["NEWKEY0001"]).publicKeyPEM))
        }
        #expect(daemon.log.filter { $0.contains("\"config_reload_refused\"") }.count == 2)
        #expect(daemon.process?.processIdentifier == pid, "no restart")
        #expect(daemon.process?.isRunning == true)
    }

    @Test("SIGHUP with a PIN file saved with a byte-order mark: the reload is refused naming it, and the daemon keeps signing with the PIN in use")
    func reloadPINWithByteOrderMark() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let pinFile = try CheckConfigTests().pinPath(daemon)
        let pin = try String(contentsOfFile: pinFile, encoding: .utf8)
        try writeSecretFile(pinFile, "\u{FEFF}" + pin)
        let refusedBefore = daemon.log.filter { $0.contains("\"config_reload_refused\"") }.count
        daemon.send(SIGHUP)
        let refused = daemon.logged(atLeast: refusedBefore + 1) { $0.contains("\"config_reload_refused\"") }
        #expect(refused.last?.contains("starts with a UTF-8 byte-order mark") == true, "\(refused)")
        #expect(!daemon.log.joined().contains(pin.trimmingCharacters(in: .whitespacesAndNewlines)), "no PIN in the log")
        #expect(try signAndVerify(daemon.client(), keyID: "ABC123DEFG", publicKeyPEM: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM))
        try writeSecretFile(pinFile, pin)
    }

    @Test("a key deleted by signctl while signerd runs: a brief 503 while the token is checked, then 404 for it; the other key keeps signing")
    func keyDeletedUnderTheDaemon() throws {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "XYZ987WVUT"])
        try daemon.start()
        defer { daemon.stop() }
        let client = daemon.client()
        let other = try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM
        #expect(try signAndVerify(client, keyID: "XYZ987WVUT", publicKeyPEM: try #require(daemon.keys["XYZ987WVUT"]).publicKeyPEM))
        // Still in keys[] of the configuration signctl was given: it says what follows.
        let (deletedStatus, deletedOutput) = daemon.signctlStatus(["keys", "delete", "XYZ987WVUT", "--yes"])
        #expect(deletedStatus == 0, "\(deletedOutput)")
        #expect(deletedOutput.contains("warning: key_still_configured: XYZ987WVUT is in keys[] of "), "\(deletedOutput)")
        var statuses: [Int] = []
        let deadline = Date().addingTimeInterval(10)
        while Date() < deadline {
            let response = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.app", "key_id": "XYZ987WVUT", "product_id": "p", "offer_id": "o"]))
            statuses.append(response.status)
            if response.status == 404 { break }
            usleep(100_000)
        }
        #expect(statuses.last == 404, "\(statuses)")
        #expect(Set(statuses).isSubset(of: [503, 404]), "\(statuses)")
        #expect(try signAndVerify(client, keyID: "ABC123DEFG", publicKeyPEM: other))
        // It stays a 404, not another outage.
        let again = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.app", "key_id": "XYZ987WVUT", "product_id": "p", "offer_id": "o"]))
        #expect(again.status == 404)
        #expect(again.error?.code == "key_not_found")
        #expect(try signAndVerify(client, keyID: "ABC123DEFG", publicKeyPEM: other))
    }

    /// A reload took `log_level` or `max_body_bytes` in silence, and the
    /// old values stayed: an operator believed they had changed.
    @Test("a reload that changes settings read only at start names them in config_reload_needs_restart, and they keep their old values")
    func reloadNamesRestartOnlySettings() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        try daemon.writeConfig(["max_body_bytes": 2048, "log_level": "debug", "rate_limit_per_second": 1000])
        #expect(daemon.reload())
        let warned = daemon.logged { $0.contains("\"config_reload_needs_restart\"") }
        #expect(warned.count == 1, "\(daemon.log.suffix(5))")
        #expect(warned.first?.contains("\"options\":\"log_level, max_body_bytes\"") == true, "rate_limit_per_second applies at once and is not named: \(warned)")
        // Still the start's 64 KiB limit: a 3 KB body is read and signed.
        let padded = #"{"bundle_id": "com.example.app", "key_id": "ABC123DEFG", "product_id": "p", "offer_id": "o"}"# + String(repeating: " ", count: 3000)
        #expect(daemon.verifies(try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Array(padded.utf8))))
        // A reload that changes none of them says nothing of the kind.
        try daemon.writeConfig(["max_body_bytes": 2048, "log_level": "debug", "rate_limit_per_second": 500])
        #expect(daemon.reload())
        #expect(daemon.log.filter { $0.contains("\"config_reload_needs_restart\"") }.count == 2,
                "compared with the file of the last reload, not the start: max_body_bytes and log_level still differ from what is in effect")
    }

    /// `keys import --replace` from signctl while clients sign: the old
    /// objects' handles go stale (or name another object) and, for a
    /// moment, signerd's SoftHSM may see the token half-updated. A tester
    /// saw a 500 with `signature_not_verified`, a `key_vanished` outage
    /// and `CKR_KEY_FUNCTION_NOT_PERMITTED` 503s during quick rotations.
    @Test("keys import --replace ten times while four clients sign: every answer a verified 200, no verification failure, no token_down",
          arguments: [false, true])
    func replacedUnderLoad(alternateKeys: Bool) throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["readiness_cache_seconds": 0])
        try daemon.start()
        defer { daemon.stop() }
        let original = try #require(daemon.keys["ABC123DEFG"])
        let other = try TestKeyFiles.make()
        // Swapping to another key under the same key ID (correcting a wrong
        // file) makes a signature verify with one of the two public keys.
        let publicKeys: [ECPublicKey] = try ([original.publicKeyPEM] + (alternateKeys ? [other.publicKeyPEM] : [])).map { try ECPublicKey(pem: $0) }
        let stop = Atomic<Bool>(false)
        let outcomes = Mutex<(ok: Int, failed: [String])>((0, []))
        let group = DispatchGroup()
        for _ in 0..<4 {
            group.enter()
            Thread.detachNewThread {
                defer { group.leave() }
                let client = daemon.client()
                defer { client.close() }
                while !stop.load(ordering: .relaxed) {
                    do {
                        let response = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.app", "key_id": "ABC123DEFG", "product_id": "p", "offer_id": "o"]))
                        guard response.status == 200 else {
                            outcomes.withLock { $0.failed.append("\(response.status) \(String(decoding: response.body, as: UTF8.self))") }
                            continue
                        }
                        let offer = try response.decode(PromotionalOfferResponse.self)
                        let payload = independentPayload(bundleID: "com.example.app", keyID: "ABC123DEFG", productID: "p", offerID: "o", token: "", nonce: offer.nonce, timestamp: offer.timestamp)
                        let der = Array(Data(base64Encoded: offer.signature) ?? Data())
                        if publicKeys.contains(where: { $0.verify(derSignature: der, digest: SHA256.hash(payload)) }) {
                            outcomes.withLock { $0.ok += 1 }
                        } else {
                            outcomes.withLock { $0.failed.append("200 with a signature no public key verifies") }
                        }
                    } catch {
                        outcomes.withLock { $0.failed.append("\(error)") }
                    }
                }
            }
        }
        let files = daemon.directory + "/AuthKey_ABC123DEFG.p8"
        for round in 0..<10 {
            usleep(100_000)
            let file = alternateKeys && round % 2 == 0 ? other.sec1 : files
            _ = try daemon.signctl(["keys", "import", "--replace", "--key-id", "ABC123DEFG", file])
        }
        usleep(200_000)
        stop.store(true, ordering: .relaxed)
        group.wait()
        let result = outcomes.withLock { $0 }
        #expect(result.failed.isEmpty, "\(result.failed.count) failed of \(result.ok + result.failed.count): \(result.failed.prefix(5))")
        #expect(result.ok > 50)
        let metrics = String(decoding: try daemon.client().send("GET", "/metrics").body, as: UTF8.self)
        #expect(metrics.contains("signerd_verification_failures_total 0"), "a rotation counted as a verification failure")
        #expect(daemon.log.filter { $0.contains("\"token_down\"") || $0.contains("\"signature_not_verified\"") }.isEmpty,
                "\(daemon.log.filter { $0.contains("\"token_down\"") || $0.contains("\"signature_not_verified\"") })")
    }

    /// The README: a replaced key "is used from the next request, no reload needed".
    @Test("a key replaced by signctl while signerd runs: /readyz stays ready and the next signature verifies with the new key, with verify_before_return on and off",
          arguments: [true, false])
    func keyReplacedUnderTheDaemon(verifyBeforeReturn: Bool) throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["readiness_cache_seconds": 0, "verify_before_return": verifyBeforeReturn])
        try daemon.start()
        defer { daemon.stop() }
        let client = daemon.client()
        #expect(try client.send("GET", "/readyz").status == 200)  // the key's objects are cached now
        #expect(try signAndVerify(client, keyID: "ABC123DEFG", publicKeyPEM: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM))
        let replacement = try TestKeyFiles.make()
        _ = try daemon.signctl(["keys", "import", "--replace", "--key-id", "ABC123DEFG", replacement.sec1])
        let ready = try client.send("GET", "/readyz")
        #expect(ready.status == 200, "\(String(decoding: ready.body, as: UTF8.self))")
        #expect(try signAndVerify(client, keyID: "ABC123DEFG", publicKeyPEM: replacement.publicKeyPEM))
        let keys = try client.send("GET", "/v1/keys").decode(KeysResponse.self)
        #expect(keys.keys.first?.publicKeyPEM == replacement.publicKeyPEM)
        let metrics = String(decoding: try client.send("GET", "/metrics").body, as: UTF8.self)
        #expect(metrics.contains("signerd_verification_failures_total 0"), "no false verification failure is counted")
    }
}
