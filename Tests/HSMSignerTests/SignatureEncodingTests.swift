import CLibCrypto
import Foundation
import HSMSigner
import TestSupport
import Testing

/// Wycheproof's vector files (vendored with their LICENSE in Vectors/wycheproof).
struct WycheproofFile: Decodable {
    struct Group: Decodable {
        struct Key: Decodable { let curve: String; let uncompressed: String }
        struct Test: Decodable { let tcId: Int; let comment: String; let msg: String; let sig: String; let result: String }
        let publicKey: Key
        let publicKeyPem: String
        let sha: String
        let tests: [Test]
    }
    let numberOfTests: Int
    let testGroups: [Group]

    static func load(_ name: String) throws -> WycheproofFile {
        let url = try #require(Bundle.module.url(forResource: "Vectors/wycheproof/\(name)", withExtension: "json"))
        return try JSONDecoder().decode(WycheproofFile.self, from: Data(contentsOf: url))
    }
}

/// The digest Wycheproof's group names, computed by OpenSSL (EVP_Digest).
func digest(_ algorithm: String, _ message: [UInt8]) -> [UInt8] {
    let name = algorithm.replacingOccurrences(of: "-", with: "")
    let md = EVP_get_digestbyname(name)!
    var out = [UInt8](repeating: 0, count: 64)
    var length: UInt32 = 0
    _ = EVP_Digest(message, message.count, &out, &length, md, nil)
    return Array(out.prefix(Int(length)))
}

@Suite("ECDSA signature encodings")
struct SignatureEncodingTests {
    static let curves: [(ECCurve, String)] = [(.p256, "secp256r1_sha256"), (.p384, "secp384r1_sha384"), (.p521, "secp521r1_sha512")]

