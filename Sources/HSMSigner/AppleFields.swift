// Field rules shared by every Apple signature signerd makes (the API
// contract's "Field rules shared by the signing endpoints"), and the classic
// promotional offer payload.

#if canImport(Glibc)
import Glibc
#endif

/// A request field that breaks a rule. ``code`` is one of the contract's
/// error codes (`missing_field`, `invalid_field`, `unknown_field`);
/// ``field`` names the field as the API spells it (`snake_case`);
/// ``message`` says what was expected.
public struct FieldError: Error, Hashable, Sendable, CustomStringConvertible {
    /// Stable error code: `missing_field`, `invalid_field` or `unknown_field`.
    public var code: String
    /// The field at fault, e.g. `timestamp`.
    public var field: String
    /// What was wrong and what was expected.
    public var message: String

    /// Makes a field error.
    /// - Parameters:
    ///   - code: `missing_field`, `invalid_field` or `unknown_field`.
    ///   - field: the API's name for the field.
    ///   - message: a sentence naming the field and the expectation.
    public init(code: String, field: String, message: String) {
        self.code = code
        self.field = field
        self.message = message
    }

    /// `invalid_field` for `field`.
    public static func invalid(_ field: String, _ message: String) -> FieldError {
        FieldError(code: "invalid_field", field: field, message: message)
    }

    /// `missing_field` for `field`.
    public static func missing(_ field: String, _ what: String = "") -> FieldError {
        FieldError(code: "missing_field", field: field, message: what.isEmpty ? "\(field) is required" : "\(field) is required: \(what)")
    }

    /// The code, the field in parentheses and the message, e.g. `invalid_field (timestamp): …`.
    public var description: String { "\(code) (\(field)): \(message)" }
}

/// Apple's field rules, as the API contract states them.
public enum AppleFields {
    /// U+2063 INVISIBLE SEPARATOR, the classic payload's separator.
    public static let separator: Character = "\u{2063}"

    /// Checks an identifier field (`bundle_id`, `product_id`, `offer_id`):
    /// 1–255 UTF-8 bytes, no control characters (Unicode `Cc`), never U+2063.
    /// - Parameters:
    ///   - value: the field's value.
    ///   - field: its API name, for the error.
    /// - Throws: ``FieldError`` `invalid_field` naming the rule broken.
    public static func checkIdentifier(_ value: String, field: String) throws(FieldError) {
        let length = value.utf8.count
        guard length >= 1, length <= 255 else {
            throw .invalid(field, "\(field) must be 1–255 UTF-8 bytes; got \(length)")
        }
        for scalar in value.unicodeScalars {
            if scalar == "\u{2063}" {
                throw .invalid(field, "\(field) must not contain U+2063 INVISIBLE SEPARATOR (it separates the signed fields)")
            }
            if scalar.value < 0x20 || (scalar.value >= 0x7f && scalar.value <= 0x9f) {
                throw .invalid(field, "\(field) must not contain control characters (found U+\(String(scalar.value, radix: 16, uppercase: true).leftPadded(to: 4)))")
            }
        }
    }

    /// Checks a key ID: 10 characters `A-Z0-9`.
    /// - Parameters:
    ///   - value: the key ID.
    ///   - field: its API name (`key_id`).
    /// - Throws: ``FieldError`` `invalid_field`.
    public static func checkKeyID(_ value: String, field: String = "key_id") throws(FieldError) {
        guard KeyID.isValid(value) else {
            throw .invalid(field, "\(field) must be 10 characters A-Z0-9, as App Store Connect shows it")
        }
    }

