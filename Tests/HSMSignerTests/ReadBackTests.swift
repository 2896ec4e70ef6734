import Foundation
@testable import HSMSigner
import TestSupport
import Testing

/// signctl reads the token back from its storage after an import (and a PIN
/// change). A signerd recovering beside it rewrote SoftHSM's token file at
/// its `C_Login`, and the import's read-back then found the token
/// uninitialized: it reported the token gone (restore the copy!) and left
/// two keys under one key ID, 3 times in 1,942 imports. A read that fails
/// other than on the PIN is now made again, twice at most; a refused PIN
/// never is.
@Suite("signctl's read-backs from token storage, through the PKCS#11 seam")
struct ReadBackTests {
    struct Transient: CustomTestStringConvertible {
        let function: PKCS11Function
        let rv: PKCS11ReturnValue
        var testDescription: String { "\(function.rawValue) \(rv)" }
    }

    static let transients = [
        // The token looks uninitialized: findSlot skips it, token_not_found (what the import reported).
        Transient(function: .getTokenInfo, rv: .tokenNotRecognized),
        // What a start beside another's C_Login saw.
        Transient(function: .login, rv: .userPinNotInitialized),
        Transient(function: .finalize, rv: .generalError),
    ]

    static func setUp(_ name: String) throws -> (HSMToken, FaultInjector, TestKeyFiles) {
        let faults = FaultInjector()
        let hsm = try TokenTests.open(try SoftHSMFixture.shared.makeToken(name), poolSize: 2, interposer: faults)
        return (hsm, faults, try TestKeyFiles.make())
    }

    @Test("one failed read-back is read again: the import succeeds, one key under its key ID, and it signs", arguments: transients)
    func transientFailureReadAgain(_ fault: Transient) throws {
        let (hsm, faults, files) = try Self.setUp("readback-\(fault.rv.rawValue)")
        defer { hsm.close() }
        let material = try ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple)
        _ = try hsm.importKey(material, keyID: "READBACK01", replace: false, confirmingStorage: true)
        let finalizes = faults.calls(.finalize)
        // Other tests' tokens share the module: C_GetTokenInfo fails for every slot once, so that this token too looks uninitialized.
        let slots = fault.function == .getTokenInfo ? hsm.functions.slotsWithToken().1.count : 1
        faults.inject(fault.function, fault.rv, count: slots)
        let result = try hsm.importKey(material, keyID: "READBACK01", replace: true, confirmingStorage: true)
        #expect(result.replaced)
        #expect(faults.calls(.finalize) == finalizes + 2, "read twice: \(faults.calls(.finalize) - finalizes)")
        let digest = SHA256.hash(Array("read back".utf8))
        let signature = try hsm.sign(digest: digest, keyID: "READBACK01")
        #expect(try ECPublicKey(pem: files.publicKeyPEM).verify(rawSignature: signature.raw, digest: digest))
        #expect(try hsm.listKeys().filter { $0.keyID == "READBACK01" }.count == 1, "the replaced objects were removed: one key")
    }

    @Test("a failure that lasts is believed after three reads: token_not_found")
    func lastingFailureBelieved() throws {
        let (hsm, faults, files) = try Self.setUp("readback-lasting")
        defer { hsm.close() }
        let material = try ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple)
        let finalizes = faults.calls(.finalize)
        faults.inject(.getTokenInfo, .tokenNotRecognized, count: nil)
        let error = #expect(throws: HSMError.self) { try hsm.importKey(material, keyID: "READBACK02", replace: false, confirmingStorage: true) }
        faults.clear()
        #expect(error?.code == .tokenNotFound, "\(String(describing: error))")
        #expect(faults.calls(.finalize) == finalizes + HSMToken.readBackAttempts)
    }

    @Test("a PIN the read-back's C_Login is refused is not sent again (tokens lock after a few wrong PINs)")
    func refusedPINNotRetried() throws {
        let (hsm, faults, files) = try Self.setUp("readback-pin")
        defer { hsm.close() }
        let logins = faults.calls(.login)
        faults.inject(.login, .pinIncorrect)
        let error = #expect(throws: HSMError.self) { try hsm.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: "READBACK03", replace: false, confirmingStorage: true) }
        #expect(error?.code == .pinRejected, "\(String(describing: error))")
        #expect(faults.calls(.login) == logins + 1, "one C_Login, not retried")
    }
}
