// Key objects on the token: look-up, listing, import and deletion.

/// What `signctl keys list` and `GET /v1/keys` show of one key on the token.
/// Never any secret.
public struct TokenKeyInfo: Sendable {
    /// The App Store key ID (the objects' `CKA_ID`, printable).
    public var keyID: String
    /// `CKA_LABEL` of the private key.
    public var label: String
    /// The curve from `CKA_EC_PARAMS`; nil when it is not one signerd knows.
    public var curve: ECCurve?
    /// The public key, from the public key object's `CKA_EC_POINT`.
    public var publicKey: ECPublicKey?
    /// `CKA_EXTRACTABLE` of the private key (nil if unreadable).
    public var extractable: Bool?
    /// `CKA_SENSITIVE` of the private key (nil if unreadable).
    public var sensitive: Bool?

    /// Whether a public key object with the same `CKA_ID` exists.
    public var hasPublicKey: Bool { publicKey != nil }
    /// SHA-256 of the DER SubjectPublicKeyInfo, lowercase hex.
    public var fingerprint: String? { publicKey?.fingerprint }
}

/// A key object with no `CKA_ID` whose `CKA_LABEL` is an App Store key ID
/// (``HSMToken/labelOnlyKeyObjects()``): not signerd's, and a namesake that
/// stops `keys import` of that key ID.
public struct LabelOnlyKeyObject: Sendable, Equatable {
    /// The key ID its `CKA_LABEL` holds.
    public var label: String
    /// What it is, in `key_id_conflict`'s words: `an EC private key object
    /// labelled ABC123DEFG with no CKA_ID`.
    public var description: String
}

/// What an import did.
public struct KeyImportResult: Sendable {
    /// The key ID the objects carry.
    public var keyID: String
    /// The public key that was imported and self-tested.
    public var publicKey: ECPublicKey
    /// Whether objects with this key ID were replaced.
    public var replaced: Bool
    /// Whether every replaced public key object held the imported key
    /// itself (`--replace` with the key the token already had): its objects
    /// were written again, no key changed. False when nothing was replaced.
    public var replacedSameKey: Bool {
        replaced && !previousPoints.isEmpty && previousPoints.allSatisfy { $0 == publicKey.uncompressedPoint }
    }
    /// Other key IDs whose public key objects hold the same key, sorted;
    /// empty unless the import was told to allow a duplicate key.
    public var duplicateOf: [String] = []
    /// The points the replaced public key objects held (uncompressed), for
    /// ``HSMToken/settleStoredImport(_:)``.
    var previousPoints: [[UInt8]] = []
}

extension HSMToken {
    /// Finds the EC private key object of `keyID` and its public key
    /// (other key objects that carry the same `CKA_ID` are not App Store
    /// keys and are left out).
    func lookUpKey(_ keyID: String, session: UInt) throws(HSMError) -> CachedKey {
        let handles = try find(session, [
            Attribute(P11.classAttribute, ulong: P11.privateKeyClass),
            Attribute(P11.keyType, ulong: P11.ecKeyType),
            Attribute(P11.id, Array(keyID.utf8)),
        ])
        guard let handle = handles.first else {
            var error = HSMError(.keyNotFound, "no private key with key ID \(keyID) on token \(label); import it with signctl keys import")
            error.keyID = keyID
            error.tokenLabel = label
            throw error
        }
        guard handles.count == 1 else {
            var error = HSMError(.keyInvalid, "\(handles.count) private keys carry key ID \(keyID) on token \(label) (a replacement that stopped half-way, or another tool); import the right .p8 again with signctl keys import --replace, which replaces every key object with that key ID")
            error.keyID = keyID
            throw error
        }
        let params = try readAttribute(session, handle, P11.ecParams, keyID: keyID)
        guard let params, ECCurve(parametersDER: params) == .p256 else {
            var error = HSMError(.keyInvalid, "key \(keyID) is not an EC P-256 key; App Store keys are P-256")
            error.keyID = keyID
            throw error
        }
        warnIfExportable(keyID, session: session, handle: handle)
        return CachedKey(handle: handle, publicKey: try readPublicKey(keyID, session: session, curve: .p256))
    }

    /// Logs `key_extractable` (warning) when the private key could leave the
    /// token: `CKA_EXTRACTABLE` true or `CKA_SENSITIVE` false, as a vendor
    /// tool may make it (`signctl keys import` never does). The key is still
    /// used; the log names the fix. Unreadable attributes say nothing.
    private func warnIfExportable(_ keyID: String, session: UInt, handle: UInt) {
        let extractable = try? readBool(session, handle, P11.extractable)
        let sensitive = try? readBool(session, handle, P11.sensitive)
        guard extractable == true || sensitive == false else { return }
        logger.warning("key_extractable", [
            "key.id": .string(keyID), "token.label": .string(label),
            "key.extractable": .bool(extractable == true), "key.sensitive": .bool(sensitive != false),
            "hint": "the private key can be read out of the token; import the .p8 again with signctl keys import --replace, which makes it sensitive and non-extractable, and delete other copies",
        ])
    }