    /// Normalizes an RFC 4122 UUID string (`8-4-4-4-12` hex digits, any
    /// case) to lowercase, the form Apple expects signed.
    /// - Parameters:
    ///   - value: the UUID text.
    ///   - field: its API name, for the error.
    /// - Returns: the lowercase UUID.
    /// - Throws: ``FieldError`` `invalid_field` when `value` is not a UUID.
    public static func normalizeUUID(_ value: String, field: String) throws(FieldError) -> String {
        var value = value
        // 0: not a UUID, 1: a lowercase UUID, 2: a UUID with uppercase digits.
        let form = value.withUTF8 { bytes -> Int in
            guard bytes.count == 36 else { return 0 }
            var form = 1
            for index in 0..<36 {
                let byte = bytes[index]
                if index == 8 || index == 13 || index == 18 || index == 23 {
                    guard byte == UInt8(ascii: "-") else { return 0 }
                    continue
                }
                switch byte {
                case UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "a")...UInt8(ascii: "f"): continue
                case UInt8(ascii: "A")...UInt8(ascii: "F"): form = 2
                default: return 0
                }
            }
            return form
        }
        switch form {
        case 1:
            return value  // already as signed: no copy
        case 2:
            return value.withUTF8 { bytes in
                String(unsafeUninitializedCapacity: 36) { out in
                    for index in 0..<36 {
                        let byte = bytes[index]
                        out[index] = byte >= UInt8(ascii: "A") && byte <= UInt8(ascii: "F") ? byte + 0x20 : byte
                    }
                    return 36
                }
            }
        default:
            throw .invalid(field, "\(field) must be a UUID (8-4-4-4-12 hexadecimal digits, e.g. 4a0f7b8e-2f1d-4c6a-9b3e-5d7c8e9f0a1b)")
        }
    }

    /// Normalizes an app account token: empty stays empty (Apple signs the
    /// empty string when the purchase sets no token), a UUID is lowercased.
    /// - Parameter value: the token, or empty.
    /// - Returns: `""` or the lowercase UUID.
    /// - Throws: ``FieldError`` `invalid_field` (`app_account_token`).
    public static func normalizeAppAccountToken(_ value: String) throws(FieldError) -> String {
        guard !value.isEmpty else { return "" }
        do throws(FieldError) {
            return try normalizeUUID(value, field: "app_account_token")
        } catch {
            throw .invalid("app_account_token", error.message + ", or empty for a purchase that sets no app account token")
        }
    }

    /// A fresh random UUID v4 (RFC 4122 §4.4), lowercase: 122 random bits
    /// from OpenSSL's DRBG (through ``BufferedRandom``: a nonce is public
    /// once signed).
    public static func randomUUID() -> String {
        var bytes: (UInt64, UInt64) = (0, 0)
        return withUnsafeMutableBytes(of: &bytes) { raw in
            BufferedRandom.fill(raw)
            raw[6] = (raw[6] & 0x0f) | 0x40
            raw[8] = (raw[8] & 0x3f) | 0x80
            return String(unsafeUninitializedCapacity: 36) { out in
                var position = 0
                for index in 0..<16 {
                    if index == 4 || index == 6 || index == 8 || index == 10 {
                        out[position] = UInt8(ascii: "-")
                        position += 1
                    }
                    out[position] = hexDigit(raw[index] >> 4)
                    out[position + 1] = hexDigit(raw[index] & 0x0f)
                    position += 2
                }
                return position
            }
        }
    }

    /// The lowercase hexadecimal digit for `value` (0–15).
    private static func hexDigit(_ value: UInt8) -> UInt8 {
        value < 10 ? UInt8(ascii: "0") + value : UInt8(ascii: "a") + value - 10
    }

    /// How far back a promotional offer timestamp may lie: 24 h, in milliseconds.
    public static let timestampMaximumAge: Int64 = 24 * 60 * 60 * 1000
    /// How far ahead of now a timestamp may lie: 5 min, in milliseconds.
    public static let timestampMaximumSkew: Int64 = 5 * 60 * 1000

    /// Checks a promotional offer timestamp: UNIX time in milliseconds,
    /// within the last 24 hours and at most 5 minutes ahead of `now`.
    /// - Parameters:
    ///   - timestamp: the value given, milliseconds since 1970-01-01 UTC.
    ///   - now: the current time in milliseconds.
    /// - Throws: ``FieldError`` `invalid_field` (`timestamp`). A positive
    ///   value of 10 digits or fewer gets a message saying it looks like
    ///   seconds and milliseconds are expected (with "multiply by 1000" when
    ///   that lands in the window); 11 digits, that 13 are expected; one
    ///   in the future that is microseconds or nanoseconds of a time in the
    ///   window, to divide by 1000 or 1000000.
    public static func checkTimestamp(_ timestamp: Int64, now: Int64) throws(FieldError) {
        let window = (now - timestampMaximumAge)...(now + timestampMaximumSkew)
        if timestamp > 0, timestamp < 10_000_000_000 {
            let hint = window.contains(timestamp * 1000) ? " — multiply by 1000" : ""
            throw .invalid("timestamp", "timestamp must be UNIX time in milliseconds (13 digits); \(timestamp) looks like UNIX time in seconds\(hint)")
        }
        if timestamp >= 10_000_000_000, timestamp < 100_000_000_000 {
            throw .invalid("timestamp", "timestamp must be UNIX time in milliseconds (13 digits); \(timestamp) has 11 digits and is more than 24 hours in the past")
        }
        if timestamp < now - timestampMaximumAge {
            throw .invalid("timestamp", "timestamp \(timestamp) is more than 24 hours in the past; Apple accepts a signed offer for 24 hours (UNIX time in milliseconds)")
        }
        if timestamp > now + timestampMaximumSkew {
            // 16 or 19 digits: a clock read in microseconds or nanoseconds.
            let unit = [(1_000, "microseconds", "divide by 1000"), (1_000_000, "nanoseconds", "divide by 1000000")]
                .first { window.contains(timestamp / $0.0) }
            let hint = unit.map { "; \(timestamp) looks like UNIX time in \($0.1) — \($0.2)" } ?? ""
            throw .invalid("timestamp", "timestamp \(timestamp) is more than 5 minutes in the future (UNIX time in milliseconds, 13 digits; now is \(now))\(hint)")
        }
    }

    /// The current UNIX time in milliseconds (`CLOCK_REALTIME`).
    public static func nowMilliseconds() -> Int64 {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        return Int64(now.tv_sec) * 1000 + Int64(now.tv_nsec) / 1_000_000
    }

    /// Checks an App Store transaction ID: digits only, 1–64 characters.
    /// - Parameter value: the transaction ID.
    /// - Throws: ``FieldError`` `invalid_field` (`transaction_id`).
    public static func checkTransactionID(_ value: String) throws(FieldError) {
        guard (1...64).contains(value.utf8.count), value.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) else {
            throw .invalid("transaction_id", "transaction_id must be 1–64 decimal digits (an App Store transaction ID)")
        }
    }
}

