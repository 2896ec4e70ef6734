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
