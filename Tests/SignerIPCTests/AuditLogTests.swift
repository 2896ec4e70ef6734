import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Synchronization
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// `audit_log`: one `signature_issued` line for every signature returned,
/// naming who asked and what was signed, written whatever `log_level`
/// says, and never the app account token's value.
@Suite("Audit log", .serialized)
struct AuditLogTests {
    /// The `signature_issued` lines among `daemon`'s log, parsed.
    func auditLines(_ daemon: InProcessDaemon) throws -> [[String: Any]] {
        try daemon.logLines.lines.filter { $0.contains("\"msg\":\"signature_issued\"") }.map { line in
            try #require(try JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any], "\(line)")
        }
    }

    func value<T>(_ object: [String: Any], _ key: String, as type: T.Type = T.self) throws -> T {
        try #require(object[key] as? T, "\(key) in \(object)")
    }

    func base64(_ text: String) throws -> [UInt8] {
        Array(try #require(Data(base64Encoded: text), "Base64: \(text)"))
    }

    func post(_ daemon: InProcessDaemon, _ path: String, _ body: String) throws -> [String: Any] {
        let response = try SignerClient(socketPath: daemon.socketPath).send("POST", path, body: Array(body.utf8))
        #expect(response.status == 200, "\(path): \(String(decoding: response.body, as: UTF8.self))")
        return try #require(try JSONSerialization.jsonObject(with: Data(response.body)) as? [String: Any])
    }

    func base64url(_ text: String) throws -> [UInt8] {
        try #require(base64urlDecoded(text), "base64url: \(text)")
    }

    /// Verifies a compact JWS with OpenSSL against the daemon's public key
    /// and returns its claims.
    func verifiedClaims(_ jws: String, _ daemon: InProcessDaemon) throws -> [String: Any] {
        let parts = jws.split(separator: ".", omittingEmptySubsequences: false).map(String.init)
        try #require(parts.count == 3, "\(jws)")
        let der = try ECDSASignature.der(fromRaw: try base64url(parts[2]), curve: .p256)
        #expect(try opensslVerifies(publicKeyPEM: daemon.publicKey.pem, derSignature: der, message: Array("\(parts[0]).\(parts[1])".utf8)))
        return try #require(try JSONSerialization.jsonObject(with: Data(try base64url(parts[1]))) as? [String: Any])
    }

    @Test("with audit_log, each signature of every endpoint gets one notice line naming the caller and what was signed, even at log_level warning")
    func everyEndpoint() throws {
        let daemon = try InProcessDaemon(logLevel: .warning) { $0.auditLog = true }
        defer { daemon.stop() }
        let bundle = daemon.bundleID
        let token = "5E3F1C2A-9B4D-4E6F-8A7B-1C2D3E4F5A6B"

        let classic = try post(daemon, "/v1/sign/promotional-offer",
                               #"{"bundle_id":"\#(bundle)","product_id":"pro_monthly","offer_id":"winback","app_account_token":"\#(token)"}"#)
        let classicSignature: String = try value(classic, "signature")
        let classicDER = try base64(classicSignature)
        let classicNonce: String = try value(classic, "nonce")
        let classicTimestamp: Int64 = try value(classic, "timestamp")
        #expect(try opensslVerifies(publicKeyPEM: daemon.publicKey.pem, derSignature: classicDER,
                                    message: independentPayload(bundleID: bundle, keyID: daemon.keyID, productID: "pro_monthly", offerID: "winback",
                                                                token: token.lowercased(), nonce: classicNonce, timestamp: classicTimestamp)))

        let batch = try post(daemon, "/v1/offers",
                             #"{"bundle_id":"\#(bundle)","app_user_id":"user_1","generate_offers":[{"offer_id":"o1","product_id":"p1"},{"offer_id":"o2","product_id":"p2"},{"offer_id":"bad\u2063","product_id":"p3"}]}"#)
        let offers = try #require(batch["offers"] as? [[String: Any]])
        try #require(offers.count == 3)
        var batchNonces: [String] = []
        for (index, offer) in offers.prefix(2).enumerated() {
            let data: [String: Any] = try value(offer, "signature_data")
            let nonce: String = try value(data, "nonce")
            let der = try base64(try value(data, "signature"))
            let timestamp: Int64 = try value(data, "timestamp")
            #expect(try opensslVerifies(publicKeyPEM: daemon.publicKey.pem, derSignature: der,
                                        message: independentPayload(bundleID: bundle, keyID: daemon.keyID, productID: "p\(index + 1)", offerID: "o\(index + 1)",
                                                                    token: "", nonce: nonce, timestamp: timestamp)))
            batchNonces.append(nonce)
        }
        #expect(offers[2]["signature_error"] != nil, "the entry with U+2063 is refused on its own")

