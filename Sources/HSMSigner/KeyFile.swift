// Reading an App Store In-App Purchase key file (.p8). OpenSSL parses the
// PEM, PKCS#8 and SEC1 structures; this file only checks what it got and
// moves the scalar into a wiped buffer.
internal import CLibCrypto

#if canImport(Glibc)
import Glibc
#endif

/// The private and public halves of an EC P-256 key read from a `.p8` file,
/// ready to be imported into a token.
///
/// Accepts what Apple and other tools write: PEM PKCS#8
/// (`-----BEGIN PRIVATE KEY-----`: Apple's form, 147 content bytes with the
/// curve repeated inside and the public key; OpenSSL's, 135 content bytes
/// with the public key; and forms without the public key) and SEC1 (`-----BEGIN EC PRIVATE KEY-----`),
/// with LF, CRLF or CR line endings, lines indented or with trailing
/// whitespace (a key pasted from an e-mail or a YAML file). The scalar lives
/// in a ``SecureBytes`` buffer that is wiped when this object is released.
public final class ECPrivateKeyMaterial: Sendable {
    /// Always ``ECCurve/p256``: App Store keys are P-256 and nothing else is accepted.
    public let curve: ECCurve
    /// The private scalar `d`, big-endian, left-padded to 32 bytes.
    public let scalar: SecureBytes
    /// The public key (computed by OpenSSL when the file does not embed it).
    public let publicKey: ECPublicKey
    /// Whether the file holds text before the private key's PEM block
    /// besides an `EC PARAMETERS` block (which `openssl ecparam -genkey`
    /// writes before a SEC1 key): a certificate, a public key or other words
    /// that OpenSSL skipped. Only the private key is read; a caller may warn
    /// that the file may not be the one meant. (Anything but blanks after
    /// the key's `-----END` line is refused, and so is a `PUBLIC KEY` block
    /// of another key.)
    public let hasOtherText: Bool

    /// Largest key file read, in bytes; real ones are about 250.
    public static let maximumFileSize = 64 * 1024

