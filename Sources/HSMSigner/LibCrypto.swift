// signerd's libcrypto wrapper: SHA-256, public keys, verification, random
// bytes. KeyFile.swift (PKCS#8), SecureBytes.swift (OPENSSL_cleanse) and
// PKCS11Module.swift (public points for import) also import CLibCrypto.
// OpenSSL types never leave them: callers see `ECPublicKey`, byte arrays
// and `CryptoError`.
internal import CLibCrypto
internal import CSignerShim

/// An error from the OpenSSL side of signerd: key files, public keys and
/// signature verification.
///
/// ``code`` is stable and meant for programs; ``message`` is for people and
/// never contains key material. ``openSSLErrors`` holds what OpenSSL's error
/// queue said (`ERR_error_string_n`), drained when the error was made.
public struct CryptoError: Error, Hashable, Sendable, CustomStringConvertible {
    /// Stable error codes.
    public struct Code: RawRepresentable, Hashable, Sendable, CustomStringConvertible {
        /// The code as programs see it, e.g. `key_file_invalid`.
        public var rawValue: String
        /// Makes a code from its spelling.
        public init(rawValue: String) { self.rawValue = rawValue }
        /// The raw value.
        public var description: String { rawValue }

        /// The key file could not be read (missing, permissions, too large).
        public static let keyFileUnreadable = Code(rawValue: "key_file_unreadable")
        /// The file is not a PEM PKCS#8 or SEC1 private key.
        public static let keyFileInvalid = Code(rawValue: "key_file_invalid")
        /// The key is not an EC key (RSA, Ed25519, …).
        public static let unsupportedKeyType = Code(rawValue: "unsupported_key_type")
        /// The key is EC but not on P-256 (prime256v1).
        public static let unsupportedCurve = Code(rawValue: "unsupported_curve")
        /// A public key (PEM, DER or EC point) could not be parsed.
        public static let publicKeyInvalid = Code(rawValue: "public_key_invalid")
        /// An OpenSSL call failed where the input was valid (a bug or out of memory).
        public static let internalFailure = Code(rawValue: "openssl_failure")
    }

    /// What went wrong, stable for programs.
    public var code: Code
    /// A human sentence; never contains secrets.
    public var message: String
    /// The OpenSSL error queue at the time of the error, oldest first.
    public var openSSLErrors: [String]

    /// Makes an error and drains OpenSSL's error queue into it.
    /// - Parameters:
    ///   - code: the stable code.
    ///   - message: a sentence for the operator.
    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
        self.openSSLErrors = CryptoError.drainQueue()
    }

    /// The code and message, then OpenSSL's queued errors in parentheses
    /// (joined by `; `) when there are any; for `signctl`'s error line.
    public var description: String {
        openSSLErrors.isEmpty ? "\(code): \(message)" : "\(code): \(message) (\(openSSLErrors.joined(separator: "; ")))"
    }

    /// Empties OpenSSL's per-thread error queue and returns its messages.
    static func drainQueue() -> [String] {
        var messages: [String] = []
        while true {
            let code = ERR_get_error()
            if code == 0 { break }
            var buffer = [CChar](repeating: 0, count: 256)
            ERR_error_string_n(code, &buffer, buffer.count)
            if messages.count < 8 {
                messages.append(String(decoding: buffer.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self))
            }
        }
        return messages
    }
}

/// The one checking helper for libcrypto: OpenSSL returns 1 on success.
@inline(__always)
func checkOpenSSL(_ result: Int32, _ code: CryptoError.Code = .internalFailure, _ what: @autoclosure () -> String) throws(CryptoError) {
    guard result == 1 else { throw CryptoError(code, what()) }
}

/// SHA-256 (FIPS 180-4) computed by OpenSSL.
public enum SHA256 {
    /// The digest length in bytes (32).
    public static let byteCount = 32

    /// Hashes `bytes`.
    /// - Parameter bytes: the message, any length.
    /// - Returns: 32 bytes.
    public static func hash(_ bytes: some ContiguousBytes) -> [UInt8] {
        bytes.withUnsafeBytes { buffer in
            [UInt8](unsafeUninitializedCapacity: 32) { out, count in
                // EVP_Digest with the implementation fetched once (OpenSSL 3
                // otherwise looks the algorithm up in the provider on every
                // call); it cannot fail on a valid buffer.
                if let algorithm = SHA256.algorithm {
                    _ = EVP_Digest(buffer.baseAddress, buffer.count, out.baseAddress, nil, algorithm, nil)
                } else {
                    _ = CLibCrypto.SHA256(buffer.baseAddress?.assumingMemoryBound(to: UInt8.self), buffer.count, out.baseAddress)
                }
                count = 32
            }
        }
    }