    private func readPublicKey(_ keyID: String, id: [UInt8]? = nil, session: UInt, curve: ECCurve) throws(HSMError) -> ECPublicKey? {
        let handles = try find(session, [
            Attribute(P11.classAttribute, ulong: P11.publicKeyClass),
            Attribute(P11.keyType, ulong: P11.ecKeyType),
            Attribute(P11.id, id ?? Array(keyID.utf8)),
        ])
        guard let handle = handles.first, let point = try readAttribute(session, handle, P11.ecPoint, keyID: keyID) else {
            return nil
        }
        // Two public key objects (an import --replace half-way) are fine
        // when they hold the same key; otherwise which one goes with the
        // private key cannot be told.
        for other in handles.dropFirst() where try readAttribute(session, other, P11.ecPoint, keyID: keyID) != point {
            var error = HSMError(.keyInvalid, "\(handles.count) public key objects with different keys carry key ID \(keyID) on token \(label) (a replacement that stopped half-way, or another tool); import the right .p8 again with signctl keys import --replace, which replaces every key object with that key ID")
            error.keyID = keyID
            throw error
        }
        guard let uncompressed = HSMToken.uncompressedPoint(fromECPoint: point, curve: curve),
              let key = try? ECPublicKey(curve: curve, uncompressedPoint: uncompressed) else {
            var error = HSMError(.keyInvalid, "the public key object of \(keyID) holds no valid \(curve) point")
            error.keyID = keyID
            throw error
        }
        return key
    }

    /// `CKA_EC_POINT` comes DER-wrapped (an OCTET STRING, as PKCS#11
    /// specifies) or raw (some tokens). Which one is decided by the length
    /// the curve implies, never by trying DER first: a raw P-256 point is 65
    /// bytes `04 ‖ X ‖ Y`, the wrapped one 67 bytes `04 41 04 ‖ X ‖ Y`.
    /// - Returns: the uncompressed point, or nil when neither length fits.
    static func uncompressedPoint(fromECPoint value: [UInt8], curve: ECCurve) -> [UInt8]? {
        let rawLength = 1 + 2 * curve.byteCount
        let header: [UInt8] = rawLength < 0x80 ? [0x04, UInt8(rawLength)] : [0x04, 0x81, UInt8(rawLength)]
        if value.count == rawLength {
            return value.first == 0x04 ? value : nil
        }
        if value.count == header.count + rawLength, Array(value.prefix(header.count)) == header {
            let point = Array(value.dropFirst(header.count))
            return point.first == 0x04 ? point : nil
        }
        return nil
    }

    /// The DER OCTET STRING form of an uncompressed point, for `CKA_EC_POINT`.
    static func wrappedECPoint(_ point: [UInt8]) -> [UInt8] {
        (point.count < 0x80 ? [0x04, UInt8(point.count)] : [0x04, 0x81, UInt8(point.count)]) + point
    }

    func find(_ session: UInt, _ template: [Attribute]) throws(HSMError) -> [UInt] {
        let (rv, function, handles) = functions.findObjects(session, template: template)
        guard rv == .ok else {
            throw HSMError(pkcs11: function, rv, message: "cannot search the token", tokenLabel: label)
        }
        return handles
    }

    /// One attribute's bytes; nil when the token says it is sensitive or absent.
    func readAttribute(_ session: UInt, _ object: UInt, _ type: UInt, keyID: String?) throws(HSMError) -> [UInt8]? {
        let (rv, value) = functions.attribute(session, object: object, type: type)
        switch rv {
        case .ok: return value
        case .attributeSensitive, .attributeTypeInvalid: return nil
        default:
            throw HSMError(pkcs11: .getAttributeValue, rv, message: "cannot read an attribute", tokenLabel: label, keyID: keyID)
        }
    }

    private func readBool(_ session: UInt, _ object: UInt, _ type: UInt) throws(HSMError) -> Bool? {
        try readAttribute(session, object, type, keyID: nil).flatMap { $0.first.map { $0 != 0 } }
    }

    /// Whether the token would give out `CKA_VALUE` of a key's private key
    /// object, which an imported key must never allow. Only the value's
    /// length is asked for (`C_GetAttributeValue` with a NULL `pValue`), so
    /// no private key byte is copied out of the module even when it would.
    /// - Returns: false when the token refuses (`CKR_ATTRIBUTE_SENSITIVE`,
    ///   or a length of `CK_UNAVAILABLE_INFORMATION`).
    /// - Throws: ``HSMError`` when the key is not found or the call fails otherwise.
    package func privateValueReadable(keyID: String) throws(HSMError) -> Bool {
        try withSession { (session) throws(HSMError) -> Bool in
            let key = try lookUpKey(keyID, session: session)
            let (rv, length) = functions.attributeLength(session, object: key.handle, type: P11.value)
            switch rv {
            case .ok: return length != nil
            case .attributeSensitive, .attributeTypeInvalid: return false
            default:
                throw HSMError(pkcs11: .getAttributeValue, rv, message: "cannot read an attribute", tokenLabel: label, keyID: keyID)
            }
        }
    }