    /// Parses PEM key text held in a secure buffer.
    /// - Parameter pem: the file's bytes.
    /// - Throws: ``CryptoError/Code/keyFileInvalid`` (not a PEM private key,
    ///   each with its own headline: an empty file, UTF-16 text, more than one PEM private
    ///   key, an encrypted key, anything but blanks after the key's `-----END`
    ///   line, bytes inside the Base64 after the PKCS#8 or SEC1 structure,
    ///   a public point off the curve, an embedded
    ///   public key that is not the private key's: `EVP_PKEY_pairwise_check`),
    ///   ``CryptoError/Code/unsupportedKeyType`` (RSA, Ed25519, …),
    ///   ``CryptoError/Code/unsupportedCurve`` (any curve but P-256, named).
    public init(pem: SecureBytes) throws(CryptoError) {
        ERR_clear_error()  // drop what other libraries (a PKCS#11 module's engine loading) left behind
        let text = pem.withUnsafeBytes { bytes in (empty: bytes.allSatisfy { [0x20, 0x09, 0x0a, 0x0d].contains($0) },
                                                   encrypted: ECPrivateKeyMaterial.count(bytes, "-----BEGIN ENCRYPTED") + ECPrivateKeyMaterial.count(bytes, "Proc-Type: 4,ENCRYPTED") > 0,
                                                   keys: ECPrivateKeyMaterial.count(bytes, "-----BEGIN ") == 0 ? 0 : ECPrivateKeyMaterial.count(bytes, "PRIVATE KEY-----") / 2) }
        guard !text.empty else {
            throw CryptoError(.keyFileInvalid, "the key file is empty")
        }
        // A .p8 opened and saved again by a Windows editor can come back as UTF-16.
        let utf16 = pem.withUnsafeBytes { bytes in
            bytes.starts(with: [0xFF, 0xFE]) || bytes.starts(with: [0xFE, 0xFF])
                || ECPrivateKeyMaterial.count(bytes, "-\0-\0-\0-\0-\0B\0E\0G\0I\0N\0") + ECPrivateKeyMaterial.count(bytes, "\0-\0-\0-\0-\0-\0B\0E\0G\0I\0N") > 0
        }
        guard !utf16 else {
            throw CryptoError(.keyFileInvalid, "the key file is UTF-16 text, not the ASCII PEM Apple delivers (it was saved again by an editor); convert it with: iconv -f UTF-16 -t ASCII FILE > AuthKey_KEYID.p8, then import that")
        }
        guard text.keys <= 1 else {
            throw CryptoError(.keyFileInvalid, "the key file holds \(text.keys) PEM private keys; put each key in a file of its own (import reads one key per file, and which one was meant cannot be told)")
        }
        guard !text.encrypted else {
            throw CryptoError(.keyFileInvalid, "the key file is encrypted (-----BEGIN ENCRYPTED PRIVATE KEY----- or Proc-Type: 4,ENCRYPTED); export it unencrypted as Apple delivers it (-----BEGIN PRIVATE KEY-----)")
        }
        let layout = ECPrivateKeyMaterial.normalizedLayout(pem)
        // OpenSSL reads the first key and ignores what follows its END line
        // (and refuses text on that line, calling the block undecodable):
        // neither is in a file as App Store Connect delivers it.
        if let trailing = layout.withUnsafeBytes(ECPrivateKeyMaterial.textAfterKey) {
            throw CryptoError(.keyFileInvalid, "the key file goes on after its \(trailing.endLine) line: \(trailing.found) (\(trailing.bytes) \(trailing.bytes == 1 ? "byte" : "bytes"), not shown, since they may be key material); "
                              + "a .p8 from App Store Connect ends with that line, so this file was put together or damaged after it was downloaded: if you appended a certificate, a public key or a note, "
                              + "remove everything after the \(trailing.endLine) line and check that the key is the one App Store Connect lists under its key ID; otherwise use an intact copy of the .p8")
        }
        hasOtherText = layout.withUnsafeBytes(ECPrivateKeyMaterial.hasTextOutsideKey)
        let parsed: OpaquePointer? = layout.withUnsafeBytes { bytes in
            guard let bio = BIO_new_mem_buf(bytes.baseAddress, Int32(bytes.count)) else { return nil }
            defer { BIO_free(bio) }
            // A password callback that declines: an encrypted key must not
            // make OpenSSL prompt on the terminal.
            return PEM_read_bio_PrivateKey(bio, nil, { _, _, _, _ in 0 }, nil)
        }
        guard let parsed else {
            guard !pem.withUnsafeBytes(ECPrivateKeyMaterial.isOneDERSequence) else {
                throw CryptoError(.keyFileInvalid, "the key file is binary DER, not PEM: convert it with: openssl pkey -inform DER -in FILE -out AuthKey_KEYID.p8, then import that")
            }
            let error = CryptoError(.keyFileInvalid, "not a PEM private key: expected -----BEGIN PRIVATE KEY----- (PKCS#8) or -----BEGIN EC PRIVATE KEY----- (SEC1), unencrypted")
            // App Store Connect lets a key be downloaded once: "download it again" is no repair.
            let intactCopy = "use an intact copy of the .p8 (App Store Connect lets you download a key once; with no intact copy, revoke the key and make a new one)"
            // OpenSSL's reason text for EC_R_POINT_IS_NOT_ON_CURVE.
            if error.openSSLErrors.contains(where: { $0.hasSuffix(":point is not on curve") }) {
                throw CryptoError(.keyFileInvalid, "the key's public point is not on the curve: the file is damaged or was edited; \(intactCopy)")
            }
            let (begins, ends) = pem.withUnsafeBytes { bytes in
                (ECPrivateKeyMaterial.count(bytes, "-----BEGIN PRIVATE KEY-----") + ECPrivateKeyMaterial.count(bytes, "-----BEGIN EC PRIVATE KEY-----"),
                 ECPrivateKeyMaterial.count(bytes, "-----END PRIVATE KEY-----") + ECPrivateKeyMaterial.count(bytes, "-----END EC PRIVATE KEY-----"))
            }
            // No private key block, but a public key or a certificate where the private key was meant
            // (a CLI audit: "not a PEM private key"). Beside a damaged private key block, the block is the news.
            for (label, what) in [("PUBLIC KEY", "a public key"), ("CERTIFICATE", "a certificate")]
            where begins == 0 && pem.withUnsafeBytes({ ECPrivateKeyMaterial.count($0, "-----BEGIN \(label)-----") }) > 0 {
                throw CryptoError(.keyFileInvalid, "the file holds \(what) (-----BEGIN \(label)-----) and no private key: import the .p8 App Store Connect delivered, which begins -----BEGIN PRIVATE KEY-----")
            }
            // The right header, yet nothing OpenSSL can read: a damaged copy, not the wrong kind of file.
            if begins == 1 && ends == 0 {
                throw CryptoError(.keyFileInvalid, "the key file's PEM block has no -----END line: the file is cut short; \(intactCopy)")
            }
            if begins == 1 && ends == 1 {
                throw CryptoError(.keyFileInvalid, "the key file's PEM block does not decode: its Base64, or the key inside it, is damaged (cut short or edited), "
                                  + "or it is a SEC1 key (BEGIN EC PRIVATE KEY) written without its curve parameters, which OpenSSL cannot read and so no openssl command converts; \(intactCopy)")
            }
            throw error
        }
        let key = EVPKey(taking: parsed)
        let type = EVP_PKEY_get_base_id(key.pointer)
        guard type == EVP_PKEY_EC else {
            let name = EVP_PKEY_get0_type_name(key.pointer).map { String(cString: $0) } ?? "type \(type)"
            throw CryptoError(.unsupportedKeyType, "the key is \(name); an App Store In-App Purchase key is EC P-256")
        }
        guard let curve = ECPublicKey.curve(of: key.pointer), curve == .p256 else {
            let name = ECPublicKey.curve(of: key.pointer)?.rawValue ?? ECPrivateKeyMaterial.groupName(of: key.pointer)
            throw CryptoError(.unsupportedCurve, name.map { "the key is on \($0); \($0) is not P-256: an App Store In-App Purchase key is on P-256 (prime256v1)" }
                ?? "the key is on an unnamed curve; an App Store In-App Purchase key is on P-256 (prime256v1)")
        }
        self.curve = curve
        // OpenSSL ignores what follows the key's structure inside the
        // Base64: it is not in a file as App Store Connect delivers it.
        if let extra = ECPrivateKeyMaterial.bytesAfterStructure(layout) {
            throw CryptoError(.keyFileInvalid, "the key file's PEM block holds \(extra.bytes) \(extra.bytes == 1 ? "byte" : "bytes") after the \(extra.structure) inside its Base64, which OpenSSL ignores (not shown, since they may be key material): "
                              + "the file is damaged or was edited; use an intact copy of the .p8 (App Store Connect lets you download a key once; with no intact copy, revoke the key and make a new one)")
        }

        var bignum: OpaquePointer?
        guard EVP_PKEY_get_bn_param(key.pointer, OSSL_PKEY_PARAM_PRIV_KEY, &bignum) == 1, let bignum else {
            throw CryptoError(.keyFileInvalid, "the file holds no private scalar")
        }
        defer { BN_clear_free(bignum) }
        // RFC 5915 §3 / SEC 1 §3.2.1: d lies in [1, n − 1]. OpenSSL reads a
        // larger one and signs with it reduced modulo n: a key that is not
        // the one in the file.
        guard ECPrivateKeyMaterial.isInRange(bignum) else {
            throw CryptoError(.keyFileInvalid, "the private scalar is 0 or not below the order n of P-256 (a private key is a number from 1 to n − 1, SEC 1 §3.2.1): the file is damaged or was not made by App Store Connect")
        }
        scalar = try SecureBytes(capacity: curve.byteCount) { (buffer) throws(CryptoError) -> Int in
            guard BN_bn2binpad(bignum, buffer.baseAddress?.assumingMemoryBound(to: UInt8.self), Int32(buffer.count)) == Int32(buffer.count) else {
                throw CryptoError(.keyFileInvalid, "the private scalar is longer than 32 bytes")
            }
            return buffer.count
        }

        var point = [UInt8](repeating: 0, count: 1 + 2 * curve.byteCount)
        var written = 0
        guard EVP_PKEY_get_octet_string_param(key.pointer, OSSL_PKEY_PARAM_ENCODED_PUBLIC_KEY, &point, point.count, &written) == 1,
              written == point.count else {
            throw CryptoError(.keyFileInvalid, "cannot derive the public key from the private key")
        }
        publicKey = try ECPublicKey(curve: curve, uncompressedPoint: point)
        // A public key embedded in the file must be the private key's own
        // (d·G): one that is not is a damaged or edited file, and is better
        // refused here than by the import's self-test after writing to the token.
        guard let context = EVP_PKEY_CTX_new_from_pkey(nil, key.pointer, nil) else {
            throw CryptoError(.keyFileInvalid, "cannot check that the key's public half belongs to its private half")
        }
        defer { EVP_PKEY_CTX_free(context) }
        guard EVP_PKEY_pairwise_check(context) == 1 else {
            throw CryptoError(.keyFileInvalid, "the public key in the file does not belong to its private key: the file is damaged or was edited; "
                              + "use an intact copy of the .p8 (App Store Connect lets you download a key once; with no intact copy, revoke the key and make a new one)")
        }
        // A PUBLIC KEY block beside the private key (OpenSSL skipped it) that
        // is another key's: a file put together from two keys, where which
        // one was meant cannot be told.
        if layout.withUnsafeBytes({ Self.count($0, "-----BEGIN PUBLIC KEY-----") }) > 0 {
            ERR_clear_error()
            let beside: OpaquePointer? = layout.withUnsafeBytes { bytes in
                guard let bio = BIO_new_mem_buf(bytes.baseAddress, Int32(bytes.count)) else { return nil }
                defer { BIO_free(bio) }
                return PEM_read_bio_PUBKEY(bio, nil, nil, nil)
            }
            ERR_clear_error()
            if let beside, let other = try? ECPublicKey(key: EVPKey(taking: beside)), other != publicKey {
                throw CryptoError(.keyFileInvalid, "the key file also holds a public key (-----BEGIN PUBLIC KEY-----, SHA-256 fingerprint \(other.fingerprint)) that is not its private key's "
                                  + "(\(publicKey.fingerprint)): the file was put together from two keys, so which one was meant cannot be told; "
                                  + "import the .p8 as App Store Connect delivered it, the private key alone")
            }
        }
    }

