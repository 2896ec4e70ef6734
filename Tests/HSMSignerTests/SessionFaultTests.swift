import Foundation
@testable import HSMSigner
import TestSupport
import Synchronization
import Testing

/// Session faults injected through the seam in front of the function table,
/// with a real SoftHSM token behind it.
@Suite("Session faults through the PKCS#11 seam")
struct SessionFaultTests {
    struct Setup {
        let hsm: HSMToken
        let faults: FaultInjector
        let publicKey: ECPublicKey
        let keyID = "FAULT00001"
        /// The token's RFC 7512 URI, with its PIN source.
        let uri: String
    }

    static func setUp(_ name: String, faults: FaultInjector = FaultInjector(), poolSize: Int = 2) throws -> Setup {
        let token = try SoftHSMFixture.shared.makeToken(name)
        let hsm = try TokenTests.open(token, poolSize: poolSize, interposer: faults)
        let files = try TestKeyFiles.make()
        _ = try hsm.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: "FAULT00001", replace: false)
        return Setup(hsm: hsm, faults: faults, publicKey: try ECPublicKey(pem: files.publicKeyPEM), uri: token.uri)
    }

    static func signAndVerify(_ setup: Setup, _ text: String = "fault test") throws -> Bool {
        let digest = SHA256.hash(Array(text.utf8))
        let signature = try setup.hsm.sign(digest: digest, keyID: setup.keyID)
        // The signature names the public key of the key object that made it (what verify_before_return uses).
        guard signature.publicKey?.uncompressedPoint == setup.publicKey.uncompressedPoint else { return false }
        return setup.publicKey.verify(rawSignature: signature.raw, digest: digest)
    }

    @Test("CKR_SESSION_HANDLE_INVALID on C_Sign: the session is replaced and the signature succeeds")
    func sessionHandleInvalid() throws {
        let setup = try Self.setUp("sess-invalid")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup))
        let opened = setup.faults.calls(.openSession)
        let closed = setup.faults.calls(.closeSession)
        setup.faults.inject(.sign, .sessionHandleInvalid)
        #expect(try Self.signAndVerify(setup))
        #expect(setup.faults.calls(.closeSession) == closed + 1, "the broken session was closed")
        #expect(setup.faults.calls(.openSession) >= opened + 1, "a new one was opened")
        #expect(setup.faults.calls(.sign) >= 3)
    }

    @Test("CKR_SESSION_CLOSED and CKR_OPERATION_ACTIVE also replace the session", arguments: [PKCS11ReturnValue.sessionClosed, .operationActive])
    func otherSessionFailures(_ rv: PKCS11ReturnValue) throws {
        let setup = try Self.setUp("sess-\(rv.rawValue)")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup))
        let opened = setup.faults.calls(.openSession)
        let closed = setup.faults.calls(.closeSession)
        setup.faults.inject(.signInit, rv)
        #expect(try Self.signAndVerify(setup))
        #expect(setup.faults.calls(.closeSession) == closed + 1, "the broken session was closed")
        #expect(setup.faults.calls(.openSession) >= opened + 1, "a new one was opened")
    }

    @Test("a C_Sign that failed while an operation stays active never poisons the next request")
    func operationActiveAfterFailedSign() throws {
        let setup = try Self.setUp("op-active")
        defer { setup.hsm.close() }
        // The injected C_Sign failure leaves SoftHSM's real sign operation
        // initialized on that session: reusing it would give CKR_OPERATION_ACTIVE.
        setup.faults.inject(.sign, .functionFailed)
        let error = #expect(throws: HSMError.self) { try Self.signAndVerify(setup) }
        #expect(error?.returnValue == .functionFailed)
        for index in 0..<10 {
            #expect(try Self.signAndVerify(setup, "after \(index)"))
        }
    }

    @Test("CKR_USER_NOT_LOGGED_IN: exactly one re-login, then success")
    func userNotLoggedIn() throws {
        let setup = try Self.setUp("relogin")
        defer { setup.hsm.close() }
        let logins = setup.faults.calls(.login)
        setup.faults.inject(.sign, .userNotLoggedIn)
        #expect(try Self.signAndVerify(setup))
        #expect(setup.faults.calls(.login) == logins + 1)
    }

    @Test("CKR_OBJECT_HANDLE_INVALID: the key is looked up again")
    func objectHandleInvalid() throws {
        let setup = try Self.setUp("rehandle")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup))
        let searches = setup.faults.calls(.findObjectsInit)
        setup.faults.inject(.signInit, .objectHandleInvalid)
        #expect(try Self.signAndVerify(setup))
        #expect(setup.faults.calls(.findObjectsInit) > searches)
        // Cached again: the next signature does not search.
        let after = setup.faults.calls(.findObjectsInit)
        #expect(try Self.signAndVerify(setup))
        #expect(setup.faults.calls(.findObjectsInit) == after)
    }

    /// SoftHSM answers CKR_GENERAL_ERROR when another process's `keys
    /// import --replace` destroys the key's objects while it reads them
    /// (at a look-up, in C_SignInit, which reads the private value, and in
    /// C_Sign). The replacement test under load saw a token_down for one
    /// such answer from C_Sign.
    @Test("CKR_GENERAL_ERROR at the key's look-up, C_SignInit or C_Sign: once, the key is looked up again, the signature made and the token stays up; when it outlasts a replacement, the token is marked down",
          arguments: [PKCS11Function.getAttributeValue, .signInit, .sign], [false, true])
    func generalErrorWhileKeyReplaced(_ function: PKCS11Function, persisting: Bool) throws {
        let setup = try Self.setUp("gen-\(function == .getAttributeValue ? "attr" : function == .signInit ? "init" : "sign")-\(persisting ? "down" : "once")")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup))
        setup.hsm.forgetKey(setup.keyID)  // the next signature looks the key up
        let searches = setup.faults.calls(.findObjectsInit)
        setup.faults.inject(function, .generalError, count: persisting ? nil : 1)
        if persisting {
            let error = #expect(throws: HSMError.self) { try Self.signAndVerify(setup) }
            #expect(error?.code == .tokenUnavailable)
            #expect(error?.returnValue == .generalError)
            #expect(setup.hsm.status == .down(reason: "CKR_GENERAL_ERROR"))
            setup.faults.clear()
        } else {
            #expect(try Self.signAndVerify(setup))
            #expect(setup.hsm.status == .up)
            #expect(setup.faults.calls(.findObjectsInit) >= searches + 2, "looked up again after the failure")
        }
    }

    /// `GET /v1/keys` reads each key's objects again (``HSMToken/currentPublicKey(keyID:maxAge:)``)
    /// and meets the same CKR_GENERAL_ERROR while another process replaces the key.
    @Test("CKR_GENERAL_ERROR while a key's public key is read again for a listing: once, the key is returned and the token stays up; when it outlasts a replacement, token_unavailable and the token is marked down",
          arguments: [false, true])
    func generalErrorWhileKeyListed(persisting: Bool) throws {
        let setup = try Self.setUp("gen-list-\(persisting ? "down" : "once")")
        defer { setup.hsm.close() }
        #expect(try setup.hsm.currentPublicKey(keyID: setup.keyID, maxAge: 0).uncompressedPoint == setup.publicKey.uncompressedPoint)
        let searches = setup.faults.calls(.findObjectsInit)
        setup.faults.inject(.getAttributeValue, .generalError, count: persisting ? nil : 1)
        if persisting {
            let error = #expect(throws: HSMError.self) { try setup.hsm.currentPublicKey(keyID: setup.keyID, maxAge: 0) }
            #expect(error?.code == .tokenUnavailable)
            #expect(error?.returnValue == .generalError)
            #expect(setup.hsm.status == .down(reason: "CKR_GENERAL_ERROR"))
            setup.faults.clear()
        } else {
            #expect(try setup.hsm.currentPublicKey(keyID: setup.keyID, maxAge: 0).uncompressedPoint == setup.publicKey.uncompressedPoint)
            #expect(setup.hsm.status == .up)
            #expect(setup.faults.calls(.findObjectsInit) >= searches + 2, "looked up again after the failure")
        }
    }

    /// C_Sign takes no key handle: a handle failure from it is not a key
    /// being replaced, and marks the token down at once (only C_SignInit's
    /// and the look-up's are waited out).
    @Test("CKR_KEY_HANDLE_INVALID from C_Sign marks the token down at once, without waiting for a replacement")
    func keyHandleInvalidFromSign() throws {
        let setup = try Self.setUp("sign-key-handle")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup))
        let searches = setup.faults.calls(.findObjectsInit)
        setup.faults.inject(.sign, .keyHandleInvalid, count: nil)
        let error = #expect(throws: HSMError.self) { try Self.signAndVerify(setup) }
        #expect(error?.code == .tokenUnavailable)
        #expect(error?.returnValue == .keyHandleInvalid)
        #expect(setup.hsm.status == .down(reason: "CKR_KEY_HANDLE_INVALID"))
        #expect(setup.faults.calls(.findObjectsInit) == searches, "no look-up: C_Sign's failure is not waited out")
        setup.faults.clear()
    }

    @Test("CKR_PIN_INCORRECT at open: exactly one C_Login and a named error")
    func pinIncorrectAtOpen() throws {
        let token = try SoftHSMFixture.shared.makeToken("pin-open")
        let faults = FaultInjector()
        faults.inject(.login, .pinIncorrect, count: nil)
        let error = #expect(throws: HSMError.self) { try TokenTests.open(token, interposer: faults) }
        #expect(error?.code == .pinRejected)
        #expect(error?.returnValue == .pinIncorrect)
        #expect(error?.function == "C_Login")
        #expect(faults.calls(.login) == 1)
    }

    @Test("CKF_USER_PIN_LOCKED at open: no C_Login at all, pin_rejected with CKR_PIN_LOCKED")
    func pinLockedAtOpen() throws {
        let token = try SoftHSMFixture.shared.makeToken("pin-locked-open")
        let faults = FaultInjector()
        faults.addTokenFlags(UserPINFlags.locked)
        let error = #expect(throws: HSMError.self) { try TokenTests.open(token, interposer: faults) }
        #expect(error?.code == .pinRejected)
        #expect(error?.returnValue == .pinLocked)
        #expect(error?.message.contains("CKF_USER_PIN_LOCKED") == true, "\(error?.message ?? "")")
        #expect(faults.calls(.login) == 0, "a locked PIN was sent")
    }

    @Test("CKF_USER_PIN_LOCKED on re-login: no C_Login however many requests follow; the status says CKR_PIN_LOCKED")
    func pinLockedOnRelogin() throws {
        let setup = try Self.setUp("pin-locked-relogin")
        defer { setup.hsm.close() }
        let logins = setup.faults.calls(.login)
        setup.faults.addTokenFlags(UserPINFlags.locked)
        setup.faults.logOut()
        for _ in 0..<20 {
            let error = #expect(throws: HSMError.self) { try setup.hsm.sign(digest: SHA256.hash([1]), keyID: setup.keyID) }
            #expect(error?.code == .pinRejected)
        }
        #expect(setup.faults.calls(.login) == logins)
        #expect(setup.hsm.status == .pinRejected(.pinLocked))
    }

    @Test("after CKR_PIN_LOCKED, a reload of the same PIN gets its one login once the SO unlocked it; after CKR_PIN_INCORRECT it gets none")
    func reloadAfterLock() throws {
        let setup = try Self.setUp("pin-unlocked")
        let hsm = setup.hsm, faults = setup.faults
        defer { hsm.close() }
        let uri = try PKCS11URI(setup.uri)
        // Locked elsewhere: the re-login is refused with CKR_PIN_LOCKED.
        faults.logOut()
        faults.inject(.login, .pinLocked, count: 1)
        #expect(throws: HSMError.self) { try hsm.sign(digest: SHA256.hash([1]), keyID: setup.keyID) }
        #expect(hsm.status == .pinRejected(.pinLocked))
        // The SO unlocked it with the same PIN; the reload logs in.
        let logins = faults.calls(.login)
        try hsm.reloadPIN(from: uri)
        #expect(faults.calls(.login) == logins + 1)
        #expect(hsm.status == .up)
        // Called wrong: the same PIN is not sent again.
        faults.logOut()
        faults.inject(.login, .pinIncorrect, count: 1)
        #expect(throws: HSMError.self) { try hsm.sign(digest: SHA256.hash([1]), keyID: setup.keyID) }
        #expect(hsm.status == .pinRejected(.pinIncorrect))
        let refused = #expect(throws: HSMError.self) { try hsm.reloadPIN(from: uri) }
        #expect(refused?.message.contains("not sent again") == true)
        #expect(faults.calls(.login) == logins + 2)
    }

    /// Only the last refused PIN was remembered: two stale PIN files
    /// given in turn spent one wrong C_Login per reload.
    @Test("two PINs SoftHSM called wrong, reloaded in turn: neither is sent again; the right one logs in")
    func refusedPINsRemembered() throws {
        let setup = try Self.setUp("pin-refused-list")
        let hsm = setup.hsm, faults = setup.faults
        defer { hsm.close() }
        let pinPath = TemporaryDirectory.make(prefix: "signerd-pins") + "/pin"
        let wrongURI = try PKCS11URI(setup.uri.replacingOccurrences(of: #"pin-source=file:[^&]*"#, with: "pin-source=file:\(pinPath)", options: .regularExpression))
        #expect(try Self.signAndVerify(setup))  // the key's handle is cached
        try writeSecretFile(pinPath, "wrong-one")
        try hsm.reloadPIN(from: wrongURI)  // logged in: taken without a login
        // The token forgets the login (C_Sign: CKR_USER_NOT_LOGGED_IN), and
        // SoftHSM really logs out, so the re-login sends "wrong-one" to it.
        #expect(try hsm.withSession { hsm.functions.logout($0) } == .ok)
        faults.logOut()
        let signError = #expect(throws: HSMError.self) { try hsm.sign(digest: SHA256.hash([1]), keyID: setup.keyID) }
        #expect(hsm.status == .pinRejected(.pinIncorrect), "\(String(describing: signError))")
        let logins = faults.calls(.login)
        try writeSecretFile(pinPath, "wrong-two")
        #expect(throws: HSMError.self) { try hsm.reloadPIN(from: wrongURI) }
        #expect(faults.calls(.login) == logins + 1)
        for pin in ["wrong-one", "wrong-two", "wrong-one"] {
            try writeSecretFile(pinPath, pin)
            let refused = #expect(throws: HSMError.self) { try hsm.reloadPIN(from: wrongURI) }
            #expect(refused?.message.contains("not sent again") == true, "\(pin): \(String(describing: refused))")
        }
        #expect(faults.calls(.login) == logins + 1, "a PIN called wrong was sent again")
        try hsm.reloadPIN(from: PKCS11URI(setup.uri))
        #expect(hsm.status == .up)
        #expect(try Self.signAndVerify(setup))
    }

    /// The list of refused PINs was emptied on CKR_PIN_LOCKED from C_Login
    /// but not when the token's flags said locked, so a PIN the SO made
    /// right again was refused until a restart.
    @Test("a lock seen in the token's flags empties the refused PINs too: after the SO's unlock, a PIN refused before logs in")
    func lockFlagForgetsRefusedPINs() throws {
        let setup = try Self.setUp("pin-lock-flag")
        let hsm = setup.hsm, faults = setup.faults
        defer { hsm.close() }
        #expect(try Self.signAndVerify(setup))
        let right = try PKCS11URI(setup.uri)
        // The right PIN, called wrong (as before the SO reset the PIN to it).
        faults.logOut()
        faults.inject(.login, .pinIncorrect, count: 1)
        #expect(throws: HSMError.self) { try hsm.sign(digest: SHA256.hash([1]), keyID: setup.keyID) }
        #expect(hsm.status == .pinRejected(.pinIncorrect))
        // Another PIN meets the lock in the flags: no login.
        let otherPath = TemporaryDirectory.make(prefix: "signerd-pins") + "/pin"
        try writeSecretFile(otherPath, "another-pin")
        let other = try PKCS11URI(setup.uri.replacingOccurrences(of: #"pin-source=file:[^&]*"#, with: "pin-source=file:\(otherPath)", options: .regularExpression))
        faults.addTokenFlags(UserPINFlags.locked)
        let logins = faults.calls(.login)
        #expect(throws: HSMError.self) { try hsm.reloadPIN(from: other) }
        #expect(hsm.status == .pinRejected(.pinLocked))
        // The SO unlocked it: the PIN refused before gets its login, and is right.
        faults.clear()
        try hsm.reloadPIN(from: right)
        #expect(faults.calls(.login) == logins + 1)
        #expect(hsm.status == .up)
    }

    @Test("CKF_USER_PIN_FINAL_TRY or COUNT_LOW before a login: the login goes ahead, and pin_count_low is logged",
          arguments: [(UserPINFlags.finalTry, true), (UserPINFlags.countLow, false)])
    func pinCountLow(_ flag: UInt, _ finalTry: Bool) throws {
        let token = try SoftHSMFixture.shared.makeToken("pin-count-low")
        let faults = FaultInjector()
        faults.addTokenFlags(flag)
        let lines = LineCollector()
        var options = TokenOptions()
        options.logger = Logger(minimumLevel: .info) { lines.append($0) }
        let hsm = try HSMToken(uri: PKCS11URI(token.uri), options: options, interposer: faults)
        defer { hsm.close() }
        #expect(faults.calls(.login) == 1)
        let warned = lines.lines.filter { $0.contains("\"msg\":\"pin_count_low\"") }
        #expect(warned.count == 1, "\(lines.lines)")
        #expect(warned.first?.contains("\"final_try\":\(finalTry)") == true, "\(warned)")
    }

    /// A daemon that is stopping must start no new PKCS#11 work: a call hung
    /// at SIGTERM took the token down at sign_timeout_ms, and recovery's test
    /// signature went into the hanging module (HungModuleTests found it).
    @Test("after stopRecovering(), an outage is marked down but nothing recovers: no new session, no login")
    func noRecoveryOnceStopping() throws {
        let setup = try Self.setUp("no-recovery")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup))
        let (logins, opened) = (setup.faults.calls(.login), setup.faults.calls(.openSession))
        setup.hsm.stopRecovering()
        setup.hsm.markDown(reason: "CKR_DEVICE_ERROR")
        usleep(600_000)  // recovery's first step comes well within this
        #expect(setup.hsm.status == .down(reason: "CKR_DEVICE_ERROR"))
        #expect(setup.faults.calls(.login) == logins && setup.faults.calls(.openSession) == opened, "recovery ran after stopRecovering()")
    }

    /// stopRecovering() was checked only between recovery's attempts: one
    /// inside its C_Login at SIGTERM went on to look the keys up, sign its
    /// test digest and log token_up after shutdown_requested (an attack round).
    @Test("stopRecovering() during a recovery step: the step makes no further call once the one in progress returns, and isRecovering says when it is inside one")
    func recoveryStopsMidStep() throws {
        let setup = try Self.setUp("recovery-mid-step")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup))
        setup.faults.inject(.login, .ok, count: 1, delay: 0.8)  // recovery's login is slow, then succeeds
        setup.hsm.markDown(reason: "CKR_DEVICE_ERROR")
        let inLogin = MonotonicClock.deadline(after: 3)
        while setup.faults.calls(.login) == 1 && MonotonicClock.now() < inLogin { usleep(10_000) }  // the start's login was the first
        #expect(setup.hsm.isRecovering, "recovery is inside its C_Login")
        let signs = setup.faults.calls(.sign)
        let finds = setup.faults.calls(.findObjectsInit)
        setup.hsm.stopRecovering()
        let done = MonotonicClock.deadline(after: 5)
        while setup.hsm.isRecovering && MonotonicClock.now() < done { usleep(10_000) }
        usleep(300_000)
        #expect(!setup.hsm.isRecovering)
        #expect(setup.faults.calls(.sign) == signs && setup.faults.calls(.findObjectsInit) == finds, "recovery went on after stopRecovering()")
        #expect(setup.hsm.status != .up)
    }

    /// A reload that changed the PIN while logged in said nothing: a wrong
    /// new PIN showed only at the next login, after an outage, as an outage
    /// that did not end (an operator runbook audit). And a reload that put
    /// the PIN into the URI gave no `pin_value_in_uri`, which start gives.
    @Test("a reload with another PIN while logged in: pin_changed, no C_Login; the same PIN, the same new PIN again, or the PIN in use again: nothing; pin-value: pin_value_in_uri")
    func pinChangedWhileLoggedIn() throws {
        let token = try SoftHSMFixture.shared.makeToken("pin-changed")
        let faults = FaultInjector()
        let lines = LineCollector()
        var options = TokenOptions()
        options.logger = Logger(minimumLevel: .info) { lines.append($0) }
        let hsm = try HSMToken(uri: PKCS11URI(token.uri), options: options, interposer: faults)
        defer { hsm.close() }
        func events(_ name: String) -> [String] { lines.lines.filter { $0.contains("\"msg\":\"\(name)\"") } }
        let logins = faults.calls(.login)
        try hsm.reloadPIN(from: PKCS11URI(token.uri))
        #expect(events("pin_changed").isEmpty, "the same PIN read again is no change: \(lines.lines)")
        let rightPIN = try String(contentsOfFile: token.pinPath, encoding: .utf8).trimmingCharacters(in: .whitespacesAndNewlines)
        let otherPath = TemporaryDirectory.make(prefix: "signerd-pins") + "/pin"
        try writeSecretFile(otherPath, "another-pin")
        let other = try PKCS11URI(token.uri.replacingOccurrences(of: #"pin-source=file:[^&]*"#, with: "pin-source=file:\(otherPath)", options: .regularExpression))
        try hsm.reloadPIN(from: other)
        let changed = events("pin_changed")
        #expect(changed.count == 1, "\(lines.lines)")
        #expect(changed.first?.contains("\"level\":\"notice\"") == true && changed.first?.contains("next login") == true, "\(changed)")
        // A CLI audit saw a second reload with the same new PIN log pin_changed again: nothing changed since the first.
        try hsm.reloadPIN(from: other)
        #expect(events("pin_changed").count == 1, "the same new PIN read again: \(lines.lines)")
        #expect(!lines.lines.joined().contains("another-pin") && !lines.lines.joined().contains(rightPIN), "a PIN reached the log")
        #expect(faults.calls(.login) == logins, "a logged-in reload sent the PIN to the token")
        #expect(events("pin_value_in_uri").isEmpty)
        let inline = try PKCS11URI(token.uri.replacingOccurrences(of: #"pin-source=file:[^&]*"#, with: "pin-value=\(rightPIN)", options: .regularExpression))
        try hsm.reloadPIN(from: inline)
        #expect(events("pin_value_in_uri").count == 1, "\(lines.lines)")
        // The wrong PIN was never sent: back to the PIN in use is no change (an attack round saw pin_changed here).
        #expect(events("pin_changed").count == 1, "back to the PIN in use: \(lines.lines)")
        try hsm.reloadPIN(from: other)
        #expect(events("pin_changed").count == 2, "the other PIN again is a change again: \(lines.lines)")
        try hsm.reloadPIN(from: inline)
        #expect(!lines.lines.joined().contains(rightPIN), "a PIN reached the log")
        // Down, recovery's next login uses the new PIN within seconds: "stays logged in" would be false.
        faults.outage(.deviceError, seconds: 3)  // recovery cannot bring it up meanwhile
        hsm.markDown(reason: "test")
        #expect(hsm.status != .up)
        try hsm.reloadPIN(from: other)
        #expect(events("pin_changed").count == 2, "pin_changed while the token is down: \(lines.lines)")
    }

    /// signctl, which an operator may just run again, spent the last try.
    @Test("loginOnFinalTry false (signctl): CKF_USER_PIN_FINAL_TRY stops before C_Login with userPINFlags; COUNT_LOW alone logs in")
    func finalTryRefused() throws {
        let token = try SoftHSMFixture.shared.makeToken("pin-final-try")
        var options = TokenOptions()
        options.logger = .disabled
        options.loginOnFinalTry = false
        let faults = FaultInjector()
        faults.addTokenFlags(UserPINFlags.finalTry | UserPINFlags.countLow)
        let refused = #expect(throws: HSMError.self) { try HSMToken(uri: PKCS11URI(token.uri), options: options, interposer: faults) }
        #expect(refused?.code == .pinRejected)
        #expect(refused?.userPINFlags.map { $0 & UserPINFlags.finalTry != 0 } == true)
        #expect(refused?.message.contains("CKF_USER_PIN_FINAL_TRY") == true, "\(String(describing: refused))")
        #expect(faults.calls(.login) == 0)
        let countLow = FaultInjector()
        countLow.addTokenFlags(UserPINFlags.countLow)
        let hsm = try HSMToken(uri: PKCS11URI(token.uri), options: options, interposer: countLow)
        hsm.close()
        #expect(countLow.calls(.login) == 1)
    }

    /// On a full disk SoftHSM answers C_CreateObject with CKR_OK and the
    /// handle then names nothing: the import said "failed its self-test
    /// signature" and the hint pointed at the device.
    @Test("an import whose new objects are gone at the self-test says the token did not keep them (full or read-only storage), and leaves nothing")
    func importNotKept() throws {
        let token = try SoftHSMFixture.shared.makeToken("import-not-kept")
        let faults = FaultInjector()
        let hsm = try TokenTests.open(token, interposer: faults)
        defer { hsm.close() }
        let files = try TestKeyFiles.make()
        faults.inject(.signInit, .objectHandleInvalid)
        let refused = #expect(throws: HSMError.self) { try hsm.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: "NOTKEPT001", replace: false) }
        #expect(refused?.returnValue == .objectHandleInvalid)
        #expect(refused?.message.contains("the token did not keep the key objects it had just created (for SoftHSM: its token directory is full or not writable by this user)") == true, "\(String(describing: refused))")
        #expect(try hsm.listKeys().isEmpty)
        #expect(try hsm.publicKeyOnlyIDs().isEmpty)
    }

    @Test("CKR_PIN_INCORRECT on re-login: one C_Login however many requests follow, from many threads")
    func pinIncorrectOnRelogin() throws {
        let setup = try Self.setUp("pin-relogin")
        defer { setup.hsm.close() }
        let logins = setup.faults.calls(.login)
        setup.faults.inject(.sign, .userNotLoggedIn, count: nil)
        setup.faults.inject(.login, .pinIncorrect, count: nil)
        let codes = Mutex<[HSMError.Code]>([])
        DispatchQueue.concurrentPerform(iterations: 8) { _ in
            for _ in 0..<25 {
                do {
                    _ = try setup.hsm.sign(digest: SHA256.hash([1, 2, 3]), keyID: setup.keyID)
                    codes.withLock { $0.append(HSMError.Code(rawValue: "success")) }
                } catch {
                    codes.withLock { $0.append((error as? HSMError)?.code ?? HSMError.Code(rawValue: "\(error)")) }
                }
            }
        }
        #expect(setup.faults.calls(.login) == logins + 1)
        #expect(codes.withLock { $0.allSatisfy { $0 == .pinRejected } })
        #expect(setup.hsm.status == .pinRejected(.pinIncorrect))
    }

    /// Sessions of the token's slot open in the module, asked of SoftHSM
    /// itself with `C_GetSessionInfo` on every handle number up to `highest`.
    static func sessionsOpenInModule(_ setup: Setup, upTo highest: UInt) -> Int {
        let slot = setup.hsm.slotAndAnchor.slot
        return (1...highest).filter { setup.hsm.functions.sessionSlot($0).1 == slot }.count
    }

    @Test("a module failure while a call holds a session: recovery waits for the call and reinitializes, so no session whose close failed in the outage stays open")
    func closeFailedDuringOutage() throws {
        let setup = try Self.setUp("close-failed")
        defer { setup.hsm.close() }
        // Both sessions of the pool open and idle.
        let deadline = MonotonicClock.deadline(after: 2)
        let first = try setup.hsm.pool.checkout(deadline: deadline)
        let second = try setup.hsm.pool.checkout(deadline: deadline)
        setup.hsm.pool.checkin(first)
        setup.hsm.pool.checkin(second)
        let highest = max(first.handle, second.handle) + 1000
        let before = Self.sessionsOpenInModule(setup, upTo: highest)

        // One signer's C_Sign takes 1 s, so its session stays leased
        // through the outage and past recovery's first attempt.
        setup.faults.inject(.sign, .ok, count: 1, delay: 1.0)
        let slowSigned = Mutex<Bool?>(nil)
        let slow = Thread { slowSigned.withLock { $0 = (try? Self.signAndVerify(setup, "slow")) ?? false } }
        slow.start()
        usleep(150_000)
        // The device fails: the other signer's session is discarded, and its
        // C_CloseSession fails too, so the module keeps it open.
        setup.faults.outage(.deviceError, seconds: 0.2)
        #expect(throws: HSMError.self) { try Self.signAndVerify(setup, "in the outage") }
        #expect(setup.hsm.status != .up)

        let waitUntil = MonotonicClock.deadline(after: 10)
        while (setup.hsm.status != .up || slowSigned.withLock({ $0 }) == nil) && MonotonicClock.now() < waitUntil { usleep(20_000) }
        #expect(slowSigned.withLock { $0 } == true, "the slow call's signature was kept")
        #expect(setup.hsm.status == .up)
        #expect(setup.faults.calls(.finalize) >= 1, "recovery reinitialized the module")
        #expect(try Self.signAndVerify(setup, "after"))
        let usage = setup.hsm.sessionUsage
        let anchor = setup.hsm.slotAndAnchor.anchor == nil ? 0 : 1
        let open = Self.sessionsOpenInModule(setup, upTo: highest)
        #expect(open == usage.idle + usage.inUse + anchor, "sessions open in the module (\(open), \(before) before) are the pool's \(usage.idle + usage.inUse) and the login anchor's \(anchor)")
    }

    /// Waiting for a written-off call kept the token down for the whole
    /// wait after every device failure (2.08 s against 0.10 s in an attack
    /// round), and bought nothing: such a call may never return.
    @Test("a device failure while a written-off call hangs: recovery does not wait for that call, and the token is up while it still hangs")
    func deviceFailureWithWrittenOffCall() throws {
        let setup = try Self.setUp("written-off")
        defer { setup.hsm.close() }
        #expect(try Self.signAndVerify(setup, "before"))
        // Hung for 2.5 s: longer than recovery needs, shorter than the 2 s
        // wait for leases would last from the device failure below.
        setup.faults.inject(.sign, .ok, count: 1, delay: 2.5)
        let hungCallReturned = Mutex(false)
        let hung = Thread {
            _ = try? Self.signAndVerify(setup, "hung")
            hungCallReturned.withLock { $0 = true }
        }
        hung.start()
        usleep(600_000)
        #expect(setup.hsm.abandonCalls(olderThan: 0.5) == 1, "the hung C_Sign is written off, as the daemon's watchdog does")
        var deadline = MonotonicClock.deadline(after: 1.5)
        while setup.hsm.status != .up && MonotonicClock.now() < deadline { usleep(10_000) }
        try #require(setup.hsm.status == .up, "recovered on new sessions after the write-off")

        setup.faults.outage(.deviceError, seconds: 0.2)
        #expect(throws: HSMError.self) { try Self.signAndVerify(setup, "in the outage") }
        #expect(setup.hsm.status != .up)
        deadline = MonotonicClock.deadline(after: 5)
        while setup.hsm.status != .up && MonotonicClock.now() < deadline { usleep(10_000) }
        #expect(setup.hsm.status == .up)
        #expect(!hungCallReturned.withLock { $0 }, "the token was up again before the written-off call returned")
        #expect(try Self.signAndVerify(setup, "after"))
        while !hungCallReturned.withLock({ $0 }) { usleep(50_000) }
    }

    @Test("session checkout waits for a free session instead of failing")
    func checkoutWaits() throws {
        let setup = try Self.setUp("wait")
        defer { setup.hsm.close() }
        // Two sessions, each C_Sign held 0.2 s: 6 concurrent signers must queue, not fail.
        setup.faults.inject(.sign, .ok, count: 6, delay: 0.2)
        let failures = Mutex(0)
        DispatchQueue.concurrentPerform(iterations: 6) { index in
            if (try? Self.signAndVerify(setup, "wait \(index)")) != true { failures.withLock { $0 += 1 } }
        }
        #expect(failures.withLock { $0 } == 0)
        #expect(setup.hsm.sessionCapacity == 2)
    }
}