    /// Lists the EC private keys on the token, leaving out incomplete ones
    /// (``incompleteKeyObjectCount()``).
    /// - Returns: one entry per private key object, sorted by key ID.
    /// - Throws: ``HSMError`` from the search.
    public func listKeys() throws(HSMError) -> [TokenKeyInfo] {
        try withSession { (session) throws(HSMError) -> [TokenKeyInfo] in
            let handles = try find(session, [
                Attribute(P11.classAttribute, ulong: P11.privateKeyClass),
                Attribute(P11.keyType, ulong: P11.ecKeyType),
            ])
            var keys: [TokenKeyInfo] = []
            for handle in handles {
                let id = try readAttribute(session, handle, P11.id, keyID: nil) ?? []
                let keyID = HSMToken.printable(id)
                let labelBytes = try readAttribute(session, handle, P11.label, keyID: keyID) ?? []
                let params = try readAttribute(session, handle, P11.ecParams, keyID: keyID) ?? []
                // Incomplete (isIncomplete(_:_:)): counted apart, not listed.
                if id.isEmpty && labelBytes.isEmpty && params.isEmpty { continue }
                let label = HSMToken.printable(labelBytes)
                let curve = ECCurve(parametersDER: params)
                // An empty CKA_ID pairs nothing: a search for it finds every public key object without an ID.
                let publicKey = curve == nil || id.isEmpty ? nil : try? readPublicKey(keyID, id: id, session: session, curve: curve!)  // checked non-nil
                keys.append(TokenKeyInfo(
                    keyID: keyID, label: label, curve: curve, publicKey: publicKey ?? nil,
                    extractable: try readBool(session, handle, P11.extractable),
                    sensitive: try readBool(session, handle, P11.sensitive)))
            }
            return keys.sorted { $0.keyID < $1.keyID }
        }
    }

    static func printable(_ bytes: [UInt8]) -> String {
        if bytes.allSatisfy({ $0 >= 0x20 && $0 < 0x7f }) {
            return String(decoding: bytes, as: UTF8.self)
        }
        return "0x" + bytes.hexString
    }