    /// Reads and parses a key file.
    /// - Parameter path: the `.p8` file.
    /// - Throws: ``CryptoError/Code/keyFileUnreadable`` plus the errors of ``init(pem:)``.
    public convenience init(contentsOf path: String) throws(CryptoError) {
        let pem = try ECPrivateKeyMaterial.readSecretFile(path)
        try self.init(pem: pem)
    }

    /// Whether `bytes` are exactly one DER SEQUENCE (X.690 §8.1: tag 0x30,
    /// then a short or a one- or two-byte long length that covers the rest):
    /// a PKCS#8 or SEC1 key saved as binary DER instead of PEM.
    static func isOneDERSequence(_ bytes: UnsafeRawBufferPointer) -> Bool {
        guard let length = sequenceLength(bytes) else { return false }
        // An editor or `echo` may have added a line end after the DER.
        var count = bytes.count
        while count > 2, bytes[count - 1] == 0x0a || bytes[count - 1] == 0x0d { count -= 1 }
        return length == count || length == bytes.count
    }

    /// The encoded length in bytes (header included) of the DER SEQUENCE
    /// that `bytes` start with (tag 0x30, then a short or a one- or two-byte
    /// long length), or nil when they do not start with one.
    static func sequenceLength(_ bytes: UnsafeRawBufferPointer) -> Int? {
        guard bytes.count >= 2, bytes[0] == 0x30 else { return nil }
        switch bytes[1] {
        case 0..<0x80: return Int(bytes[1]) + 2
        case 0x81 where bytes.count >= 3: return Int(bytes[2]) + 3
        case 0x82 where bytes.count >= 4: return (Int(bytes[2]) << 8 | Int(bytes[3])) + 4
        default: return nil
        }
    }