    /// SHA-256 from the default provider (`EVP_MD_fetch`), kept for the process's life.
    nonisolated(unsafe) private static let algorithm: OpaquePointer? = EVP_MD_fetch(nil, "SHA256", nil)
}

/// Byte containers that can lend their contiguous storage.
public protocol ContiguousBytes {
    /// Calls `body` with the bytes.
    func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R
}

extension Array: ContiguousBytes where Element == UInt8 {}
extension ArraySlice: ContiguousBytes where Element == UInt8 {}
extension UnsafeRawBufferPointer: ContiguousBytes {
    /// Calls `body` with this buffer itself.
    /// - Parameter body: reads the bytes; the pointer is valid only during the call.
    /// - Returns: what `body` returns.
    /// - Throws: what `body` throws.
    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R { try body(self) }
}
extension String.UTF8View: ContiguousBytes {
    /// Calls `body` with the string's UTF-8 bytes: its contiguous storage when
    /// it has one, else a temporary copy.
    /// - Parameter body: reads the bytes; the pointer is valid only during the call.
    /// - Returns: what `body` returns.
    /// - Throws: what `body` throws.
    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R {
        if let result = try self.withContiguousStorageIfAvailable({ try body(UnsafeRawBufferPointer($0)) }) {
            return result
        }
        return try Array(self).withUnsafeBytes(body)
    }
}

/// Owner of one `EVP_PKEY` (OpenSSL 3), freed in `deinit`.
final class EVPKey: @unchecked Sendable {
    // An EVP_PKEY is reference counted and safe to use from several threads
    // for verification (each operation makes its own EVP_PKEY_CTX); nothing
    // mutates it after construction.
    let pointer: OpaquePointer

    init(taking pointer: OpaquePointer) {
        self.pointer = pointer
    }

    deinit {
        EVP_PKEY_free(pointer)
    }
}

/// An EC public key (P-256, P-384 or P-521) held by OpenSSL, used to verify
/// every signature signerd produces and to export the key as PEM.
///
/// Instances are immutable and safe to share between threads.
public final class ECPublicKey: Sendable, Equatable {
    let key: EVPKey
    /// The curve of the key.
    public let curve: ECCurve
    /// The uncompressed SEC1 point `04 ‖ X ‖ Y` (65 bytes for P-256).
    public let uncompressedPoint: [UInt8]

    init(key: EVPKey) throws(CryptoError) {
        self.key = key
        guard EVP_PKEY_get_base_id(key.pointer) == EVP_PKEY_EC else {
            throw CryptoError(.unsupportedKeyType, "the public key is not an EC key")
        }
        guard let curve = ECPublicKey.curve(of: key.pointer) else {
            throw CryptoError(.unsupportedCurve, "the public key is not on P-256, P-384 or P-521")
        }
        self.curve = curve
        var point = [UInt8](repeating: 0, count: 1 + 2 * curve.byteCount)
        var written = 0
        try checkOpenSSL(
            EVP_PKEY_get_octet_string_param(key.pointer, OSSL_PKEY_PARAM_ENCODED_PUBLIC_KEY, &point, point.count, &written),
            .publicKeyInvalid, "cannot read the EC point of the public key")
        guard written == point.count, point[0] == 0x04 else {
            throw CryptoError(.publicKeyInvalid, "the public key's EC point is not in uncompressed form")
        }
        self.uncompressedPoint = point
    }

    static func curve(of key: OpaquePointer) -> ECCurve? {
        var name = [CChar](repeating: 0, count: 64)
        var length = 0
        guard EVP_PKEY_get_utf8_string_param(key, OSSL_PKEY_PARAM_GROUP_NAME, &name, name.count, &length) == 1 else {
            return nil
        }
        return ECCurve(openSSLName: String(decoding: name.prefix(length).map { UInt8(bitPattern: $0) }, as: UTF8.self))
    }

