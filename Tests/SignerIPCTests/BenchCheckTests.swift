import Foundation
import HSMSigner
@testable import SignerIPC
import TestSupport
import Testing

/// The smoke test's zero errors under `signctl bench --verify` mean
/// something only if the check would count a bad signature: it is shown
/// here on real answers, with the right key, another key and another payload.
@Suite("signctl bench --verify: the per-response check", .serialized)
struct BenchCheckTests {
    @Test("a signature that does not verify with the listed key, or over the payload bench asked for, is invalid_signature",
          arguments: [LoadGenerator.Endpoint.promotionalOffer, .promotionalOfferV2])
    func invalidSignatureCounted(_ endpoint: LoadGenerator.Endpoint) throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        // The body bench sends for this endpoint (Benchmark.swift, request(bundle:keyID:)).
        let path = endpoint == .promotionalOffer ? "/v1/sign/promotional-offer" : "/v1/sign/promotional-offer-v2"
        let body = #"{"bundle_id":"\#(daemon.bundleID)","key_id":"\#(daemon.keyID)","offer_id":"bench_offer","product_id":"bench_product"}"#
        let response = try client.send("POST", path, body: Array(body.utf8))
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        let generator = LoadGenerator(socketPath: daemon.socketPath, endpoint: endpoint, concurrency: 1, length: .requests(1), verify: true)
        let other = try ECPublicKey(pem: TestKeyFiles.make().publicKeyPEM)
        #expect(generator.check(response, bundleID: daemon.bundleID, publicKeys: [daemon.keyID: daemon.publicKey]) == nil)
        #expect(generator.check(response, bundleID: daemon.bundleID, publicKeys: [daemon.keyID: other]) == "invalid_signature")
        #expect(generator.check(response, bundleID: daemon.bundleID, publicKeys: nil) == nil, "without --verify only the shape is checked")
        if endpoint == .promotionalOffer {
            // The classic payload is rebuilt from what bench sent: another bundle ID is another payload.
            #expect(generator.check(response, bundleID: "com.example.other", publicKeys: [daemon.keyID: daemon.publicKey]) == "invalid_signature")
        }
    }
}

/// A 200 whose signature bench could not read, and one that is a valid DER
/// signature shorter than the documented 70 bytes (signerd returns one only
/// when signing again failed, as in an outage), were one bucket,
/// `malformed_signature`: an attack round's report could not tell a bug
/// from the documented outage case.
@Suite("signctl bench: a short signature is not a malformed one")
struct BenchShortSignatureTests {
    func response(signature: String) -> ClientResponse {
        let body = #"{"key_id":"ABC123DEFG","nonce":"e4a1b2c3-d5e6-4f70-8192-a3b4c5d6e7f8","signature":"\#(signature)","timestamp":1790800914034}"#
        return ClientResponse(status: 200, headers: [:], body: Array(body.utf8))
    }

    @Test("valid DER under 70 bytes is short_signature; 70–72 bytes passes; what is not DER, or not Base64, is malformed_signature")
    func shortCountedApart() throws {
        let generator = LoadGenerator(socketPath: "/nonexistent", endpoint: .promotionalOffer, concurrency: 1, length: .requests(1), verify: false)
        func checked(_ raw: [UInt8]) throws -> String? {
            let der = try ECDSASignature.der(fromRaw: raw, curve: .p256)
            return generator.check(response(signature: Data(der).base64EncodedString()), bundleID: "com.example.app", publicKeys: nil)
        }
        let full = [UInt8](repeating: 0x7f, count: 64)           // r and s of 32 bytes each: DER 70 bytes
        #expect(try checked(full) == nil)
        #expect(try checked([0x80] + [UInt8](repeating: 1, count: 31) + [0x80] + [UInt8](repeating: 1, count: 31)) == nil, "72 bytes")
        let shortR = [0x00] + [UInt8](repeating: 0x7f, count: 63)  // r under 2²⁴⁸: DER 69 bytes
        #expect(try ECDSASignature.der(fromRaw: shortR, curve: .p256).count == 69)
        #expect(try checked(shortR) == "short_signature")
        #expect(generator.check(response(signature: Data(repeating: 0x30, count: 70).base64EncodedString()), bundleID: "com.example.app", publicKeys: nil) == "malformed_signature")
        #expect(generator.check(response(signature: "not base64!"), bundleID: "com.example.app", publicKeys: nil) == "malformed_signature")
    }
}

