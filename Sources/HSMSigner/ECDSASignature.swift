// Conversion between the two ECDSA signature encodings signerd deals with:
// raw r ‖ s (PKCS#11 CKM_ECDSA output, JWS ES256, IEEE P1363) and DER
// ECDSA-Sig-Value (SEC 1 v2 §C.8, RFC 3279 §2.2.3; what Apple's classic
// promotional offer signature carries). Strict both ways: there is exactly one
// DER encoding of a signature, and anything else is rejected.

/// The NIST prime curves signerd can convert signatures for.
public enum ECCurve: String, Sendable, Hashable, CaseIterable, CustomStringConvertible {
    /// P-256 (secp256r1, prime256v1): the curve of App Store keys.
    case p256 = "P-256"
    /// P-384 (secp384r1).
    case p384 = "P-384"
    /// P-521 (secp521r1).
    case p521 = "P-521"

    /// The length of a field element and of each signature half, in bytes:
    /// 32, 48 or 66.
    public var byteCount: Int {
        switch self {
        case .p256: 32
        case .p384: 48
        case .p521: 66
        }
    }

    /// The DER encoding of the curve's OID, as `CKA_EC_PARAMS` carries it
    /// (PKCS#11 v2.40 §2.3.3, `namedCurve`).
    public var parametersDER: [UInt8] {
        switch self {
        case .p256: [0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07]
        case .p384: [0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22]
        case .p521: [0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x23]
        }
    }

    /// The curve whose OID is `der` (a `CKA_EC_PARAMS` value), if known.
    /// - Parameter der: DER OBJECT IDENTIFIER bytes.
    public init?(parametersDER der: [UInt8]) {
        guard let curve = ECCurve.allCases.first(where: { $0.parametersDER == der }) else { return nil }
        self = curve
    }

    /// OpenSSL's group name: `prime256v1`, `secp384r1`, `secp521r1`.
    public var openSSLName: String {
        switch self {
        case .p256: "prime256v1"
        case .p384: "secp384r1"
        case .p521: "secp521r1"
        }
    }

    /// The curve OpenSSL calls `name` (`prime256v1`/`P-256`/`secp256r1`, …).
    /// - Parameter name: an OpenSSL group name or NIST name.
    public init?(openSSLName name: String) {
        switch name {
        case "prime256v1", "P-256", "secp256r1": self = .p256
        case "secp384r1", "P-384": self = .p384
        case "secp521r1", "P-521": self = .p521
        default: return nil
        }
    }

    /// The NIST name (the raw value), e.g. `P-256`.
    public var description: String { rawValue }
}

/// Why a signature could not be converted. Stable ``code`` values:
/// `raw_length`, `zero_half`, `der_tag`, `der_length`, `der_integer`,
/// `der_negative`, `der_non_minimal`, `der_trailing`, `der_too_large`.
public struct SignatureEncodingError: Error, Hashable, Sendable, CustomStringConvertible {
    /// Stable code for programs.
    public var code: String
    /// A sentence for people.
    public var message: String

    init(_ code: String, _ message: String) {
        self.code = code
        self.message = message
    }

    /// The code and message, e.g. `der_tag: …`.
    public var description: String { "\(code): \(message)" }
}

/// Converts ECDSA signatures between raw `r ‖ s` and DER.
public enum ECDSASignature {
    /// Encodes a raw signature as DER `SEQUENCE { INTEGER r, INTEGER s }`.
    ///
    /// Leading zero bytes of each half are dropped and one `0x00` is added
    /// where the top bit is set, so the INTEGERs are minimal and positive.
    /// P-256 signatures give 8–72 bytes (70–72 for almost all); P-521 uses
    /// the long-form length `0x81`.
    /// - Parameters:
    ///   - raw: exactly `2 × curve.byteCount` bytes (64 for P-256).
    ///   - curve: the curve the signature was made on.
    /// - Returns: the DER bytes.
    /// - Throws: `raw_length` when the length is not exactly twice the
    ///   curve's byte length (odd lengths included), `zero_half` when r or s
    ///   is zero.
    public static func der(fromRaw raw: some Collection<UInt8>, curve: ECCurve) throws(SignatureEncodingError) -> [UInt8] {
        let n = curve.byteCount
        guard raw.count == 2 * n else {
            throw SignatureEncodingError("raw_length", "a raw \(curve) signature is \(2 * n) bytes (r ‖ s, \(n) each); got \(raw.count)")
        }
        let bytes = Array(raw)
        // Where each half's minimal INTEGER content starts: its first
        // non-zero byte, after a 0x00 pad when that byte has the top bit set.
        func firstNonZero(_ start: Int) -> Int? {
            var index = start
            while index < start + n && bytes[index] == 0 { index += 1 }
            return index < start + n ? index : nil
        }
        guard let rStart = firstNonZero(0), let sStart = firstNonZero(n) else {
            throw SignatureEncodingError("zero_half", "r and s must not be zero")
        }
        let rPad = bytes[rStart] & 0x80 != 0, sPad = bytes[sStart] & 0x80 != 0
        let rCount = n - rStart + (rPad ? 1 : 0), sCount = 2 * n - sStart + (sPad ? 1 : 0)
        // At most 2 × (66 + 1) + 4 = 138 bytes: one length byte suffices.
        let body = rCount + sCount + 4
        return [UInt8](unsafeUninitializedCapacity: body + 3) { out, count in
            var position = 0
            func put(_ byte: UInt8) {
                out[position] = byte
                position += 1
            }
            func putInteger(pad: Bool, from start: Int, to end: Int, count: Int) {
                put(0x02)
                put(UInt8(count))
                if pad { put(0x00) }
                for index in start..<end { put(bytes[index]) }
            }
            put(0x30)
            if body >= 0x80 { put(0x81) }
            put(UInt8(body))
            putInteger(pad: rPad, from: rStart, to: n, count: rCount)
            putInteger(pad: sPad, from: sStart, to: 2 * n, count: sCount)
            count = position
        }
    }

