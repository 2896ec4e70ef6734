import Foundation
@testable import HSMSigner
import TestSupport
import Testing

/// Operator mistakes in the token URI and key files, each refused with a
/// message of its own that never shows a secret.
@Suite("Operator input: token URI")
struct OperatorURITests {
    /// A PIN written where the PIN file's path belongs was echoed by
    /// readPIN's error (signctl, signerd's token_open_failed) and passed
    /// --check-config.
    @Test("a pin-source that is not file:/absolute/path is refused at parse, and its value is never shown", arguments: [
        "pkcs11:token=signer?module-path=/x.so&pin-source=50a0392f0c82a225fa64f846cbd2e48a",
        "pkcs11:token=signer?module-path=/x.so&pin-source=file:50a0392f0c82a225fa64f846cbd2e48a",
        "pkcs11:token=signer?module-path=/x.so&pinfile=50a0392f0c82a225fa64f846cbd2e48a",
        "pkcs11:token=signer?module-path=/x.so&pin-source=%35%30a0392f0c82a225fa64f846cbd2e48a",
    ])
    func pinSourceNotAFile(_ text: String) throws {
        let error = #expect(throws: HSMError.self) { try PKCS11URI(text) }
        #expect(error?.code == .invalidURI)
        #expect(error?.message.contains("pin-source must be file:/absolute/path") == true, "\(error?.message ?? "no error")")
        #expect(error?.description.contains("a0392f0c82a225fa64f846cbd2e48a") == false, "\(error?.description ?? "")")
        #expect(PKCS11URI.pinFilePath("50a0392f0c82a225fa64f846cbd2e48a") == nil)
    }

    @Test("the redacted form of a URI shows a pin-source file path but hides any other pin-source value")
    func pinSourceRedacted() throws {
        let file = try PKCS11URI("pkcs11:token=signer?module-path=/x.so&pin-source=file:/etc/signerd/pin")
        #expect(file.redacted == "pkcs11:token=signer?module-path=/x.so&pin-source=file:/etc/signerd/pin")
        // A URI refused for another reason still must not show it.
        let refused = #expect(throws: HSMError.self) { try PKCS11URI("pkcs11:token=signer;slot-id=1?module-path=/x.so&pin-source=s3cret%zz") }
        #expect(refused?.description.contains("s3cret") == false, "\(refused?.description ?? "")")
    }

    /// A refused URI leaked its p11-kit URI object: `deinit` does not run
    /// for an object whose initializer threw before every stored property
    /// was set. Each reload with a bad `token_uri` parses it twice.
    @Test("a refused token URI frees what p11-kit allocated for it", arguments: [
        "pkcs11:token=signer;slot-id=1?module-path=/x.so&pin-source=file:/p",
        "pkcs11:serial=1?pin-source=file:/p",
        "pkcs11:token=signer?module-path=/x.so&pin-source=file:/p&pin-value=1",
    ])
    func refusedURIFreed(_ text: String) throws {
        // Resident memory in bytes, from /proc/self/statm (pages).
        func resident() throws -> Int {
            let fields = try String(contentsOfFile: "/proc/self/statm", encoding: .utf8).split(separator: " ")
            return try #require(Int(fields[1])) * Int(sysconf(Int32(_SC_PAGESIZE)))
        }
        for _ in 0..<500 { _ = try? PKCS11URI(text) }  // the heap settles
        let before = try resident()
        for _ in 0..<10_000 { _ = try? PKCS11URI(text) }
        let grown = try resident() - before
        // A leaked URI object is about 700 bytes (its CK_INFO, CK_SLOT_INFO
        // and CK_TOKEN_INFO, measured): 10,000 of them are about 7 MiB.
        #expect(grown < 2 << 20, "resident memory grew by \(grown >> 10) KiB over 10,000 refused parses")
        #expect(throws: HSMError.self) { try PKCS11URI(text) }
    }
}