/// A stall that ends in errors must show in the report: the latency
/// statistics cover successful requests only, so a failed request's time
/// was counted nowhere (745 errors during a 7-s SIGSTOP, max latency 22 ms).
@Suite("signctl bench: the latency of failed requests", .serialized)
struct BenchErrorLatencyTests {
    @Test("a request that fails after 400 ms in C_Sign shows in error_latency_ms, not in latency_ms; a clean run has none")
    func failedRequestsTimed() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 5000)
        defer { daemon.stop() }
        let clean = try LoadGenerator(socketPath: daemon.socketPath, endpoint: .promotionalOffer, concurrency: 1, length: .requests(20), verify: true).run()
        #expect(clean.errorCount == 0, "\(clean.errors)")
        #expect(clean.errorLatencyMs.isEmpty)
        // The first request's C_Sign returns CKR_FUNCTION_FAILED after 400 ms.
        daemon.faults.inject(.sign, .functionFailed, count: 1, delay: 0.4)
        let report = try LoadGenerator(socketPath: daemon.socketPath, endpoint: .promotionalOffer, concurrency: 1, length: .requests(20), verify: true).run()
        #expect(report.errorCount >= 1, "\(report.errors)")
        #expect((report.errorLatencyMs["max"] ?? 0) >= 400, "\(report.errorLatencyMs)")
        let json = try JSONSerialization.jsonObject(with: JSONEncoder().encode(report)) as? [String: Any]
        #expect((json?["error_latency_ms"] as? [String: Double])?["max"] == report.errorLatencyMs["max"])
    }
}

/// A request the socket failed was counted as one `socket` bucket: a
/// report of 3,000 `socket` errors did not say whether the daemon was gone,
/// the path removed, or the connection cut. The bucket now names the cause.
@Suite("signctl bench: socket failures are counted by their cause", .serialized)
struct BenchSocketErrorTests {
    enum After: String, CaseIterable, CustomTestStringConvertible {
        case listenerClosed, pathRemoved, connectionsCut, notHTTP
        var testDescription: String { rawValue }
    }

    /// Answers the first connection (bench's `GET /v1/keys` probe) with a
    /// listing of one key, then fails every later connection the `After` way.
    final class OneListingServer: @unchecked Sendable {
        let path: String
        private let thread: Thread

        init(after: After) throws {
            path = TemporaryDirectory.make(prefix: "signerd-bench-socket") + "/listing.sock"
            let listener = try UnixListener.bind(path: path, mode: 0o600, group: nil)
            let socketPath = path
            let listing = #"{"keys":[{"key_id":"ABC123DEFG","bundle_ids":["com.example.app"],"curve":"P-256","token_label":"t"}]}"#
            thread = Thread {
                func serveOne(_ answer: String?) -> Bool {
                    var pollfd = Glibc.pollfd(fd: listener, events: Int16(POLLIN), revents: 0)
                    guard poll(&pollfd, 1, 10_000) == 1 else { return false }
                    let connection = accept(listener, nil, nil)
                    guard connection >= 0 else { return false }
                    var request = [UInt8](repeating: 0, count: 4096)
                    _ = read(connection, &request, request.count)
                    if let answer { _ = answer.utf8CString.withUnsafeBytes { write(connection, $0.baseAddress, $0.count - 1) } }
                    close(connection)
                    return true
                }
                // The listener goes before the listing is written, so that no
                // bench request can reach it.
                var pollfd = Glibc.pollfd(fd: listener, events: Int16(POLLIN), revents: 0)
                guard poll(&pollfd, 1, 10_000) == 1 else { close(listener); return }
                let probe = accept(listener, nil, nil)
                var request = [UInt8](repeating: 0, count: 4096)
                _ = read(probe, &request, request.count)
                switch after {
                case .listenerClosed: close(listener)
                case .pathRemoved: close(listener); unlink(socketPath)
                case .connectionsCut, .notHTTP: break
                }
                let answer = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \(listing.utf8.count)\r\n\r\n\(listing)"
                _ = answer.utf8CString.withUnsafeBytes { write(probe, $0.baseAddress, $0.count - 1) }
                close(probe)
                guard after == .connectionsCut || after == .notHTTP else { return }
                for _ in 0..<3 {
                    guard serveOne(after == .notHTTP ? "SSH-2.0-OpenSSH_9.2\r\n\r\n" : nil) else { break }
                }
                close(listener)
            }
            thread.start()
        }
    }

    @Test("nothing listening, the path gone, the connection cut, an answer that is not HTTP: each its own bucket",
          arguments: After.allCases)
    func namedByCause(_ after: After) throws {
        let server = try OneListingServer(after: after)
        let report = try LoadGenerator(socketPath: server.path, endpoint: .promotionalOffer, concurrency: 1, length: .requests(3), verify: false).run()
        let expected = switch after {
        case .listenerClosed: "socket_ECONNREFUSED"
        case .pathRemoved: "socket_ENOENT"
        case .connectionsCut: "socket_closed"
        case .notHTTP: "socket_protocol"
        }
        #expect(report.errors == [expected: 3], "\(report.errors)")
        #expect(report.requests == 3)
    }
}
