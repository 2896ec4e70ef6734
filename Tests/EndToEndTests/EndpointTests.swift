import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

/// The real signerd binary on a real SoftHSM token, called over its Unix socket.
@Suite("signerd end to end", .serialized)
struct EndpointTests {
    static let issuer = "57246542-96fe-1a63-e053-0824d011072a"

    @Test("every endpoint over the socket; every signature verified by openssl against an independently rebuilt payload")
    func everyEndpoint() throws {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "XYZ987WVUT"])
        try daemon.start()
        defer { daemon.stop() }
        let client = daemon.client()
        let first = try #require(daemon.keys["ABC123DEFG"])

        // /healthz
        let health = try client.send("GET", "/healthz")
        #expect(health.status == 200)
        #expect(String(decoding: health.body, as: UTF8.self) == #"{"status":"ok"}"#)

        // /readyz: both keys self-tested.
        let ready = try client.send("GET", "/readyz")
        #expect(ready.status == 200)
        let readiness = try ready.decode(ReadinessResponse.self)
        #expect(readiness.status == "ready")
        #expect(Set(readiness.keys.map(\.keyID)) == ["ABC123DEFG", "XYZ987WVUT"])
        #expect(readiness.keys.allSatisfy { $0.ok && $0.lastCheckMs > 1_700_000_000_000 })

        // /v1/keys: public keys equal `openssl ec -pubout`, nothing secret.
        let keysResponse = try client.send("GET", "/v1/keys")
        #expect(keysResponse.status == 200)
        let keys = try keysResponse.decode(KeysResponse.self)
        #expect(keys.keys.count == 2)
        let listed = try #require(keys.keys.first { $0.keyID == "ABC123DEFG" })
        #expect(listed.publicKeyPEM == first.publicKeyPEM)
        #expect(listed.issuerID == Self.issuer)
        #expect(listed.bundleIDs == ["com.example.app", "com.example.other"])
        #expect(listed.curve == "P-256")
        #expect(listed.tokenLabel == "signer")
        #expect(!String(decoding: keysResponse.body, as: UTF8.self).contains("PRIVATE"))

        // Classic promotional offer, given values: returned exactly as signed.
        let now = Int64(Date().timeIntervalSince1970 * 1000)
        let request: [String: Any] = [
            "bundle_id": "com.example.app", "key_id": "ABC123DEFG", "product_id": "pro_monthly", "offer_id": "winback_half_price",
            "app_account_token": "5E3F1C2A-9B4D-4E6F-8A7B-1C2D3E4F5A6B", "nonce": "4A0F7B8E-2F1D-4C6A-9B3E-5D7C8E9F0A1B", "timestamp": now,
        ]
        let signed = try client.send("POST", "/v1/sign/promotional-offer", body: body(request))
        #expect(signed.status == 200)
        let offer = try signed.decode(PromotionalOfferResponse.self)
        #expect(offer.keyID == "ABC123DEFG")
        #expect(offer.nonce == "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b")
        #expect(offer.appAccountToken == "5e3f1c2a-9b4d-4e6f-8a7b-1c2d3e4f5a6b", "returned as signed: lowercase")
        #expect(offer.timestamp == now)
        #expect(offer.signature.count == 96 || offer.signature.count == 92 || offer.signature.count == 88)
        #expect(!offer.signature.contains("-") && !offer.signature.contains("_"))
        let der = try #require(Data(base64Encoded: offer.signature))
        let payload = independentPayload(bundleID: "com.example.app", keyID: "ABC123DEFG", productID: "pro_monthly", offerID: "winback_half_price",
                                         token: "5e3f1c2a-9b4d-4e6f-8a7b-1c2d3e4f5a6b", nonce: offer.nonce, timestamp: now)
        #expect(try opensslVerifies(publicKeyPEM: first.publicKeyPEM, derSignature: Array(der), message: payload))

        // Defaults: a fresh lowercase nonce, now, an empty token; the only key for com.example.other is chosen.
        let minimal = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.other", "product_id": "p", "offer_id": "o"]))
        #expect(minimal.status == 200)
        let defaulted = try minimal.decode(PromotionalOfferResponse.self)
        #expect(defaulted.keyID == "ABC123DEFG")
        #expect(defaulted.appAccountToken == "")
        #expect(defaulted.nonce == defaulted.nonce.lowercased())
        #expect(abs(defaulted.timestamp - Int64(Date().timeIntervalSince1970 * 1000)) < 60_000)
        #expect(try opensslVerifies(publicKeyPEM: first.publicKeyPEM, derSignature: Array(try #require(Data(base64Encoded: defaulted.signature))),
                                    message: independentPayload(bundleID: "com.example.other", keyID: "ABC123DEFG", productID: "p", offerID: "o",
                                                                token: "", nonce: defaulted.nonce, timestamp: defaulted.timestamp)))

        // The second key, named.
        let second = try #require(daemon.keys["XYZ987WVUT"])
        let byName = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.app", "key_id": "XYZ987WVUT", "product_id": "p", "offer_id": "o"]))
        let named = try byName.decode(PromotionalOfferResponse.self)
        #expect(named.keyID == "XYZ987WVUT")
        #expect(try opensslVerifies(publicKeyPEM: second.publicKeyPEM, derSignature: Array(try #require(Data(base64Encoded: named.signature))),
                                    message: independentPayload(bundleID: "com.example.app", keyID: "XYZ987WVUT", productID: "p", offerID: "o",
                                                                token: "", nonce: named.nonce, timestamp: named.timestamp)))

        // Batch, RevenueCat format: a UUID app user ID is the signed token; each offer its own nonce.
        let userID = "D3B1A6F0-0E1C-4B5E-9C0A-1F2E3D4C5B6A"
        let batch = try client.send("POST", "/v1/offers", body: body([
            "bundle_id": "com.example.other", "app_user_id": userID,
            "generate_offers": [["offer_id": "a", "product_id": "p1", "subscription_group": "g"], ["offer_id": "b", "product_id": "p2"]],
        ]))
        #expect(batch.status == 200)
        let offers = try batch.decode(OffersResponse.self).offers
        #expect(offers.count == 2)
        #expect(Set(offers.compactMap { $0.signatureData?.nonce }).count == 2)
        for result in offers {
            let data = try #require(result.signatureData)
            #expect(result.keyID == "ABC123DEFG")
            #expect(try opensslVerifies(publicKeyPEM: first.publicKeyPEM, derSignature: Array(try #require(Data(base64Encoded: data.signature))),
                                        message: independentPayload(bundleID: "com.example.other", keyID: "ABC123DEFG", productID: result.productID,
                                                                    offerID: result.offerID, token: userID.lowercased(), nonce: data.nonce, timestamp: data.timestamp)))
        }
        // A non-UUID app user ID signs an empty token; an unknown bundle gets 7234 per offer.
        let plain = try client.send("POST", "/v1/offers", body: body(["bundle_id": "com.example.other", "app_user_id": "user_1", "generate_offers": [["offer_id": "a", "product_id": "p"]]]))
        let plainOffer = try #require(try plain.decode(OffersResponse.self).offers.first)
        let plainData = try #require(plainOffer.signatureData)
        #expect(try opensslVerifies(publicKeyPEM: first.publicKeyPEM, derSignature: Array(try #require(Data(base64Encoded: plainData.signature))),
                                    message: independentPayload(bundleID: "com.example.other", keyID: "ABC123DEFG", productID: "p", offerID: "a",
                                                                token: "", nonce: plainData.nonce, timestamp: plainData.timestamp)))
        let unknown = try client.send("POST", "/v1/offers", body: body(["bundle_id": "com.unknown.app", "app_user_id": "u", "generate_offers": [["offer_id": "a", "product_id": "p"]]]))
        #expect(unknown.status == 200)
        let noKey = try #require(try unknown.decode(OffersResponse.self).offers.first)
        #expect(noKey.signatureError?.code == 7234)
        #expect(noKey.signatureData == nil)

        // /metrics: Prometheus text with the families the contract names.
        let metrics = try client.send("GET", "/metrics")
        #expect(metrics.status == 200)
        #expect(metrics.headers["content-type"]?.hasPrefix("text/plain; version=0.0.4") == true)
        let text = String(decoding: metrics.body, as: UTF8.self)
        for family in ["signerd_requests_total{endpoint=\"/v1/sign/promotional-offer\",status=\"200\"}", "signerd_sign_queue_seconds_bucket",
                       "signerd_sign_hsm_seconds_count", "signerd_sessions{state=\"idle\"}", "signerd_token_up 1", "signerd_keys 2",
                       "signerd_verification_failures_total 0"] {
            #expect(text.contains(family), "\(family)")
        }

        // signctl against the daemon.
        let (status, output) = daemon.signctlStatus(["health"])
        #expect(status == 0, "\(output)")
        #expect(output.hasPrefix("ready"))
        let json = try daemon.signctl(["sign", "promotional-offer", "--bundle-id", "com.example.app", "--key-id", "ABC123DEFG",
                                       "--product-id", "pro_monthly", "--offer-id", "o", "--json"])
        let viaCLI = try JSONDecoder().decode(PromotionalOfferResponse.self, from: Data(json.utf8))
        // A refusal with --json carries the field signerd named (a CLI audit found it only inside the message).
        let refused = runSignctl(["--config", daemon.configPath, "sign", "promotional-offer", "--bundle-id", "com.example.app", "--product-id", "p",
                                  "--offer-id", "o", "--nonce", "undefined", "--json"], environment: daemon.environment)
        let refusal = try #require((try JSONSerialization.jsonObject(with: Data(refused.stdout.utf8)) as? [String: Any])?["error"] as? [String: Any], "\(refused.stdout)")
        #expect(refused.status == 65 && refusal["code"] as? String == "invalid_field" && refusal["field"] as? String == "nonce", "\(refused.stdout)")
        try first.publicKeyPEM.write(toFile: daemon.directory + "/pub.pem", atomically: false, encoding: .utf8)
        let verifyArguments = ["verify", "promotional-offer", "--public-key", daemon.directory + "/pub.pem", "--bundle-id", "com.example.app",
                               "--key-id", "ABC123DEFG", "--product-id", "pro_monthly", "--offer-id", "o", "--nonce", viaCLI.nonce,
                               "--timestamp", String(viaCLI.timestamp)]
        #expect(daemon.signctlStatus(verifyArguments + ["--signature", viaCLI.signature]).0 == 0)
        // Wrong offer: signctl verify says invalid (exit 65).
        var tampered = verifyArguments
        tampered[tampered.firstIndex(of: "o")!] = "other"
        #expect(daemon.signctlStatus(tampered + ["--signature", viaCLI.signature]).0 == 65)
        // signctl keys export-public equals openssl ec -pubout.
        #expect(try daemon.signctl(["keys", "export-public", "ABC123DEFG"]) == first.publicKeyPEM)
    }

    @Test("signctl keys export-public and delete refuse a malformed KEY_ID before opening the token, naming it")
    func malformedKeyIDArgument() throws {
        let daemon = try DaemonHarness()  // a token with ABC123DEFG; no daemon needed
        for arguments in [["keys", "export-public", "lower"], ["keys", "export-public", "abc123defg"], ["keys", "delete", "ABC123DEF", "--yes"]] {
            let (status, output) = daemon.signctlStatus(arguments)
            #expect(status == 64, "\(arguments): \(output)")
            #expect(output.hasPrefix("error: KEY_ID must be 10 characters A-Z0-9"), "\(arguments): \(output)")
            #expect(output.contains("got \(arguments[2])"))
            #expect(!output.contains("key_not_found"))
        }
        #expect(try daemon.signctl(["keys", "list"]).contains("ABC123DEFG"), "nothing was deleted")
    }

    @Test("signctl verify promotional-offer --json: valid is a JSON boolean, problems an array")
    func verifyOfferJSONTypes() throws {
        let daemon = try DaemonHarness()  // offline check: the daemon is not started
        try daemon.keys["ABC123DEFG"]!.publicKeyPEM.write(toFile: daemon.directory + "/pub.pem", atomically: false, encoding: .utf8)
        // A well-formed DER signature over something else: the check fails.
        let signature = Data(try ECDSASignature.der(fromRaw: [UInt8](repeating: 0x11, count: 64), curve: .p256)).base64EncodedString()
        let (status, output) = daemon.signctlStatus(["verify", "promotional-offer", "--public-key", daemon.directory + "/pub.pem",
                                                     "--bundle-id", "com.example.app", "--key-id", "ABC123DEFG", "--product-id", "p", "--offer-id", "o",
                                                     "--nonce", "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b", "--timestamp", "1790800914", "--signature", signature, "--json"])
        #expect(status == 65, "\(output)")
        let object = try #require(try JSONSerialization.jsonObject(with: Data(output.utf8)) as? [String: Any], "\(output)")
        // "false" as a string is truthy: `signctl verify … --json | jq -e .valid` succeeded for a bad signature.
        #expect(object["valid"] as? Bool == false, "\(output)")
        let problems = try #require(object["problems"] as? [String], "\(output)")
        #expect(problems.contains { $0.contains("seconds") }, "\(output)")

        // A CLI audit: an uppercase nonce (a field failure: it must be signed lowercase) got no note.
        let (_, upper) = daemon.signctlStatus(["verify", "promotional-offer", "--public-key", daemon.directory + "/pub.pem",
                                               "--bundle-id", "com.example.app", "--key-id", "ABC123DEFG", "--product-id", "p", "--offer-id", "o",
                                               "--nonce", "4A0F7B8E-2F1D-4C6A-9B3E-5D7C8E9F0A1B", "--timestamp", "1790800914034", "--signature", signature, "--json"])
        let upperProblems = try #require((try JSONSerialization.jsonObject(with: Data(upper.utf8)) as? [String: Any])?["problems"] as? [String], "\(upper)")
        #expect(upperProblems == ["the nonce was given with uppercase letters; the payload is checked with it lowercase, as it must be signed"], "\(upper)")

        // The same audit: a missing option was reported as the unreadable --public-key file (65), not as a usage error.
        let (missing, missingOutput) = daemon.signctlStatus(["verify", "promotional-offer", "--public-key", daemon.directory + "/absent.pem",
                                                             "--bundle-id", "com.example.app", "--key-id", "ABC123DEFG", "--product-id", "p", "--offer-id", "o"])
        #expect(missing == 64 && missingOutput.contains("is required"), "\(missingOutput)")
    }

    @Test("every signctl --json output is one JSON value and a trailing newline")
    func jsonOutputEndsWithNewline() throws {
        let daemon = try DaemonHarness()  // the daemon is not started: health reports it unreachable
        let header = Base64URL.encode(Array(#"{"alg":"ES256","kid":"ABC123DEFG","typ":"JWT"}"#.utf8))
        let jws = header + "." + Base64URL.encode(Array(#"{"iss":"x"}"#.utf8)) + "." + Base64URL.encode([UInt8](repeating: 1, count: 64))
        try daemon.keys["ABC123DEFG"]!.publicKeyPEM.write(toFile: daemon.directory + "/pub.pem", atomically: false, encoding: .utf8)
        let commands: [(arguments: [String], status: Int32)] = [
            (["keys", "list", "--json"], 0),
            (["keys", "import", "--replace", "--json", daemon.directory + "/AuthKey_ABC123DEFG.p8"], 0),
            (["verify", "jws", jws, "--public-key", daemon.directory + "/pub.pem", "--json"], 65),  // decodes, does not verify
            (["health", "--json"], 69),
        ]
        for (arguments, expected) in commands {
            let run = runSignctl(["--config", daemon.configPath] + arguments, environment: daemon.environment)
            #expect(run.status == expected, "\(arguments): \(run.stdout) \(run.stderr)")
            #expect(run.stdout.hasSuffix("\n") && !run.stdout.hasSuffix("\n\n"), "\(arguments): \(run.stdout.debugDescription)")
            #expect((try? JSONSerialization.jsonObject(with: Data(run.stdout.utf8))) != nil, "\(arguments): \(run.stdout)")
        }
        // A daemon that cannot be reached is a failure like any other: the {"error": …} object
        // on stdout, the words and the hint on stderr (it was a {"status": "unreachable"} object
        // and nothing on stderr).
        let health = runSignctl(["--config", daemon.configPath, "health", "--json"], environment: daemon.environment)
        let error = try #require((try? JSONSerialization.jsonObject(with: Data(health.stdout.utf8)) as? [String: Any])?["error"] as? [String: Any], "\(health.stdout)")
        #expect(error["exit_code"] as? Int == 69)
        #expect((error["message"] as? String)?.contains("signerd is not reachable at \(daemon.socketPath)") == true, "\(health.stdout)")
        #expect(health.stderr.hasPrefix("error: signerd is not reachable") && health.stderr.contains("\nhint: "), "\(health.stderr)")
    }
}
