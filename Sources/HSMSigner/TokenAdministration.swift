/// Token set-up for development tokens (SoftHSM): what `softhsm2-util
/// --init-token` does, but with PINs read from files instead of argv or a
/// terminal.
public enum TokenAdministration {
    /// What ``initializeToken(modulePath:label:soPIN:userPIN:)`` did.
    public enum Outcome: Sendable, Equatable {
        /// A free token was initialized; its serial number.
        case initialized(serial: String)
        /// A token with the label already existed and was left alone.
        case alreadyInitialized(serial: String)
        /// A token with the label existed without a user PIN (an earlier
        /// initialization stopped half-way); its user PIN was set.
        case userPINSet(serial: String)
    }

    /// Whether ``initializeToken(modulePath:label:soPIN:userPIN:)`` would
    /// write to the token storage for `label`, found without changing
    /// anything (`C_GetSlotList`, `C_GetTokenInfo`): false when an
    /// initialized token with the label and a user PIN exists.
    /// - Parameters:
    ///   - modulePath: the PKCS#11 module (e.g. `libsofthsm2.so`).
    ///   - label: the token label.
    /// - Throws: `pkcs11_failure` naming the function when the module cannot list its tokens.
    public static func initializationWouldWrite(modulePath: String, label: String) throws(HSMError) -> Bool {
        let module = try PKCS11Module.acquire(path: modulePath)
        defer { module.release() }
        let functions = PKCS11Functions(module: module, interposer: nil)
        guard let existing = try tokens(functions).first(where: { $0.1.label == label && $0.1.flags & P11.tokenInitialized != 0 }) else { return true }
        return existing.1.flags & P11.userPINInitialized == 0
    }

    /// The slots that hold a token, with what `C_GetTokenInfo` says of each.
    private static func tokens(_ functions: PKCS11Functions) throws(HSMError) -> [(UInt, TokenInfo)] {
        let (rv, slots) = functions.slotsWithToken()
        guard rv == .ok else { throw HSMError(pkcs11: .getSlotList, rv, message: "cannot list slots") }
        return slots.compactMap { slot in
            let (infoRV, info) = functions.tokenInfo(slot: slot)
            return infoRV == .ok ? info.map { (slot, $0) } : nil
        }
    }

    /// Initializes a token with `label` in a free slot (`C_InitToken`), then
    /// sets its user PIN (`C_Login` as SO, `C_InitPIN`, `C_Logout`). If an
    /// initialized token with this label exists, nothing is changed, unless
    /// it has no user PIN: then only the user PIN is set. Both PINs are
    /// checked against the token's `ulMinPinLen` and `ulMaxPinLen`
    /// (`C_GetTokenInfo`) before anything is changed, so a PIN the token
    /// would refuse cannot leave it initialized without a user PIN.
    /// - Parameters:
    ///   - modulePath: the PKCS#11 module (e.g. `libsofthsm2.so`).
    ///   - label: the token label, at most 32 bytes.
    ///   - soPIN: the security officer PIN to set.
    ///   - userPIN: the user PIN to set.
    /// - Returns: whether a token was initialized, and its serial number.
    /// - Throws: ``HSMError/Code/tokenNotFound`` when no free slot exists;
    ///   ``HSMError/Code/pinInvalid`` (`CKR_PIN_LEN_RANGE`) when a PIN is
    ///   shorter or longer than the token takes, before any change, or when
    ///   `C_InitToken` (the SO PIN) or `C_InitPIN` (the user PIN; the token
    ///   is then left without one) answers `CKR_PIN_INVALID` or
    ///   `CKR_PIN_LEN_RANGE`; `pin_rejected` when the SO login for
    ///   `C_InitPIN` is refused; `pkcs11_failure` with the function and
    ///   `CKR_*` value.
    public static func initializeToken(modulePath: String, label: String, soPIN: SecureBytes, userPIN: SecureBytes) throws(HSMError) -> Outcome {
        try initialize(modulePath: modulePath, label: label, soPIN: soPIN, userPIN: userPIN)
    }