@Suite("Operator input: token attribute lengths")
struct OperatorTokenFieldTests {
    /// A 33-byte label was reported as an attribute p11-kit does not recognize.
    @Test("a token attribute longer than its CK_TOKEN_INFO field is named with the limit", arguments: [
        ("token=" + String(repeating: "a", count: 33), "token is 33 bytes long; PKCS#11 holds at most 32 bytes"),
        ("token=" + String(repeating: "%61", count: 33), "token is 33 bytes long; PKCS#11 holds at most 32 bytes"),
        ("token=a;manufacturer=" + String(repeating: "m", count: 40), "manufacturer is 40 bytes long; PKCS#11 holds at most 32 bytes"),
        ("token=a;model=" + String(repeating: "m", count: 17), "model is 17 bytes long; PKCS#11 holds at most 16 bytes"),
        ("serial=" + String(repeating: "1", count: 17), "serial is 17 bytes long; PKCS#11 holds at most 16 bytes"),
    ])
    func tooLong(_ path: String, _ expected: String) throws {
        let error = #expect(throws: HSMError.self) { try PKCS11URI("pkcs11:\(path)?module-path=/x.so&pin-source=file:/p") }
        #expect(error?.code == .invalidURI)
        #expect(error?.message.contains(expected) == true, "\(error?.message ?? "no error")")
        #expect(error?.message.contains("does not recognize") == false)
    }

    @Test("values that fill their fields exactly are accepted")
    func exactlyFull() throws {
        let label = String(repeating: "a", count: 32)
        let uri = try PKCS11URI("pkcs11:token=\(label);model=\(String(repeating: "m", count: 16));serial=\(String(repeating: "1", count: 16))?module-path=/x.so&pin-source=file:/p")
        #expect(uri.tokenLabel == label)
    }
}

@Suite("Operator input: key file headlines")
struct OperatorKeyFileTests {
    static func write(_ name: String, _ text: String) throws -> String {
        let path = TemporaryDirectory.make(prefix: "signerd-keyfile") + "/" + name
        try writeSecretFile(path, text)
        return path
    }

    static func write(bytes: [UInt8], _ name: String) throws -> String {
        let path = TemporaryDirectory.make(prefix: "signerd-keyfile") + "/" + name
        #expect(FileManager.default.createFile(atPath: path, contents: Data(bytes)))
        return path
    }