    /// Parses a PEM `-----BEGIN PUBLIC KEY-----` (SubjectPublicKeyInfo,
    /// RFC 5480) as written by `openssl ec -pubout`.
    /// - Parameter pem: the PEM text.
    /// - Throws: ``CryptoError/Code/publicKeyInvalid``, ``CryptoError/Code/unsupportedKeyType``,
    ///   ``CryptoError/Code/unsupportedCurve``.
    public convenience init(pem: String) throws(CryptoError) {
        ERR_clear_error()
        var text = pem
        let parsed: OpaquePointer? = text.withUTF8 { utf8 in
            guard let bio = BIO_new_mem_buf(utf8.baseAddress, Int32(utf8.count)) else { return nil }
            defer { BIO_free(bio) }
            return PEM_read_bio_PUBKEY(bio, nil, nil, nil)
        }
        guard let parsed else {
            throw CryptoError(.publicKeyInvalid, "not a PEM SubjectPublicKeyInfo (expected -----BEGIN PUBLIC KEY-----)")
        }
        try self.init(key: EVPKey(taking: parsed))
    }

    /// Builds a key from an uncompressed SEC1 point (`04 ‖ X ‖ Y`), as read
    /// from a token's `CKA_EC_POINT`.
    /// - Parameters:
    ///   - curve: the curve the point lies on.
    ///   - uncompressedPoint: `1 + 2 × curve.byteCount` bytes.
    /// - Throws: ``CryptoError/Code/publicKeyInvalid`` when the point is not on the curve.
    public convenience init(curve: ECCurve, uncompressedPoint: [UInt8]) throws(CryptoError) {
        guard uncompressedPoint.count == 1 + 2 * curve.byteCount, uncompressedPoint.first == 0x04 else {
            throw CryptoError(.publicKeyInvalid, "an uncompressed \(curve) point is \(1 + 2 * curve.byteCount) bytes starting 0x04; got \(uncompressedPoint.count) bytes")
        }
        ERR_clear_error()
        let pkey: OpaquePointer? = uncompressedPoint.withUnsafeBytes { point in
            CSignerShim_ec_public_key(curve.openSSLName, point.baseAddress?.assumingMemoryBound(to: UInt8.self), point.count)
        }
        guard let pkey else {
            throw CryptoError(.publicKeyInvalid, "the EC point is not on \(curve)")
        }
        let owned = EVPKey(taking: pkey)
        try self.init(key: owned)
    }

    /// The key as DER SubjectPublicKeyInfo (RFC 5480), named curve,
    /// uncompressed point: 91 bytes for P-256.
    public var subjectPublicKeyInfoDER: [UInt8] {
        let length = i2d_PUBKEY(key.pointer, nil)
        guard length > 0 else { return [] }
        return [UInt8](unsafeUninitializedCapacity: Int(length)) { buffer, count in
            var cursor = buffer.baseAddress
            count = Int(i2d_PUBKEY(key.pointer, &cursor))
        }
    }

    /// The key as PEM `-----BEGIN PUBLIC KEY-----`, byte-identical to
    /// `openssl ec -in FILE.p8 -pubout` (64-column Base64, trailing newline).
    public var pem: String {
        guard let bio = BIO_new(BIO_s_mem()) else { return "" }
        defer { BIO_free(bio) }
        guard PEM_write_bio_PUBKEY(bio, key.pointer) == 1 else { return "" }
        var data: UnsafeMutablePointer<CChar>?
        let length = CSignerShim_bio_mem_data(bio, &data)
        guard length > 0, let data else { return "" }
        return String(decoding: UnsafeRawBufferPointer(start: data, count: length), as: UTF8.self)
    }

    /// SHA-256 of ``subjectPublicKeyInfoDER`` as lowercase hex, the key's
    /// fingerprint in `signctl keys list`.
    public var fingerprint: String {
        SHA256.hash(subjectPublicKeyInfoDER).hexString
    }

    /// Verifies an ECDSA signature over a precomputed digest
    /// (`EVP_PKEY_verify`, strict DER as OpenSSL 3 parses it).
    /// - Parameters:
    ///   - derSignature: the DER `ECDSA-Sig-Value` (SEQUENCE of two INTEGERs).
    ///   - digest: the hash that was signed (32 bytes for SHA-256).
    /// - Returns: true when the signature is valid for this key.
    public func verify(derSignature: some ContiguousBytes, digest: some ContiguousBytes) -> Bool {
        guard let context = EVP_PKEY_CTX_new_from_pkey(nil, key.pointer, nil) else {
            _ = CryptoError.drainQueue()
            return false
        }
        defer { EVP_PKEY_CTX_free(context) }
        guard EVP_PKEY_verify_init(context) == 1 else {
            _ = CryptoError.drainQueue()
            return false
        }
        let result = derSignature.withUnsafeBytes { signature in
            digest.withUnsafeBytes { hash in
                EVP_PKEY_verify(context,
                                signature.baseAddress?.assumingMemoryBound(to: UInt8.self), signature.count,
                                hash.baseAddress?.assumingMemoryBound(to: UInt8.self), hash.count)
            }
        }
        if result != 1 {
            _ = CryptoError.drainQueue()
        }
        return result == 1
    }