    /// What LF-separated `text` (``normalizedLayout(_:)``) holds after the
    /// `-----END …-----` marker of its private key's PEM block, on that
    /// line and after it, when that is anything but blanks (spaces, tabs,
    /// line ends). The description names PEM blocks by their `BEGIN` line
    /// and otherwise only the kind of bytes, never what they say: bytes
    /// after a key may be key material (a second copy of its Base64).
    /// - Returns: the END line (`-----END PRIVATE KEY-----`), what follows
    ///   it in words, and how many bytes that is (leading and trailing
    ///   blanks left out); nil when nothing but blanks follows, or the file
    ///   has no such block.
    static func textAfterKey(_ text: UnsafeRawBufferPointer) -> (endLine: String, found: String, bytes: Int)? {
        let lines = text.split(separator: 0x0a, omittingEmptySubsequences: false)
        func starts(_ line: Slice<UnsafeRawBufferPointer>, _ prefix: String) -> Bool {
            line.count >= prefix.utf8.count && zip(line, prefix.utf8).allSatisfy { $0 == $1 }
        }
        guard let begin = lines.firstIndex(where: { starts($0, "-----BEGIN PRIVATE KEY-----") || starts($0, "-----BEGIN EC PRIVATE KEY-----") }),
              let end = lines[(begin + 1)...].firstIndex(where: { starts($0, "-----END ") }) else { return nil }
        let endLine = starts(lines[begin], "-----BEGIN EC") ? "-----END EC PRIVATE KEY-----" : "-----END PRIVATE KEY-----"
        let blank: Set<UInt8> = [0x20, 0x09, 0x0a, 0x0d, 0x0b, 0x0c]
        // Past the marker on the END line itself (its closing five dashes), then every later line.
        let endBytes = lines[end]
        let markerEnd = starts(endBytes, endLine) ? endBytes.startIndex + endLine.utf8.count : endBytes.endIndex
        let rest = text[markerEnd...]
        guard let first = rest.firstIndex(where: { !blank.contains($0) }), let last = rest.lastIndex(where: { !blank.contains($0) }) else { return nil }
        let trailing = text[first...last]
        // The labels of PEM blocks that follow (CERTIFICATE, PUBLIC KEY): shown when they look like one.
        var labels: [String] = []
        for line in trailing.split(separator: 0x0a) where starts(line, "-----BEGIN ") {
            let label = line.dropFirst("-----BEGIN ".utf8.count).prefix { $0 != 0x2d }
            let tail = line.dropFirst("-----BEGIN ".utf8.count + label.count)
            guard (1...40).contains(label.count), label.allSatisfy({ (0x41...0x5a).contains($0) || (0x30...0x39).contains($0) || $0 == 0x20 }),
                  tail.prefix(5).elementsEqual("-----".utf8) else { continue }
            labels.append("-----BEGIN \(String(decoding: label, as: UTF8.self))-----")
        }
        let found: String
        if first < endBytes.endIndex {
            found = "text on the END line itself, after the marker"
        } else if !labels.isEmpty {
            found = labels.count == 1 ? "a \(labels[0]) block" : "\(labels.count) PEM blocks (\(labels.joined(separator: ", ")))"
        } else if trailing.contains(where: { ($0 < 0x20 && !blank.contains($0)) || $0 >= 0x7f }) {
            found = "bytes that are not text"
        } else if trailing.count >= 16, trailing.allSatisfy({ blank.contains($0) || (0x41...0x5a).contains($0) || (0x61...0x7a).contains($0) || (0x30...0x39).contains($0) || [0x2b, 0x2f, 0x3d].contains($0) }) {
            found = "Base64 with no PEM header of its own"
        } else {
            found = "text"
        }
        return (endLine, found, trailing.count)
    }

