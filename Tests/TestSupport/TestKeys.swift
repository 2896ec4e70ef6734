import Foundation
import HSMSigner

/// Key files in every form the field produces, made with the `openssl` CLI.
public struct TestKeyFiles: Sendable {
    public let directory: String
    /// SEC1 `-----BEGIN EC PRIVATE KEY-----` (with parameters and public key).
    public let sec1: String
    /// PKCS#8 as OpenSSL writes it: `MIGHAgEA…`, 135 content bytes (138 DER bytes), public key embedded.
    public let pkcs8OpenSSL: String
    /// PKCS#8 as Apple writes it: `MIGTAgEA…`, 147 content bytes (150 DER bytes), curve repeated inside and public key embedded.
    public let pkcs8Apple: String
    /// PKCS#8 without the public key (OpenSSL must derive it).
    public let pkcs8NoPublicKey: String
    /// The Apple form with CRLF line endings and trailing whitespace.
    public let pkcs8AppleCRLF: String
    /// `openssl ec -pubout` of the key.
    public let publicKeyPEM: String

    /// Makes a fresh P-256 key in all forms in a new directory.
    public static func make() throws -> TestKeyFiles {
        let directory = TemporaryDirectory.make(prefix: "signerd-keys")
        umask(0o077)  // key files 0600, whoever writes them (openssl or this file)
        let sec1 = directory + "/sec1.pem"
        try run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", sec1])
        let pkcs8OpenSSL = directory + "/SubscriptionKey_OPENSSL01.p8"
        try run(["openssl", "pkcs8", "-topk8", "-nocrypt", "-in", sec1, "-out", pkcs8OpenSSL])
        // Apple's layout: PrivateKeyInfo { 0, {ecPublicKey, prime256v1}, OCTET STRING { the SEC1 ECPrivateKey with [0] params and [1] public key } }
        let sec1DER = [UInt8](try run(["openssl", "ec", "-in", sec1, "-outform", "DER"]))
        precondition(sec1DER.count == 121, "SEC1 P-256 with params and public key is 121 bytes")
        let algorithm: [UInt8] = [0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07]
        let content: [UInt8] = [0x02, 0x01, 0x00] + algorithm + [0x04, UInt8(sec1DER.count)] + sec1DER
        let appleDER: [UInt8] = [0x30, 0x81, UInt8(content.count)] + content
        precondition(content.count == 147)
        let applePEM = pem("PRIVATE KEY", appleDER, lineEnding: "\n")
        let pkcs8Apple = directory + "/AuthKey_APPLE00001.p8"
        try applePEM.write(toFile: pkcs8Apple, atomically: false, encoding: .utf8)
        let pkcs8AppleCRLF = directory + "/SubscriptionKey_CRLF000001.p8"
        try (pem("PRIVATE KEY", appleDER, lineEnding: "\r\n") + "  \r\n\r\n").write(toFile: pkcs8AppleCRLF, atomically: false, encoding: .utf8)
        let noPublic = directory + "/nopub.p8"
        let noPublicSEC1 = try run(["openssl", "ec", "-in", sec1, "-no_public"])
        try run(["openssl", "pkcs8", "-topk8", "-nocrypt", "-out", noPublic], input: noPublicSEC1)
        let publicKeyPEM = String(decoding: try run(["openssl", "ec", "-in", pkcs8Apple, "-pubout"]), as: UTF8.self)
        return TestKeyFiles(directory: directory, sec1: sec1, pkcs8OpenSSL: pkcs8OpenSSL, pkcs8Apple: pkcs8Apple,
                            pkcs8NoPublicKey: noPublic, pkcs8AppleCRLF: pkcs8AppleCRLF, publicKeyPEM: publicKeyPEM)
    }

    public static func pem(_ label: String, _ der: [UInt8], lineEnding: String) -> String {
        let base64 = Data(der).base64EncodedString()
        var lines = ["-----BEGIN \(label)-----"]
        var index = base64.startIndex
        while index < base64.endIndex {
            let end = base64.index(index, offsetBy: 64, limitedBy: base64.endIndex) ?? base64.endIndex
            lines.append(String(base64[index..<end]))
            index = end
        }
        lines.append("-----END \(label)-----")
        return lines.joined(separator: lineEnding) + lineEnding
    }

    /// A key file on another curve or of another type, for refusal tests.
    public static func other(_ kind: String, in directory: String) throws -> String {
        let path = directory + "/\(kind).p8"
        switch kind {
        case "p384": try run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-384", "-out", path])
        case "rsa": try run(["openssl", "genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", path])
        case "ed25519": try run(["openssl", "genpkey", "-algorithm", "ED25519", "-out", path])
        default: fatalError("unknown kind \(kind)")
        }
        return path
    }
}

/// Verifies with the `openssl` CLI (an independent path from the in-process
/// wrapper): `openssl dgst -sha256 -verify PUB -signature SIG` over `message`.
public func opensslVerifies(publicKeyPEM: String, derSignature: [UInt8], message: [UInt8]) throws -> Bool {
    let directory = TemporaryDirectory.make(prefix: "signerd-verify")
    defer { try? FileManager.default.removeItem(atPath: directory) }
    try publicKeyPEM.write(toFile: directory + "/pub.pem", atomically: false, encoding: .utf8)
    try Data(derSignature).write(to: URL(fileURLWithPath: directory + "/sig.der"))
    do {
        let out = try run(["openssl", "dgst", "-sha256", "-verify", directory + "/pub.pem", "-signature", directory + "/sig.der"], input: Data(message))
        return String(decoding: out, as: UTF8.self).contains("Verified OK")
    } catch {
        return false
    }
}

/// Decodes base64url without padding (RFC 4648 §5, as in a compact JWS,
/// RFC 7515 §2) by hand, independently of HSMSigner's encoder.
/// - Parameter text: the base64url text.
/// - Returns: the bytes; nil when `text` is not base64url.
public func base64urlDecoded(_ text: String) -> [UInt8]? {
    var standard = text.replacingOccurrences(of: "-", with: "+").replacingOccurrences(of: "_", with: "/")
    standard += String(repeating: "=", count: (4 - standard.utf8.count % 4) % 4)
    return Data(base64Encoded: standard).map(Array.init)
}