    /// Initializes a token with `label` in a free slot (`C_InitToken`) and
    /// stops there: no user PIN is set (no `C_InitPIN`). That is the state an
    /// initialization interrupted between the two calls leaves behind, on
    /// which `C_Login` as user returns `CKR_USER_PIN_NOT_INITIALIZED`; tests
    /// make it with this, operators never need it. An initialized token with
    /// this label is left alone.
    ///
    /// The corresponding PKCS#11 function is `C_InitToken`.
    /// - Parameters:
    ///   - modulePath: the PKCS#11 module (e.g. `libsofthsm2.so`).
    ///   - label: the token label, 1–32 bytes.
    ///   - soPIN: the security officer PIN to set, checked against the
    ///     token's `ulMinPinLen`…`ulMaxPinLen` (bytes) first.
    /// - Returns: ``Outcome/initialized(serial:)``, or
    ///   ``Outcome/alreadyInitialized(serial:)`` when the label was taken.
    /// - Throws: ``HSMError/Code/invalidURI`` for a label outside 1–32 bytes;
    ///   ``HSMError/Code/tokenNotFound`` when no free slot exists;
    ///   ``HSMError/Code/pinInvalid`` (`CKR_PIN_LEN_RANGE`) before any change;
    ///   `pkcs11_failure` with the function and `CKR_*` value.
    package static func initializeTokenWithoutUserPIN(modulePath: String, label: String, soPIN: SecureBytes) throws(HSMError) -> Outcome {
        try initialize(modulePath: modulePath, label: label, soPIN: soPIN, userPIN: nil)
    }

    /// ``initializeToken(modulePath:label:soPIN:userPIN:)``; with `userPIN`
    /// nil it stops after `C_InitToken` and leaves an existing token alone.
    private static func initialize(modulePath: String, label: String, soPIN: SecureBytes, userPIN: SecureBytes?) throws(HSMError) -> Outcome {
        guard !label.isEmpty, label.utf8.count <= 32 else {
            throw HSMError(.invalidURI, "a token label is 1–32 bytes")
        }
        let module = try PKCS11Module.acquire(path: modulePath)
        defer { module.release() }
        let functions = PKCS11Functions(module: module, interposer: nil)

        let present = try tokens(functions)
        if let existing = present.first(where: { $0.1.label == label && $0.1.flags & P11.tokenInitialized != 0 }) {
            guard let userPIN, existing.1.flags & P11.userPINInitialized == 0 else {
                return .alreadyInitialized(serial: existing.1.serial)
            }
            try checkPINLengths(functions, slot: existing.0, label: label, soPIN: soPIN, userPIN: userPIN)
            try setUserPIN(functions, slot: existing.0, label: label, soPIN: soPIN, userPIN: userPIN)
            return .userPINSet(serial: existing.1.serial)
        }
        guard let free = present.first(where: { $0.1.flags & P11.tokenInitialized == 0 }) else {
            throw HSMError(.tokenNotFound, "no free (uninitialized) token in \(modulePath)")
        }
        try checkPINLengths(functions, slot: free.0, label: label, soPIN: soPIN, userPIN: userPIN)
        let rv = functions.initToken(slot: free.0, soPIN: soPIN, label: label)
        guard rv == .ok else {
            var error = HSMError(pkcs11: .initToken, rv, message: "cannot initialize token \(label)")
            if rv == .pinInvalid || rv == .pinLenRange { error.code = .pinInvalid }  // the SO PIN's form
            throw error
        }
        // SoftHSM moves an initialized token to a new slot ID: find it again by label.
        guard let (slot, info) = try tokens(functions).first(where: { $0.1.label == label && $0.1.flags & P11.tokenInitialized != 0 }) else {
            throw HSMError(.tokenNotFound, "token \(label) vanished after C_InitToken")
        }
        if let userPIN {
            try setUserPIN(functions, slot: slot, label: label, soPIN: soPIN, userPIN: userPIN)
        }
        return .initialized(serial: info.serial)
    }