    /// Imports a P-256 key: a private key object (`CKA_TOKEN`, `CKA_PRIVATE`,
    /// `CKA_SENSITIVE` true, `CKA_EXTRACTABLE` false, `CKA_SIGN` true, every
    /// other usage false, `CKA_LABEL` and `CKA_ID` the key ID) and a public
    /// key object (`CKA_EC_POINT` as a DER OCTET STRING). Then it signs a
    /// random digest through the token and verifies it with the file's
    /// public key; on failure it removes what it created. With `replace`,
    /// older objects with the key ID are removed only after the new key passed.
    ///
    /// Before anything is created, the key's uncompressed point is compared
    /// with the `CKA_EC_POINT` of every EC public key object on the token
    /// (DER-wrapped or raw) that has a `CKA_ID` and is not about to be
    /// replaced: an App Store key ID names exactly one key, so the same key
    /// under a second key ID is refused unless `allowDuplicateKey`. A private
    /// key without a public key object cannot be compared.
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects`,
    /// `C_GetAttributeValue` (`CKA_ID`, `CKA_EC_POINT`) and `C_CreateObject`.
    /// - Parameters:
    ///   - material: the parsed key file.
    ///   - keyID: 10 characters `A-Z0-9`.
    ///   - replace: whether an existing key with this ID may be replaced.
    ///   - allowDuplicateKey: whether the key may also be on the token under
    ///     other key IDs (``KeyImportResult/duplicateOf`` names them).
    /// - Returns: what was imported.
    /// - Throws: ``HSMError/Code/keyIDConflict`` when a key object of
    ///   another type or class (a secret key) carries the key ID as `CKA_ID`, or any key object
    ///   carries it as `CKA_LABEL` under another `CKA_ID` (with or without `replace`),
    ///   ``HSMError/Code/keyExists`` (without `replace`),
    ///   ``HSMError/Code/keyDuplicate`` naming the other key IDs (without
    ///   `allowDuplicateKey`), both before any change;
    ///   ``HSMError/Code/verificationFailed`` (self-test), `pkcs11_failure`;
    ///   with `confirmingStorage`, ``HSMError/Code/keyNotStored``.
    /// - Parameter confirmingStorage: read the token back from its storage
    ///   before the older objects are removed (``settleStoredImport(_:)``);
    ///   only where this is the one token open on the module (signctl).
    public func importKey(_ material: ECPrivateKeyMaterial, keyID: String, replace: Bool, allowDuplicateKey: Bool = false, confirmingStorage: Bool = false) throws(HSMError) -> KeyImportResult {
        guard confirmingStorage else {
            return try importKey(material, keyID: keyID, replace: replace, allowDuplicateKey: allowDuplicateKey, extractable: false)
        }
        let result = try importKey(material, keyID: keyID, replace: replace, allowDuplicateKey: allowDuplicateKey, extractable: false, removingOld: false)
        try settleStoredImport(result)
        return result
    }

    /// ``importKey(_:keyID:replace:allowDuplicateKey:confirmingStorage:)`` with
    /// `CKA_EXTRACTABLE` and the opposite `CKA_SENSITIVE` chosen: true only in
    /// tests, to make the key a vendor tool may leave on a token. With
    /// `removingOld` false, older objects with the key ID stay for
    /// ``settleStoredImport(_:)`` to remove.
    func importKey(_ material: ECPrivateKeyMaterial, keyID: String, replace: Bool, allowDuplicateKey: Bool = false, extractable: Bool, removingOld: Bool = true) throws(HSMError) -> KeyImportResult {
        guard KeyID.isValid(keyID) else {
            throw HSMError(.keyInvalid, "key ID \(keyID) is not 10 characters A-Z0-9")
        }
        let idBytes = Array(keyID.utf8)
        return try withReadWriteSession { (session) throws(HSMError) -> KeyImportResult in
            let (old, foreign) = try keyObjects(session, keyID: keyID)
            // A key object of another type under this key ID, or another
            // application's key labelled with it, would stay beside the
            // import and make the key ID name two keys.
            if !foreign.isEmpty {
                var error = HSMError(.keyIDConflict, "key ID \(keyID) is already carried by \(foreign.joined(separator: " and ")) on token \(label), not an App Store key signctl made; signctl neither replaces nor deletes it: remove or relabel it with the tool that made it, or import under another key ID")
                error.keyID = keyID
                error.tokenLabel = label
                throw error
            }
            if !old.isEmpty && !replace {
                var error = HSMError(.keyExists, "key ID \(keyID) is already on token \(label); pass --replace to replace it")
                error.keyID = keyID
                throw error
            }
            let duplicateOf = try keyIDs(holding: material.publicKey, session: session, excluding: Set(old))
            if !duplicateOf.isEmpty && !allowDuplicateKey {
                var error = HSMError(.keyDuplicate, "this key is already on token \(label) as key ID \(duplicateOf.joined(separator: ", ")) (public key SHA-256 fingerprint \(material.publicKey.fingerprint)); an App Store key ID names exactly one key, so importing it as \(keyID) too is most likely the wrong file or the wrong key ID; nothing was changed")
                error.keyID = keyID
                error.tokenLabel = label
                throw error
            }
            let privateTemplate: [Attribute] = [
                Attribute(P11.classAttribute, ulong: P11.privateKeyClass),
                Attribute(P11.keyType, ulong: P11.ecKeyType),
                Attribute(P11.token, bool: true),
                Attribute(P11.private, bool: true),
                Attribute(P11.sensitive, bool: !extractable),
                Attribute(P11.extractable, bool: extractable),
                Attribute(P11.sign, bool: true),
                Attribute(P11.signRecover, bool: false),
                Attribute(P11.decrypt, bool: false),
                Attribute(P11.unwrap, bool: false),
                Attribute(P11.derive, bool: false),
                Attribute(P11.modifiable, bool: false),
                Attribute(P11.label, idBytes),
                Attribute(P11.id, idBytes),
                Attribute(P11.ecParams, material.curve.parametersDER),
                Attribute(P11.value, secret: material.scalar),
            ]
            let publicTemplate: [Attribute] = [
                Attribute(P11.classAttribute, ulong: P11.publicKeyClass),
                Attribute(P11.keyType, ulong: P11.ecKeyType),
                Attribute(P11.token, bool: true),
                Attribute(P11.private, bool: false),
                Attribute(P11.verify, bool: true),
                Attribute(P11.encrypt, bool: false),
                Attribute(P11.wrap, bool: false),
                Attribute(P11.verifyRecover, bool: false),
                Attribute(P11.derive, bool: false),
                Attribute(P11.modifiable, bool: false),
                Attribute(P11.label, idBytes),
                Attribute(P11.id, idBytes),
                Attribute(P11.ecParams, material.curve.parametersDER),
                Attribute(P11.ecPoint, HSMToken.wrappedECPoint(material.publicKey.uncompressedPoint)),
            ]
            // The public key object first: a signer that finds the new
            // private key (signerd, during a replace) then always finds its
            // public key to verify with.
            let (publicRV, publicHandle) = functions.createObject(session, template: publicTemplate)
            guard publicRV == .ok else {
                throw HSMError(pkcs11: .createObject, publicRV, message: "cannot create the public key object", tokenLabel: label, keyID: keyID)
            }
            let (privateRV, privateHandle) = functions.createObject(session, template: privateTemplate)
            guard privateRV == .ok else {
                _ = functions.destroyObject(session, object: publicHandle)
                throw HSMError(pkcs11: .createObject, privateRV, message: "cannot create the private key object", tokenLabel: label, keyID: keyID)
            }
            // Self-test: sign through the token, verify with the file's public key.
            let digest = SecureRandom.bytes(32)
            let (signRV, function, raw) = functions.signECDSA(session, key: privateHandle, digest: digest)
            guard signRV == .ok, material.publicKey.verify(rawSignature: raw, digest: digest) else {
                _ = functions.destroyObject(session, object: publicHandle)
                _ = functions.destroyObject(session, object: privateHandle)
                if PKCS11ReturnValue.objectFailures.contains(signRV) {
                    // C_CreateObject said CKR_OK, yet the handle names nothing:
                    // SoftHSM does so when it cannot write the object's file.
                    throw HSMError(pkcs11: function, signRV, message: "the token did not keep the key objects it had just created (for SoftHSM: its token directory is full or not writable by this user); nothing was imported", tokenLabel: label, keyID: keyID)
                }
                if signRV != .ok {
                    throw HSMError(pkcs11: function, signRV, message: "the imported key failed its self-test signature; removed it", tokenLabel: label, keyID: keyID)
                }
                var error = HSMError(.verificationFailed, "the token's test signature with the imported key did not verify with the file's public key; removed it")
                error.keyID = keyID
                throw error
            }
            // The points the older public key objects hold, to tell them from
            // the new key's once the token is read back.
            var previousPoints: [[UInt8]] = []
            for handle in old {
                if let value = try readAttribute(session, handle, P11.ecPoint, keyID: keyID), let point = HSMToken.uncompressedPoint(fromECPoint: value, curve: .p256) {
                    previousPoints.append(point)
                }
            }
            if removingOld {
                try destroy(old, session: session, keyID: keyID, message: "imported the new key but cannot remove the old objects")
            }
            forgetKey(keyID)
            options.logger.notice("key_imported", ["key.id": .string(keyID), "token.label": .string(label), "replaced": .bool(!old.isEmpty)])
            var result = KeyImportResult(keyID: keyID, publicKey: material.publicKey, replaced: !old.isEmpty, duplicateOf: duplicateOf)
            result.previousPoints = previousPoints
            return result
        }
    }

    /// Removes `objects` with `C_DestroyObject`, stopping at the first
    /// failure, which is thrown with `message`.
    private func destroy(_ objects: [UInt], session: UInt, keyID: String?, message: String) throws(HSMError) {
        for handle in objects {
            let rv = functions.destroyObject(session, object: handle)
            guard rv == .ok else {
                throw HSMError(pkcs11: .destroyObject, rv, message: message, tokenLabel: label, keyID: keyID)
            }
        }
    }

    /// Finishes an import made with `removingOld` false: reads the token
    /// again from its storage (`C_Finalize`, `C_Initialize`, a new login)
    /// and sorts the key objects that carry the key ID. When a private key
    /// that signs for the imported public key and a public key object that
    /// holds it are there, the other objects with the key ID (the replaced
    /// key, extra copies, objects cut short) are removed. Otherwise the
    /// import is undone as far as storage allows (the new key's objects,
    /// objects cut short, incomplete ones) and the older key stays.
    ///
    /// SoftHSM keeps objects it could not write to its token directory (a
    /// full disk, a file size limit) in the memory of the process that made
    /// them: the import and its self-test succeed there, while the key is
    /// missing or cut short for every other process and after a restart.
    /// Only a fresh read shows it, and only then may the replaced key go.
    ///
    /// Every session and login of this process on the module ends, as in
    /// recovery: call it only where this is the one token open on the module.
    ///
    /// The corresponding PKCS#11 functions are `C_Finalize`, `C_Initialize`,
    /// `C_Login`, `C_FindObjects`, `C_GetAttributeValue`, `C_SignInit`,
    /// `C_Sign` and `C_DestroyObject`.
    /// - Throws: ``HSMError/Code/keyNotStored`` naming what is missing and
    ///   whether the older key was kept; ``HSMError`` from the
    ///   reinitialization, the login or a removal.
    func settleStoredImport(_ result: KeyImportResult) throws(HSMError) {
        let keyID = result.keyID
        let newPoint = result.publicKey.uncompressedPoint
        // The same key imported again: its older objects are the new ones too.
        let sameKeyBefore = result.previousPoints.contains(newPoint)
        func notStored(_ what: String, kept: String? = nil) -> HSMError {
            let kept = kept ?? (result.replaced ? "the key \(keyID) had before is kept" : "nothing was imported")
            var error = HSMError(.keyNotStored, "token \(label) accepted key \(keyID), yet read again from its storage \(what): the token could not write it (for SoftHSM: its token directory is full, over a file size limit, or not writable); \(kept); keep the .p8 file")
            error.keyID = keyID
            error.tokenLabel = label
            return error
        }
        do {
            try readBackFromStorage()
        } catch {
            if error.code == .tokenNotFound {
                // token_not_found, whose hint is to restore the copy: freeing
                // space and importing again cannot bring the token back.
                var gone = notStored("the token itself is gone (\(error.message))", kept: "every key on it is lost until the copy of its token directory is restored")
                gone.code = .tokenNotFound
                throw gone
            }
            var unread = error
            unread.message = "token \(label) accepted key \(keyID), but could not be read back from its storage (\(error.message)); "
                + (result.replaced ? "the objects of the key it had before were not removed, so \(keyID) may name two keys until the same import with --replace runs again"
                                   : "run signctl keys list to see whether \(keyID) is there whole; keep the .p8 file")
            throw unread
        }
        forgetKey(keyID)
        // EC key objects whose CKA_ID is the key ID, as the import counted
        // the ones it replaces (keyObjects(_:keyID:)).
        func named(_ objectClass: UInt, _ session: UInt) throws(HSMError) -> [UInt] {
            try find(session, [Attribute(P11.classAttribute, ulong: objectClass), Attribute(P11.keyType, ulong: P11.ecKeyType), Attribute(P11.id, Array(keyID.utf8))])
        }
        try withReadWriteSession { (session) throws(HSMError) in
            var storedPrivate: UInt?
            var storedPublic: UInt?
            var extraNew: [UInt] = []
            var broken: [UInt] = []
            var others: [UInt] = []
            for handle in try named(P11.privateKeyClass, session) {
                guard let params = try readAttribute(session, handle, P11.ecParams, keyID: keyID), ECCurve(parametersDER: params) == .p256 else {
                    broken.append(handle)
                    continue
                }
                let digest = SecureRandom.bytes(32)
                let (rv, _, raw) = functions.signECDSA(session, key: handle, digest: digest)
                if rv != .ok {
                    broken.append(handle)
                } else if result.publicKey.verify(rawSignature: raw, digest: digest) {
                    if storedPrivate == nil { storedPrivate = handle } else { extraNew.append(handle) }
                } else {
                    others.append(handle)
                }
            }
            for handle in try named(P11.publicKeyClass, session) {
                let point = try readAttribute(session, handle, P11.ecPoint, keyID: keyID).flatMap { HSMToken.uncompressedPoint(fromECPoint: $0, curve: .p256) }
                if point == nil {
                    broken.append(handle)
                } else if point == newPoint {
                    if storedPublic == nil { storedPublic = handle } else { extraNew.append(handle) }
                } else {
                    others.append(handle)
                }
            }
            if storedPrivate != nil, storedPublic != nil {
                try destroy(others + extraNew + broken, session: session, keyID: keyID, message: "imported the new key but cannot remove the old objects")
                return
            }
            // Not stored: take back what the import left, so that the older
            // key (if any) is again the only one with the key ID; best effort,
            // on storage that is failing.
            var leftovers = broken + (try incompleteKeyObjects(session))
            if !sameKeyBefore { leftovers += [storedPrivate, storedPublic].compactMap { $0 } + extraNew }
            for handle in leftovers { _ = functions.destroyObject(session, object: handle) }
            throw notStored(storedPrivate == nil && storedPublic == nil ? "neither of its key objects is there whole"
                            : storedPrivate == nil ? "its private key object is missing or cut short" : "its public key object is missing or cut short")
        }
    }

    /// The key IDs (`CKA_ID`, printable) of the EC public key objects whose
    /// `CKA_EC_POINT`, DER-wrapped or raw, is `publicKey`'s point; objects in
    /// `excluded` and objects without a `CKA_ID` are left out.
    /// - Returns: the key IDs, sorted, each once.
    /// - Throws: ``HSMError`` from the search or an attribute read.
    private func keyIDs(holding publicKey: ECPublicKey, session: UInt, excluding excluded: Set<UInt>) throws(HSMError) -> [String] {
        var holders: Set<String> = []
        let handles = try find(session, [
            Attribute(P11.classAttribute, ulong: P11.publicKeyClass),
            Attribute(P11.keyType, ulong: P11.ecKeyType),
        ])
        for handle in handles where !excluded.contains(handle) {
            guard let id = try readAttribute(session, handle, P11.id, keyID: nil), !id.isEmpty,
                  let point = try readAttribute(session, handle, P11.ecPoint, keyID: HSMToken.printable(id)),
                  HSMToken.uncompressedPoint(fromECPoint: point, curve: publicKey.curve) == publicKey.uncompressedPoint else { continue }
            holders.insert(HSMToken.printable(id))
        }
        return holders.sorted()
    }

    /// The key objects that carry `keyID`, split: the EC private and public
    /// key objects whose `CKA_ID` is the key ID (what signerd signs with, an
    /// import replaces and a delete removes), and descriptions (`an RSA
    /// public key object`, `an AES secret key object`, `an EC private key
    /// object labelled ABC123DEFG with CKA_ID 0x01`) of the others: private,
    /// public and secret key objects of another type with that `CKA_ID`
    /// (a secret key, `CKO_SECRET_KEY`, is never signerd's), and key objects
    /// of any class and type whose `CKA_LABEL` is the key ID but whose
    /// `CKA_ID` is not (another application's key, or one made without an
    /// ID). signctl neither replaces nor deletes those. Objects that are not
    /// keys (data objects, certificates) are not looked at.
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects` and
    /// `C_GetAttributeValue` (`CKA_KEY_TYPE`, `CKA_ID`).
    func keyObjects(_ session: UInt, keyID: String) throws(HSMError) -> (ec: [UInt], other: [String]) {
        let idBytes = Array(keyID.utf8)
        var ec: [UInt] = []
        var other: [String] = []
        for (objectClass, kind) in HSMToken.keyClasses {
            let byID = try find(session, [Attribute(P11.classAttribute, ulong: objectClass), Attribute(P11.id, idBytes)])
            for handle in byID {
                let type = try keyType(session, handle, keyID: keyID)
                if type == P11.ecKeyType && objectClass != P11.secretKeyClass {
                    ec.append(handle)
                } else {
                    other.append("\(P11.keyTypeName(type)) \(kind) key object")
                }
            }
            for handle in try find(session, [Attribute(P11.classAttribute, ulong: objectClass), Attribute(P11.label, idBytes)]) where !byID.contains(handle) {
                other.append(try labelledDescription(session, handle, kind: kind, label: keyID))
            }
        }
        return (ec.sorted(), other)
    }

    /// The key object classes signctl looks at, with the word its
    /// descriptions use: private, public and secret keys.
    static let keyClasses = [(P11.privateKeyClass, "private"), (P11.publicKeyClass, "public"), (P11.secretKeyClass, "secret")]

    /// `an EC private key object labelled ABC123DEFG with CKA_ID 0x01`, or
    /// `… with no CKA_ID`: a key object whose `CKA_LABEL` is `label`, as
    /// `key_id_conflict` and signctl's notes name it.
    private func labelledDescription(_ session: UInt, _ handle: UInt, kind: String, label: String) throws(HSMError) -> String {
        let type = try keyType(session, handle, keyID: label)
        let id = try readAttribute(session, handle, P11.id, keyID: label) ?? []
        return "\(P11.keyTypeName(type)) \(kind) key object labelled \(label) with \(id.isEmpty ? "no CKA_ID" : "CKA_ID \(HSMToken.printable(id))")"
    }

    /// The key objects that carry `keyID` and are not signerd's, described
    /// as ``importKey(_:keyID:replace:allowDuplicateKey:confirmingStorage:)``'s
    /// `key_id_conflict` names them (`an AES secret key object`, `an EC
    /// private key object labelled ABC123DEFG with no CKA_ID`): what
    /// ``deleteKey(keyID:)`` leaves on the token, and what stops a later
    /// import of the key ID.
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects` and
    /// `C_GetAttributeValue` (`CKA_KEY_TYPE`, `CKA_ID`).
    /// - Parameter keyID: the App Store key ID.
    /// - Returns: the descriptions; empty when only signerd's EC key objects (or nothing) carry it.
    /// - Throws: ``HSMError`` from the search or an attribute read.
    public func keyNamesakes(keyID: String) throws(HSMError) -> [String] {
        try withSession { (session) throws(HSMError) -> [String] in try keyObjects(session, keyID: keyID).other }
    }

    /// The private, public and secret key objects that have no `CKA_ID`
    /// (absent or empty) and whose `CKA_LABEL` is an App Store key ID:
    /// another tool's (`pkcs11-tool --write-object` or `--keypairgen`
    /// without `--id`; signctl always sets both). signerd, which finds keys
    /// by `CKA_ID`, never uses them; they are not incomplete either (they
    /// have a label), so ``deleteIncompleteKeyObjects()`` leaves them; and,
    /// as namesakes by label, they stop an import of that key ID
    /// (`key_id_conflict`), which signctl neither replaces nor deletes.
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects` and
    /// `C_GetAttributeValue` (`CKA_ID`, `CKA_LABEL`, `CKA_KEY_TYPE`).
    /// - Returns: one entry per object, sorted by label, then description.
    /// - Throws: ``HSMError`` from the search or an attribute read.
    public func labelOnlyKeyObjects() throws(HSMError) -> [LabelOnlyKeyObject] {
        try withSession { (session) throws(HSMError) -> [LabelOnlyKeyObject] in
            var found: [LabelOnlyKeyObject] = []
            for (objectClass, kind) in HSMToken.keyClasses {
                for handle in try find(session, [Attribute(P11.classAttribute, ulong: objectClass)]) {
                    guard try readAttribute(session, handle, P11.id, keyID: nil)?.isEmpty ?? true,
                          let bytes = try readAttribute(session, handle, P11.label, keyID: nil), KeyID.isValid(HSMToken.printable(bytes)) else { continue }
                    let label = HSMToken.printable(bytes)
                    found.append(LabelOnlyKeyObject(label: label, description: try labelledDescription(session, handle, kind: kind, label: label)))
                }
            }
            return found.sorted { ($0.label, $0.description) < ($1.label, $1.description) }
        }
    }

