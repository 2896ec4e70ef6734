import Dispatch
import HSMSigner
import TestSupport
import Testing

@Suite("Classic promotional offer payload")
struct PromotionalOfferPayloadTests {
    struct Golden: Sendable, CustomTestStringConvertible {
        let bundleID, keyID, productID, offerID, token, nonce: String
        let timestamp: Int64
        let length: Int
        let sha256: String
        var testDescription: String { "\(bundleID) \(token.isEmpty ? "no token" : "token") \(length) bytes" }
    }

    /// The three golden vectors of apple-signatures.md.
    static let golden: [Golden] = [
        Golden(bundleID: "com.example.app", keyID: "ABC123DEFG", productID: "pro_monthly", offerID: "winback_half_price",
               token: "", nonce: "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b", timestamp: 1790800914034,
               length: 121, sha256: "6f94db47e812bec643cc4ef18d4dc2254157f0eff33146dc1d316e082b91e2a1"),
        Golden(bundleID: "com.example.app", keyID: "ABC123DEFG", productID: "pro_monthly", offerID: "winback_half_price",
               token: "5E3F1C2A-9B4D-4E6F-8A7B-1C2D3E4F5A6B", nonce: "4A0F7B8E-2F1D-4C6A-9B3E-5D7C8E9F0A1B", timestamp: 1790800914034,
               length: 157, sha256: "ce15ce30b536f1cc0527bab7b042bbaab277de5002b7525f295f9658fbac3f39"),
        Golden(bundleID: "com.exämple.app", keyID: "ABC123DEFG", productID: "pro.yearly", offerID: "intro_50",
               token: "", nonce: "00000000-0000-4000-8000-000000000000", timestamp: 1790800914000,
               length: 111, sha256: "0298a2d662bc596ba984c11bfc300adcae621efd59b8c174627552a97100a2e0"),
    ]

    @Test("golden vectors: payload length and SHA-256 byte for byte", arguments: golden)
    func goldenVector(_ vector: Golden) throws {
        let payload = try PromotionalOfferPayload(bundleID: vector.bundleID, keyID: vector.keyID, productID: vector.productID,
                                                  offerID: vector.offerID, appAccountToken: vector.token, nonce: vector.nonce,
                                                  timestamp: vector.timestamp)
        #expect(payload.payload.count == vector.length)
        #expect(SHA256.hash(payload.payload).hexString == vector.sha256)
        #expect(payload.nonce == vector.nonce.lowercased())
        #expect(payload.appAccountToken == vector.token.lowercased())
    }

    @Test("the payload is the seven values joined by U+2063, no trailing separator")
    func layout() throws {
        let payload = try PromotionalOfferPayload(bundleID: "b", keyID: "ABC123DEFG", productID: "p", offerID: "o",
                                                  appAccountToken: "", nonce: "00000000-0000-4000-8000-000000000000", timestamp: 1790800914000)
        let text = String(decoding: payload.payload, as: UTF8.self)
        #expect(text == "b\u{2063}ABC123DEFG\u{2063}p\u{2063}o\u{2063}\u{2063}00000000-0000-4000-8000-000000000000\u{2063}1790800914000")
    }