        let v2 = try post(daemon, "/v1/sign/promotional-offer-v2",
                          #"{"bundle_id":"\#(bundle)","product_id":"pro_yearly","offer_id":"intro_50","transaction_id":"2000000012345678"}"#)
        let v2Claims = try verifiedClaims(try value(v2, "jws"), daemon)
        let intro = try post(daemon, "/v1/sign/introductory-offer-eligibility",
                             #"{"bundle_id":"\#(bundle)","product_id":"pro_yearly","allow_introductory_offer":false,"transaction_id":"2000000087654321"}"#)
        let introClaims = try verifiedClaims(try value(intro, "jws"), daemon)
        let commerce = try post(daemon, "/v1/sign/advanced-commerce-request", #"{"bundle_id":"\#(bundle)","request":{"operation":"CREATE"}}"#)
        let commerceClaims = try verifiedClaims(try value(commerce, "jws"), daemon)
        let bearer = try post(daemon, "/v1/tokens/app-store-server-api", #"{"bundle_id":"\#(bundle)","ttl_seconds":600}"#)
        let bearerClaims = try verifiedClaims(try value(bearer, "token"), daemon)

        // Refused requests sign nothing and are not audited.
        let refused = try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer",
                                                                           body: Array(#"{"bundle_id":"\#(bundle)","product_id":"p"}"#.utf8))
        #expect(refused.status == 400)

        let lines = try auditLines(daemon)
        try #require(lines.count == 7, "1 classic + 2 batch offers + 4 JWS kinds: \(daemon.logLines.lines)")
        for line in lines {
            #expect(line["level"] as? String == "notice")
            #expect(line["peer.uid"] as? Int == Int(getuid()))
            #expect(line["peer.pid"] as? Int == Int(getpid()))
            #expect(line["key.id"] as? String == daemon.keyID)
            #expect(line["bundle.id"] as? String == bundle)
        }
        #expect(lines.map { $0["http.path"] as? String ?? "" } == [
            "/v1/sign/promotional-offer", "/v1/offers", "/v1/offers", "/v1/sign/promotional-offer-v2",
            "/v1/sign/introductory-offer-eligibility", "/v1/sign/advanced-commerce-request", "/v1/tokens/app-store-server-api",
        ])
        #expect(lines[0]["product.id"] as? String == "pro_monthly" && lines[0]["offer.id"] as? String == "winback")
        #expect(lines[0]["nonce"] as? String == classicNonce)
        #expect(lines[0]["timestamp"] as? Int64 == classicTimestamp)
        #expect(lines[0]["app_account_token.set"] as? Bool == true)
        #expect(lines[0]["signature.sha256"] as? String == SHA256.hash(classicDER).hexString)
        let bearerSignature = try base64url(String(try value(bearer, "token", as: String.self).split(separator: ".")[2]))
        #expect(lines[6]["signature.sha256"] as? String == SHA256.hash(bearerSignature).hexString)
        #expect(Set(lines.compactMap { $0["signature.sha256"] as? String }).count == 7, "every line names its own signature")
        #expect(lines[1]["offer.id"] as? String == "o1" && lines[2]["offer.id"] as? String == "o2")
        #expect(lines[1...2].map { $0["nonce"] as? String ?? "" } == batchNonces)
        #expect(lines[1]["app_account_token.set"] as? Bool == false)
        #expect(lines[3]["offer.id"] as? String == "intro_50" && lines[3]["transaction.id"] as? String == "2000000012345678")
        // Each claim is required first, so that two missing values cannot compare equal.
        #expect(lines[3]["nonce"] as? String == (try value(v2Claims, "nonce", as: String.self)))
        #expect(lines[3]["iat"] as? Int == (try value(v2Claims, "iat", as: Int.self)))
        #expect(lines[4]["transaction.id"] as? String == "2000000087654321" && lines[4]["allow_introductory_offer"] as? Bool == false)
        #expect(lines[4]["nonce"] as? String == (try value(introClaims, "nonce", as: String.self)))
        #expect(lines[5]["request.bytes"] as? Int == #"{"operation":"CREATE"}"#.utf8.count)
        #expect(lines[5]["nonce"] as? String == (try value(commerceClaims, "nonce", as: String.self)))
        #expect(lines[6]["iat"] as? Int == (try value(bearerClaims, "iat", as: Int.self)))
        #expect(lines[6]["exp"] as? Int == (try value(bearerClaims, "exp", as: Int.self)))
        #expect(lines[6]["nonce"] as? String == (try value(bearerClaims, "nonce", as: String.self)))

        let everything = daemon.logLines.lines.joined(separator: "\n").lowercased()
        #expect(!everything.contains(token.lowercased()), "the app account token's value is never logged")
        #expect(!everything.contains(classicSignature.lowercased()), "nor a signature")
    }

    @Test("an audit line that cannot be written returns no signature: 503 audit_log_unwritable for every endpoint, counted")
    func unwritableLine() throws {
        let daemon = try InProcessDaemon(configure: { $0.auditLog = true }, keepsLine: { !$0.contains("\"signature_issued\"") })
        defer { daemon.stop() }
        let bundle = daemon.bundleID
        let requests = [
            ("/v1/sign/promotional-offer", #"{"bundle_id":"\#(bundle)","product_id":"p","offer_id":"o"}"#),
            ("/v1/offers", #"{"bundle_id":"\#(bundle)","app_user_id":"u","generate_offers":[{"offer_id":"o1","product_id":"p1"}]}"#),
            ("/v1/sign/promotional-offer-v2", #"{"bundle_id":"\#(bundle)","product_id":"p","offer_id":"o"}"#),
            ("/v1/sign/introductory-offer-eligibility", #"{"bundle_id":"\#(bundle)","product_id":"p","allow_introductory_offer":true,"transaction_id":"1"}"#),
            ("/v1/sign/advanced-commerce-request", #"{"bundle_id":"\#(bundle)","request":{"a":1}}"#),
            ("/v1/tokens/app-store-server-api", #"{"bundle_id":"\#(bundle)"}"#),
        ]
        for (path, body) in requests {
            let response = try SignerClient(socketPath: daemon.socketPath).send("POST", path, body: Array(body.utf8))
            let text = String(decoding: response.body, as: UTF8.self)
            #expect(response.status == 503, "\(path): \(text)")
            #expect(response.error?.code == "audit_log_unwritable", "\(path): \(text)")
            #expect(response.headers["retry-after"] == "1", "\(path)")
            #expect(!text.contains("signature\"") && !text.contains("jws") && !text.contains("token\""), "\(path): no signature leaves: \(text)")
        }
        #expect(daemon.service.metrics.value("audit_write_failures") == UInt64(requests.count))
    }

    @Test("a batch whose second offer's audit line fails is refused whole: no signature of it leaves, the first offer's line stays")
    func batchFailsWhole() throws {
        let written = Mutex(0)
        let daemon = try InProcessDaemon(configure: { $0.auditLog = true }, keepsLine: { line in
            guard line.contains("\"signature_issued\"") else { return true }
            return written.withLock { count in count += 1; return count < 2 }
        })
        defer { daemon.stop() }
        let body = #"{"bundle_id":"\#(daemon.bundleID)","app_user_id":"u","generate_offers":[{"offer_id":"o1","product_id":"p"},{"offer_id":"o2","product_id":"p"},{"offer_id":"o3","product_id":"p"}]}"#
        let response = try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/offers", body: Array(body.utf8))
        #expect(response.status == 503 && response.error?.code == "audit_log_unwritable", "\(String(decoding: response.body, as: UTF8.self))")
        #expect(!String(decoding: response.body, as: UTF8.self).contains("signature_data"))
        #expect(written.withLock { $0 } == 2, "the third offer is not signed")
        #expect(try auditLines(daemon).map { $0["offer.id"] as? String } == ["o1", "o2"])
    }

    @Test("without audit_log (the default) no signature_issued line is written, even at log_level trace")
    func offByDefault() throws {
        let daemon = try InProcessDaemon(logLevel: .trace)
        defer { daemon.stop() }
        let response = try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
        #expect(daemon.verifies(response))
        #expect(try auditLines(daemon).isEmpty)
    }

    @Test("a reload turns audit_log on and off at once")
    func reload() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        var config = daemon.service.configuration
        for (on, expected) in [(true, 1), (false, 1), (true, 2)] {
            config.auditLog = on
            try daemon.service.reload(config)
            let response = try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
            #expect(daemon.verifies(response))
            #expect(try auditLines(daemon).count == expected, "audit_log \(on)")
        }
    }
}