/// The seven values of a classic promotional offer signature, checked and
/// normalized (Apple: "Generating a signature for promotional offers").
///
/// ``payload`` is what gets hashed and signed: the values joined by U+2063,
/// UTF-8, no trailing separator.
public struct PromotionalOfferPayload: Sendable, Hashable {
    /// The app's bundle ID, e.g. `com.example.app`.
    public let bundleID: String
    /// The 10-character ID of the In-App Purchase key that signs.
    public let keyID: String
    /// The product identifier of the subscription.
    public let productID: String
    /// The promotional offer identifier set in App Store Connect.
    public let offerID: String
    /// Empty, or the lowercase app account token UUID.
    public let appAccountToken: String
    /// The lowercase nonce UUID.
    public let nonce: String
    /// UNIX time in milliseconds.
    public let timestamp: Int64

    /// Checks and normalizes the seven values. The timestamp window is not
    /// checked here (see ``AppleFields/checkTimestamp(_:now:)``), so that
    /// fixed vectors stay reproducible.
    /// - Parameters:
    ///   - bundleID: 1–255 UTF-8 bytes, no control characters, no U+2063.
    ///   - keyID: 10 characters `A-Z0-9`.
    ///   - productID: as `bundleID`.
    ///   - offerID: as `bundleID`.
    ///   - appAccountToken: empty or a UUID in any case.
    ///   - nonce: a UUID in any case.
    ///   - timestamp: milliseconds; must be positive.
    /// - Throws: ``FieldError`` naming the first field at fault.
    public init(bundleID: String, keyID: String, productID: String, offerID: String,
                appAccountToken: String, nonce: String, timestamp: Int64) throws(FieldError) {
        try AppleFields.checkIdentifier(bundleID, field: "bundle_id")
        try AppleFields.checkKeyID(keyID)
        try AppleFields.checkIdentifier(productID, field: "product_id")
        try AppleFields.checkIdentifier(offerID, field: "offer_id")
        self.bundleID = bundleID
        self.keyID = keyID
        self.productID = productID
        self.offerID = offerID
        self.appAccountToken = try AppleFields.normalizeAppAccountToken(appAccountToken)
        self.nonce = try AppleFields.normalizeUUID(nonce, field: "nonce")
        guard timestamp > 0 else {
            throw .invalid("timestamp", "timestamp must be a positive UNIX time in milliseconds")
        }
        self.timestamp = timestamp
    }

    /// The same checked values, signed by `keyID` instead: only the key ID
    /// is checked again (the signer chooses the key after the fields are
    /// checked, so that a bad value is refused whatever the key).
    /// - Parameter keyID: 10 characters `A-Z0-9`.
    /// - Throws: ``FieldError`` `invalid_field` (`key_id`).
    public func signed(by keyID: String) throws(FieldError) -> PromotionalOfferPayload {
        try AppleFields.checkKeyID(keyID)
        return PromotionalOfferPayload(checked: self, keyID: keyID)
    }

    private init(checked: PromotionalOfferPayload, keyID: String) {
        bundleID = checked.bundleID
        self.keyID = keyID
        productID = checked.productID
        offerID = checked.offerID
        appAccountToken = checked.appAccountToken
        nonce = checked.nonce
        timestamp = checked.timestamp
    }

    /// The bytes Apple verifies: `bundle_id ⁣ key_id ⁣ product_id ⁣ offer_id ⁣
    /// app_account_token ⁣ nonce ⁣ timestamp`, UTF-8.
    public var payload: [UInt8] {
        let separator: [UInt8] = [0xe2, 0x81, 0xa3]
        var out: [UInt8] = []
        out.reserveCapacity(bundleID.utf8.count + productID.utf8.count + offerID.utf8.count + 120)
        let parts = [bundleID, keyID, productID, offerID, appAccountToken, nonce, String(timestamp)]
        for (index, part) in parts.enumerated() {
            if index > 0 { out.append(contentsOf: separator) }
            out.append(contentsOf: part.utf8)
        }
        return out
    }
}

extension String {
    func leftPadded(to width: Int, with pad: Character = "0") -> String {
        count >= width ? self : String(repeating: pad, count: width - count) + self
    }
}
