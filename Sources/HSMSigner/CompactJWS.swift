// ES256 compact JWS (RFC 7515 §7.1, RFC 7518 §3.4) as Apple's StoreKit and
// App Store Server API expect it: header {"alg":"ES256","kid":…,"typ":"JWT"},
// base64url without padding, signature raw r ‖ s (64 bytes), never DER.
import Foundation

/// A claim value in a signerd JWS: the JSON types Apple's claims use.
public enum ClaimValue: Sendable, Equatable {
    case string(String)
    case integer(Int64)
    case bool(Bool)
}

/// Why a compact JWS could not be decoded or verified.
public struct JWSError: Error, Sendable, Equatable, CustomStringConvertible {
    /// Stable code: `jws_format`, `jws_base64url`, `jws_json`, `jws_alg`, `jws_signature_der`, `jws_signature_length`.
    public var code: String
    /// A sentence for people.
    public var message: String
    /// The code and message, e.g. `jws_alg: …`.
    public var description: String { "\(code): \(message)" }
    init(_ code: String, _ message: String) {
        self.code = code
        self.message = message
    }
}

/// Builds and reads ES256 compact JWS.
public enum CompactJWS {
    /// The JWS header Apple expects (RFC 7515 §4.1), members in sorted order.
    /// - Parameter keyID: the In-App Purchase key ID (`kid`).
    public static func header(keyID: String) -> String {
        var out = "{\"alg\":\"ES256\",\"kid\":"
        appendJSONString(keyID, to: &out)
        out += ",\"typ\":\"JWT\"}"
        return out
    }

    /// Serializes claims as compact JSON with members sorted by name, so the
    /// same claims always give the same bytes.
    /// - Parameter claims: claim names and values.
    public static func claimsJSON(_ claims: [String: ClaimValue]) -> String {
        var out = "{"
        for (index, name) in claims.keys.sorted().enumerated() {
            if index > 0 { out += "," }
            appendJSONString(name, to: &out)
            out += ":"
            switch claims[name]! {  // name comes from the dictionary
            case .string(let text): appendJSONString(text, to: &out)
            case .integer(let number): out += String(number)
            case .bool(let flag): out += flag ? "true" : "false"
            }
        }
        return out + "}"
    }

    /// `base64url(header) + "." + base64url(claims)`: the bytes whose SHA-256 is signed.
    /// - Parameters:
    ///   - keyID: the `kid`.
    ///   - claims: the payload claims.
    public static func signingInput(keyID: String, claims: [String: ClaimValue]) -> String {
        Base64URL.encode(Array(header(keyID: keyID).utf8)) + "." + Base64URL.encode(Array(claimsJSON(claims).utf8))
    }

    /// Appends the signature to a signing input.
    /// - Parameters:
    ///   - signingInput: from ``signingInput(keyID:claims:)``.
    ///   - rawSignature: `r ‖ s`, exactly 64 bytes for ES256 (each half left-padded to 32).
    /// - Returns: the compact JWS (`header.claims.signature`, the last part 86 characters).
    /// - Throws: ``JWSError`` `jws_signature_length` unless the signature is 64 bytes.
    public static func assemble(signingInput: String, rawSignature: [UInt8]) throws(JWSError) -> String {
        guard rawSignature.count == 64 else {
            throw JWSError("jws_signature_length", "an ES256 signature is 64 bytes (r ‖ s); got \(rawSignature.count)")
        }
        return signingInput + "." + Base64URL.encode(rawSignature)
    }

    /// A decoded compact JWS.
    public struct Decoded: Sendable {
        /// The header's JSON text.
        public var header: String
        /// The payload's JSON text.
        public var claims: String
        /// The signature bytes (64 for ES256).
        public var signature: [UInt8]
        /// What was signed: the first two parts joined by ".".
        public var signingInput: String
        /// The header's `kid`, if a string.
        public var keyID: String?
        /// The header's `alg`.
        public var algorithm: String?
    }

    /// Splits and decodes a compact JWS; checks `alg` is ES256 and the
    /// signature is 64 bytes (a DER signature is named as such).
    /// - Parameter token: `header.claims.signature`.
    /// - Throws: ``JWSError``.
    public static func decode(_ token: String) throws(JWSError) -> Decoded {
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3 else {
            throw JWSError("jws_format", "a compact JWS has 3 parts separated by '.'; got \(parts.count)")
        }
        guard let header = Base64URL.decode(String(parts[0])), let claims = Base64URL.decode(String(parts[1])),
              let signature = Base64URL.decode(String(parts[2])) else {
            throw JWSError("jws_base64url", "each part must be base64url without padding")
        }
        let headerText = String(decoding: header, as: UTF8.self)
        guard let headerObject = (try? JSONSerialization.jsonObject(with: Data(header))) as? [String: Any],
              (try? JSONSerialization.jsonObject(with: Data(claims))) is [String: Any] else {
            throw JWSError("jws_json", "the header and the claims must each be a JSON object")
        }
        let algorithm = headerObject["alg"] as? String
        guard algorithm == "ES256" else {
            throw JWSError("jws_alg", "alg must be ES256; got \(algorithm ?? "none")")
        }
        if signature.count != 64 {
            if (try? ECDSASignature.raw(fromDER: signature, curve: .p256)) != nil {
                throw JWSError("jws_signature_der", "the signature is DER (\(signature.count) bytes); ES256 in a JWS is raw r ‖ s, 64 bytes")
            }
            throw JWSError("jws_signature_length", "an ES256 signature is 64 bytes; got \(signature.count)")
        }
        return Decoded(header: headerText, claims: String(decoding: claims, as: UTF8.self), signature: signature,
                       signingInput: parts[0] + "." + parts[1], keyID: headerObject["kid"] as? String, algorithm: algorithm)
    }

    /// Verifies a compact JWS with `publicKey`.
    /// - Returns: the decoded token when the signature verifies, nil otherwise.
    /// - Throws: ``JWSError`` when the token is malformed.
    public static func verify(_ token: String, publicKey: ECPublicKey) throws(JWSError) -> Decoded? {
        let decoded = try decode(token)
        let digest = SHA256.hash(Array(decoded.signingInput.utf8))
        return publicKey.verify(rawSignature: decoded.signature, digest: digest) ? decoded : nil
    }

    static func appendJSONString(_ text: String, to out: inout String) {
        Logger.appendJSONString(text, to: &out)
    }
}

/// base64url without padding (RFC 4648 §5, RFC 7515 §2), on top of
/// Foundation's Base64.
public enum Base64URL {
    /// Encodes without padding.
    public static func encode(_ bytes: [UInt8]) -> String {
        var text = Data(bytes).base64EncodedString()
        while text.last == "=" { text.removeLast() }
        return String(text.map { $0 == "+" ? "-" : $0 == "/" ? "_" : $0 })
    }

    /// Decodes unpadded base64url; nil when the text holds `+`, `/`, `=`,
    /// whitespace or anything else outside the base64url alphabet.
    public static func decode(_ text: String) -> [UInt8]? {
        guard text.utf8.allSatisfy({ byte in
            (byte >= 0x41 && byte <= 0x5a) || (byte >= 0x61 && byte <= 0x7a) || (byte >= 0x30 && byte <= 0x39) || byte == 0x2d || byte == 0x5f
        }) else { return nil }
        var standard = String(text.map { $0 == "-" ? "+" : $0 == "_" ? "/" : $0 })
        standard += String(repeating: "=", count: (4 - standard.utf8.count % 4) % 4)
        return Data(base64Encoded: standard).map { Array($0) }
    }
}