    /// Sets the user PIN of an initialized token: `C_Login` as SO,
    /// `C_InitPIN`, `C_Logout`, on a read-write session.
    /// - Throws: `pin_rejected` for an SO PIN `C_Login` refuses;
    ///   ``HSMError/Code/pinInvalid`` for a user PIN `C_InitPIN` answers
    ///   with `CKR_PIN_INVALID` or `CKR_PIN_LEN_RANGE`; `pkcs11_failure`
    ///   naming the function otherwise.
    private static func setUserPIN(_ functions: PKCS11Functions, slot: UInt, label: String, soPIN: SecureBytes, userPIN: SecureBytes) throws(HSMError) {
        let (openRV, session) = functions.openSession(slot: slot, readWrite: true)
        guard openRV == .ok else { throw HSMError(pkcs11: .openSession, openRV, message: "cannot open a session on \(label)") }
        defer { functions.closeSession(session) }
        var rv = functions.loginSecurityOfficer(session, pin: soPIN)
        guard rv == .ok else { throw HSMError(pkcs11: .login, rv, message: "cannot log in as SO on \(label)") }
        defer { functions.logout(session) }
        rv = functions.initPIN(session, pin: userPIN)
        guard rv == .ok else {
            var error = HSMError(pkcs11: .initPIN, rv, message: "cannot set the user PIN of \(label)")
            if rv == .pinInvalid || rv == .pinLenRange { error.code = .pinInvalid }
            throw error
        }
    }

    /// Refuses a PIN outside the token's `ulMinPinLen`…`ulMaxPinLen` (bytes)
    /// before anything is changed (the user PIN only when one is given). The
    /// message gives the limits, never the PIN or its length. Skipped when
    /// the token does not answer `C_GetTokenInfo` (the later calls then
    /// report what it says).
    ///
    /// The corresponding PKCS#11 function is `C_GetTokenInfo`.
    /// - Throws: ``HSMError/Code/pinInvalid`` with `CKR_PIN_LEN_RANGE`.
    private static func checkPINLengths(_ functions: PKCS11Functions, slot: UInt, label: String, soPIN: SecureBytes, userPIN: SecureBytes?) throws(HSMError) {
        let (rv, info) = functions.tokenInfo(slot: slot)
        guard rv == .ok, let lengths = info?.pinLengths else { return }
        let pins = [userPIN.map { ("user PIN (--pin-file)", $0) }, ("SO PIN (--so-pin-file)", soPIN)].compactMap { $0 }
        for (name, pin) in pins {
            try refusePIN(pin, named: name, outside: lengths, label: label)
        }
    }

    /// ``HSMError/Code/pinInvalid`` (`CKR_PIN_LEN_RANGE`) when `pin` is
    /// shorter or longer than `lengths` (bytes); the message gives the
    /// limits, never the PIN or its length.
    static func refusePIN(_ pin: SecureBytes, named name: String, outside lengths: ClosedRange<Int>, label: String) throws(HSMError) {
        guard !lengths.contains(pin.count) else { return }
        var error = HSMError(.pinInvalid, "the \(name) is \(pin.count < lengths.lowerBound ? "shorter" : "longer") than token \(label) takes: \(lengths.lowerBound) to \(lengths.upperBound) bytes (ulMinPinLen, ulMaxPinLen); nothing was changed")
        error.function = PKCS11Function.getTokenInfo.rawValue
        error.returnValue = .pinLenRange
        error.tokenLabel = label
        throw error
    }

    /// Reads a PIN file the way ``PKCS11URI/readPIN()`` does (mode checked,
    /// one trailing newline removed).
    /// - Parameter path: an absolute path.
    /// - Throws: ``HSMError/Code/pinSourceUnreadable``, ``HSMError/Code/pinSourceInsecure``.
    public static func readPINFile(_ path: String) throws(HSMError) -> SecureBytes {
        try PKCS11URI.readPINFile(path)
    }
}
