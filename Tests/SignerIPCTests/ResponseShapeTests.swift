import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

/// The shapes the contract promises for what goes back to a client: a
/// classic signature of 70–72 DER bytes (96 Base64 characters), and a
/// keep-alive connection that stays open after an error answered before
/// any body was read.
@Suite("Response shapes", .serialized)
struct ResponseShapeTests {
    /// apple-signatures.md: "DER encoded (SEQUENCE of two INTEGERs, 70–72
    /// bytes), then standard Base64 with padding (96 characters)". About
    /// one ECDSA signature in 512 has a shorter DER (an r or s below 2²⁴⁷,
    /// the other below 2²⁵⁵: INTEGER contents of 31 and 32 bytes or less).
    /// A request with a fixed nonce and timestamp for `daemon`, its payload,
    /// and a real signature of the token over that payload whose DER is
    /// short: valid, so verify_before_return lets it through unless signerd
    /// looks at its length.
    func shortSignatureCase(_ daemon: InProcessDaemon) throws -> (body: [UInt8], payload: PromotionalOfferPayload, short: [UInt8]) {
        let nonce = "0f1e2d3c-4b5a-4978-8695-a4b3c2d1e0f9"
        let timestamp = AppleFields.nowMilliseconds()
        let payload = try PromotionalOfferPayload(bundleID: daemon.bundleID, keyID: daemon.keyID, productID: "pro_monthly", offerID: "winback",
                                                  appAccountToken: "", nonce: nonce, timestamp: timestamp)
        let digest = SHA256.hash(payload.payload)
        var short: [UInt8]?
        for _ in 0..<20_000 where short == nil {
            let raw = try daemon.token.sign(digest: digest, keyID: daemon.keyID).raw
            if try ECDSASignature.der(fromRaw: raw, curve: .p256).count < 70 { short = raw }
        }
        let found = try #require(short, "no short signature in 20,000 tries (expected about one in 512)")
        #expect(daemon.publicKey.verify(rawSignature: found, digest: digest))
        let body = #"{"bundle_id":"\#(daemon.bundleID)","product_id":"pro_monthly","offer_id":"winback","nonce":"\#(nonce)","timestamp":\#(timestamp)}"#
        return (Array(body.utf8), payload, found)
    }

