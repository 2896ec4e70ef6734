import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// A real signerd whose standard error cannot take its audit lines: with
/// `audit_log` on it returns no signature (503 `audit_log_unwritable`),
/// and a closed standard error never lends its number to another file.
@Suite("Audit log of a real signerd", .serialized)
struct AuditLogEndToEndTests {
    static let offer = body(["bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"])

    /// signerd run by `sh -c 'exec signerd … 2>TARGET'` (`&-` closes it).
    func start(_ daemon: DaemonHarness, standardError target: String) throws {
        try daemon.start(launcher: ["/bin/sh", "-c", "exec \"$0\" \"$@\" 2>\(target)"])
    }

    @Test("standard error closed at start (2>&-) or a full disk (2>/dev/full): with audit_log no signature leaves, 503 audit_log_unwritable, counted; without it signing works",
          arguments: ["&-", "/dev/full"])
    func unwritableStandardError(target: String) throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["audit_log": true])
        try start(daemon, standardError: target)
        defer { _ = daemon.stop() }
        let pid = try #require(daemon.process?.processIdentifier)
        if target == "&-" {
            // The number stays /dev/null's, so no later file (the socket, a token file) receives log lines.
            #expect((try? FileManager.default.destinationOfSymbolicLink(atPath: "/proc/\(pid)/fd/2")) == "/dev/null")
        }
        let client = daemon.client()
        let refused = try client.send("POST", "/v1/sign/promotional-offer", body: Self.offer)
        #expect(refused.status == 503, "\(String(decoding: refused.body, as: UTF8.self))")
        #expect(refused.headers["retry-after"] == "1")
        #expect(refused.error?.code == "audit_log_unwritable")
        #expect(!String(decoding: refused.body, as: UTF8.self).contains("signature\":"), "no signature in the answer")
        let batch = try client.send("POST", "/v1/offers", body: body([
            "bundle_id": "com.example.app", "app_user_id": "u", "generate_offers": [["offer_id": "o1", "product_id": "p1"]],
        ]))
        #expect(batch.status == 503 && batch.error?.code == "audit_log_unwritable")
        let metrics = String(decoding: try client.send("GET", "/metrics").body, as: UTF8.self)
        #expect(metrics.contains("signerd_audit_write_failures_total 2"), "\(metrics.split(separator: "\n").filter { $0.contains("audit") })")

        // Auditing off by a reload (its config_reloaded line goes nowhere): the same daemon signs again.
        try daemon.writeConfig(["audit_log": false])
        daemon.send(SIGHUP)
        var signed: ClientResponse?
        for _ in 0..<50 {
            let response = try client.send("POST", "/v1/sign/promotional-offer", body: Self.offer)
            if response.status == 200 { signed = response; break }
            usleep(100_000)
        }
        let response = try #require(signed, "no 200 within 5 s of the reload")
        #expect(daemon.verifies(response))
    }

    @Test("standard error to /dev/null (2>/dev/null, StandardError=null): with audit_log every signature is refused")
    func nullDevice() throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["audit_log": true])
        try start(daemon, standardError: "/dev/null")
        defer { _ = daemon.stop() }
        let refused = try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Self.offer)
        #expect(refused.status == 503 && refused.error?.code == "audit_log_unwritable", "\(String(decoding: refused.body, as: UTF8.self))")
    }

    /// A log reader that stops reading (journald wedged, a pipe to a tool
    /// that hangs) fills the pipe; a blocking write would then hold every
    /// logging thread for ever, the watchdog's included.
    @Test("standard error a blocking pipe nobody reads: once it is full, signatures get 503 within about a second each and the daemon keeps answering; once read again, every line is whole JSON and signing resumes")
    func unreadPipe() throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["audit_log": true, "log_level": "warning", "sign_timeout_ms": 10000])
        let fifo = daemon.directory + "/stderr.fifo"
        try #require(mkfifo(fifo, 0o600) == 0)
        // Opened for reading (not read) first, so that signerd's open for writing does not wait; then blocking.
        let reader = open(fifo, O_RDONLY | O_NONBLOCK)
        try #require(reader >= 0)
        defer { close(reader) }
        try start(daemon, standardError: fifo)
        defer { _ = daemon.stop() }
        // A timeout, so that a daemon whose log writes block fails this test instead of hanging it.
        let client = SignerClient(socketPath: daemon.socketPath, timeout: 15)
        var refused: ClientResponse?
        var signedBefore = 0
        let started = Date()
        while refused == nil && signedBefore < 2000 && Date().timeIntervalSince(started) < 60 {
            let response = try client.send("POST", "/v1/sign/promotional-offer", body: Self.offer)
            if response.status == 200 { signedBefore += 1 } else { refused = response }
        }
        let full = try #require(refused, "the 64 KiB pipe never filled: \(signedBefore) signatures")
        #expect(full.status == 503 && full.error?.code == "audit_log_unwritable", "\(String(decoding: full.body, as: UTF8.self))")
        #expect(try client.send("GET", "/healthz").status == 200, "the daemon keeps answering")

        // Read the pipe dry, then sign again.
        var text = Data()
        var chunk = [UInt8](repeating: 0, count: 65536)
        func drain() { while true { let n = read(reader, &chunk, chunk.count); if n <= 0 { break }; text.append(contentsOf: chunk[0..<n]) } }
        drain()
        let again = try client.send("POST", "/v1/sign/promotional-offer", body: Self.offer)
        #expect(daemon.verifies(again))
        usleep(200_000)
        drain()
        let lines = String(decoding: text, as: UTF8.self).split(separator: "\n")
        let issued = lines.filter { $0.contains("\"signature_issued\"") }
        #expect(issued.count == signedBefore + 1, "one line per signature returned: \(issued.count) lines, \(signedBefore + 1) signatures")
        for line in lines {
            #expect((try? JSONSerialization.jsonObject(with: Data(line.utf8))) != nil, "a torn line: \(line.prefix(200))")
        }
    }

    @Test("with audit_log on a working standard error, each signature's line carries the SHA-256 of the signature returned, and start and reload leave audit_log_changed lines at log_level warning")
    func signatureHashAndTrailChanges() throws {
        let daemon = try DaemonHarness()
        try daemon.writeConfig(["audit_log": true, "log_level": "warning"])
        try daemon.start()
        defer { _ = daemon.stop() }
        let response = try daemon.client().send("POST", "/v1/sign/promotional-offer", body: Self.offer)
        #expect(daemon.verifies(response))
        let answer = try response.decode(PromotionalOfferResponse.self)
        let der = Array(try #require(Data(base64Encoded: answer.signature)))
        let lines = daemon.logged { $0.contains("\"signature_issued\"") }
        try #require(lines.count == 1, "\(daemon.log)")
        #expect(lines[0].contains("\"nonce\":\"\(answer.nonce)\""))
        #expect(lines[0].contains("\"signature.sha256\":\"\(SHA256.hash(der).hexString)\""), "\(lines[0])")
        #expect(!lines[0].contains(answer.signature))
        #expect(daemon.logged { $0.contains("\"audit_log_changed\"") && $0.contains("\"reason\":\"start\"") }.count == 1, "\(daemon.log)")

        try daemon.writeConfig(["audit_log": false, "log_level": "warning"])
        daemon.send(SIGHUP)  // config_reloaded is a notice, below log_level warning
        let off = daemon.logged { $0.contains("\"audit_log_changed\"") && $0.contains("\"audit_log\":false") }
        #expect(off.count == 1, "turning the trail off shows in it: \(daemon.log)")
    }
}