    static let fieldCases: [(field: String, bundle: String, product: String, offer: String, token: String, nonce: String, keyID: String)] = [
        ("bundle_id", "", "p", "o", "", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("bundle_id", "com.ex\u{2063}ample", "p", "o", "", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("bundle_id", String(repeating: "a", count: 256), "p", "o", "", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("product_id", "b", "pro\nmonthly", "o", "", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("product_id", "b", "pro\u{85}", "o", "", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("offer_id", "b", "p", "", "", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("offer_id", "b", "p", "a\u{2063}b", "", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("app_account_token", "b", "p", "o", "user_1", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("app_account_token", "b", "p", "o", "5e3f1c2a9b4d4e6f8a7b1c2d3e4f5a6b", "00000000-0000-4000-8000-000000000000", "ABC123DEFG"),
        ("nonce", "b", "p", "o", "", "undefined", "ABC123DEFG"),
        ("nonce", "b", "p", "o", "", "00000000-0000-4000-8000-00000000000g", "ABC123DEFG"),
        ("key_id", "b", "p", "o", "", "00000000-0000-4000-8000-000000000000", "abc123defg"),
        ("key_id", "b", "p", "o", "", "00000000-0000-4000-8000-000000000000", "ABC123DEF"),
    ]

    @Test("each broken field is named", arguments: fieldCases.indices)
    func fieldRules(_ index: Int) throws {
        let c = Self.fieldCases[index]
        let error = #expect(throws: FieldError.self) {
            try PromotionalOfferPayload(bundleID: c.bundle, keyID: c.keyID, productID: c.product, offerID: c.offer,
                                        appAccountToken: c.token, nonce: c.nonce, timestamp: 1790800914000)
        }
        #expect(error?.field == c.field)
        #expect(error?.code == "invalid_field")
        #expect(error?.message.contains(c.field) == true)
    }

    @Test("timestamps: seconds, microseconds and nanoseconds are refused with a hint, and the 24 h / 5 min window holds")
    func timestamps() throws {
        let now: Int64 = 1_790_800_914_034
        try AppleFields.checkTimestamp(now, now: now)
        try AppleFields.checkTimestamp(now - AppleFields.timestampMaximumAge, now: now)
        try AppleFields.checkTimestamp(now + AppleFields.timestampMaximumSkew, now: now)
        let seconds = #expect(throws: FieldError.self) { try AppleFields.checkTimestamp(1_790_800_914, now: now) }
        #expect(seconds?.field == "timestamp")
        #expect(seconds?.message.contains("milliseconds") == true)
        #expect(seconds?.message.contains("seconds") == true)
        // api.md: "a 10-digit value is rejected with a message that says
        // milliseconds are expected", whether or not times 1000 is in the window.
        for tenDigits: Int64 in [1_000_000_000, 1_790_800_914 - 5 * 86_400, 9_999_999_999, 17, 1] {
            let old = #expect(throws: FieldError.self) { try AppleFields.checkTimestamp(tenDigits, now: now) }
            #expect(old?.message.contains("milliseconds") == true && old?.message.contains("looks like UNIX time in seconds") == true, "\(old?.message ?? "")")
            #expect(old?.message.contains("multiply") == false, "out of the window even in milliseconds: \(old?.message ?? "")")
        }
        // 11 digits: times 1000 is not a time Apple accepts either, so no advice to multiply.
        let eleven = #expect(throws: FieldError.self) { try AppleFields.checkTimestamp(17_908_009_140, now: now) }
        #expect(eleven?.message.contains("multiply") == false, "\(eleven?.message ?? "")")
        #expect(eleven?.message.contains("milliseconds (13 digits)") == true, "\(eleven?.message ?? "")")
        #expect(eleven?.message.contains("24 hours in the past") == true, "\(eleven?.message ?? "")")
        let old = #expect(throws: FieldError.self) { try AppleFields.checkTimestamp(now - AppleFields.timestampMaximumAge - 1, now: now) }
        #expect(old?.message.contains("24 hours") == true)
        let future = #expect(throws: FieldError.self) { try AppleFields.checkTimestamp(now + AppleFields.timestampMaximumSkew + 1, now: now) }
        #expect(future?.message.contains("5 minutes") == true)
        #expect(future?.message.contains("looks like") == false, "\(future?.message ?? "")")
        // A clock read in microseconds or nanoseconds said only "more than 5 minutes in the future".
        for (value, unit, advice) in [(now * 1000 + 123, "microseconds", "divide by 1000"), (now * 1_000_000 + 456_789, "nanoseconds", "divide by 1000000")] {
            let refused = #expect(throws: FieldError.self) { try AppleFields.checkTimestamp(value, now: now) }
            #expect(refused?.message.contains("looks like UNIX time in \(unit) — \(advice)") == true, "\(refused?.message ?? "")")
        }
    }

    @Test("random nonces are lowercase UUID v4 and differ")
    func randomUUIDs() throws {
        var seen = Set<String>()
        for _ in 0..<1000 {
            let uuid = AppleFields.randomUUID()
            #expect(try AppleFields.normalizeUUID(uuid, field: "nonce") == uuid)
            let bytes = Array(uuid.utf8)
            #expect(bytes[14] == UInt8(ascii: "4"))
            #expect("89ab".utf8.contains(bytes[19]))
            seen.insert(uuid)
        }
        #expect(seen.count == 1000)
    }

    /// Nonces come from a pool of random bytes refilled 4 KiB at a time
    /// (``BufferedRandom``): threads taking from it at once must never get
    /// the same bytes.
    @Test("nonces made on 8 threads at once, across many pool refills, are all distinct")
    func randomUUIDsFromThreads() {
        let perThread = 2_000
        let made = Locked<[String]>([])
        DispatchQueue.concurrentPerform(iterations: 8) { _ in
            let mine = (0..<perThread).map { _ in AppleFields.randomUUID() }
            made.withLock { $0 += mine }
        }
        let all = made.withLock { $0 }
        #expect(all.count == 8 * perThread)
        #expect(Set(all).count == all.count)
        // Each hexadecimal digit of the random part appears about equally often (a stuck pool would not).
        var counts = [UInt8: Int]()
        for uuid in all { for byte in uuid.utf8.prefix(8) { counts[byte, default: 0] += 1 } }
        #expect(counts.count == 16)
        #expect(counts.values.allSatisfy { (6_000...10_000).contains($0) }, "\(counts)")
    }

    @Test("a UUID in any case comes back lowercase; a lowercase one unchanged; anything else is refused naming the field")
    func uuidForms() throws {
        #expect(try AppleFields.normalizeUUID("4A0F7B8E-2F1D-4C6A-9B3E-5D7C8E9F0A1B", field: "nonce") == "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b")
        #expect(try AppleFields.normalizeUUID("4a0F7b8E-2f1d-4C6a-9b3e-5d7c8e9f0a1B", field: "nonce") == "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b")
        #expect(try AppleFields.normalizeUUID("4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b", field: "nonce") == "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b")
        let refused = [
            "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1",    // 35 characters
            "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1bc",  // 37
            "4a0f7b8-e2f1d-4c6a-9b3e-5d7c8e9f0a1b",   // a dash one place early
            "4a0f7b8e02f1d-4c6a-9b3e-5d7c8e9f0a1b",   // a digit where a dash belongs
            "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1g",   // not hexadecimal
            "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0aé",    // 36 UTF-8 bytes, 35 characters
            "4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a-b",   // a dash among the digits
            "",
        ]
        for value in refused {
            let error = #expect(throws: FieldError.self, "\(value)") { try AppleFields.normalizeUUID(value, field: "app_account_token") }
            #expect(error?.field == "app_account_token")
            #expect(error?.message.contains("must be a UUID") == true)
        }
    }

    @Test("transaction IDs are 1–64 digits")
    func transactionIDs() throws {
        try AppleFields.checkTransactionID("2000000123456789")
        for bad in ["", "12a", String(repeating: "1", count: 65), "-1", "1.0"] {
            let error = #expect(throws: FieldError.self) { try AppleFields.checkTransactionID(bad) }
            #expect(error?.field == "transaction_id")
        }
    }
}
