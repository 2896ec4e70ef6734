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
    }

    /// Initializes a token with `label` in a free slot (`C_InitToken`), then
    /// sets its user PIN (`C_Login` as SO, `C_InitPIN`, `C_Logout`). If an
    /// initialized token with this label exists, nothing is changed.
    /// - Parameters:
    ///   - modulePath: the PKCS#11 module (e.g. `libsofthsm2.so`).
    ///   - label: the token label, at most 32 bytes.
    ///   - soPIN: the security officer PIN to set.
    ///   - userPIN: the user PIN to set.
    /// - Returns: whether a token was initialized, and its serial number.
    /// - Throws: ``HSMError/Code/tokenNotFound`` when no free slot exists;
    ///   `pkcs11_failure` with the function and `CKR_*` value.
    public static func initializeToken(modulePath: String, label: String, soPIN: SecureBytes, userPIN: SecureBytes) throws(HSMError) -> Outcome {
        guard !label.isEmpty, label.utf8.count <= 32 else {
            throw HSMError(.invalidURI, "a token label is 1–32 bytes")
        }
        let module = try PKCS11Module.acquire(path: modulePath)
        defer { module.release() }
        let functions = PKCS11Functions(module: module, interposer: nil)

        func tokens() throws(HSMError) -> [(UInt, TokenInfo)] {
            let (rv, slots) = functions.slotsWithToken()
            guard rv == .ok else { throw HSMError(pkcs11: .getSlotList, rv, message: "cannot list slots") }
            return slots.compactMap { slot in
                let (infoRV, info) = functions.tokenInfo(slot: slot)
                return infoRV == .ok ? info.map { (slot, $0) } : nil
            }
        }

        let present = try tokens()
        if let existing = present.first(where: { $0.1.label == label && $0.1.flags & P11.tokenInitialized != 0 }) {
            return .alreadyInitialized(serial: existing.1.serial)
        }
        guard let free = present.first(where: { $0.1.flags & P11.tokenInitialized == 0 }) else {
            throw HSMError(.tokenNotFound, "no free (uninitialized) token in \(modulePath)")
        }
        var rv = functions.initToken(slot: free.0, soPIN: soPIN, label: label)
        guard rv == .ok else { throw HSMError(pkcs11: .initToken, rv, message: "cannot initialize token \(label)") }
        // SoftHSM moves an initialized token to a new slot ID: find it again by label.
        guard let (slot, info) = try tokens().first(where: { $0.1.label == label && $0.1.flags & P11.tokenInitialized != 0 }) else {
            throw HSMError(.tokenNotFound, "token \(label) vanished after C_InitToken")
        }
        let (openRV, session) = functions.openSession(slot: slot, readWrite: true)
        guard openRV == .ok else { throw HSMError(pkcs11: .openSession, openRV, message: "cannot open a session on \(label)") }
        defer { functions.closeSession(session) }
        rv = functions.loginSecurityOfficer(session, pin: soPIN)
        guard rv == .ok else { throw HSMError(pkcs11: .login, rv, message: "cannot log in as SO on \(label)") }
        defer { functions.logout(session) }
        rv = functions.initPIN(session, pin: userPIN)
        guard rv == .ok else { throw HSMError(pkcs11: .initPIN, rv, message: "cannot set the user PIN of \(label)") }
        return .initialized(serial: info.serial)
    }

    /// Reads a PIN file the way ``PKCS11URI/readPIN()`` does (mode checked,
    /// one trailing newline removed).
    /// - Parameter path: an absolute path.
    /// - Throws: ``HSMError/Code/pinSourceUnreadable``, ``HSMError/Code/pinSourceInsecure``.
    public static func readPINFile(_ path: String) throws(HSMError) -> SecureBytes {
        try PKCS11URI.readPINFile(path)
    }
}