    @Test("a classic signature whose DER is under 70 bytes is made again: the answer is 96 Base64 characters and verifies")
    func shortDERSignedAgain() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let (body, payload, short) = try shortSignatureCase(daemon)
        daemon.faults.replaceSignatures([short])
        let signsBefore = daemon.faults.calls(.sign)
        let response = try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer", body: body)
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        let answer = try JSONDecoder().decode(PromotionalOfferResponse.self, from: Data(response.body))
        #expect(answer.signature.utf8.count == 96, "\(answer.signature)")
        let der = try #require(Data(base64Encoded: answer.signature))
        #expect((70...72).contains(der.count))
        #expect(try opensslVerifies(publicKeyPEM: daemon.publicKey.pem, derSignature: Array(der), message: payload.payload))
        #expect(daemon.faults.calls(.sign) - signsBefore == 2, "the short signature and one more")
    }

    /// A review found the re-signing threw the valid short signature away
    /// when the second call failed (a 503 for a request already signed),
    /// and that an HSM with deterministic k (RFC 6979) would be asked 8
    /// times for the same signature.
    @Test("the short signature is returned when signing again fails, gives the same signature, or might outlast the deadline",
          arguments: ["fails", "repeats", "late"])
    func shortDERKept(_ second: String) throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 1000)
        defer { daemon.stop() }
        let (body, payload, short) = try shortSignatureCase(daemon)
        switch second {
        case "fails":
            daemon.faults.replaceSignatures([short])
            daemon.faults.inject(.sign, .functionFailed, after: 1)
        case "repeats":
            daemon.faults.replaceSignatures([short, short])
        default:
            // The first signature takes 0.6 s of the 1 s budget: a second one might not make it.
            daemon.faults.replaceSignatures([short])
            daemon.faults.inject(.sign, .ok, count: 1, delay: 0.6)
        }
        let signsBefore = daemon.faults.calls(.sign)
        let response = try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer", body: body)
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        let answer = try JSONDecoder().decode(PromotionalOfferResponse.self, from: Data(response.body))
        #expect(answer.signature == Data(try ECDSASignature.der(fromRaw: short, curve: .p256)).base64EncodedString())
        #expect(try opensslVerifies(publicKeyPEM: daemon.publicKey.pem, derSignature: try ECDSASignature.der(fromRaw: short, curve: .p256), message: payload.payload))
        #expect(daemon.faults.calls(.sign) - signsBefore == (second == "late" ? 1 : 2), "one more try at most, not eight")
        // The request was answered 200: the failed second call is no "signing failure answered with an error".
        let metrics = String(decoding: try SignerClient(socketPath: daemon.socketPath).send("GET", "/metrics").body, as: UTF8.self)
        let counted = metrics.split(separator: "\n").filter { $0.hasPrefix("signerd_hsm_errors_total{") }
        #expect(counted.isEmpty, "\(counted)")
    }

    /// `GET /v1/keys` read a key's public key from signerd's cache, so after
    /// `signctl keys import --replace` it showed the old key until a
    /// signature with the new objects failed to verify, or a reload.
    @Test("GET /v1/keys shows the public key of a key another process replaced on the token within 5 s, and signing uses it")
    func replacedKeyListed() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath)
        func listed() throws -> ECPublicKey? {
            let keys = try client.send("GET", "/v1/keys").decode(KeysResponse.self).keys
            return try keys.first { $0.keyID == daemon.keyID }?.publicKeyPEM.map { try ECPublicKey(pem: $0) }
        }
        #expect(try listed() == daemon.publicKey)
        // Another process (signctl keys import --replace) puts a new key under the same key ID.
        let files = try TestKeyFiles.make()
        let newKey = try ECPublicKey(pem: files.publicKeyPEM)
        var plain = TokenOptions()
        plain.logger = .disabled
        let importer = try HSMToken(uri: PKCS11URI(daemon.tokenURI), options: plain)
        _ = try importer.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: daemon.keyID, replace: true)
        importer.close()
        // Within keyListingMaxAge (5 s), with no signature or reload in between.
        let replacedAt = MonotonicClock.now()
        #expect(poll(seconds: 8) { (try? listed()) == newKey }, "the new key's public key")
        #expect(MonotonicClock.nanoseconds(from: replacedAt, to: MonotonicClock.now()) < 6_000_000_000)

        let body = #"{"bundle_id":"\#(daemon.bundleID)","product_id":"p","offer_id":"o"}"#
        let signed = try client.send("POST", "/v1/sign/promotional-offer", body: Array(body.utf8)).decode(PromotionalOfferResponse.self)
        let payload = try PromotionalOfferPayload(bundleID: daemon.bundleID, keyID: daemon.keyID, productID: "p", offerID: "o",
                                                  appAccountToken: "", nonce: signed.nonce, timestamp: signed.timestamp)
        let der = try #require(Data(base64Encoded: signed.signature))
        #expect(newKey.verify(derSignature: Array(der), digest: SHA256.hash(payload.payload)))
    }

    /// An error answered from the head alone (404, 405, 415) used to be
    /// queued before libmicrohttpd had finished the request, and it then
    /// closed the connection, so a keep-alive client's next request met a reset.
    @Test("404, 405 and 415 for a request without a body keep the connection open for the next request")
    func earlyErrorsKeepAlive() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
        defer { connection.close() }
        let requests: [(String, String)] = [
            ("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 404"),
            ("GET /v1/sign/promotional-offer HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 405"),
            ("POST /v1/sign/promotional-offer HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n", "HTTP/1.1 415"),
            ("DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 405"),
            ("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "HTTP/1.1 200"),
        ]
        for (request, status) in requests {
            try connection.write(Array(request.utf8))
            let response = try connection.readResponse().head
            #expect(response.hasPrefix(status), "\(request): \(response)")
            #expect(!response.lowercased().contains("connection: close"), "\(request): \(response)")
        }
    }

    /// An early answer to a request whose body was not read still closes:
    /// the unread body would otherwise be taken for the next request.
    @Test("an early error for a request with a body still closes the connection")
    func earlyErrorWithBodyCloses() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
        defer { connection.close() }
        let hidden = "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        try connection.write(Array("POST /nope HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: \(hidden.utf8.count)\r\n\r\n\(hidden)".utf8))
        let text = connection.readUntilClosed()
        #expect(text.hasPrefix("HTTP/1.1 404"), "\(text)")
        #expect(text.components(separatedBy: "HTTP/1.1 ").count == 2, "the body was not answered as a request: \(text)")
    }

    /// libmicrohttpd 0.9.75 sends "100 Continue" for a request without a
    /// body that carries `Expect: 100-continue`; with the next pipelined
    /// request already read, it then called the handler with data of size
    /// 0 before the request was complete, refused the response queued there
    /// and closed the connection: neither request got an answer.
    @Test("a bodiless request with Expect: 100-continue followed by a pipelined one: both are answered, in order")
    func expectContinuePipelined() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let requests: [(String, [String])] = [
            ("GET /nope HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n", ["404", "200"]),
            ("GET /healthz HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n", ["200", "200"]),
            ("POST /healthz HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 0\r\n\r\n", ["405", "200"]),
            ("POST /v1/sign/promotional-offer HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n", ["400", "200"]),
        ]
        for (first, statuses) in requests {
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
            defer { connection.close() }
            try connection.write(Array((first + "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").utf8))
            // Read until both final answers are in (the last is the
            // pipelined /healthz), or the connection ends.
            var received: [UInt8] = []
            var finals: [String] = []
            while true {
                let text = String(decoding: received, as: UTF8.self)
                finals = text.components(separatedBy: "HTTP/1.1 ").dropFirst().map { String($0.prefix(3)) }.filter { $0 != "100" }
                if finals.count >= statuses.count && text.hasSuffix(#"{"status":"ok"}"#) { break }
                guard (try? connection.read(appendingTo: &received)) ?? 0 > 0 else { break }
            }
            #expect(finals == statuses, "\(first): \(String(decoding: received, as: UTF8.self))")
        }
    }
}
