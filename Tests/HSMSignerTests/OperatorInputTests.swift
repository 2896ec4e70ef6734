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