    /// Decodes a strict DER `ECDSA-Sig-Value` into raw `r ‖ s`, each half
    /// left-padded with zeros to `curve.byteCount`.
    /// - Parameters:
    ///   - der: the DER bytes, nothing before or after the SEQUENCE.
    ///   - curve: the curve, which fixes the output length.
    /// - Returns: `2 × curve.byteCount` bytes.
    /// - Throws: `der_tag` (not SEQUENCE/INTEGER), `der_length` (indefinite,
    ///   non-minimal or inconsistent lengths), `der_integer` (empty INTEGER),
    ///   `der_negative`, `der_non_minimal` (superfluous leading zero),
    ///   `der_trailing` (bytes after an element), `der_too_large` (a half
    ///   longer than the curve allows), `zero_half`.
    public static func raw(fromDER der: some Collection<UInt8>, curve: ECCurve) throws(SignatureEncodingError) -> [UInt8] {
        let bytes = Array(der)
        var cursor = 0
        let (tag, sequence) = try element(bytes, &cursor)
        guard tag == 0x30 else {
            throw SignatureEncodingError("der_tag", "expected a SEQUENCE (0x30); got tag 0x\(String(tag, radix: 16))")
        }
        guard cursor == bytes.count else {
            throw SignatureEncodingError("der_trailing", "\(bytes.count - cursor) bytes follow the SEQUENCE")
        }
        let inner = Array(bytes[sequence])
        var innerCursor = 0
        let r = try integer(inner, &innerCursor, curve: curve, name: "r")
        let s = try integer(inner, &innerCursor, curve: curve, name: "s")
        guard innerCursor == inner.count else {
            throw SignatureEncodingError("der_trailing", "\(inner.count - innerCursor) bytes follow s inside the SEQUENCE")
        }
        return r + s
    }

    /// Reads one TLV; returns its tag and the range of its contents.
    private static func element(_ bytes: [UInt8], _ cursor: inout Int) throws(SignatureEncodingError) -> (UInt8, Range<Int>) {
        guard cursor + 2 <= bytes.count else {
            throw SignatureEncodingError("der_length", "truncated: no room for a tag and a length")
        }
        let tag = bytes[cursor]
        var length = Int(bytes[cursor + 1])
        cursor += 2
        if length == 0x80 {
            throw SignatureEncodingError("der_length", "indefinite lengths are not DER")
        }
        if length > 0x80 {
            let octets = length & 0x7f
            // No ECDSA signature needs more than one length octet (≤ 255 bytes).
            guard octets == 1 else {
                throw SignatureEncodingError("der_length", "a length of \(octets) octets is longer than any ECDSA signature needs")
            }
            guard cursor < bytes.count else {
                throw SignatureEncodingError("der_length", "truncated length")
            }
            length = Int(bytes[cursor])
            cursor += 1
            guard length >= 0x80 else {
                throw SignatureEncodingError("der_length", "long-form length \(length) must use the short form")
            }
        }
        guard length <= bytes.count - cursor else {
            throw SignatureEncodingError("der_length", "the length \(length) runs past the end (\(bytes.count - cursor) bytes left)")
        }
        let range = cursor..<(cursor + length)
        cursor += length
        return (tag, range)
    }

    private static func integer(_ bytes: [UInt8], _ cursor: inout Int, curve: ECCurve, name: String) throws(SignatureEncodingError) -> [UInt8] {
        let (tag, range) = try element(bytes, &cursor)
        guard tag == 0x02 else {
            throw SignatureEncodingError("der_tag", "expected INTEGER (0x02) for \(name); got tag 0x\(String(tag, radix: 16))")
        }
        guard !range.isEmpty else {
            throw SignatureEncodingError("der_integer", "\(name) is an empty INTEGER")
        }
        var content = bytes[range]
        if content.first! & 0x80 != 0 {  // non-empty: checked above
            throw SignatureEncodingError("der_negative", "\(name) is negative")
        }
        if content.count > 1, content.first == 0x00 {
            guard content[content.startIndex + 1] & 0x80 != 0 else {
                throw SignatureEncodingError("der_non_minimal", "\(name) has a superfluous leading zero byte")
            }
            content = content.dropFirst()
        }
        guard content.count <= curve.byteCount else {
            throw SignatureEncodingError("der_too_large", "\(name) is \(content.count) bytes; \(curve) allows \(curve.byteCount)")
        }
        guard content.contains(where: { $0 != 0 }) else {
            throw SignatureEncodingError("zero_half", "\(name) is zero")
        }
        return [UInt8](repeating: 0, count: curve.byteCount - content.count) + content
    }
}