    /// How many bytes the DER of `layout`'s private key block (the Base64
    /// between its `BEGIN` and `END` lines, decoded by OpenSSL's PEM
    /// reader into a buffer wiped afterwards) holds after the PKCS#8
    /// PrivateKeyInfo or SEC1 ECPrivateKey structure it starts with. OpenSSL
    /// reads the structure and ignores the rest.
    /// - Returns: the count and the structure's name, or nil when the DER is
    ///   exactly the structure (or the block cannot be read here; the parse
    ///   that did read it decides then).
    static func bytesAfterStructure(_ layout: SecureBytes) -> (bytes: Int, structure: String)? {
        layout.withUnsafeBytes { bytes -> (bytes: Int, structure: String)? in
            guard let bio = BIO_new_mem_buf(bytes.baseAddress, Int32(bytes.count)) else { return nil }
            defer { BIO_free(bio) }
            defer { ERR_clear_error() }  // the reader's end-of-input "no start line" is no failure here
            // Block by block: an EC PARAMETERS block may come first.
            while true {
                var name: UnsafeMutablePointer<CChar>?
                var header: UnsafeMutablePointer<CChar>?
                var data: UnsafeMutablePointer<UInt8>?
                var length = 0
                guard PEM_read_bio(bio, &name, &header, &data, &length) == 1 else { return nil }
                defer {
                    CRYPTO_free(name, nil, 0)
                    CRYPTO_free(header, nil, 0)
                    // The private key's DER: wiped before it is freed.
                    CRYPTO_clear_free(data, length, nil, 0)
                }
                let label = name.map { String(cString: $0) } ?? ""
                guard label == "PRIVATE KEY" || label == "EC PRIVATE KEY" else { continue }
                let der = UnsafeRawBufferPointer(start: data, count: data == nil ? 0 : length)
                guard let structure = sequenceLength(der), structure < der.count else { return nil }
                return (der.count - structure, label == "PRIVATE KEY" ? "PKCS#8 PrivateKeyInfo structure" : "SEC1 ECPrivateKey structure")
            }
        }
    }

