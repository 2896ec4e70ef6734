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
    /// - Throws: ``JWSError``; `jws_base64url` names the part that is not
    ///   canonical base64url (see ``Base64URL/decode(_:)``).
    public static func decode(_ token: String) throws(JWSError) -> Decoded {
        let parts = token.split(separator: ".", omittingEmptySubsequences: false)
        guard parts.count == 3 else {
            throw JWSError("jws_format", "a compact JWS has 3 parts separated by '.'; got \(parts.count)")
        }
        let header = try decodePart(parts[0], "the header (part 1)")
        let claims = try decodePart(parts[1], "the claims (part 2)")
        let signature = try decodePart(parts[2], "the signature (part 3)")
        let headerText = String(decoding: header, as: UTF8.self)
        // RFC 7515 §5.2: UTF-8 JSON. Foundation's parser alone would also
        // take UTF-16, a byte-order mark or a trailing comma, which Apple's
        // need not, and `signctl verify jws --json` prints these parts as they are.
        guard let headerObject = (try? JSONText.parse(header))?.value as? [String: Any],
              (try? JSONText.parse(claims))?.value is [String: Any] else {
            throw JWSError("jws_json", "the header and the claims must each be a JSON object in UTF-8 (RFC 7515 §5.2; no byte-order mark, no trailing comma)")
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

    /// Decodes one part of a compact JWS, naming it when it is not canonical base64url.
    /// - Parameters:
    ///   - part: the part's text.
    ///   - name: the part for the error, e.g. `the signature (part 3)`.
    /// - Throws: ``JWSError`` `jws_base64url`.
    private static func decodePart(_ part: Substring, _ name: String) throws(JWSError) -> [UInt8] {
        guard let bytes = Base64URL.decode(String(part)) else {
            throw JWSError("jws_base64url", "\(name) is not canonical base64url (RFC 7515 §2, RFC 4648 §5): only A-Z a-z 0-9 - _, no '=' padding, and the unused low bits of the last character zero")
        }
        return bytes
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

    /// Decodes unpadded base64url, strictly: only the canonical encoding of
    /// some bytes is accepted (RFC 4648 §3.5), so each byte string has
    /// exactly one text form.
    /// - Parameter text: base64url without padding.
    /// - Returns: the bytes; nil when the text holds `+`, `/`, `=`,
    ///   whitespace or anything else outside the base64url alphabet, has a
    ///   length of 4n + 1 characters, or its last character has non-zero
    ///   unused low bits (`AB` where `AA` encodes the same byte).
    public static func decode(_ text: String) -> [UInt8]? {
        guard text.utf8.allSatisfy({ value(of: $0) != nil }) else { return nil }
        // The last character of 2 (or 3) carries 12 (or 18) bits for 8 (or 16): the low 4 (or 2) are padding and must be zero.
        let unusedBits: UInt8
        switch text.utf8.count % 4 {
        case 1: return nil
        case 2: unusedBits = 0x0f
        case 3: unusedBits = 0x03
        default: unusedBits = 0
        }
        if let last = text.utf8.last, let lastValue = value(of: last), lastValue & unusedBits != 0 {
            return nil
        }
        var standard = String(text.map { $0 == "-" ? "+" : $0 == "_" ? "/" : $0 })
        standard += String(repeating: "=", count: (4 - standard.utf8.count % 4) % 4)
        return Data(base64Encoded: standard).map { Array($0) }
    }

    /// The 6-bit value of a base64url character (RFC 4648 §5, table 2), or nil outside the alphabet.
    private static func value(of byte: UInt8) -> UInt8? {
        switch byte {
        case UInt8(ascii: "A")...UInt8(ascii: "Z"): byte - UInt8(ascii: "A")
        case UInt8(ascii: "a")...UInt8(ascii: "z"): byte - UInt8(ascii: "a") + 26
        case UInt8(ascii: "0")...UInt8(ascii: "9"): byte - UInt8(ascii: "0") + 52
        case UInt8(ascii: "-"): 62
        case UInt8(ascii: "_"): 63
        default: nil
        }
    }
}
