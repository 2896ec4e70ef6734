import Foundation
import HSMSigner
import SignerIPC

/// Fuzz target `misc`: signerd's smaller parsers and encoders, each with the
/// property it must keep.
///
/// Input: byte 0 picks the parser (modulo 10); the rest is its input:
/// 0 the configuration file; 1 DER → raw → DER (strict DER, X9.62 / RFC 3279);
/// 2 raw → DER → raw; 3 RFC 7512 URIs; 4 compact JWS decoding (RFC 7515);
/// 5 base64url (RFC 4648 §5, canonical); 6 Apple's field rules; 7 key files
/// (PKCS#8, SEC1, public PEM); 8 command-line arguments (NUL-separated
/// words); 9 request bodies through `FieldReader` and two endpoint readers.
enum MiscTarget {
    /// Runs one input; traps when a round trip or an invariant breaks.
    static func run(_ input: UnsafeBufferPointer<UInt8>) {
        guard input.count >= 1 else { return }
        let bytes = Array(input[1...])
        let text = String(decoding: bytes, as: UTF8.self)
        switch input[0] % 10 {
        case 0:
            if let config = try? SignerConfiguration.parse(bytes) {
                _ = config.restartOnlyChanges(from: config)
            }
        case 1:
            for curve in ECCurve.allCases {
                guard let raw = try? ECDSASignature.raw(fromDER: bytes, curve: curve) else { continue }
                precondition(raw.count == 2 * curve.byteCount, "raw signature of \(raw.count) bytes for \(curve)")
                guard let der = try? ECDSASignature.der(fromRaw: raw, curve: curve) else {
                    preconditionFailure("accepted DER whose raw form does not encode again for \(curve)")
                }
                precondition(der == bytes, "DER round trip differs for \(curve)")
            }
        case 2:
            for curve in ECCurve.allCases {
                guard let der = try? ECDSASignature.der(fromRaw: bytes, curve: curve) else { continue }
                guard let raw = try? ECDSASignature.raw(fromDER: der, curve: curve) else {
                    preconditionFailure("DER made from raw does not decode for \(curve)")
                }
                precondition(raw == bytes, "raw round trip differs for \(curve)")
            }
        case 3:
            if let uri = try? PKCS11URI(text) {
                _ = uri.description
                _ = try? uri.resolveModulePath()
            }
        case 4:
            _ = try? CompactJWS.decode(text)
        case 5:
            if let decoded = Base64URL.decode(text) {
                precondition(Base64URL.encode(decoded) == text, "non-canonical base64url accepted")
            }
            precondition(Base64URL.decode(Base64URL.encode(bytes)) == bytes, "base64url round trip differs")
        case 6:
            try? AppleFields.checkIdentifier(text, field: "f")
            _ = try? AppleFields.normalizeUUID(text, field: "f")
            _ = try? AppleFields.normalizeAppAccountToken(text)
            try? AppleFields.checkTransactionID(text)
            try? AppleFields.checkKeyID(text)
            if bytes.count >= 16 {
                let timestamp = bytes.prefix(8).reduce(Int64(0)) { $0 << 8 | Int64($1) }
                // `now` is the host's clock, never client input: keep it to plausible times (0 to about year 5138).
                let now = bytes.dropFirst(8).prefix(8).reduce(Int64(0)) { $0 << 8 | Int64($1) } & 0x7fff_ffff_ffff % 100_000_000_000_000
                try? AppleFields.checkTimestamp(timestamp, now: now)
                try? AppleFields.checkTimestamp(timestamp, now: AppleFields.nowMilliseconds())
            }
        case 7:
            let secure = bytes.withUnsafeBytes { SecureBytes(copying: $0) }
            _ = try? ECPrivateKeyMaterial(pem: secure)
            _ = try? ECPublicKey(pem: text)
        case 8:
            let words = bytes.split(separator: 0, omittingEmptySubsequences: false).map { Array($0) }
            if (try? Arguments.checkUTF8(words)) != nil {
                let strings = words.map { String(decoding: $0, as: UTF8.self) }
                if let arguments = try? Arguments(strings, options: ["--config", "--key-id", "--ttl"], flags: ["--json", "--yes"]) {
                    _ = try? arguments.integer("--ttl", default: 300, in: 1...3600)
                    _ = try? arguments.positionals(2, "A B")
                }
            }
        default:
            _ = try? FieldReader(json: bytes, allowed: ["a", "b", "request", "generate_offers"])
            _ = try? OffersRequest(body: bytes)
            _ = try? AdvancedCommerceSigningRequest(body: bytes)
        }
    }
}