    /// Whether `d` lies in [1, n − 1] for P-256's group order n.
    private static func isInRange(_ d: OpaquePointer) -> Bool {
        guard BN_is_zero(d) == 0, BN_is_negative(d) == 0,
              let group = EC_GROUP_new_by_curve_name(NID_X9_62_prime256v1) else { return false }
        defer { EC_GROUP_free(group) }
        guard let order = EC_GROUP_get0_order(group) else { return false }
        return BN_cmp(d, order) < 0
    }

    /// `pem` with every line end (CRLF, or CR alone as old Mac editors
    /// write) made LF, each line's leading spaces and tabs removed, and
    /// empty lines dropped (CR CR LF, a file converted twice): the layout
    /// OpenSSL's PEM reader needs, which a key pasted from an e-mail or
    /// indented in a YAML file has lost. Base64 and the PEM lines hold no
    /// blanks at the start, and a PEM block no empty line, so nothing of
    /// the key changes.
    static func normalizedLayout(_ pem: SecureBytes) -> SecureBytes {
        pem.withUnsafeBytes { bytes in
            SecureBytes(capacity: bytes.count) { out in
                var written = 0
                var index = 0
                var lineStart = true
                while index < bytes.count {
                    var byte = bytes[index]
                    index += 1
                    if byte == 0x0d {
                        byte = 0x0a
                        if index < bytes.count, bytes[index] == 0x0a { index += 1 }
                    }
                    if lineStart, byte == 0x20 || byte == 0x09 || byte == 0x0a { continue }
                    out[written] = byte
                    written += 1
                    lineStart = byte == 0x0a
                }
                return written
            }
        }
    }