    @Test("Wycheproof DER vectors: valid ones round-trip and verify, invalid ones are refused or fail verification",
          arguments: [ECCurve.p256, .p384, .p521])
    func wycheproofDER(curve: ECCurve) throws {
        let name = Self.curves.first { $0.0 == curve }!.1
        let file = try WycheproofFile.load("ecdsa_\(name)_test")
        var valid = 0
        var invalidRefused = 0
        var invalidUnverified = 0
        for group in file.testGroups {
            let key = try ECPublicKey(pem: group.publicKeyPem)
            #expect(key.curve == curve)
            for test in group.tests {
                let der = try #require([UInt8](hex: test.sig))
                let hash = digest(group.sha, try #require([UInt8](hex: test.msg)))
                switch test.result {
                case "valid":
                    let raw = try ECDSASignature.raw(fromDER: der, curve: curve)
                    #expect(raw.count == 2 * curve.byteCount, "tcId \(test.tcId)")
                    #expect(try ECDSASignature.der(fromRaw: raw, curve: curve) == der, "tcId \(test.tcId) \(test.comment)")
                    #expect(key.verify(rawSignature: raw, digest: hash), "tcId \(test.tcId)")
                    valid += 1
                case "invalid":
                    if let raw = try? ECDSASignature.raw(fromDER: der, curve: curve) {
                        // Accepted encodings must be canonical DER: re-encoding gives the input back…
                        #expect(try ECDSASignature.der(fromRaw: raw, curve: curve) == der, "tcId \(test.tcId) \(test.comment)")
                        // …and then the values make the signature fail.
                        #expect(!key.verify(rawSignature: raw, digest: hash), "tcId \(test.tcId) \(test.comment)")
                        invalidUnverified += 1
                    } else {
                        invalidRefused += 1
                    }
                default:
                    break
                }
            }
        }
        #expect(valid > 100)
        #expect(invalidRefused > 50, "the parser refused \(invalidRefused) malformed encodings")
        #expect(invalidUnverified + invalidRefused > 250)
    }

    @Test("Wycheproof P1363 (raw r‖s) vectors", arguments: [ECCurve.p256, .p384, .p521])
    func wycheproofRaw(curve: ECCurve) throws {
        let name = Self.curves.first { $0.0 == curve }!.1
        let file = try WycheproofFile.load("ecdsa_\(name)_p1363_test")
        var checked = 0
        for group in file.testGroups {
            let key = try ECPublicKey(pem: group.publicKeyPem)
            for test in group.tests {
                let raw = try #require([UInt8](hex: test.sig))
                let hash = digest(group.sha, try #require([UInt8](hex: test.msg)))
                let der = try? ECDSASignature.der(fromRaw: raw, curve: curve)
                if raw.count != 2 * curve.byteCount {
                    #expect(der == nil, "tcId \(test.tcId): wrong length must be refused")
                }
                if test.result == "valid" {
                    let der = try #require(der, "tcId \(test.tcId)")
                    #expect(key.verify(derSignature: der, digest: hash))
                    #expect(try ECDSASignature.raw(fromDER: der, curve: curve) == raw)
                } else if test.result == "invalid", let der {
                    #expect(!key.verify(derSignature: der, digest: hash), "tcId \(test.tcId) \(test.comment)")
                }
                checked += 1
            }
        }
        #expect(checked == file.numberOfTests)
    }

    @Test("raw → DER rejects odd and wrong lengths and zero halves, by name")
    func rawRejections() throws {
        expectEncodingError("raw_length") { try ECDSASignature.der(fromRaw: [UInt8](repeating: 1, count: 63), curve: .p256) }
        expectEncodingError("raw_length") { try ECDSASignature.der(fromRaw: [UInt8](repeating: 1, count: 65), curve: .p256) }
        expectEncodingError("raw_length") { try ECDSASignature.der(fromRaw: [UInt8](repeating: 1, count: 96), curve: .p256) }
        expectEncodingError("zero_half") { try ECDSASignature.der(fromRaw: [UInt8](repeating: 0, count: 32) + [UInt8](repeating: 1, count: 32), curve: .p256) }
        expectEncodingError("zero_half") { try ECDSASignature.der(fromRaw: [UInt8](repeating: 1, count: 32) + [UInt8](repeating: 0, count: 32), curve: .p256) }
    }

    @Test("DER → raw rejects each malformation with its code")
    func derRejections() throws {
        let good: [UInt8] = [0x30, 0x06, 0x02, 0x01, 0x01, 0x02, 0x01, 0x02]
        #expect(try ECDSASignature.raw(fromDER: good, curve: .p256) == [UInt8](repeating: 0, count: 31) + [1] + [UInt8](repeating: 0, count: 31) + [2])
        let cases: [(String, [UInt8])] = [
            ("der_tag", [0x31, 0x06, 0x02, 0x01, 0x01, 0x02, 0x01, 0x02]),
            ("der_tag", [0x30, 0x06, 0x03, 0x01, 0x01, 0x02, 0x01, 0x02]),
            ("der_length", [0x30, 0x80, 0x02, 0x01, 0x01, 0x02, 0x01, 0x02, 0x00, 0x00]),
            ("der_length", [0x30, 0x81, 0x06, 0x02, 0x01, 0x01, 0x02, 0x01, 0x02]),
            ("der_length", [0x30, 0x07, 0x02, 0x01, 0x01, 0x02, 0x01, 0x02]),
            ("der_trailing", good + [0x00]),
            ("der_trailing", [0x30, 0x07, 0x02, 0x01, 0x01, 0x02, 0x01, 0x02, 0x00]),
            ("der_negative", [0x30, 0x06, 0x02, 0x01, 0x81, 0x02, 0x01, 0x02]),
            ("der_non_minimal", [0x30, 0x07, 0x02, 0x02, 0x00, 0x01, 0x02, 0x01, 0x02]),
            ("der_integer", [0x30, 0x05, 0x02, 0x00, 0x02, 0x01, 0x02]),
            ("zero_half", [0x30, 0x06, 0x02, 0x01, 0x00, 0x02, 0x01, 0x02]),
            ("der_too_large", [0x30, 0x26, 0x02, 0x21, 0x01] + [UInt8](repeating: 0x11, count: 32) + [0x02, 0x01, 0x02]),
        ]
        for (code, der) in cases {
            expectEncodingError(code, "\(der.hexString)") { try ECDSASignature.raw(fromDER: der, curve: .p256) }
        }
    }

    @Test("P-521 uses the long-form length and round-trips")
    func p521LongForm() throws {
        let raw = [UInt8](repeating: 0x01, count: 66) + [UInt8](repeating: 0xff, count: 66)
        let der = try ECDSASignature.der(fromRaw: raw, curve: .p521)
        #expect(der[0] == 0x30 && der[1] == 0x81)
        #expect(Int(der[2]) == der.count - 3)
        #expect(try ECDSASignature.raw(fromDER: der, curve: .p521) == raw)
    }

    // MARK: Differential against OpenSSL

    /// OpenSSL's DER for (r, s): `i2d_ECDSA_SIG`.
    static func opensslDER(_ raw: [UInt8], _ n: Int) -> [UInt8] {
        let sig = ECDSA_SIG_new()!
        defer { ECDSA_SIG_free(sig) }
        let r = BN_bin2bn(raw, Int32(n), nil)
        let s = raw.withUnsafeBufferPointer { BN_bin2bn($0.baseAddress! + n, Int32(n), nil) }
        ECDSA_SIG_set0(sig, r, s)
        let length = i2d_ECDSA_SIG(sig, nil)
        var out = [UInt8](repeating: 0, count: Int(length))
        out.withUnsafeMutableBufferPointer { buffer in
            var cursor = buffer.baseAddress
            _ = i2d_ECDSA_SIG(sig, &cursor)
        }
        return out
    }

    /// What a strict parser must answer for `der`, by OpenSSL: `d2i_ECDSA_SIG`
    /// consumed everything, re-encoding gives the same bytes, r and s are
    /// positive and fit the curve. Returns the padded raw form, or nil.
    static func opensslStrictRaw(_ der: [UInt8], _ n: Int) -> [UInt8]? {
        der.withUnsafeBufferPointer { buffer -> [UInt8]? in
            var cursor: UnsafePointer<UInt8>? = buffer.baseAddress
            guard let sig = d2i_ECDSA_SIG(nil, &cursor, der.count) else {
                ERR_clear_error()
                return nil
            }
            defer { ECDSA_SIG_free(sig) }
            guard cursor == buffer.baseAddress! + der.count else { return nil }
            var r: OpaquePointer?
            var s: OpaquePointer?
            ECDSA_SIG_get0(sig, &r, &s)
            guard let r, let s, BN_is_negative(r) == 0, BN_is_negative(s) == 0, BN_is_zero(r) == 0, BN_is_zero(s) == 0,
                  (BN_num_bits(r) + 7) / 8 <= n, (BN_num_bits(s) + 7) / 8 <= n else { return nil }
            var raw = [UInt8](repeating: 0, count: 2 * n)
            raw.withUnsafeMutableBufferPointer {
                _ = BN_bn2binpad(r, $0.baseAddress, Int32(n))
                _ = BN_bn2binpad(s, $0.baseAddress! + n, Int32(n))
            }
            let reencoded = opensslDER(raw, n)
            return reencoded == der ? raw : nil
        }
    }

    static func half(_ n: Int, _ pattern: Int, _ random: inout SystemRandomNumberGenerator) -> [UInt8] {
        var bytes = (0..<n).map { _ in UInt8.random(in: 0...255, using: &random) }
        switch pattern {
        case 0: bytes[0] = 0x00
        case 1: bytes[0] = 0x00; bytes[1] = 0x80 | bytes[1]
        case 2: bytes[0] = 0x80
        case 3: bytes[0] = 0xff
        case 4: for index in 0..<(n - 1) { bytes[index] = 0 }  // tiny value
        case 5: for index in 0..<(n / 2) { bytes[index] = 0 }
        case 6: bytes = [UInt8](repeating: 0xff, count: n)
        default: break  // fully random
        }
        if bytes.allSatisfy({ $0 == 0 }) { bytes[n - 1] = 1 }
        return bytes
    }

    @Test("differential against OpenSSL i2d/d2i_ECDSA_SIG over 100,000+ inputs per curve", arguments: [ECCurve.p256, .p384, .p521])
    func differential(curve: ECCurve) throws {
        let n = curve.byteCount
        var random = SystemRandomNumberGenerator()
        var compared = 0
        var mismatches: [String] = []
        for iteration in 0..<50_000 {  // 50,000 raw pairs + 50,000 DER inputs per curve
            let raw = Self.half(n, iteration % 8, &random) + Self.half(n, (iteration / 8) % 8, &random)
            let expected = Self.opensslDER(raw, n)
            let ours = try ECDSASignature.der(fromRaw: raw, curve: curve)
            if ours != expected, mismatches.count < 5 { mismatches.append("raw→DER \(raw.hexString)") }
            let back = try ECDSASignature.raw(fromDER: ours, curve: curve)
            if back != raw, mismatches.count < 5 { mismatches.append("DER→raw \(ours.hexString)") }
            compared += 2

            // Mutations of the valid encoding, judged by OpenSSL's strict reading.
            var mutated = expected
            switch iteration % 10 {
            case 0: mutated[Int.random(in: 0..<mutated.count)] ^= UInt8(1 << Int.random(in: 0...7))
            case 1: mutated.removeLast(Int.random(in: 1...min(4, mutated.count)))
            case 2: mutated.append(UInt8.random(in: 0...255))
            case 3: mutated[1] = mutated[1] &+ UInt8.random(in: 1...3)
            case 4:  // superfluous leading zero in r
                let rLength = Int(mutated[mutated[1] == 0x81 ? 4 : 3])
                let at = mutated[1] == 0x81 ? 5 : 4
                mutated.insert(0x00, at: at)
                mutated[at - 1] = UInt8(rLength + 1)
                if mutated[1] == 0x81 { mutated[2] &+= 1 } else { mutated[1] &+= 1 }
            case 5: mutated[0] = [0x31, 0x10, 0x02, 0xa0][Int.random(in: 0...3)]
            case 6: mutated = (0..<Int.random(in: 0...(2 * n + 10))).map { _ in UInt8.random(in: 0...255) }
            case 7:  // long-form length where short form is required
                if mutated[1] < 0x80 { mutated.insert(0x81, at: 1) }
            case 8: mutated = [0x30, 0x80] + mutated.dropFirst(2) + [0x00, 0x00]
            default: break  // unmodified
            }
            let oracle = Self.opensslStrictRaw(mutated, n)
            let parsed = try? ECDSASignature.raw(fromDER: mutated, curve: curve)
            if parsed != oracle, mismatches.count < 5 {
                mismatches.append("parse \(mutated.hexString): ours \(parsed?.hexString ?? "reject"), OpenSSL \(oracle?.hexString ?? "reject")")
            }
            compared += 1
        }
        #expect(mismatches.isEmpty, "\(mismatches)")
        #expect(compared >= 150_000)
    }
}


/// Expects `body` to throw a ``SignatureEncodingError`` with `code`.
func expectEncodingError(_ code: String, _ comment: String = "", sourceLocation: SourceLocation = #_sourceLocation, _ body: () throws -> Any) {
    let error = #expect(throws: SignatureEncodingError.self, sourceLocation: sourceLocation) { _ = try body() }
    #expect(error?.code == code, "\(comment): got \(error.map { "\($0)" } ?? "no error")", sourceLocation: sourceLocation)
}
