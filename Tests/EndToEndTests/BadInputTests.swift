import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// Checks the daemon still serves: /healthz answers and a fresh signature verifies.
func expectServing(_ daemon: DaemonHarness, sourceLocation: SourceLocation = #_sourceLocation) throws {
    let client = daemon.client()
    defer { client.close() }
    #expect(try client.send("GET", "/healthz").status == 200, sourceLocation: sourceLocation)
    let response = try client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.app", "key_id": "ABC123DEFG", "product_id": "p", "offer_id": "o"]))
    #expect(response.status == 200, sourceLocation: sourceLocation)
    let offer = try response.decode(PromotionalOfferResponse.self)
    let key = try ECPublicKey(pem: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM)
    let der = try #require(Data(base64Encoded: offer.signature))
    let payload = independentPayload(bundleID: "com.example.app", keyID: "ABC123DEFG", productID: "p", offerID: "o", token: "", nonce: offer.nonce, timestamp: offer.timestamp)
    #expect(key.verify(derSignature: Array(der), digest: SHA256.hash(payload)), sourceLocation: sourceLocation)
}

/// Bad input of every kind: a named error each time, and the daemon keeps serving.
@Suite("signerd under bad input", .serialized)
struct BadInputTests {
    /// One daemon for the whole suite (each test starts by checking it serves).
    static let shared: Result<DaemonHarness, any Error> = Result {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "XYZ987WVUT"])
        try daemon.writeConfig(["request_timeout_seconds": 3])
        try daemon.start()
        return daemon
    }

    let daemon: DaemonHarness

    init() throws {
        daemon = try Self.shared.get()
    }

    struct FieldCase: Sendable, CustomTestStringConvertible {
        let name: String
        let path: String
        let fields: [String: any Sendable]
        let status: Int
        let code: String
        let field: String?
        var mention: String? = nil
        var testDescription: String { name }
    }

    static let now = Int64(Date().timeIntervalSince1970 * 1000)
    static let base: [String: any Sendable] = ["bundle_id": "com.example.app", "product_id": "pro_monthly", "offer_id": "winback"]

    static func with(_ changes: [String: any Sendable], removing: [String] = []) -> [String: any Sendable] {
        var fields = base
        for (key, value) in changes { fields[key] = value }
        for key in removing { fields[key] = nil }
        return fields
    }

    static let offer = "/v1/sign/promotional-offer"
    static let fieldCases: [FieldCase] = [
        FieldCase(name: "missing bundle_id", path: offer, fields: with([:], removing: ["bundle_id"]), status: 400, code: "missing_field", field: "bundle_id"),
        FieldCase(name: "null bundle_id", path: offer, fields: with(["bundle_id": NSNull()]), status: 400, code: "missing_field", field: "bundle_id"),
        FieldCase(name: "missing product_id", path: offer, fields: with([:], removing: ["product_id"]), status: 400, code: "missing_field", field: "product_id"),
        FieldCase(name: "missing offer_id", path: offer, fields: with([:], removing: ["offer_id"]), status: 400, code: "missing_field", field: "offer_id"),
        FieldCase(name: "typo productId", path: offer, fields: with(["productId": "x"], removing: ["product_id"]), status: 400, code: "unknown_field", field: "productId"),
        FieldCase(name: "empty bundle_id", path: offer, fields: with(["bundle_id": ""]), status: 400, code: "invalid_field", field: "bundle_id"),
        FieldCase(name: "256-byte bundle_id", path: offer, fields: with(["bundle_id": String(repeating: "a", count: 256)]), status: 400, code: "invalid_field", field: "bundle_id"),
        FieldCase(name: "number bundle_id", path: offer, fields: with(["bundle_id": 12]), status: 400, code: "invalid_field", field: "bundle_id"),
        FieldCase(name: "control character in product_id", path: offer, fields: with(["product_id": "pro\u{7}"]), status: 400, code: "invalid_field", field: "product_id"),
        FieldCase(name: "U+2063 in offer_id", path: offer, fields: with(["offer_id": "win\u{2063}back"]), status: 400, code: "invalid_field", field: "offer_id", mention: "U+2063"),
        FieldCase(name: "U+2063 in product_id", path: offer, fields: with(["product_id": "\u{2063}"]), status: 400, code: "invalid_field", field: "product_id"),
        FieldCase(name: "lowercase key_id", path: offer, fields: with(["key_id": "abc123defg"]), status: 400, code: "invalid_field", field: "key_id"),
        FieldCase(name: "unknown key_id", path: offer, fields: with(["key_id": "ZZZZZZZZZZ"]), status: 404, code: "key_not_found", field: "key_id"),
        FieldCase(name: "bundle not allowed for key", path: offer, fields: with(["key_id": "XYZ987WVUT", "bundle_id": "com.example.other"]), status: 403, code: "bundle_not_allowed", field: "bundle_id"),
        FieldCase(name: "bundle without any key", path: offer, fields: with(["bundle_id": "com.nobody.app"]), status: 403, code: "bundle_not_allowed", field: "bundle_id", mention: "\"com.nobody.app\""),
        FieldCase(name: "token not a UUID", path: offer, fields: with(["app_account_token": "user_1"]), status: 400, code: "invalid_field", field: "app_account_token", mention: "or empty"),
        FieldCase(name: "token without dashes", path: offer, fields: with(["app_account_token": "5e3f1c2a9b4d4e6f8a7b1c2d3e4f5a6b"]), status: 400, code: "invalid_field", field: "app_account_token"),
        FieldCase(name: "nonce 'undefined'", path: offer, fields: with(["nonce": "undefined"]), status: 400, code: "invalid_field", field: "nonce"),
        FieldCase(name: "timestamp in seconds", path: offer, fields: with(["timestamp": now / 1000]), status: 400, code: "invalid_field", field: "timestamp", mention: "milliseconds"),
        FieldCase(name: "timestamp 25 h old", path: offer, fields: with(["timestamp": now - 25 * 3_600_000]), status: 400, code: "invalid_field", field: "timestamp", mention: "24 hours"),
        FieldCase(name: "timestamp 10 min ahead", path: offer, fields: with(["timestamp": now + 600_000]), status: 400, code: "invalid_field", field: "timestamp", mention: "5 minutes"),
        FieldCase(name: "timestamp in microseconds", path: offer, fields: with(["timestamp": now * 1000]), status: 400, code: "invalid_field", field: "timestamp", mention: "looks like UNIX time in microseconds — divide by 1000"),
        FieldCase(name: "timestamp as string", path: offer, fields: with(["timestamp": String(now)]), status: 400, code: "invalid_field", field: "timestamp", mention: "must be an integer JSON number (UNIX time in milliseconds); got a string"),
        FieldCase(name: "timestamp with a fraction", path: offer, fields: with(["timestamp": 1.5]), status: 400, code: "invalid_field", field: "timestamp"),
        FieldCase(name: "batch: no offers", path: "/v1/offers", fields: ["bundle_id": "com.example.app", "app_user_id": "u", "generate_offers": [[String: String]]()], status: 400, code: "invalid_field", field: "generate_offers"),
        FieldCase(name: "batch: 51 offers", path: "/v1/offers", fields: ["bundle_id": "com.example.app", "app_user_id": "u", "generate_offers": Array(repeating: ["offer_id": "a", "product_id": "p"], count: 51)], status: 400, code: "invalid_field", field: "generate_offers"),
        // The contract refuses unknown fields in a request "so that a typo such as productId is never silently signed".
        FieldCase(name: "batch: typo productId in an offer", path: "/v1/offers",
                  fields: ["bundle_id": "com.example.app", "generate_offers": [["offer_id": "a", "product_id": "p"], ["offer_id": "a", "productId": "p"]]],
                  status: 400, code: "unknown_field", field: "generate_offers[1].productId"),
        // "Unknown fields are reported before missing or invalid ones" (API.md), an entry's included.
        FieldCase(name: "batch: an entry's unknown member before a missing bundle_id", path: "/v1/offers",
                  fields: ["generate_offers": [["offer_id": "a", "productId": "p"]]],
                  status: 400, code: "unknown_field", field: "generate_offers[0].productId"),
        FieldCase(name: "batch: an entry's unknown member before an earlier entry that is not an object", path: "/v1/offers",
                  fields: ["bundle_id": "com.example.app", "generate_offers": ["x", ["offer_id": "a", "productId": "p"]] as [any Sendable]],
                  status: 400, code: "unknown_field", field: "generate_offers[1].productId"),
        FieldCase(name: "batch: an entry's unknown member before too many offers", path: "/v1/offers",
                  fields: ["bundle_id": "com.example.app", "generate_offers": Array(repeating: ["offer_id": "a", "product_id": "p"], count: 50) + [["offer_id": "a", "productId": "p"]]],
                  status: 400, code: "unknown_field", field: "generate_offers[50].productId"),
        FieldCase(name: "batch: offers not an array", path: "/v1/offers", fields: ["bundle_id": "com.example.app", "generate_offers": "a"], status: 400, code: "invalid_field", field: "generate_offers"),
    ]

    /// The contract: in a batch, "each offer succeeds or fails on its own".
    @Test("batch: an offer that breaks a field rule gets its own signature_error 7226; the others are signed")
    func batchOfferProblems() throws {
        let response = try daemon.client().send("POST", "/v1/offers", body: body([
            "bundle_id": "com.example.other",
            "generate_offers": [
                ["offer_id": "good", "product_id": "p1"],
                ["offer_id": "a\u{2063}", "product_id": "p2"],
                ["offer_id": "no_product"],
                ["offer_id": "c", "product_id": "p\u{7}"],
                ["offer_id": "d", "product_id": 5],
                ["offer_id": "grouped", "product_id": "p6", "subscription_group": 5],
            ] as [[String: any Sendable]],
        ]))
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        let offers = try response.decode(OffersResponse.self).offers
        try #require(offers.count == 6)
        // Refused entries: code 7226, the message names the field, the sent identifiers are echoed.
        let refused: [(index: Int, field: String, offerID: String, productID: String)] = [
            (1, "generate_offers[1].offer_id", "a\u{2063}", "p2"), (2, "generate_offers[2].product_id", "no_product", ""),
            (3, "generate_offers[3].product_id", "c", "p\u{7}"), (4, "generate_offers[4].product_id", "d", ""),
        ]
        for entry in refused {
            let offer = offers[entry.index]
            #expect(offer.signatureError?.code == OffersResponse.invalidOfferCode, "\(offer)")
            #expect(offer.signatureError?.message.contains(entry.field) == true, "\(offer.signatureError?.message ?? "")")
            #expect(offer.signatureData == nil && offer.keyID == nil)
            #expect(offer.offerID == entry.offerID && offer.productID == entry.productID)
        }
        // Signed entries verify; subscription_group of any type is ignored.
        for index in [0, 5] {
            let offer = offers[index]
            let data = try #require(offer.signatureData, "\(offer)")
            #expect(offer.signatureError == nil)
            let publicKey = try #require(daemon.keys[offer.keyID ?? ""]).publicKeyPEM
            #expect(try opensslVerifies(publicKeyPEM: publicKey, derSignature: Array(try #require(Data(base64Encoded: data.signature))),
                                        message: independentPayload(bundleID: "com.example.other", keyID: try #require(offer.keyID), productID: offer.productID,
                                                                    offerID: offer.offerID, token: "", nonce: data.nonce, timestamp: data.timestamp)))
        }
        try expectServing(daemon)
    }

    /// The RevenueCat SDK sends the receipt as `fetch_token`; a backend
    /// passing the SDK's body on got 400 unknown_field.
    @Test("batch: the RevenueCat SDK's own body, fetch_token included (string or null), is signed")
    func batchSDKBody() throws {
        for fetchToken in [#""MIIT\#(String(repeating: "A", count: 4000))==""#, "null"] {
            let text = #"{"app_user_id":"$RCAnonymousID:1234","fetch_token":\#(fetchToken),"generate_offers":[{"offer_id":"o","product_id":"p","subscription_group":"21456789"}],"bundle_id":"com.example.other"}"#
            let response = try daemon.client().send("POST", "/v1/offers", body: Array(text.utf8))
            #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
            let offer = try #require(try response.decode(OffersResponse.self).offers.first)
            let data = try #require(offer.signatureData, "\(offer)")
            let keyID = try #require(offer.keyID)
            let publicKey = try #require(daemon.keys[keyID]).publicKeyPEM
            #expect(try opensslVerifies(publicKeyPEM: publicKey, derSignature: Array(try #require(Data(base64Encoded: data.signature))),
                                        message: independentPayload(bundleID: "com.example.other", keyID: keyID, productID: "p",
                                                                    offerID: "o", token: "", nonce: data.nonce, timestamp: data.timestamp)))
        }
    }

    @Test("batch: an integer beyond Int64 fails only the entry or field that holds it; one beyond a double fails the request, naming where it sits")
    func batchBigIntegers() throws {
        let big = "99999999999999999999"
        let text = #"{"bundle_id":"com.example.other","generate_offers":[{"offer_id":"good","product_id":"p"},"#
            + #"{"offer_id":"grouped","product_id":"p","subscription_group":{"x":[\#(big)]}},"#
            + #"{"offer_id":\#(big),"product_id":"p"},{"offer_id":"o","product_id":\#(big)}]}"#
        let response = try daemon.client().send("POST", "/v1/offers", body: Array(text.utf8))
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        let offers = try response.decode(OffersResponse.self).offers
        try #require(offers.count == 4)
        #expect(offers[0].signatureData != nil && offers[1].signatureData != nil, "subscription_group is ignored, whatever it holds")
        #expect(offers[2].signatureError?.code == OffersResponse.invalidOfferCode && offers[2].signatureError?.message.contains("generate_offers[2].offer_id") == true)
        #expect(offers[3].signatureError?.code == OffersResponse.invalidOfferCode && offers[3].signatureError?.message.contains("generate_offers[3].product_id") == true)
        // 166 to 309 digits (a Double to Foundation) in an ignored member: still ignored.
        let long = String(repeating: "1", count: 200)
        let ignored = try daemon.client().send("POST", "/v1/offers", body: Array(#"{"bundle_id":"com.example.other","fetch_token":\#(long),"generate_offers":[{"offer_id":"o","product_id":"p","subscription_group":\#(long)}]}"#.utf8))
        #expect(ignored.status == 200 && (try? ignored.decode(OffersResponse.self))?.offers.first?.signatureData != nil,
                "\(String(decoding: ignored.body.prefix(600), as: UTF8.self))")
        // A number the parser itself cannot hold (over 308 digits) fails the whole body, naming
        // where it sits; the error does not quote all of it.
        let huge = String(repeating: "9", count: 60_000)
        let refused = try daemon.client().send("POST", "/v1/offers", body: Array(#"{"bundle_id":"com.example.other","generate_offers":[{"offer_id":"o","product_id":"p","subscription_group":\#(huge)}]}"#.utf8))
        #expect(refused.status == 400 && refused.error?.code == "invalid_field" && refused.error?.field == "generate_offers[0].subscription_group",
                "\(String(decoding: refused.body.prefix(600), as: UTF8.self))")
        #expect(refused.body.count < 1_000, "\(refused.body.count) bytes of error body")
        // So is one written with an exponent, which the contract's timestamp rule would otherwise meet.
        let exponent = try daemon.client().send("POST", Self.offer, body: Array(#"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o","timestamp":1e309}"#.utf8))
        #expect(exponent.status == 400 && exponent.error?.code == "invalid_field" && exponent.error?.field == "timestamp", "\(String(decoding: exponent.body, as: UTF8.self))")
        try expectServing(daemon)
        // Where a number is signed, the same integer is still refused with its path.
        let commerce = try daemon.client().send("POST", "/v1/sign/advanced-commerce-request",
                                                body: Array(#"{"bundle_id":"com.example.other","request":{"price":\#(big)}}"#.utf8))
        #expect(commerce.status == 400 && commerce.error?.code == "invalid_field" && commerce.error?.field == "request.price", "\(String(decoding: commerce.body, as: UTF8.self))")
    }

    @Test("each field rule gives its status, code and field, and the daemon keeps serving", arguments: fieldCases)
    func fieldRule(_ fieldCase: FieldCase) throws {
        let response = try daemon.client().send("POST", fieldCase.path, body: body(fieldCase.fields))
        #expect(response.status == fieldCase.status, "\(String(decoding: response.body, as: UTF8.self))")
        let error = try #require(response.error)
        #expect(error.code == fieldCase.code)
        #expect(error.field == fieldCase.field)
        if let field = fieldCase.field {
            #expect(error.message.contains(field.split(separator: ".").last.map(String.init) ?? field), "\(error.message)")
        }
        if let mention = fieldCase.mention {
            #expect(error.message.contains(mention), "\(error.message)")
        }
        try expectServing(daemon)
    }

    @Test("broken JSON, non-objects, wrong content types, methods and paths")
    func protocolErrors() throws {
        let client = daemon.client()
        // A trailing comma is refused too, though Foundation's parser accepts it.
        for text in ["{", "{\"bundle_id\": }", "[]", "\"x\"", "", "nul", "{\"bundle_id\": \"a\" \"product_id\": \"b\"}", "\u{FF}\u{FE}",
                     #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"a",}"#,
                     #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"a" ,   }"#,
                     #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"a","timestamp":1,}"#] {
            let response = try client.send("POST", Self.offer, body: Array(text.utf8))
            #expect(response.status == 400, "\(text)")
            #expect(response.error?.code == "invalid_json", "\(text)")
            // The parser's own reason reads as a clause: no ".;" where it meets signerd's advice.
            #expect(response.error?.message.contains(".;") == false, "\(response.error?.message ?? "")")
        }
        let comma = try client.send("POST", Self.offer, body: Array(#"{"bundle_id":"com.example.app","product_id":"p","offer_id":"a",}"#.utf8))
        #expect(comma.error?.message.contains("trailing comma") == true, "\(comma.error?.message ?? "")")
        // In a nested array (the batch endpoint) as well; a comma inside a string is only text.
        let nested = try client.send("POST", "/v1/offers", body: Array(#"{"bundle_id":"com.example.app","app_user_id":"u","generate_offers":[{"offer_id":"a","product_id":"p"},]}"#.utf8))
        #expect(nested.status == 400 && nested.error?.code == "invalid_json", "\(nested.status) \(nested.error?.message ?? "")")
        let inString = try client.send("POST", Self.offer, body: Array(#"{"bundle_id":"com.example.app","product_id":"p,]","offer_id":"a,}"}"#.utf8))
        #expect(daemon.verifies(inString, productID: "p,]", offerID: "a,}"), "\(inString.error?.message ?? "")")
        // A lone surrogate escape is named, not Foundation's "Unexpected end of file".
        let lone = try client.send("POST", Self.offer, body: Array(#"{"bundle_id":"com.example.app","product_id":"p\ud800","offer_id":"a"}"#.utf8))
        #expect(lone.status == 400 && lone.error?.code == "invalid_json", "\(lone.status)")
        #expect(lone.error?.message.contains(#"the escape \ud800 at byte 46 is half of a UTF-16 surrogate pair"#) == true, "\(lone.error?.message ?? "")")
        // A member named twice would otherwise be signed with its last value.
        let repeated = try client.send("POST", Self.offer, body: Array(#"{"bundle_id":"com.example.app","product_id":"p","offer_id":"a","offer_id":"b"}"#.utf8))
        #expect(repeated.status == 400)
        #expect(repeated.error?.code == "invalid_json")
        #expect(repeated.error?.field == "offer_id")
        let text = try client.send("POST", Self.offer, body: body(Self.base), contentType: "text/plain")
        #expect(text.status == 415)
        #expect(text.error?.code == "unsupported_media_type")
        let form = try client.send("POST", Self.offer, body: Array("bundle_id=a".utf8), contentType: "application/x-www-form-urlencoded")
        #expect(form.status == 415 && form.error?.code == "unsupported_media_type")
        let charset = try client.send("POST", Self.offer, body: body(Self.base), contentType: "application/json; charset=utf-8")
        #expect(daemon.verifies(charset, productID: "pro_monthly", offerID: "winback"))
        // Media types compare case-insensitively, letters only: 0x0F is not "/".
        let upper = try client.send("POST", Self.offer, body: body(Self.base), contentType: "Application/JSON")
        #expect(daemon.verifies(upper, productID: "pro_monthly", offerID: "winback"))
        let control = try client.send("POST", Self.offer, body: body(Self.base), contentType: "application\u{0F}json")
        #expect(control.status == 415 && control.error?.code == "unsupported_media_type", "\(control.status)")
        let get = try client.send("GET", Self.offer)
        #expect(get.status == 405)
        #expect(get.headers["allow"] == "POST")
        #expect(get.error?.code == "method_not_allowed")
        let postHealth = try client.send("POST", "/healthz", body: Array("{}".utf8))
        #expect(postHealth.status == 405 && postHealth.error?.code == "method_not_allowed")
        #expect(postHealth.headers["allow"] == "GET")
        let missing = try client.send("GET", "/v1/nothing")
        #expect(missing.status == 404)
        #expect(missing.error?.code == "not_found")
        try expectServing(daemon)
    }

    @Test("a 1 MiB body is refused with 413, with Content-Length and chunked")
    func hugeBody() throws {
        var big = Array("{\"bundle_id\": \"".utf8)
        big += [UInt8](repeating: UInt8(ascii: "a"), count: 1024 * 1024)
        big += Array("\"}".utf8)
        let response = try daemon.client().send("POST", Self.offer, body: big)
        #expect(response.status == 413)
        #expect(response.error?.code == "payload_too_large")

        // Chunked: no Content-Length, so the limit applies as the body arrives.
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 10)
        defer { connection.close() }
        var request = Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".utf8)
        for _ in 0..<16 {
            request += Array("10000\r\n".utf8) + [UInt8](repeating: UInt8(ascii: "a"), count: 0x10000) + Array("\r\n".utf8)
        }
        request += Array("0\r\n\r\n".utf8)
        try? connection.write(request)
        var received: [UInt8] = []
        while (try? connection.read(appendingTo: &received)) ?? 0 > 0 {
            if String(decoding: received, as: UTF8.self).contains("payload_too_large") { break }
        }
        #expect(String(decoding: received, as: UTF8.self).hasPrefix("HTTP/1.1 413"))

        // A length past Int64 (libmicrohttpd takes up to 2^64 - 1) is just as
        // far over the limit: 413 at once, within the 5 s read timeout here
        // (not after the 10 s request timeout, waiting for the body).
        for length in ["9223372036854775808", "18446744073709551615"] {
            let huge = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
            defer { huge.close() }
            try huge.write(Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: \(length)\r\n\r\n".utf8))
            var answer: [UInt8] = []
            while (try? huge.read(appendingTo: &answer)) ?? 0 > 0 {
                if String(decoding: answer, as: UTF8.self).contains("payload_too_large") { break }
            }
            #expect(String(decoding: answer, as: UTF8.self).hasPrefix("HTTP/1.1 413"), "Content-Length \(length): \(String(decoding: answer, as: UTF8.self))")
        }
        try expectServing(daemon)
    }

    /// RFC 9112 §6.3: libmicrohttpd took the first of two Content-Length
    /// values and answered the rest of the body as a second, pipelined request.
    @Test("ambiguous or missing framing (two Content-Length values, Content-Length with Transfer-Encoding, a folded Content-Length, a coding other than chunked) gets 400 bad_request and a closed connection; a 404, 405 or 415 for such a request closes it too")
    func ambiguousFraming() throws {
        let sign = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        let smuggled = "GET /v1/keys HTTP/1.1\r\nHost: x\r\n\r\n"
        // A whole signing request hidden in the body must never be answered on its own.
        let hidden = "POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: \(sign.utf8.count)\r\n\r\n\(sign)"
        let heads = [
            "Content-Length: \(sign.utf8.count)\r\nContent-Length: \(sign.utf8.count + smuggled.utf8.count)\r\n",
            "Content-Length: \(sign.utf8.count)\r\nTransfer-Encoding: chunked\r\n",
            // obs-fold: libmicrohttpd drops the folded line, leaving a POST with no length at all.
            "Content-Length:\r\n \(hidden.utf8.count)\r\n",
            "Transfer-Encoding: gzip\r\n",
            // chunked as RFC 9112 may take it, but not libmicrohttpd, which then waited for the body until the client closed.
            "Transfer-Encoding: chunked,\r\n", "Transfer-Encoding: ,chunked\r\n", "Transfer-Encoding: chunked \r\n",
            "Transfer-Encoding:   CHUNKED  \r\n", "Transfer-Encoding: \r\nTransfer-Encoding: chunked\r\n",
            "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        ]
        // The signing request gets 400. One answered from its head (404,
        // 405, 415) with the same framing closes the connection too: it was
        // kept open, and the body's smuggled request answered (or, for a
        // coding other than chunked, the connection hung until the
        // slow-request drop).
        let requests = [("POST \(Self.offer)", "application/json", "400"), ("POST /nope", "application/json", "404"),
                        ("POST /healthz", "application/json", "405"), ("POST \(Self.offer)", "text/plain", "415")]
        for (start, contentType, status) in requests {
            for head in heads {
                let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
                defer { connection.close() }
                let rest = head.hasPrefix("Content-Length:\r\n") ? hidden : sign + smuggled
                try connection.write(Array("\(start) HTTP/1.1\r\nHost: x\r\nContent-Type: \(contentType)\r\n\(head)\r\n\(rest)".utf8))
                var received: [UInt8] = []
                var closed = false  // end of stream, not the 5 s read timeout
                while let count = try? connection.read(appendingTo: &received) {
                    if count == 0 { closed = true; break }
                }
                let text = String(decoding: received, as: UTF8.self)
                #expect(closed, "\(start) \(head): the connection was left open: \(text)")
                #expect(text.hasPrefix("HTTP/1.1 \(status)"), "\(start) \(head): \(text)")
                if status == "400" {
                    #expect(text.contains("\"bad_request\"") && text.contains("RFC 9112"), "\(text)")
                }
                #expect(text.components(separatedBy: "HTTP/1.1 ").count == 2, "\(start) \(head): one response, no second request read from the body: \(text)")
            }
        }
        // The same value twice is not ambiguous.
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
        defer { connection.close() }
        try connection.write(Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: \(sign.utf8.count)\r\nContent-Length: \(sign.utf8.count)\r\n\r\n\(sign)".utf8))
        #expect(daemon.verifies(rawResponse: connection.readUntilClosed()))
        try expectServing(daemon)
    }

    /// A gzipped body was read as JSON text and refused as "not UTF-8 (it
    /// holds a NUL byte…)", about bytes the client never wrote.
    @Test("a body with a content coding gets 415 naming it, with Accept-Encoding: identity, and the connection keeps serving; identity is read and signed")
    func contentEncoding() throws {
        let sign = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        // The POST with `codings`, then `next` on the same connection; read until the daemon closes.
        func exchange(_ codings: [String], then next: String = "", closing: Bool = false) throws -> String {
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
            defer { connection.close() }
            let headers = codings.map { "Content-Encoding: \($0)\r\n" }.joined() + (closing ? "Connection: close\r\n" : "")
            try connection.write(Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\(headers)Content-Length: \(sign.utf8.count)\r\n\r\n\(sign)\(next)".utf8))
            return connection.readUntilClosed()
        }
        for (codings, refused) in [(["gzip"], "gzip"), (["identity", "br"], "br"), (["identity, deflate"], "deflate")] {
            // The body is read and thrown away: a request pipelined after it is answered on the same connection.
            let text = try exchange(codings, then: "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            #expect(text.hasPrefix("HTTP/1.1 415"), "\(codings): \(text.prefix(300))")
            #expect(text.contains("\"unsupported_media_type\"") && text.contains("Content-Encoding \(refused),"), "\(text.prefix(500))")
            #expect(text.lowercased().contains("\r\naccept-encoding: identity\r\n"), "\(text.prefix(400))")
            #expect(text.contains("\"status\":\"ok\""), "\(codings): the pipelined /healthz: \(text.suffix(300))")
        }
        for codings in [["identity"], ["Identity"], []] {
            let text = try exchange(codings, closing: true)
            #expect(daemon.verifies(rawResponse: text), "\(codings): \(text.prefix(400))")
        }
    }

    /// The contract's "headers 8 KiB" (max_header_bytes), answered in JSON
    /// like every other error.
    @Test("a request head over 8 KiB gets 431 headers_too_large in JSON and a closed connection; one just under is served")
    func headerLimit() throws {
        let sign = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        func exchange(headerValueBytes: Int) throws -> String {
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
            defer { connection.close() }
            let filler = String(repeating: "a", count: headerValueBytes)
            try connection.write(Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Filler: \(filler)\r\nConnection: close\r\nContent-Length: \(sign.utf8.count)\r\n\r\n\(sign)".utf8))
            return connection.readUntilClosed()
        }
        // The head is about 150 bytes plus the filler.
        for size in [8 * 1024, 12_000] {
            let text = try exchange(headerValueBytes: size)
            #expect(text.hasPrefix("HTTP/1.1 431"), "\(size): \(text.prefix(200))")
            #expect(text.lowercased().contains("content-type: application/json"), "\(text.prefix(300))")
            #expect(text.contains("\"headers_too_large\"") && text.contains("max_header_bytes"), "\(text.prefix(400))")
            // Written on the socket, not by libmicrohttpd: RFC 9110 §6.6.1 still wants a Date.
            #expect(text.range(of: #"\r\nDate: (Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d\d (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) \d{4} \d\d:\d\d:\d\d GMT\r\n"#,
                                options: .regularExpression) != nil, "\(text.prefix(300))")
        }
        #expect(daemon.verifies(rawResponse: try exchange(headerValueBytes: 7 * 1024)))
        // Heads near libmicrohttpd's 16 KiB pool: the pool held them but had no room left for a
        // queued response head, and libmicrohttpd closed without any answer. Every one gets a 431
        // now (JSON while signerd's handler runs; libmicrohttpd's own HTML page beyond the pool).
        var unanswered: [Int] = []
        for size in stride(from: 15_900, through: 16_400, by: 20) {
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
            defer { connection.close() }
            try? connection.write(Array("GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: \(String(repeating: "a", count: size))\r\n\r\n".utf8))
            if !connection.readUntilClosed().hasPrefix("HTTP/1.1 431") { unanswered.append(size) }
        }
        #expect(unanswered.isEmpty, "header sizes without a 431: \(unanswered)")
        // Many small headers: libmicrohttpd's per-header bookkeeping filled its pool, so a
        // request under 8 KiB was signed and then got no answer. Over 100 fields get a 431 first.
        func signWithHeaders(_ count: Int, valueBytes: Int) throws -> String {
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
            defer { connection.close() }
            let headers = (0..<count).map { "X-\($0): " + String(repeating: "v", count: valueBytes) + "\r\n" }.joined()
            try connection.write(Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\(headers)Connection: close\r\nContent-Length: \(sign.utf8.count)\r\n\r\n\(sign)".utf8))
            return connection.readUntilClosed()
        }
        // Sizes from the attack run that got no answer: now a 431, from signerd or (when the
        // pool is full before signerd sees the head) from libmicrohttpd; never a lost signature.
        for (count, valueBytes) in [(200, 8), (196, 5), (160, 28)] {
            let text = try signWithHeaders(count, valueBytes: valueBytes)
            #expect(text.hasPrefix("HTTP/1.1 431"), "\(count) headers: \(text.prefix(200))")
        }
        let overCount = try signWithHeaders(99, valueBytes: 3)  // + Host, Content-Type, Connection, Content-Length
        #expect(overCount.hasPrefix("HTTP/1.1 431") && overCount.contains("header fields; the limit is 100"), "\(overCount.prefix(300))")
        #expect(daemon.verifies(rawResponse: try signWithHeaders(90, valueBytes: 60)), "90 headers of 60 bytes (about 6.4 KB) are served")
        // A query string counts too: it is part of the request line.
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
        defer { connection.close() }
        try connection.write(Array("GET /healthz?q=\(String(repeating: "a", count: 9000)) HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".utf8))
        let answer = connection.readUntilClosed()
        #expect(answer.hasPrefix("HTTP/1.1 431"), "\(answer.prefix(200))")
        try expectServing(daemon)
    }

    /// Cookies, query arguments and trailer fields each take a record in
    /// libmicrohttpd's connection pool, as header lines do, but were not
    /// counted: at 215 cookies (a 1.2 KB head) or 221 trailer fields a
    /// request was signed and then got no answer (a black-box fuzzing round).
    @Test("cookies, query arguments and trailer fields count toward the 100 fields: a 431 before signing, never a signature without an answer")
    func poolRecordsCounted() throws {
        let sign = #"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#
        // promotional-offer-v2: one C_Sign per 200, never a second (raw r‖s has no short form).
        func signCalls() throws -> Int {
            let text = String(decoding: try daemon.client().send("GET", "/metrics").body, as: UTF8.self)
            let line = text.split(separator: "\n").first { $0.hasPrefix("signerd_sign_hsm_seconds_count ") }
            return Int(line?.split(separator: " ").last ?? "") ?? -1
        }
        func exchange(_ request: String) throws -> String {
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
            defer { connection.close() }
            try? connection.write(Array(request.utf8))
            return connection.readUntilClosed()
        }
        let head = "POST /v1/sign/promotional-offer-v2 HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        let before = try signCalls()
        var answered200 = 0
        var ours431: [String: Int] = [:]
        for count in 90...240 {
            let cookies = head + "Content-Length: \(sign.utf8.count)\r\nCookie: " + Array(repeating: "a=b", count: count).joined(separator: "; ") + "\r\n\r\n" + sign
            let chunked = head + "Transfer-Encoding: chunked\r\n\r\n" + String(sign.utf8.count, radix: 16) + "\r\n" + sign + "\r\n0\r\n"
                + String(repeating: "X-T: v\r\n", count: count) + "\r\n"
            for (kind, request) in [("cookies", cookies), ("trailers", chunked)] {
                let text = try exchange(request)
                if text.hasPrefix("HTTP/1.1 200") { answered200 += 1 }
                if text.hasPrefix("HTTP/1.1 431") && text.contains("\"headers_too_large\"") { ours431[kind, default: 0] += 1 }
            }
        }
        #expect(try signCalls() - before == answered200, "a request was signed and got no answer")
        #expect(answered200 > 0, "small ones are served")
        #expect((ours431["cookies"] ?? 0) > 0 && (ours431["trailers"] ?? 0) > 0, "\(ours431)")
        let arguments = try exchange("GET /healthz?" + Array(repeating: "a", count: 150).joined(separator: "&") + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        #expect(arguments.hasPrefix("HTTP/1.1 431") && arguments.contains("150 cookies and query arguments"), "\(arguments.prefix(400))")
        try expectServing(daemon)
    }

    /// This session's new refusals, through the daemon: each names what was
    /// wrong, and the daemon keeps serving.
    @Test("nesting deeper than 32 and a ttl_seconds beyond 64 bits: named 400s, and the daemon keeps serving")
    func nestingAndHugeTTL() throws {
        let deep = #"{"bundle_id":"com.example.app","request":{"a":"# + String(repeating: "[", count: 40) + String(repeating: "]", count: 40) + "}}"
        let nested = try daemon.client().send("POST", "/v1/sign/advanced-commerce-request", body: Array(deep.utf8))
        #expect(nested.status == 400 && nested.error?.code == "invalid_json" && nested.error?.message.contains("nested more than 32 deep") == true,
                "\(String(decoding: nested.body, as: UTF8.self))")
        let ttl = try daemon.client().send("POST", "/v1/tokens/app-store-server-api", body: Array(#"{"bundle_id":"com.example.app","ttl_seconds":99999999999999999999}"#.utf8))
        #expect(ttl.status == 400 && ttl.error?.field == "ttl_seconds" && ttl.error?.message.hasPrefix("ttl_seconds must be 1 to 3600 seconds") == true,
                "\(String(decoding: ttl.body, as: UTF8.self))")
        try expectServing(daemon)
    }

    @Test("a request trickled one byte per 100 ms is dropped after request_timeout_seconds; others are served meanwhile")
    func trickle() throws {
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 30)
        defer { connection.close() }
        let request = Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 80\r\n\r\n{\"bundle_id\": \"com.example.app\", \"product_id\": \"p\", \"offer_id\": \"o\"}".utf8)
        let started = Date()
        var cut = false
        var servedMeanwhile = 0
        for (index, byte) in request.enumerated() {
            do {
                try connection.write([byte])
            } catch {
                cut = true
                break
            }
            usleep(100_000)
            if Date().timeIntervalSince(started) > 25 { break }
            if index % 20 == 10 {
                try expectServing(daemon)  // others are served while the slow one trickles
                servedMeanwhile += 1
            }
        }
        #expect(servedMeanwhile >= 3, "checked others were served \(servedMeanwhile) times while the request trickled")
        var received: [UInt8] = []
        let closed = cut || ((try? connection.read(appendingTo: &received)) ?? 0) == 0
        #expect(closed, "the slow connection was not closed")
        #expect(!String(decoding: received, as: UTF8.self).contains("\"signature\""))
        // Request line (~47 bytes, 4.7 s) plus the 3 s limit: cut well before the whole request (~16 s) arrived.
        #expect(Date().timeIntervalSince(started) < 12, "cut after \(Date().timeIntervalSince(started)) s")
        try expectServing(daemon)
        let metrics = String(decoding: try daemon.client().send("GET", "/metrics").body, as: UTF8.self)
        #expect(metrics.contains("signerd_dropped_slow_requests_total 1"))
    }

    @Test("500 connections opened and left idle: the daemon still answers and signs")
    func idleConnections() throws {
        var idle: [UnixConnection] = []
        for _ in 0..<500 {
            idle.append(try UnixConnection.connect(path: daemon.socketPath))
        }
        defer { idle.forEach { $0.close() } }
        // Half of them send a partial request head and stop.
        for connection in idle.prefix(250) {
            try connection.write(Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\n".utf8))
        }
        try expectServing(daemon)
        let ready = try daemon.client().send("GET", "/readyz")
        #expect(ready.status == 200)
    }

    @Test("a client that disconnects mid-request, mid-body or before reading the response leaves the daemon serving")
    func disconnects() throws {
        for cutAfter in ["POST /v1/sign/promo", "POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 70\r\n\r\n{\"bundle_id\": \"com.exa"] {
            let connection = try UnixConnection.connect(path: daemon.socketPath)
            try connection.write(Array(cutAfter.utf8))
            connection.close()
        }
        // A complete request whose sender goes away before the response.
        for _ in 0..<20 {
            let connection = try UnixConnection.connect(path: daemon.socketPath)
            let json = body(Self.base)
            try connection.write(Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: \(json.count)\r\n\r\n".utf8) + json)
            connection.close()
        }
        usleep(200_000)
        try expectServing(daemon)
    }

    /// signctl's client reconnects when the server closes, so it cannot
    /// show keep-alive: one raw connection carries every request here, and a
    /// close would fail the next read.
    @Test("keep-alive: many requests on one connection, signatures included, none answered with Connection: close")
    func keepAlive() throws {
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 10)
        defer { connection.close() }
        let key = try ECPublicKey(pem: try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM)
        let json = body(["bundle_id": "com.example.app", "key_id": "ABC123DEFG", "product_id": "p", "offer_id": "o"])
        var verified = 0
        for index in 0..<50 {
            let signs = index % 2 == 1
            try connection.write(signs
                ? Array("POST \(Self.offer) HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: \(json.count)\r\n\r\n".utf8) + json
                : Array("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".utf8))
            let (head, answer) = try connection.readResponse()
            #expect(head.hasPrefix("HTTP/1.1 200"), "request \(index): \(head)")
            #expect(!head.lowercased().contains("connection: close"), "request \(index): \(head)")
            if signs, offerVerifies(body: Array(answer.utf8), publicKey: key, bundleID: "com.example.app", keyID: "ABC123DEFG") { verified += 1 }
        }
        #expect(verified == 25)
    }
}