    /// Whether LF-separated `text` (``normalizedLayout(_:)``) has a line
    /// with anything but blanks outside its private key's PEM block and an
    /// `EC PARAMETERS` block; a UTF-8 byte-order mark at the start is skipped.
    /// (What follows the key is refused before this matters: ``textAfterKey(_:)``.)
    static func hasTextOutsideKey(_ text: UnsafeRawBufferPointer) -> Bool {
        func starts(_ line: Slice<UnsafeRawBufferPointer>, _ prefix: String) -> Bool {
            line.count >= prefix.utf8.count && zip(line, prefix.utf8).allSatisfy { $0 == $1 }
        }
        var inside = false
        let byteOrderMark: [UInt8] = [0xEF, 0xBB, 0xBF]
        let body = text.starts(with: byteOrderMark) ? text[3...] : text[...]
        for line in body.split(separator: 0x0a, omittingEmptySubsequences: true) {
            if starts(line, "-----BEGIN PRIVATE KEY-----") || starts(line, "-----BEGIN EC PRIVATE KEY-----") || starts(line, "-----BEGIN EC PARAMETERS-----") {
                inside = true
            } else if starts(line, "-----END ") && inside {
                inside = false
            } else if !inside && !line.allSatisfy({ $0 == 0x20 || $0 == 0x09 }) {
                return true
            }
        }
        return false
    }

    /// OpenSSL's name of an EC key's group (`secp256k1`), for curves
    /// ``ECCurve`` does not know; nil when the group has no name.
    private static func groupName(of key: OpaquePointer) -> String? {
        var name = [CChar](repeating: 0, count: 64)
        var length = 0
        guard EVP_PKEY_get_utf8_string_param(key, OSSL_PKEY_PARAM_GROUP_NAME, &name, name.count, &length) == 1, length > 0 else { return nil }
        return String(decoding: name.prefix(length).map { UInt8(bitPattern: $0) }, as: UTF8.self)
    }

    /// How often `bytes` contain `word` (ASCII), counted without copying
    /// them out of their wiped buffer.
    static func count(_ bytes: UnsafeRawBufferPointer, _ word: String) -> Int {
        let needle = Array(word.utf8)
        guard bytes.count >= needle.count else { return 0 }
        return (0...(bytes.count - needle.count)).count { start in
            needle.indices.allSatisfy { bytes[start + $0] == needle[$0] }
        }
    }