    /// An object's `CKA_KEY_TYPE`, or nil when it has none of the right size.
    private func keyType(_ session: UInt, _ handle: UInt, keyID: String) throws(HSMError) -> UInt? {
        let bytes = try readAttribute(session, handle, P11.keyType, keyID: keyID)
        return bytes.flatMap { $0.count == MemoryLayout<UInt>.size ? $0.withUnsafeBytes { $0.loadUnaligned(as: UInt.self) } : nil }
    }

    /// Removes the EC private and public key objects whose `CKA_ID` is
    /// `keyID`; other objects with that label or ID stay (``keyObjects(_:keyID:)``).
    ///
    /// The corresponding PKCS#11 function is `C_DestroyObject`.
    /// - Parameter keyID: the key ID.
    /// - Returns: how many objects were removed.
    /// - Throws: ``HSMError/Code/keyNotFound`` when none exist.
    @discardableResult
    public func deleteKey(keyID: String) throws(HSMError) -> Int {
        let count = try withReadWriteSession { (session) throws(HSMError) -> Int in
            let (objects, others) = try keyObjects(session, keyID: keyID)
            guard !objects.isEmpty else {
                let left = others.isEmpty ? "" : "; signctl leaves alone \(others.joined(separator: " and ")), which it did not make"
                var error = HSMError(.keyNotFound, "no EC key objects with key ID \(keyID) as CKA_ID on token \(label)\(left)")
                error.keyID = keyID
                throw error
            }
            try destroy(objects, session: session, keyID: keyID, message: "cannot delete key \(keyID)")
            return objects.count
        }
        forgetKey(keyID)
        forgetKnownKey(keyID)
        options.logger.notice("key_deleted", ["key.id": .string(keyID), "token.label": .string(label)])
        return count
    }

