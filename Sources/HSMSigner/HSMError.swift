/// An error from the token side of signerd: module, URI, PIN, sessions,
/// keys and signing.
///
/// ``code`` is stable for programs. Context fields say where it happened:
/// the PKCS#11 ``function`` and its ``returnValue`` (`CKR_*`), the
/// ``tokenLabel`` and the ``keyID``. ``message`` never contains a PIN or key
/// bytes.
public struct HSMError: Error, Sendable, CustomStringConvertible {
    /// Stable error codes.
    public struct Code: RawRepresentable, Hashable, Sendable, CustomStringConvertible {
        /// The code as the API, logs and metrics spell it, e.g. `pin_rejected`.
        public var rawValue: String
        /// Makes a code from its spelling.
        public init(rawValue: String) { self.rawValue = rawValue }
        /// The raw value.
        public var description: String { rawValue }

        /// A PKCS#11 function returned a failure not covered by a more specific code.
        public static let pkcs11Failure = Code(rawValue: "pkcs11_failure")
        /// The token URI is not a valid RFC 7512 URI or lacks what signerd needs.
        public static let invalidURI = Code(rawValue: "invalid_uri")
        /// The PKCS#11 module could not be found or loaded.
        public static let moduleNotFound = Code(rawValue: "module_not_found")
        /// The PKCS#11 module file, or a directory it is reached through,
        /// belongs to another user than root and this process's, or may be
        /// written by others: whoever can change it runs code in signerd,
        /// so it is not loaded.
        public static let moduleInsecure = Code(rawValue: "module_insecure")
        /// No token (or more than one) matches the URI.
        public static let tokenNotFound = Code(rawValue: "token_not_found")
        /// The PIN source could not be read.
        public static let pinSourceUnreadable = Code(rawValue: "pin_source_unreadable")
        /// The PIN file is readable by other users; signerd refuses it.
        public static let pinSourceInsecure = Code(rawValue: "pin_source_insecure")
        /// The token refused the PIN (`CKR_PIN_INCORRECT`, `CKR_PIN_LOCKED`,
        /// `CKR_PIN_EXPIRED`, …). Never retried: tokens lock after a few tries.
        public static let pinRejected = Code(rawValue: "pin_rejected")
        /// A new PIN (`token init`, `token change-pin`) the token does not
        /// take: its length is outside `ulMinPinLen`…`ulMaxPinLen` of
        /// `C_GetTokenInfo` (checked before any change), or `C_SetPIN` or
        /// `C_InitPIN` answered `CKR_PIN_LEN_RANGE` or `CKR_PIN_INVALID`, or
        /// it is the PIN the token has already. Not a refused login: no try
        /// was spent.
        public static let pinInvalid = Code(rawValue: "pin_invalid")
        /// No private key with this key ID on the token.
        public static let keyNotFound = Code(rawValue: "key_not_found")
        /// A key with this key ID is already on the token.
        public static let keyExists = Code(rawValue: "key_exists")
        /// A key object of another type (RSA, a secret key, …: not an App
        /// Store EC key) already carries this key ID. `--replace` does not
        /// help: signerd neither replaces nor deletes what another tool made.
        public static let keyIDConflict = Code(rawValue: "key_id_conflict")
        /// The key being imported is already on the token under another key
        /// ID: a public key object with another `CKA_ID` holds the same
        /// `CKA_EC_POINT`.
        public static let keyDuplicate = Code(rawValue: "key_duplicate")
        /// The key object is unusable (not EC P-256, no public key object, …).
        public static let keyInvalid = Code(rawValue: "key_invalid")
        /// An import the token answered with `CKR_OK` (self-test included)
        /// is missing, or cut short, once the token is read again from its
        /// storage: SoftHSM keeps objects it could not write (a full disk, a
        /// file size limit) in the memory of the importing process only.
        public static let keyNotStored = Code(rawValue: "key_not_stored")
        /// A new user PIN the token answered with `CKR_OK` (`C_SetPIN`) is
        /// not what the token holds once read again from its storage: the
        /// token is gone (SoftHSM's token file cut short) or refuses it.
        public static let pinNotStored = Code(rawValue: "pin_not_stored")
        /// No session became free within the checkout timeout.
        public static let sessionUnavailable = Code(rawValue: "session_unavailable")
        /// The token is down and being recovered; try again after ``HSMError/retryAfter``.
        public static let tokenUnavailable = Code(rawValue: "token_unavailable")
        /// A signature made by the token did not verify with the key's public key.
        public static let verificationFailed = Code(rawValue: "verification_failed")
        /// A signing call did not return within the configured timeout.
        public static let signTimeout = Code(rawValue: "sign_timeout")
        /// The request's deadline (``RequestDeadline/current``) passed before
        /// it asked the token for anything (it was still being read and
        /// checked), or before it asked for a PKCS#11 session. Not the
        /// token's failure: no wait of its own on the token made it late.
        public static let requestExpired = Code(rawValue: "request_expired")