    /// Each of these said "not a PEM private key: expected … unencrypted"
    /// followed by OpenSSL's error queue.
    @Test("an empty file, an encrypted key, a public point off the curve and a damaged or cut-short PEM block each get their own headline")
    func headlines() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-keyfile")
        let encrypted = directory + "/enc.p8"
        try run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-aes256", "-pass", "pass:testonly", "-out", encrypted])
        let legacy = directory + "/legacy.pem"
        try run(["openssl", "ec", "-in", encrypted, "-passin", "pass:testonly", "-aes256", "-passout", "pass:testonly", "-out", legacy])
        // SEC1 DER ends with the public point 04‖X‖Y: flip a bit of Y.
        let files = try TestKeyFiles.make()
        var der = [UInt8](try run(["openssl", "ec", "-in", files.sec1, "-outform", "DER"]))
        der[der.count - 1] ^= 1
        let offCurve = try Self.write("offcurve.p8", TestKeyFiles.pem("EC PRIVATE KEY", der, lineEnding: "\n"))
        // Apple's PKCS#8 ends with the public point too: put another key's point there (on the curve, not this key's).
        let appleText = try String(contentsOfFile: files.pkcs8Apple, encoding: .utf8)
        var apple = [UInt8](try #require(Data(base64Encoded: appleText.split(separator: "\n").filter { !$0.hasPrefix("-----") }.joined())))
        let otherPoint = try ECPublicKey(pem: try TestKeyFiles.make().publicKeyPEM).uncompressedPoint
        let ownPoint = try ECPublicKey(pem: files.publicKeyPEM).uncompressedPoint
        #expect(apple.count == 150 && Array(apple.suffix(65)) == ownPoint)
        apple.replaceSubrange((apple.count - otherPoint.count)..., with: otherPoint)
        let mismatched = try Self.write("mismatched.p8", TestKeyFiles.pem("PRIVATE KEY", apple, lineEnding: "\n"))
        // SEC1 without its curve parameters (the [0] element, a0 0a and the OID, taken out): the hint
        // was to convert it with openssl pkcs8, which cannot read it either.
        let sec1 = [UInt8](try run(["openssl", "ec", "-in", files.sec1, "-outform", "DER"]))
        #expect(sec1.count == 121 && sec1[1] == 0x77 && sec1[39] == 0xA0 && sec1[40] == 0x0A, "\(sec1.prefix(41))")
        let noParameters = try Self.write("noparams.pem", TestKeyFiles.pem("EC PRIVATE KEY", [0x30, 0x6B] + sec1[2..<39] + sec1[51...], lineEnding: "\n"))
        #expect(throws: (any Error).self) { try run(["openssl", "pkcs8", "-topk8", "-nocrypt", "-in", noParameters]) }
        // Cut short, with and without the END line put back, and one Base64 character changed.
        let good = try String(contentsOfFile: files.pkcs8Apple, encoding: .utf8)
        let body = good.split(separator: "\n").filter { !$0.hasPrefix("-----") }.joined()
        let cut = "-----BEGIN PRIVATE KEY-----\n" + body.prefix(100)
        var flipped = Array(body)
        flipped[40] = flipped[40] == "A" ? "B" : "A"
        let cases: [(String, String)] = [
            (try Self.write("cut.p8", cut + "\n"), "the key file's PEM block has no -----END line: the file is cut short"),
            (try Self.write("cut-end.p8", cut + "\n-----END PRIVATE KEY-----\n"), "the key file's PEM block does not decode"),
            (try Self.write("edited.p8", "-----BEGIN PRIVATE KEY-----\n" + String(flipped) + "\n-----END PRIVATE KEY-----\n"), "the key file's PEM block does not decode"),
            (try Self.write("empty.p8", ""), "the key file is empty"),
            // A CLI audit: a public key where the .p8 was meant got "not a PEM private key".
            (try Self.write("public.p8", files.publicKeyPEM), "the file holds a public key (-----BEGIN PUBLIC KEY-----) and no private key"),
            // A damaged key after its public key: the damage is what to report.
            (try Self.write("public-then-cut.p8", files.publicKeyPEM + cut + "\n-----END PRIVATE KEY-----\n"), "the key file's PEM block does not decode"),
            (try Self.write("blank.p8", " \n\r\n"), "the key file is empty"),
            (encrypted, "the key file is encrypted ("),
            (legacy, "the key file is encrypted ("),
            (offCurve, "the key's public point is not on the curve"),
            (noParameters, "the key file's PEM block does not decode"),
            (mismatched, "the public key in the file does not belong to its private key"),
            (try Self.write(bytes: [0xFF, 0xFE] + [UInt8](try #require(good.data(using: .utf16LittleEndian))), "utf16le.p8"), "the key file is UTF-16 text"),
            (try Self.write(bytes: [UInt8](try #require(good.data(using: .utf16BigEndian))), "utf16be.p8"), "the key file is UTF-16 text"),
        ]
        // A key saved as binary DER (PKCS#8 and SEC1) is named as such, with the conversion.
        let pkcs8DER = try run(["openssl", "pkey", "-in", files.pkcs8Apple, "-outform", "DER"])
        for (index, der) in [pkcs8DER, try run(["openssl", "ec", "-in", files.sec1, "-outform", "DER"]), pkcs8DER + Data("\n".utf8)].enumerated() {
            let path = directory + "/key\(index).der"
            #expect(FileManager.default.createFile(atPath: path, contents: der))
            let error = #expect(throws: CryptoError.self) { try ECPrivateKeyMaterial(contentsOf: path) }
            #expect(error?.message.hasPrefix("the key file is binary DER, not PEM: convert it with: openssl pkey -inform DER") == true, "\(error?.description ?? "no error")")
        }
        for (path, headline) in cases {
            let error = #expect(throws: CryptoError.self) { try ECPrivateKeyMaterial(contentsOf: path) }
            #expect(error?.code == .keyFileInvalid)
            #expect(error?.message.hasPrefix(headline) == true, "\(path): \(error?.description ?? "no error")")
            #expect(error?.description.contains("not a PEM private key") == false, "\(path): \(error?.description ?? "")")
            // Neither repair works: a key is downloaded once, and openssl cannot read a SEC1 key without its curve.
            #expect(error?.message.contains("download the key again") == false && error?.message.contains("openssl pkcs8") == false, "\(path): \(error?.message ?? "")")
            #expect(error?.message.contains("revoke the key") == true || !headline.contains("does not decode") && !headline.contains("not on the curve"), "\(path): \(error?.message ?? "")")
        }
    }

    /// An indented key (pasted from an e-mail or a YAML file) or one with
    /// CR line ends was called damaged, with advice to revoke it.
    @Test("a key file indented, with tabs, or with CR line ends reads as the same key; nothing else is said of it")
    func layouts() throws {
        let files = try TestKeyFiles.make()
        let expected = try ECPublicKey(pem: files.publicKeyPEM)
        for source in [files.pkcs8Apple, files.sec1, files.pkcs8NoPublicKey] {
            let text = try String(contentsOfFile: source, encoding: .utf8)
            let lines = text.split(separator: "\n").map(String.init)
            let variants: [String] = [
                "   " + text,
                lines.map { "    " + $0 }.joined(separator: "\n") + "\n",
                lines.map { "\t" + $0 }.joined(separator: "\r\n"),
                lines.joined(separator: "\r") + "\r",
                lines.map { " \t " + $0 + "  " }.joined(separator: "\r"),
                lines.joined(separator: "\r\r\n") + "\r\r\n",  // CRLF converted to CRLF again
                lines.joined(separator: "\n\r") + "\n\r",
                lines.joined(separator: "\n  \t\n"),  // a line of blanks between every two
            ]
            for (index, variant) in variants.enumerated() {
                let material = try ECPrivateKeyMaterial(contentsOf: Self.write("layout\(index).p8", variant))
                #expect(material.publicKey == expected, "\(source) variant \(index)")
                #expect(!material.hasOtherText, "\(source) variant \(index)")
            }
        }
    }

    /// OpenSSL reads the first private key and skips whatever surrounds it.
    /// (What follows the key is refused: ``trailingData()``.)
    @Test("text before the key (a certificate, a line of words) reads, and is reported; an EC PARAMETERS block or a byte-order mark is not")
    func otherText() throws {
        let files = try TestKeyFiles.make()
        let key = try String(contentsOfFile: files.pkcs8Apple, encoding: .utf8)
        let publicKey = files.publicKeyPEM
        let directory = TemporaryDirectory.make(prefix: "signerd-keyfile")
        try run(["openssl", "req", "-x509", "-new", "-key", files.pkcs8Apple, "-subj", "/CN=x", "-days", "1", "-out", directory + "/cert.pem"])
        let certificate = try String(contentsOfFile: directory + "/cert.pem", encoding: .utf8)
        try run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-out", directory + "/with-params.pem"])
        let cases: [(String, Bool)] = [
            (certificate + key, true),
            (publicKey + key, true),
            ("Key for the App Store:\n" + key, true),
            (key, false),
            ("\u{FEFF}" + key, false),
            (try String(contentsOfFile: directory + "/with-params.pem", encoding: .utf8), false),
        ]
        for (index, (text, other)) in cases.enumerated() {
            let material = try ECPrivateKeyMaterial(contentsOf: Self.write("other\(index).p8", text))
            #expect(material.hasOtherText == other, "case \(index)")
        }
        // Another key's public key before (or after the key, refused anyway as trailing text): a
        // file put together from two keys imported with a warning only (found by an attack round).
        let strangerPEM = try TestKeyFiles.make().publicKeyPEM
        let stranger = try ECPublicKey(pem: strangerPEM)
        let own = try ECPublicKey(pem: publicKey)
        let error = #expect(throws: CryptoError.self) {
            try ECPrivateKeyMaterial(contentsOf: Self.write("two-keys.p8", strangerPEM + key))
        }
        #expect(error?.code == .keyFileInvalid)
        #expect(error?.message.hasPrefix("the key file also holds a public key (-----BEGIN PUBLIC KEY-----, SHA-256 fingerprint \(stranger.fingerprint)) that is not its private key's (\(own.fingerprint))") == true,
                "\(error?.message ?? "accepted")")
    }

    /// OpenSSL's PEM reader stops at the key's END line and its DER reader
    /// at the end of the key's structure: a .p8 with a certificate, a note
    /// or a second copy of its Base64 after the key imported, and so did one
    /// whose Base64 carried bytes after the PKCS#8 structure.
    @Test("anything but blanks after the END line, or bytes after the PKCS#8 or SEC1 structure inside the Base64, is refused naming what it is and never showing it; CRLF and a trailing newline are not")
    func trailingData() throws {
        let files = try TestKeyFiles.make()
        let key = try String(contentsOfFile: files.pkcs8Apple, encoding: .utf8)
        let sec1 = try String(contentsOfFile: files.sec1, encoding: .utf8)
        let directory = TemporaryDirectory.make(prefix: "signerd-keyfile")
        try run(["openssl", "req", "-x509", "-new", "-key", files.pkcs8Apple, "-subj", "/CN=x", "-days", "1", "-out", directory + "/cert.pem"])
        let certificate = try String(contentsOfFile: directory + "/cert.pem", encoding: .utf8)
        let body = key.split(separator: "\n").filter { !$0.hasPrefix("-----") }
        let secondCopy = body.joined(separator: "\n") + "\n"
        let after = "the key file goes on after its -----END PRIVATE KEY----- line: "
        let refused: [(String, [UInt8], String)] = [
            ("note", Array((key + "garbage here !!!\n").utf8), after + "text ("),
            ("public-key", Array((key + files.publicKeyPEM).utf8), after + "a -----BEGIN PUBLIC KEY----- block ("),
            ("certificate", Array((key + "\r\n" + certificate + files.publicKeyPEM).utf8), after + "2 PEM blocks (-----BEGIN CERTIFICATE-----, -----BEGIN PUBLIC KEY-----) ("),
            ("same-line", Array((key.dropLast() + "junk\n").utf8), after + "text on the END line itself, after the marker (4 bytes"),
            ("binary", Array(key.utf8) + [0x00, 0x1A], after + "bytes that are not text (2 bytes"),
            ("second-copy", Array((key + secondCopy).utf8), after + "Base64 with no PEM header of its own ("),
            ("sec1", Array((sec1 + "x\n").utf8), "the key file goes on after its -----END EC PRIVATE KEY----- line: text (1 byte,"),
        ]
        // Bytes after the structure inside the Base64, for PKCS#8 (Apple's form) and SEC1.
        let appleDER = [UInt8](try #require(Data(base64Encoded: body.joined())))
        let sec1DER = [UInt8](try run(["openssl", "ec", "-in", files.sec1, "-outform", "DER"]))
        let inside: [(String, [UInt8], String)] = [
            ("der-pkcs8", Array(TestKeyFiles.pem("PRIVATE KEY", appleDER + [0x00, 0x00], lineEnding: "\n").utf8),
             "the key file's PEM block holds 2 bytes after the PKCS#8 PrivateKeyInfo structure inside its Base64"),
            ("der-sec1", Array(TestKeyFiles.pem("EC PRIVATE KEY", sec1DER + Array("AB".utf8), lineEnding: "\r\n").utf8),
             "the key file's PEM block holds 2 bytes after the SEC1 ECPrivateKey structure inside its Base64"),
        ]
        for (name, bytes, headline) in refused + inside {
            let error = #expect(throws: CryptoError.self, "\(name)") { try ECPrivateKeyMaterial(contentsOf: Self.write(bytes: bytes, name + ".p8")) }
            #expect(error?.code == .keyFileInvalid, "\(name)")
            #expect(error?.message.hasPrefix(headline) == true, "\(name): \(error?.description ?? "no error")")
            #expect(error?.message.contains("not shown") == true, "\(name): \(error?.message ?? "")")
            // Never the bytes themselves: after a key they may be its Base64 again.
            for line in body {
                #expect(error?.description.contains(line) == false, "\(name): \(error?.description ?? "")")
            }
            #expect(error?.description.contains("garbage") == false && error?.description.contains("junk") == false, "\(name)")
        }
        // Line ends and blanks after the END line are no data.
        let expected = try ECPublicKey(pem: files.publicKeyPEM)
        for (index, text) in [key, String(key.dropLast()), key.replacingOccurrences(of: "\n", with: "\r\n") + "\r\n  \t\r\n", key + "\n\n   \n\t", sec1 + "\r\n"].enumerated() {
            let material = try ECPrivateKeyMaterial(contentsOf: Self.write("blank\(index).p8", text))
            #expect(material.publicKey == expected, "case \(index)")
            #expect(!material.hasOtherText, "case \(index)")
        }
        #expect(try ECPrivateKeyMaterial(contentsOf: files.pkcs8AppleCRLF).publicKey == expected)
    }

    /// A PKCS#8 or SEC1 key whose d is n + 5 imported, and the token then
    /// signed with d mod n = 5: a key that is not the one in the file.
    @Test("a private scalar of 0, n or beyond n is refused naming the range", arguments: [
        "0000000000000000000000000000000000000000000000000000000000000000",
        "FFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551",
        "FFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632556",
        "FFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF",
    ])
    func scalarOutOfRange(_ hex: String) throws {
        let d = stride(from: 0, to: hex.count, by: 2).map { UInt8(hex.dropFirst($0).prefix(2), radix: 16)! }  // literal hex above
        // RFC 5915 ECPrivateKey: version 1, d, parameters [0] prime256v1; no public key.
        let der: [UInt8] = [0x30, 0x31, 0x02, 0x01, 0x01, 0x04, 0x20] + d + [0xA0, 0x0A, 0x06, 0x08, 0x2A, 0x86, 0x48, 0xCE, 0x3D, 0x03, 0x01, 0x07]
        let path = try Self.write("range.p8", TestKeyFiles.pem("EC PRIVATE KEY", der, lineEnding: "\n"))
        let error = #expect(throws: CryptoError.self) { try ECPrivateKeyMaterial(contentsOf: path) }
        #expect(error?.code == .keyFileInvalid)
        #expect(error?.message.hasPrefix("the private scalar is 0 or not below the order n of P-256") == true, "\(error?.description ?? "no error")")
    }

    /// "… import it with signctl keys import token=t1 key=K" read as part of the command.
    @Test("an error's description sets the token and key apart after a dash, and leaves out what the message already names")
    func errorDescription() {
        var error = HSMError(.keyNotFound, "no private key with key ID NOPE000001 on token t1; import it with signctl keys import")
        error.tokenLabel = "t1"
        error.keyID = "NOPE000001"
        #expect(error.description == "key_not_found: no private key with key ID NOPE000001 on token t1; import it with signctl keys import")
        error.message = "cannot sign: C_Sign returned CKR_DEVICE_ERROR"
        #expect(error.description == "key_not_found: cannot sign: C_Sign returned CKR_DEVICE_ERROR — token t1, key NOPE000001")
        error.keyID = nil
        #expect(error.description.hasSuffix("CKR_DEVICE_ERROR — token t1"))
        #expect(!error.description.contains("token="))
        // Named only as whole words: token t10 is not token t1, nor a file name holding the key ID the key ID.
        error.message = "token t10 is not the one meant; see /tmp/AuthKey_NOPE000001X.p8"
        error.keyID = "NOPE000001"
        #expect(error.description.hasSuffix(" — token t1, key NOPE000001"), "\(error.description)")
        error.message = "key NOPE000001 is missing (token t1)"
        #expect(error.description == "key_not_found: key NOPE000001 is missing (token t1)", "\(error.description)")
    }

    @Test("a secp256k1 key is refused naming secp256k1")
    func secp256k1() throws {
        let path = TemporaryDirectory.make(prefix: "signerd-keyfile") + "/k1.p8"
        try run(["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:secp256k1", "-out", path])
        let error = #expect(throws: CryptoError.self) { try ECPrivateKeyMaterial(contentsOf: path) }
        #expect(error?.code == .unsupportedCurve)
        #expect(error?.message.contains("secp256k1 is not P-256") == true, "\(error?.message ?? "no error")")
    }
}

@Suite("Operator input: one key per file")
struct OperatorKeyCountTests {
    /// The first of two keys was imported without a word.
    @Test("a file with two PEM private keys is refused; one key alone imports")
    func twoKeys() throws {
        let first = try TestKeyFiles.make()
        let second = try TestKeyFiles.make()
        let one = try String(contentsOfFile: first.pkcs8Apple, encoding: .utf8)
        let mixed = [(one + (try String(contentsOfFile: second.pkcs8OpenSSL, encoding: .utf8)), 2),
                     (one + (try String(contentsOfFile: second.sec1, encoding: .utf8)) + one, 3)]
        for (text, keys) in mixed {
            let path = try OperatorKeyFileTests.write("two.p8", text)
            let error = #expect(throws: CryptoError.self) { try ECPrivateKeyMaterial(contentsOf: path) }
            #expect(error?.code == .keyFileInvalid)
            #expect(error?.message.hasPrefix("the key file holds \(keys) PEM private keys") == true, "\(error?.message ?? "no error")")
        }
        #expect(try ECPrivateKeyMaterial(contentsOf: first.pkcs8Apple).publicKey == ECPublicKey(pem: first.publicKeyPEM))
    }
}

/// A fourth attack round renamed a library into /var/tmp (sticky) between
/// the module check, which passed a path that did not exist yet, and
/// p11-kit's load: the library ran as root.
@Suite("PathSafety and the module check: nothing missing passes")
struct MissingPathTests {
    @Test("a module path that does not exist, or lies below a directory that does not, is refused by the check itself, not left to the load")
    func missingModuleRefused() throws {
        let sticky = TemporaryDirectory.make(prefix: "signerd-sticky")
        #expect(chmod(sticky, 0o1777) == 0)
        for path in [sticky + "/libnotyet.so", sticky + "/notyet/lib.so"] {
            let problem = PKCS11Module.insecurity(ofModule: path)
            #expect(problem?.contains("cannot be") == true, "\(path): \(String(describing: problem))")
        }
        #expect(PathSafety.unsafeDirectory(above: sticky + "/notyet/signerd.sock")?.contains("the directory \(sticky)/notyet cannot be checked") == true)
        // What exists and is root's (or ours), below safe directories, passes.
        let file = sticky + "/present.so"
        #expect(FileManager.default.createFile(atPath: file, contents: Data([0x7F, 0x45, 0x4C, 0x46]), attributes: [.posixPermissions: 0o755]))
        #expect(PKCS11Module.insecurity(ofModule: file) == nil, "\(String(describing: PKCS11Module.insecurity(ofModule: file)))")
    }
}

/// The configuration file and the PIN file were checked for their own owner
/// and mode, but not for the directories above them: another user who may
/// write one could swap the file (a configuration naming their module, a PIN
/// file with wrong PINs that lock the token).
@Suite("PathSafety: the PIN file's directories, and users whose primary group it is")
struct PINDirectoryTests {
    @Test("a PIN file below a directory others may write (no sticky bit), directly or through a link, is pin_source_insecure; below a sticky one it is read")
    func pinBelowWritableDirectory() throws {
        // As written, the link's path passes (stat follows it to a 0700
        // directory); after symbolic links it lies below the open one.
        let (open, inner, link) = TemporaryDirectory.makeBelowOpen(prefix: "signerd-pindir")
        try writeSecretFile(inner + "/pin", "s3cret\n")
        for path in [inner + "/pin", link + "/pin"] {
            let error = #expect(throws: HSMError.self) { try PKCS11URI("pkcs11:token=x?module-path=/x.so&pin-source=file:\(path)").readPIN() }
            #expect(error?.code == .pinSourceInsecure)
            #expect(error?.message.contains("lies below the directory \(open) (owner uid \(geteuid())") == true, "\(error?.message ?? "no error")")
            #expect(error?.message.contains("may be written by other users without the sticky bit") == true, "\(error?.message ?? "no error")")
            #expect(error?.message.contains("s3cret") == false)
        }
        #expect(chmod(open, 0o1777) == 0)
        #expect(try PKCS11URI("pkcs11:token=x?module-path=/x.so&pin-source=file:\(link)/pin").readPIN().count == 6)
    }

    @Test("a group is not this user's alone when another user has it as primary group (nobody's nogroup), though /etc/group lists no member",
          .enabled(if: getpwnam("nobody")?.pointee.pw_gid == 65534 && geteuid() != 65534, "needs Debian's nobody user with primary group 65534, run as another user"))
    func primaryGroupMembers() throws {
        #expect(getgrgid(65534)?.pointee.gr_mem?.pointee == nil, "nogroup lists a member in /etc/group, so this test would not show the primary-group check")
        #expect(PathSafety.primaryGroupUsers(65534)?.contains(65534) == true)
        #expect(!PathSafety.groupHasNoOtherMembers(65534))
        // This user's own entry is enumerated too, and does not count against it.
        if let own = getpwuid(geteuid()) {
            #expect(PathSafety.primaryGroupUsers(own.pointee.pw_gid)?.contains(geteuid()) == true)
        }
    }
}

@Suite("Operator input: key file names")
struct KeyFileNameTests {
    @Test("the key ID comes from Apple's names, a browser's second copy and an upper-case .P8 included",
          arguments: [
            ("SubscriptionKey_ABC123DEFG.p8", "ABC123DEFG"), ("/tmp/x/AuthKey_XYZ987WVUT.p8", "XYZ987WVUT"),
            ("SubscriptionKey_ABC123DEFG (1).p8", "ABC123DEFG"), ("SubscriptionKey_ABC123DEFG (12).p8", "ABC123DEFG"),
            ("SubscriptionKey_ABC123DEFG.P8", "ABC123DEFG"),
          ])
    func keyIDFound(_ name: String, _ keyID: String) {
        #expect(ECPrivateKeyMaterial.keyID(fromFileName: name) == keyID)
        #expect(ECPrivateKeyMaterial.keyIDProblem(fileName: name) == nil)
    }

    @Test("a name the key ID cannot be taken from says why",
          arguments: [
            ("SubscriptionKey_abc123defg.p8", "is not in upper case"), ("SubscriptionKey_ABC123DEF.p8", "ABC123DEF, is not 10 characters"),
            ("SubscriptionKey_ABC123DEFG (x).p8", "is not 10 characters"), ("SubscriptionKey_ABC123DEFG(1).p8", "is not 10 characters"),
            ("key.p8", "not AuthKey_<KEYID>.p8"), ("SubscriptionKey_ABC123DEFG.pem", "not AuthKey_<KEYID>.p8"),
          ])
    func keyIDProblem(_ name: String, _ reason: String) {
        #expect(ECPrivateKeyMaterial.keyID(fromFileName: name) == nil)
        let problem = ECPrivateKeyMaterial.keyIDProblem(fileName: name) ?? ""
        #expect(problem.contains(reason), "\(problem)")
    }
}
