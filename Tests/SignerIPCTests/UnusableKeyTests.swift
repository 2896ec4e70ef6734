import Foundation
@testable import HSMSigner
import SignerIPC
import TestSupport
import Testing

/// A key that is on the token but cannot be used: two private keys under
/// one key ID, as a `keys import --replace` that stopped half-way leaves.
@Suite("an unusable key on the token")
struct UnusableKeyTests {
    static let halfReplaced = "HALFREPL02"
    static let bundleID = "com.example.halfreplaced"

    /// The daemon, with a second configured key whose key ID two private keys carry.
    static func daemonWithHalfReplacedKey() throws -> InProcessDaemon {
        let daemon = try InProcessDaemon(configure: { config in
            config.keys.append(KeyConfiguration(keyID: halfReplaced, bundleIDs: [bundleID]))
        })
        var plain = TokenOptions()
        plain.logger = .disabled
        let importer = try HSMToken(uri: PKCS11URI(daemon.tokenURI), options: plain)
        defer { importer.close() }
        for _ in 0..<2 {
            let files = try TestKeyFiles.make()
            _ = try importer.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: halfReplaced, replace: true,
                                       extractable: false, removingOld: false)
        }
        return daemon
    }

    /// An audit found the whole batch answered 500 `internal` ("key … cannot
    /// sign: key_invalid"), where the contract gives each offer 7234, "no
    /// usable In-App Purchase key".
    @Test("/v1/offers answers 200 with 7234 for every offer; the usable key's batch still signs")
    func batchGets7234() throws {
        let daemon = try Self.daemonWithHalfReplacedKey()
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath)
        let offers = #"[{"offer_id":"a","product_id":"p"},{"offer_id":"b","product_id":"p"},{"offer_id":"","product_id":"p"}]"#
        let body = #"{"bundle_id":"\#(Self.bundleID)","app_user_id":"u","generate_offers":\#(offers)}"#
        let response = try client.send("POST", "/v1/offers", body: Array(body.utf8))
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        let results = try response.decode(OffersResponse.self).offers
        #expect(results.map(\.signatureError?.code) == [7234, 7234, 7226])
        #expect(results.allSatisfy { $0.signatureData == nil && $0.keyID == nil })
        #expect(results[0].signatureError?.message == "no In-App Purchase key for this app")

        let usable = #"{"bundle_id":"\#(daemon.bundleID)","app_user_id":"u","generate_offers":[{"offer_id":"a","product_id":"p"}]}"#
        let signed = try #require(try client.send("POST", "/v1/offers", body: Array(usable.utf8)).decode(OffersResponse.self).offers.first)
        let data = try #require(signed.signatureData, "\(signed)")
        let payload = try PromotionalOfferPayload(bundleID: daemon.bundleID, keyID: daemon.keyID, productID: "p", offerID: "a",
                                                  appAccountToken: "", nonce: data.nonce, timestamp: data.timestamp)
        #expect(try opensslVerifies(publicKeyPEM: daemon.publicKey.pem, derSignature: Array(try #require(Data(base64Encoded: data.signature))),
                                    message: payload.payload))
    }

    /// The same audit: the single endpoint's message was "key … cannot
    /// sign: key_invalid", which does not say what is wrong or what to do.
    @Test("a single signature answers 500 internal naming the two private keys and the --replace advice")
    func singleNamesTheProblem() throws {
        let daemon = try Self.daemonWithHalfReplacedKey()
        defer { daemon.stop() }
        let body = #"{"bundle_id":"\#(Self.bundleID)","product_id":"p","offer_id":"o"}"#
        let response = try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer", body: Array(body.utf8))
        #expect(response.status == 500)
        let text = String(decoding: response.body, as: UTF8.self)
        #expect(text.contains(#""code":"internal""#), "\(text)")
        #expect(text.contains("key \(Self.halfReplaced) is unusable on the token: 2 private keys carry key ID \(Self.halfReplaced)"), "\(text)")
        #expect(text.contains("signctl keys import --replace"), "\(text)")
    }
}