    /// The public key held by the public key object with `CKA_ID` `keyID`,
    /// whether or not a private key goes with it: what `keys export-public`
    /// shows for a key ``publicKeyOnlyIDs()`` lists.
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects` and `C_GetAttributeValue` (`CKA_EC_POINT`).
    /// - Parameter keyID: the App Store key ID.
    /// - Throws: ``HSMError/Code/keyNotFound`` when no such object holds a
    ///   P-256 point, ``HSMError`` from the search.
    public func publicKeyObject(keyID: String) throws(HSMError) -> ECPublicKey {
        let found = try withSession { (session) throws(HSMError) -> ECPublicKey? in
            try readPublicKey(keyID, session: session, curve: .p256)
        }
        guard let found else {
            var error = HSMError(.keyNotFound, "no public key object with key ID \(keyID) on token \(label)")
            error.keyID = keyID
            throw error
        }
        return found
    }

    /// Whether the EC key object `handle` is incomplete: it carries no
    /// `CKA_ID`, no `CKA_LABEL` and no `CKA_EC_PARAMS`. SoftHSM writes a new
    /// object's file before the template's attributes, so a process ended
    /// inside `C_CreateObject` (a second Ctrl-C, `SIGKILL`, a file size
    /// limit) leaves such an object: nothing can name it, and without a
    /// curve it signs and verifies nothing.
    func isIncomplete(_ session: UInt, _ handle: UInt) throws(HSMError) -> Bool {
        for type in [P11.id, P11.label, P11.ecParams] {
            if let value = try readAttribute(session, handle, type, keyID: nil), !value.isEmpty { return false }
        }
        return true
    }

    /// The handles of the token's incomplete EC private and public key
    /// objects (``isIncomplete(_:_:)``).
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects` and `C_GetAttributeValue`.
    func incompleteKeyObjects(_ session: UInt) throws(HSMError) -> [UInt] {
        var incomplete: [UInt] = []
        for objectClass in [P11.privateKeyClass, P11.publicKeyClass] {
            for handle in try find(session, [Attribute(P11.classAttribute, ulong: objectClass), Attribute(P11.keyType, ulong: P11.ecKeyType)])
            where try isIncomplete(session, handle) {
                incomplete.append(handle)
            }
        }
        return incomplete
    }

