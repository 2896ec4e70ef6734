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
