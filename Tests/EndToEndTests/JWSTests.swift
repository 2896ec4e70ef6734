import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

/// The four ES256 compact JWS kinds, decoded and checked claim by claim,
/// verified with OpenSSL and with PyJWT.
@Suite("signerd JWS kinds", .serialized)
struct JWSTests {
    static let issuer = "57246542-96fe-1a63-e053-0824d011072a"

    static let shared: Result<DaemonHarness, any Error> = Result {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "NOISSUER01"])
        var config = daemon.config
        config["keys"] = [
            ["key_id": "ABC123DEFG", "bundle_ids": ["com.example.app"], "issuer_id": issuer],
            ["key_id": "NOISSUER01", "bundle_ids": ["com.example.noissuer"]],
        ] as [[String: Any]]
        config["clock_skew_seconds"] = 60
        try daemon.writeConfig(config, removing: ["issuer_id", "default_key_id"])
        try daemon.start()
        return daemon
    }

    let daemon: DaemonHarness
    init() throws { daemon = try Self.shared.get() }

    var publicKeyPEM: String { daemon.keys["ABC123DEFG"]!.publicKeyPEM }  // imported in shared

    struct Decoded {
        let header: [String: Any]
        let claims: [String: Any]
        let claimsText: String
        let signature: [UInt8]
        let signingInput: String
        let token: String
    }

    /// Decodes a compact JWS by hand (not with HSMSigner's decoder), checks
    /// the signature is 64 bytes and verifies it with `openssl dgst` after converting to DER.
    func decodeAndVerify(_ token: String, sourceLocation: SourceLocation = #_sourceLocation) throws -> Decoded {
        let parts = token.split(separator: ".", omittingEmptySubsequences: false).map(String.init)
        try #require(parts.count == 3, sourceLocation: sourceLocation)
        func base64url(_ text: String) throws -> Data {
            #expect(!text.contains("=") && !text.contains("+") && !text.contains("/"), "base64url without padding", sourceLocation: sourceLocation)
            return Data(try #require(base64urlDecoded(text), sourceLocation: sourceLocation))
        }
        let header = try #require(try JSONSerialization.jsonObject(with: base64url(parts[0])) as? [String: Any], sourceLocation: sourceLocation)
        let claimsData = try base64url(parts[1])
        let claims = try #require(try JSONSerialization.jsonObject(with: claimsData) as? [String: Any], sourceLocation: sourceLocation)
        let signature = Array(try base64url(parts[2]))
        #expect(signature.count == 64, "ES256 signature is raw r‖s, 64 bytes", sourceLocation: sourceLocation)
        #expect(parts[2].count == 86, sourceLocation: sourceLocation)
        let der = try ECDSASignature.der(fromRaw: signature, curve: .p256)
        let input = parts[0] + "." + parts[1]
        #expect(try opensslVerifies(publicKeyPEM: publicKeyPEM, derSignature: der, message: Array(input.utf8)), sourceLocation: sourceLocation)
        #expect(header as NSDictionary == ["alg": "ES256", "kid": "ABC123DEFG", "typ": "JWT"] as NSDictionary, sourceLocation: sourceLocation)
        return Decoded(header: header, claims: claims, claimsText: String(decoding: claimsData, as: UTF8.self), signature: signature, signingInput: input, token: token)
    }

    func post(_ path: String, _ fields: [String: Any]) throws -> ClientResponse {
        try daemon.client().send("POST", path, body: body(fields))
    }

    func isLowercaseUUID(_ value: Any?) -> Bool {
        guard let text = value as? String else { return false }
        return text.count == 36 && text == text.lowercased() && UUID(uuidString: text) != nil
    }

    func nowSeconds() -> Int { Int(Date().timeIntervalSince1970) }

    @Test("promotional offer V2: claims exactly, transactionId only when given")
    func promotionalOfferV2() throws {
        let withTransaction = try post("/v1/sign/promotional-offer-v2", ["bundle_id": "com.example.app", "product_id": "pro_monthly", "offer_id": "winback", "transaction_id": "2000000123456789"])
        #expect(withTransaction.status == 200)
        let response = try withTransaction.decode(JWSResponse.self)
        let jws = try decodeAndVerify(response.jws)
        #expect(Set(jws.claims.keys) == ["iss", "iat", "aud", "bid", "nonce", "productId", "offerIdentifier", "transactionId"])
        #expect(jws.claims["iss"] as? String == Self.issuer)
        #expect(jws.claims["aud"] as? String == "promotional-offer")
        #expect(jws.claims["bid"] as? String == "com.example.app")
        #expect(jws.claims["productId"] as? String == "pro_monthly")
        #expect(jws.claims["offerIdentifier"] as? String == "winback")
        #expect(jws.claims["transactionId"] as? String == "2000000123456789")
        #expect(jws.claims["nonce"] as? String == response.nonce)
        #expect(isLowercaseUUID(jws.claims["nonce"]))
        let iat = try #require(jws.claims["iat"] as? Int)
        #expect(abs(iat - nowSeconds()) <= 5, "iat in seconds")
        #expect(jws.claims["exp"] == nil)
        #expect(response.keyID == "ABC123DEFG")

        let without = try post("/v1/sign/promotional-offer-v2", ["bundle_id": "com.example.app", "product_id": "pro_monthly", "offer_id": "winback"]).decode(JWSResponse.self)
        let bare = try decodeAndVerify(without.jws)
        #expect(bare.claims["transactionId"] == nil)
        #expect(Set(bare.claims.keys) == ["iss", "iat", "aud", "bid", "nonce", "productId", "offerIdentifier"])
        #expect(without.nonce != response.nonce)
    }

    @Test("introductory offer eligibility: allowIntroductoryOffer is a JSON boolean, transactionId required")
    func introductoryOfferEligibility() throws {
        for allow in [true, false] {
            let response = try post("/v1/sign/introductory-offer-eligibility", ["bundle_id": "com.example.app", "product_id": "pro_monthly",
                                                                                "allow_introductory_offer": allow, "transaction_id": "42"]).decode(JWSResponse.self)
            let jws = try decodeAndVerify(response.jws)
            #expect(Set(jws.claims.keys) == ["iss", "iat", "aud", "bid", "nonce", "productId", "allowIntroductoryOffer", "transactionId"])
            #expect(jws.claims["aud"] as? String == "introductory-offer-eligibility")
            #expect((jws.claims["allowIntroductoryOffer"] as? Bool) == allow)
            #expect(jws.claims["transactionId"] as? String == "42")
            // A JSON boolean: the claims text says true/false, not 1/0.
            #expect(jws.claimsText.contains("\"allowIntroductoryOffer\":\(allow)"), "\(jws.claimsText)")
        }
    }

    @Test("Advanced Commerce: request is standard Base64 of the compact UTF-8 JSON of the object given")
    func advancedCommerce() throws {
        let request: [String: Any] = ["operation": "CREATE_SUBSCRIPTION", "version": "1", "requestInfo": ["requestReferenceId": "0f3a-é"], "items": [["SKU": "sku.1", "price": 4990]]]
        let response = try post("/v1/sign/advanced-commerce-request", ["bundle_id": "com.example.app", "request": request]).decode(JWSResponse.self)
        let jws = try decodeAndVerify(response.jws)
        #expect(Set(jws.claims.keys) == ["iss", "iat", "aud", "bid", "nonce", "request"])
        #expect(jws.claims["aud"] as? String == "advanced-commerce-api")
        let encoded = try #require(jws.claims["request"] as? String)
        let decoded = try #require(Data(base64Encoded: encoded), "standard Base64")
        let object = try #require(try JSONSerialization.jsonObject(with: decoded) as? NSDictionary)
        #expect(object == request as NSDictionary)
        #expect(!String(decoding: decoded, as: UTF8.self).contains(" "), "compact JSON")
        #expect(String(decoding: decoded, as: UTF8.self).contains("0f3a-é"), "UTF-8, not escaped")
    }

    /// Bodies over 4 KiB are read a few at a time (`BodyReadingGate`), and
    /// the request object is kept only as its Base64 while the request
    /// waits for the token: each of several sent at once must still be
    /// signed exactly as sent.
    @Test("large Advanced Commerce requests sent at once are each signed exactly as sent")
    func largeAdvancedCommerceRequestsAtOnce() throws {
        let clients = 6
        let results = Locked<[Int: Result<(sent: NSDictionary, jws: String), any Error>]>([:])
        let done = DispatchGroup()
        for index in 0..<clients {
            done.enter()
            OSThread.start {
                defer { done.leave() }
                let items = (0..<800).map { ["SKU": "sku.\(index).\($0)", "price": 1000 + $0] as [String: Any] }
                let request: [String: Any] = ["operation": "CREATE_SUBSCRIPTION", "version": "1", "items": items]
                let outcome = Result { () throws -> (sent: NSDictionary, jws: String) in
                    let body = try JSONSerialization.data(withJSONObject: ["bundle_id": "com.example.app", "request": request])
                    guard body.count > 4096 * 4 else { throw CocoaError(.coderInvalidValue) }  // well over the threshold
                    let response = try daemon.client().send("POST", "/v1/sign/advanced-commerce-request", body: Array(body))
                    guard response.status == 200 else { throw CocoaError(.coderReadCorrupt, userInfo: ["body": String(decoding: response.body, as: UTF8.self)]) }
                    return (request as NSDictionary, try response.decode(JWSResponse.self).jws)
                }
                results.withLock { $0[index] = outcome }
            }
        }
        #expect(done.wait(timeout: .now() + 120) == .success)
        let collected = results.withLock { $0 }
        #expect(collected.count == clients)
        for (_, outcome) in collected.sorted(by: { $0.key < $1.key }) {
            let (sent, token) = try outcome.get()
            let jws = try decodeAndVerify(token)
            let encoded = try #require(jws.claims["request"] as? String)
            let decoded = try #require(Data(base64Encoded: encoded), "standard Base64")
            let signed = try #require(try JSONSerialization.jsonObject(with: decoded) as? NSDictionary)
            #expect(signed == sent)
        }
    }

    /// Foundation's JSON parser drops a U+FEFF written as raw UTF-8 at the
    /// start of a string (it decodes each string as if it were a file with
    /// a byte-order mark), so `"\u{FEFF}abc"` was signed as `abc`.
    @Test("a U+FEFF sent as raw UTF-8 at the start of a string is signed as sent, never dropped")
    func rawByteOrderMarkInStrings() throws {
        let bom = "\u{FEFF}"
        let v2 = try daemon.client().send("POST", "/v1/sign/promotional-offer-v2",
                                          body: Array(#"{"bundle_id":"com.example.app","product_id":"\#(bom)pro","offer_id":"\#(bom)o"}"#.utf8))
        #expect(v2.status == 200, "\(String(decoding: v2.body, as: UTF8.self))")
        let offer = try decodeAndVerify(try v2.decode(JWSResponse.self).jws)
        // The claims text, not a parse of it: Foundation's parser would drop the mark again.
        #expect(offer.claimsText.contains(#""offerIdentifier":"\#(bom)o","productId":"\#(bom)pro""#), "\(offer.claimsText)")

        let commerce = try daemon.client().send("POST", "/v1/sign/advanced-commerce-request",
                                                body: Array(#"{"bundle_id":"com.example.app","request":{"sku":"\#(bom)x","\#(bom)k":1}}"#.utf8))
        #expect(commerce.status == 200, "\(String(decoding: commerce.body, as: UTF8.self))")
        let request = try #require(try decodeAndVerify(try commerce.decode(JWSResponse.self).jws).claims["request"] as? String)
        #expect(String(decoding: try #require(Data(base64Encoded: request)), as: UTF8.self) == #"{"sku":"\#(bom)x","\#(bom)k":1}"#)

        // The allow-list compares bytes: a bundle ID that is not the configured one is not signed for it.
        let bundle = try daemon.client().send("POST", "/v1/sign/promotional-offer-v2",
                                              body: Array(#"{"bundle_id":"\#(bom)com.example.app","product_id":"p","offer_id":"o"}"#.utf8))
        #expect(bundle.status == 403, "\(String(decoding: bundle.body, as: UTF8.self))")
        #expect(bundle.error?.code == "bundle_not_allowed")
        // A member name that only looks like a field is not taken for it.
        let name = try daemon.client().send("POST", "/v1/sign/promotional-offer-v2",
                                            body: Array(#"{"bundle_id":"com.example.app","\#(bom)product_id":"p","offer_id":"o"}"#.utf8))
        #expect(name.status == 400)
        #expect(name.error?.code == "unknown_field")
        try expectServing(daemon)
    }

    @Test("App Store Server API token: exp − iat is ttl_seconds (default 300), iat backdated by the skew but at most half the TTL")
    func serverAPIToken() throws {
        let now = nowSeconds()
        let token = try post("/v1/tokens/app-store-server-api", ["bundle_id": "com.example.app"]).decode(ServerAPITokenResponse.self)
        let jws = try decodeAndVerify(token.token)
        // apple-signatures.md's common claims, nonce included, plus exp.
        #expect(Set(jws.claims.keys) == ["iss", "iat", "exp", "aud", "bid", "nonce"])
        #expect(jws.claims["aud"] as? String == "appstoreconnect-v1")
        let nonce = try #require(jws.claims["nonce"] as? String)
        #expect(isLowercaseUUID(nonce), "\(nonce)")
        let iat = try #require(jws.claims["iat"] as? Int)
        let exp = try #require(jws.claims["exp"] as? Int)
        #expect(Int64(iat) == token.issuedAt && Int64(exp) == token.expiresAt)
        #expect(iat <= now - 55 && iat >= now - 65, "iat backdated by clock_skew_seconds (60)")
        #expect(exp - iat == 300, "the default ttl_seconds")

        let longest = try post("/v1/tokens/app-store-server-api", ["bundle_id": "com.example.app", "ttl_seconds": 3600]).decode(ServerAPITokenResponse.self)
        let long = try decodeAndVerify(longest.token)
        #expect(long.claims["nonce"] as? String != nonce, "a fresh nonce for every token")
        #expect((long.claims["exp"] as? Int ?? 0) - (long.claims["iat"] as? Int ?? 0) == 3600, "Apple's cap, whatever the skew")

        // A TTL under twice the skew: iat backdated by half of it, so the token is still valid when it leaves.
        let start = Int64(nowSeconds())
        let short = try post("/v1/tokens/app-store-server-api", ["bundle_id": "com.example.app", "ttl_seconds": 10]).decode(ServerAPITokenResponse.self)
        #expect(short.expiresAt - short.issuedAt == 10)
        #expect(short.issuedAt <= start - 4 && short.issuedAt >= start - 6, "\(short.issuedAt) against \(start)")
        let one = try post("/v1/tokens/app-store-server-api", ["bundle_id": "com.example.app", "ttl_seconds": 1]).decode(ServerAPITokenResponse.self)
        #expect(one.expiresAt - one.issuedAt == 1 && one.expiresAt > start)
    }

    @Test("PyJWT (with cryptography) verifies all four kinds independently")
    func pyjwt() throws {
        let v2 = try post("/v1/sign/promotional-offer-v2", ["bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"]).decode(JWSResponse.self)
        let intro = try post("/v1/sign/introductory-offer-eligibility", ["bundle_id": "com.example.app", "product_id": "p", "allow_introductory_offer": false, "transaction_id": "7"]).decode(JWSResponse.self)
        let commerce = try post("/v1/sign/advanced-commerce-request", ["bundle_id": "com.example.app", "request": ["operation": "x"]]).decode(JWSResponse.self)
        let bearer = try post("/v1/tokens/app-store-server-api", ["bundle_id": "com.example.app", "ttl_seconds": 60]).decode(ServerAPITokenResponse.self)
        let cases: [[String: String]] = [
            ["token": v2.jws, "audience": "promotional-offer", "public_key_pem": publicKeyPEM],
            ["token": intro.jws, "audience": "introductory-offer-eligibility", "public_key_pem": publicKeyPEM],
            ["token": commerce.jws, "audience": "advanced-commerce-api", "public_key_pem": publicKeyPEM],
            ["token": bearer.token, "audience": "appstoreconnect-v1", "public_key_pem": publicKeyPEM],
        ]
        let script = Binaries.root + "/Tests/EndToEndTests/Scripts/verify_with_pyjwt.py"
        let output = try run(["python3", script], input: try JSONSerialization.data(withJSONObject: cases))
        let verified = try #require(try JSONSerialization.jsonObject(with: output) as? [[String: [String: Any]]])
        #expect(verified.count == 4)
        #expect(verified[1]["claims"]?["allowIntroductoryOffer"] as? Bool == false)
        #expect(verified[3]["claims"]?["exp"] != nil)
        #expect(verified.allSatisfy { $0["header"]?["kid"] as? String == "ABC123DEFG" })

        // A tampered token is refused by PyJWT too (the check can fail).
        var parts = v2.jws.split(separator: ".").map(String.init)
        parts[1] = Base64URL.encode(Array(#"{"aud":"promotional-offer","iss":"x","iat":1,"bid":"evil"}"#.utf8))
        #expect(throws: (any Error).self) {
            try run(["python3", script], input: try JSONSerialization.data(withJSONObject: [["token": parts.joined(separator: "."), "audience": "promotional-offer", "public_key_pem": publicKeyPEM]]))
        }
    }

    struct FieldCase: Sendable, CustomTestStringConvertible {
        let path: String
        let fields: [String: any Sendable]
        let code: String
        let field: String
        var testDescription: String { "\(path) \(field) \(code)" }
    }

    static let fieldCases: [FieldCase] = [
        FieldCase(path: "/v1/sign/introductory-offer-eligibility", fields: ["bundle_id": "com.example.app", "product_id": "p", "allow_introductory_offer": true], code: "missing_field", field: "transaction_id"),
        FieldCase(path: "/v1/sign/introductory-offer-eligibility", fields: ["bundle_id": "com.example.app", "product_id": "p", "allow_introductory_offer": "true", "transaction_id": "1"], code: "invalid_field", field: "allow_introductory_offer"),
        FieldCase(path: "/v1/sign/introductory-offer-eligibility", fields: ["bundle_id": "com.example.app", "product_id": "p", "transaction_id": "1"], code: "missing_field", field: "allow_introductory_offer"),
        FieldCase(path: "/v1/sign/introductory-offer-eligibility", fields: ["bundle_id": "com.example.app", "product_id": "p", "allow_introductory_offer": true, "transaction_id": "12a"], code: "invalid_field", field: "transaction_id"),
        FieldCase(path: "/v1/sign/promotional-offer-v2", fields: ["bundle_id": "com.example.app", "product_id": "p", "offer_id": "o", "transaction_id": 123], code: "invalid_field", field: "transaction_id"),
        FieldCase(path: "/v1/sign/promotional-offer-v2", fields: ["bundle_id": "com.example.app", "product_id": "p"], code: "missing_field", field: "offer_id"),
        FieldCase(path: "/v1/sign/promotional-offer-v2", fields: ["bundle_id": "com.example.app", "product_id": "p", "offer_id": "o", "offerIdentifier": "o"], code: "unknown_field", field: "offerIdentifier"),
        FieldCase(path: "/v1/tokens/app-store-server-api", fields: ["bundle_id": "com.example.app", "ttl_seconds": 0], code: "invalid_field", field: "ttl_seconds"),
        FieldCase(path: "/v1/tokens/app-store-server-api", fields: ["bundle_id": "com.example.app", "ttl_seconds": 3601], code: "invalid_field", field: "ttl_seconds"),
        FieldCase(path: "/v1/tokens/app-store-server-api", fields: ["bundle_id": "com.example.app", "ttl_seconds": "300"], code: "invalid_field", field: "ttl_seconds"),
        FieldCase(path: "/v1/sign/advanced-commerce-request", fields: ["bundle_id": "com.example.app", "request": "{\"operation\":\"x\"}"], code: "invalid_field", field: "request"),
        FieldCase(path: "/v1/sign/advanced-commerce-request", fields: ["bundle_id": "com.example.app", "request": [1, 2]], code: "invalid_field", field: "request"),
        FieldCase(path: "/v1/sign/advanced-commerce-request", fields: ["bundle_id": "com.example.app"], code: "missing_field", field: "request"),
        FieldCase(path: "/v1/sign/promotional-offer-v2", fields: ["bundle_id": "com.example.noissuer", "product_id": "p", "offer_id": "o"], code: "invalid_field", field: "key_id"),
    ]

    @Test("field errors are named", arguments: fieldCases)
    func fieldErrors(_ fieldCase: FieldCase) throws {
        let response = try post(fieldCase.path, fieldCase.fields)
        #expect(response.status == 400, "\(String(decoding: response.body, as: UTF8.self))")
        #expect(response.error?.code == fieldCase.code)
        #expect(response.error?.field == fieldCase.field)
        #expect(response.error?.message.contains(fieldCase.field) == true || fieldCase.field == "key_id")
        try expectServing(daemon)
    }

    @Test("signctl sign and signctl verify jws round-trip every kind; a DER signature in a JWS is named")
    func signctlRoundTrip() throws {
        try publicKeyPEM.write(toFile: daemon.directory + "/jws-pub.pem", atomically: false, encoding: .utf8)
        let commands: [[String]] = [
            ["sign", "promotional-offer-v2", "--bundle-id", "com.example.app", "--product-id", "p", "--offer-id", "o"],
            ["sign", "introductory-offer-eligibility", "--bundle-id", "com.example.app", "--product-id", "p", "--transaction-id", "9", "--allow-introductory-offer", "true"],
            ["sign", "advanced-commerce-request", "--bundle-id", "com.example.app", "--request", #"{"operation":"x"}"#],
            ["sign", "server-api-token", "--bundle-id", "com.example.app", "--ttl-seconds", "120"],
        ]
        for command in commands {
            let token = try daemon.signctl(command).trimmingCharacters(in: .whitespacesAndNewlines)
            let (status, output) = daemon.signctlStatus(["verify", "jws", token, "--public-key", daemon.directory + "/jws-pub.pem"])
            #expect(status == 0, "\(command[1]): \(output)")
            #expect(output.contains("\"alg\" : \"ES256\""))
        }
        // The same token with its signature swapped for DER: named, exit 65.
        let token = try daemon.signctl(commands[0]).trimmingCharacters(in: .whitespacesAndNewlines)
        var parts = token.split(separator: ".").map(String.init)
        let raw = try #require(Base64URL.decode(parts[2]))
        parts[2] = Base64URL.encode(try ECDSASignature.der(fromRaw: raw, curve: .p256))
        let (status, output) = daemon.signctlStatus(["verify", "jws", parts.joined(separator: "."), "--public-key", daemon.directory + "/jws-pub.pem"])
        #expect(status == 65)
        #expect(output.contains("DER"))
    }

    /// An attack round found `signctl verify jws` printing a claim's
    /// U+202E (right-to-left override) raw: the terminal showed the claim
    /// reordered.
    @Test("signctl verify jws shows bidirectional controls in claims as escapes, not raw")
    func signctlEscapesBidiControls() throws {
        try publicKeyPEM.write(toFile: daemon.directory + "/jws-pub.pem", atomically: false, encoding: .utf8)
        let token = try daemon.signctl(["sign", "promotional-offer-v2", "--bundle-id", "com.example.app", "--product-id", "pro\u{202E}yhtnom", "--offer-id", "o\u{2066}x"])
            .trimmingCharacters(in: .whitespacesAndNewlines)
        let (status, output) = daemon.signctlStatus(["verify", "jws", token, "--public-key", daemon.directory + "/jws-pub.pem"])
        #expect(status == 0, "\(output)")
        #expect(output.contains(#""productId" : "pro\u202Eyhtnom""#) && output.contains(#""offerIdentifier" : "o\u2066x""#), "\(output)")
        #expect(!output.unicodeScalars.contains { $0.value == 0x202E || $0.value == 0x2066 }, "no raw control: \(output)")
    }

    @Test("signctl verify jws refuses a signature whose last character has its unused bits set (A → B): malformed, naming the signature")
    func signctlNonCanonicalSignature() throws {
        try publicKeyPEM.write(toFile: daemon.directory + "/jws-pub.pem", atomically: false, encoding: .utf8)
        let verify = ["--public-key", daemon.directory + "/jws-pub.pem"]
        // 86 characters: the last carries 2 bits of s and 4 unused bits, so it is one of A, Q, g, w.
        let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        let token = try daemon.signctl(["sign", "promotional-offer-v2", "--bundle-id", "com.example.app", "--product-id", "p", "--offer-id", "o"])
            .trimmingCharacters(in: .whitespacesAndNewlines)
        #expect(daemon.signctlStatus(["verify", "jws", token] + verify).0 == 0)
        let last = try #require(alphabet.firstIndex(of: token.last!))
        #expect(last & 0x0f == 0)
        let changed = String(token.dropLast()) + String(alphabet[last | 1])
        let (status, output) = daemon.signctlStatus(["verify", "jws", changed] + verify)
        #expect(status == 65, "\(output)")
        #expect(output.contains("malformed JWS: the signature (part 3) is not canonical base64url"), "\(output)")
        #expect(!output.contains("valid: "))
    }

    /// signctl decoded --request and encoded it again, so a repeated name
    /// was merged and 1e-400 sent as 0 before signerd could refuse them.
    @Test("signctl sign advanced-commerce-request sends --request as written: signerd's checks apply, and what it signs is what was given")
    func signctlPassesRequestThrough() throws {
        for (request, expected) in [(#"{"a":1,"a":2}"#, "more than once"), (#"{"a\u005f":1,"a_":2}"#, "more than once"), (#"{"n":1e-400}"#, "fraction or exponent")] {
            let (status, output) = daemon.signctlStatus(["sign", "advanced-commerce-request", "--bundle-id", "com.example.app", "--request", request])
            #expect(status != 0, "\(request) was signed: \(output)")
            #expect(output.contains(expected), "\(request): \(output)")
        }
        let token = try daemon.signctl(["sign", "advanced-commerce-request", "--bundle-id", "com.example.app", "--request", #"{"price":4990,"sku":"ä"}"#])
            .trimmingCharacters(in: .whitespacesAndNewlines)
        let claims = try decodeAndVerify(token).claims
        let request = try #require(claims["request"] as? String)
        #expect(String(decoding: try #require(Data(base64Encoded: request)), as: UTF8.self) == #"{"price":4990,"sku":"ä"}"#)
    }
}