        /// The failures that are the token's, not a key's: the token down,
        /// no session free, a call past its timeout, the PIN refused. Every
        /// key would fail alike, and re-importing keys cannot help.
        public static let tokenProblems: Set<Code> = [.tokenUnavailable, .sessionUnavailable, .signTimeout, .pinRejected]
    }

    /// What went wrong.
    public var code: Code
    /// A sentence for the operator.
    public var message: String
    /// The PKCS#11 function that failed (`C_Sign`), when one did.
    public var function: String?
    /// What it returned.
    public var returnValue: PKCS11ReturnValue?
    /// The token's label.
    public var tokenLabel: String?
    /// The key ID involved.
    public var keyID: String?
    /// For ``Code/pinSourceInsecure``: the uid that owns the PIN file, when
    /// its owner (neither root nor the reading process's uid) is what is
    /// wrong, rather than its mode.
    public var fileOwner: UInt32?
    /// For ``Code/pinRejected`` decided from the token's flags before any
    /// login: its `CKF_USER_PIN_COUNT_LOW`, `CKF_USER_PIN_FINAL_TRY` and
    /// `CKF_USER_PIN_LOCKED` bits (`CK_TOKEN_INFO.flags`).
    public var userPINFlags: UInt?
    /// For ``Code/tokenUnavailable`` and ``Code/sessionUnavailable``: seconds
    /// after which a retry may succeed.
    public var retryAfter: Double?

    /// Makes an error.
    /// - Parameters:
    ///   - code: the stable code.
    ///   - message: a sentence without secrets.
    public init(_ code: Code, _ message: String) {
        self.code = code
        self.message = message
    }

    /// Makes an error for a PKCS#11 call that returned `rv`: codes
    /// ``Code/pinRejected`` for the PIN family, ``Code/pkcs11Failure`` otherwise.
    init(pkcs11 function: PKCS11Function, _ rv: PKCS11ReturnValue, message: String, tokenLabel: String? = nil, keyID: String? = nil) {
        self.code = PKCS11ReturnValue.pinFailures.contains(rv) ? .pinRejected : .pkcs11Failure
        self.message = "\(message): \(function.rawValue) returned \(rv)"
        self.function = function.rawValue
        self.returnValue = rv
        self.tokenLabel = tokenLabel
        self.keyID = keyID
    }

    /// The code and message, then after a dash the token label and key ID
    /// when known and not already in the message (`key_not_found: … —
    /// token t1, key ABC123DEFG`); for logs and `signctl`'s error line.
    /// Never contains a PIN or key bytes.
    public var description: String {
        // Set apart from the message, and only what it does not say already:
        // "token=t1 key=K" after "import it with signctl keys import" read as
        // part of the command.
        var context: [String] = []
        if let tokenLabel, !Self.names(message, "token \(tokenLabel)") { context.append("token \(tokenLabel)") }
        if let keyID, !Self.names(message, keyID) { context.append("key \(keyID)") }
        return "\(code): \(message)" + (context.isEmpty ? "" : " — \(context.joined(separator: ", "))")
    }

    /// Whether `text` holds `words` as words of their own: not followed by
    /// a letter or digit ("token t1" is not named by "token t10"), nor
    /// preceded by one.
    private static func names(_ text: String, _ words: String) -> Bool {
        var searched = text.startIndex..<text.endIndex
        while let found = text.range(of: words, range: searched) {
            let before = found.lowerBound == text.startIndex ? nil : text[text.index(before: found.lowerBound)]
            let after = found.upperBound == text.endIndex ? nil : text[found.upperBound]
            if !(before?.isLetter ?? false || before?.isNumber ?? false), !(after?.isLetter ?? false || after?.isNumber ?? false) { return true }
            searched = found.upperBound..<text.endIndex
        }
        return false
    }
}

extension PKCS11ReturnValue {
    /// Return values that mean the PIN itself is wrong or unusable; a login
    /// that gets one is never repeated.
    public static let pinFailures: Set<PKCS11ReturnValue> = [.pinIncorrect, .pinLocked, .pinExpired, .pinInvalid, .pinLenRange]

    /// Return values after which the session is dropped and replaced.
    public static let sessionFailures: Set<PKCS11ReturnValue> = [.sessionHandleInvalid, .sessionClosed, .operationActive, .operationNotInitialized]

    /// Return values after which the key handle is looked up again.
    public static let objectFailures: Set<PKCS11ReturnValue> = [.objectHandleInvalid, .keyHandleInvalid]

    /// Return values that mean the token or module is gone or broken as a
    /// whole; recovery reinitializes the module.
    public static let tokenFailures: Set<PKCS11ReturnValue> = [
        .deviceRemoved, .tokenNotPresent, .deviceError, .deviceMemory, .cryptokiNotInitialized,
        .generalError, .slotIdInvalid, .tokenNotRecognized,
    ]
}