    /// Opens `path` for reading and refuses anything but a regular file
    /// (`O_NONBLOCK`: a FIFO given by mistake must not hang the open).
    /// - Returns: the descriptor, which the caller closes, and its `stat`.
    /// - Throws: ``CryptoError`` `key_file_unreadable` naming the path and the reason.
    static func openRegularFile(_ path: String) throws(CryptoError) -> (fd: Int32, info: stat) {
        let fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK)
        guard fd >= 0 else {
            throw CryptoError(.keyFileUnreadable, "cannot open \(path): \(String(cString: strerror(errno)))")
        }
        var info = stat()
        guard fstat(fd, &info) == 0, (info.st_mode & S_IFMT) == S_IFREG else {
            close(fd)
            throw CryptoError(.keyFileUnreadable, "\(path) is not a regular file")
        }
        return (fd, info)
    }

    /// Fails as ``init(contentsOf:)`` would for a key file that cannot be
    /// opened or is not a regular file; reads nothing. For callers that must
    /// name a missing file before they look at its name.
    /// - Parameter path: the key file.
    /// - Throws: ``CryptoError`` `key_file_unreadable`.
    package static func checkFileOpens(_ path: String) throws(CryptoError) {
        close(try openRegularFile(path).fd)
    }

    /// Reads a whole small file into a wiped buffer, never through `String`.
    static func readSecretFile(_ path: String) throws(CryptoError) -> SecureBytes {
        let (fd, info) = try openRegularFile(path)
        defer { close(fd) }
        guard Int(info.st_size) <= maximumFileSize else {
            throw CryptoError(.keyFileUnreadable, "\(path) is \(info.st_size) bytes; a key file is under \(maximumFileSize)")
        }
        return try SecureBytes(capacity: Int(info.st_size)) { (buffer) throws(CryptoError) -> Int in
                var total = 0
                while total < buffer.count {
                    let n = read(fd, buffer.baseAddress! + total, buffer.count - total)  // capacity ≥ 1: non-nil
                    if n < 0 {
                        if errno == EINTR { continue }
                        throw CryptoError(.keyFileUnreadable, "cannot read \(path): \(String(cString: strerror(errno)))")
                    }
                    if n == 0 { break }
                    total += n
                }
                return total
        }
    }

    /// The key ID in an Apple key file name: `AuthKey_<KEYID>.p8` or
    /// `SubscriptionKey_<KEYID>.p8`, the ID being 10 characters `A-Z0-9`.
    /// The `.p8` may be in any case, and a browser's ` (1)` before it (a
    /// second download of the same name) is passed over.
    /// - Parameter path: a path or file name.
    /// - Returns: the key ID, or nil when the name does not follow Apple's pattern
    ///   (``keyIDProblem(fileName:)`` says why).
    public static func keyID(fromFileName path: String) -> String? {
        guard let id = keyIDPart(fileName: path), KeyID.isValid(id) else { return nil }
        return id
    }

    /// Why the key ID cannot be taken from a file name, in words for an
    /// error message: the ID part is not 10 characters `A-Z0-9` (lower case
    /// included: App Store Connect's key IDs are upper case), or the name is
    /// not `AuthKey_<KEYID>.p8` or `SubscriptionKey_<KEYID>.p8` at all.
    /// - Parameter path: a path or file name.
    /// - Returns: the reason, or nil when ``keyID(fromFileName:)`` finds the ID.
    public static func keyIDProblem(fileName path: String) -> String? {
        guard let id = keyIDPart(fileName: path) else {
            return "the name is not AuthKey_<KEYID>.p8 or SubscriptionKey_<KEYID>.p8"
        }
        if KeyID.isValid(id) { return nil }
        if KeyID.isValid(id.uppercased()) {
            return "its key ID, \(id), is not in upper case as App Store Connect shows key IDs"
        }
        return "its key ID part, \(id), is not 10 characters A-Z0-9"
    }

    /// What stands between `AuthKey_` or `SubscriptionKey_` and `.p8` (any
    /// case, a trailing ` (N)` dropped), or nil when the name has neither.
    private static func keyIDPart(fileName path: String) -> String? {
        var name = Substring(path.split(separator: "/").last ?? Substring(path))
        guard name.lowercased().hasSuffix(".p8") else { return nil }
        name = name.dropLast(3)
        // "SubscriptionKey_ABC123DEFG (1).p8": the browser's second copy.
        if name.last == ")", let open = name.lastIndex(of: "("), name[..<open].hasSuffix(" ") {
            let digits = name[name.index(after: open)..<name.index(before: name.endIndex)]
            if !digits.isEmpty && digits.allSatisfy({ $0.isASCII && $0.isNumber }) {
                name = name[..<name.index(before: open)]
            }
        }
        for prefix in ["AuthKey_", "SubscriptionKey_"] where name.hasPrefix(prefix) {
            return String(name.dropFirst(prefix.count))
        }
        return nil
    }
}

/// Rules for App Store key IDs.
public enum KeyID {
    /// Whether `id` is 10 characters `A-Z0-9`, as App Store Connect issues them.
    /// - Parameter id: a candidate key ID.
    public static func isValid(_ id: some StringProtocol) -> Bool {
        id.utf8.count == 10 && id.utf8.allSatisfy { ($0 >= 0x41 && $0 <= 0x5a) || ($0 >= 0x30 && $0 <= 0x39) }
    }
}