    /// Verifies a raw `r ‖ s` signature (as PKCS#11 `CKM_ECDSA` and JWS
    /// ES256 carry it) over a precomputed digest.
    /// - Parameters:
    ///   - rawSignature: `2 × curve.byteCount` bytes.
    ///   - digest: the hash that was signed.
    /// - Returns: true when the signature is valid for this key; false also
    ///   when `rawSignature` is malformed.
    public func verify(rawSignature: [UInt8], digest: some ContiguousBytes) -> Bool {
        guard let der = try? ECDSASignature.der(fromRaw: rawSignature, curve: curve) else {
            return false
        }
        return verify(derSignature: der, digest: digest)
    }

    /// Two keys are equal when their curves and uncompressed points
    /// (SEC 1 v2 §2.3.3) are equal.
    public static func == (lhs: ECPublicKey, rhs: ECPublicKey) -> Bool {
        lhs.curve == rhs.curve && lhs.uncompressedPoint == rhs.uncompressedPoint
    }
}

/// Cryptographically secure random bytes from OpenSSL's DRBG (`RAND_bytes`).
public enum SecureRandom {
    /// Fills `buffer` with random bytes.
    /// - Parameter buffer: the bytes to overwrite.
    public static func fill(_ buffer: UnsafeMutableRawBufferPointer) {
        guard buffer.count > 0 else { return }
        // RAND_bytes fails only when the DRBG cannot be seeded, which leaves
        // no safe way to make nonces; stopping is the right answer.
        guard RAND_bytes(buffer.baseAddress?.assumingMemoryBound(to: UInt8.self), Int32(buffer.count)) == 1 else {
            fatalError("RAND_bytes failed: OpenSSL's random generator is not seeded")
        }
    }

    /// Returns `count` random bytes.
    /// - Parameter count: how many bytes.
    public static func bytes(_ count: Int) -> [UInt8] {
        var out = [UInt8](repeating: 0, count: count)
        out.withUnsafeMutableBytes { fill($0) }
        return out
    }
}

/// Random bytes for values that are public once used (the nonces signerd
/// makes), drawn from OpenSSL's DRBG (`RAND_bytes`) 4 KiB at a time: each
/// `RAND_bytes` call costs about 6,700 instructions whatever its length
/// (callgrind, OpenSSL 3.0), more than the rest of making a UUID.
/// Never for keys or other secrets: bytes not yet handed out sit in this
/// process's memory until used.
public enum BufferedRandom {
    private struct Pool {
        var bytes = [UInt8](repeating: 0, count: 4096)
        /// The next byte to hand out; `bytes.count` when the pool is spent.
        var next = 4096
    }

    private static let pool = Locked(Pool())

    /// Fills `buffer` with random bytes never handed out before.
    /// - Parameter buffer: the bytes to overwrite, at most 4096.
    public static func fill(_ buffer: UnsafeMutableRawBufferPointer) {
        precondition(buffer.count <= 4096, "BufferedRandom hands out at most 4096 bytes at a time")
        pool.withLock { pool in
            if pool.bytes.count - pool.next < buffer.count {
                pool.bytes.withUnsafeMutableBytes { SecureRandom.fill($0) }
                pool.next = 0
            }
            pool.bytes.withUnsafeBytes { source in
                buffer.copyMemory(from: UnsafeRawBufferPointer(rebasing: source[pool.next..<(pool.next + buffer.count)]))
            }
            pool.next += buffer.count
        }
    }
}

extension Sequence where Element == UInt8 {
    /// Lowercase hexadecimal, two digits a byte.
    public var hexString: String {
        let digits: [UInt8] = Array("0123456789abcdef".utf8)
        var out: [UInt8] = []
        out.reserveCapacity(underestimatedCount * 2)
        for byte in self {
            out.append(digits[Int(byte >> 4)])
            out.append(digits[Int(byte & 0x0f)])
        }
        return String(decoding: out, as: UTF8.self)
    }
}