    /// How many EC key objects on the token are incomplete: left by a
    /// process that ended while it created them, with no `CKA_ID`,
    /// `CKA_LABEL` or `CKA_EC_PARAMS`. ``listKeys()`` and
    /// ``publicKeyOnlyIDs()`` leave them out; ``deleteIncompleteKeyObjects()``
    /// removes them.
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects` and `C_GetAttributeValue`.
    /// - Returns: the number of such objects, private and public.
    /// - Throws: ``HSMError`` from the search or an attribute read.
    public func incompleteKeyObjectCount() throws(HSMError) -> Int {
        try withSession { (session) throws(HSMError) -> Int in try incompleteKeyObjects(session).count }
    }

    /// Removes the token's incomplete EC key objects
    /// (``incompleteKeyObjectCount()``); complete objects, and objects of
    /// other types, stay.
    ///
    /// The corresponding PKCS#11 function is `C_DestroyObject`.
    /// - Returns: how many objects were removed (0 when there were none).
    /// - Throws: ``HSMError`` from the search or from `C_DestroyObject`.
    @discardableResult
    public func deleteIncompleteKeyObjects() throws(HSMError) -> Int {
        let count = try withReadWriteSession { (session) throws(HSMError) -> Int in
            let objects = try incompleteKeyObjects(session)
            try destroy(objects, session: session, keyID: nil, message: "cannot delete an incomplete key object")
            return objects.count
        }
        if count > 0 {
            options.logger.notice("incomplete_key_objects_deleted", ["count": .int(Int64(count)), "token.label": .string(label)])
        }
        return count
    }

    /// The key IDs of public key objects (`CKO_PUBLIC_KEY`) that have no
    /// private key object with the same `CKA_ID`: left behind by an import
    /// or a tool that stopped half-way. They block `keys import` of that ID
    /// (`key_exists`) yet sign nothing, and ``listKeys()`` (private keys
    /// only) does not show them.
    ///
    /// The corresponding PKCS#11 functions are `C_FindObjects` and `C_GetAttributeValue`.
    /// - Returns: the printable key IDs (`0x…` hex when not printable), sorted.
    /// - Throws: ``HSMError`` from the search.
    public func publicKeyOnlyIDs() throws(HSMError) -> [String] {
        try withSession { (session) throws(HSMError) -> [String] in
            var ids: Set<String> = []
            for handle in try find(session, [Attribute(P11.classAttribute, ulong: P11.publicKeyClass), Attribute(P11.keyType, ulong: P11.ecKeyType)]) {
                guard let id = try readAttribute(session, handle, P11.id, keyID: nil), !id.isEmpty else { continue }
                let privateKeys = try find(session, [Attribute(P11.classAttribute, ulong: P11.privateKeyClass), Attribute(P11.keyType, ulong: P11.ecKeyType), Attribute(P11.id, id)])
                if privateKeys.isEmpty { ids.insert(HSMToken.printable(id)) }
            }
            return ids.sorted()
        }
    }
}
