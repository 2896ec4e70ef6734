import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// Settings for a ``HSMToken``.
public struct TokenOptions: Sendable {
    /// The most PKCS#11 sessions used at once; capped at the token's
    /// `ulMaxSessionCount` less 2 (the login session and one for
    /// administration), and at least 1. Default 8.
    public var sessionPoolSize: Int = 8
    /// How long a signer waits for a free session before giving up, in seconds. Default 2.
    public var sessionCheckoutTimeout: Double = 2
    /// First delay between recovery attempts while the token is down, in seconds. Default 0.1.
    public var recoveryInitialBackoff: Double = 0.1
    /// Longest delay between recovery attempts, in seconds. Default 2.
    public var recoveryMaximumBackoff: Double = 2
    /// Where events go.
    public var logger: Logger = Logger()
    /// Whether a login goes ahead when the token reports
    /// `CKF_USER_PIN_FINAL_TRY` (one more wrong user PIN locks it). Default
    /// true: the daemon's PIN has been right before. signctl, which an
    /// operator may simply run again, sets it false unless told otherwise.
    public var loginOnFinalTry = true
    /// Taken before each step of recovery (a module reinitialization or new
    /// sessions, `C_Login`, the keys looked up again, a test signature) and
    /// before a reload's login after a refused PIN
    /// (``HSMToken/reloadPIN(from:)``), on that step's own thread, never on
    /// a request's; what it returns is held until the step ends, then
    /// released by dropping it. Default nil: nothing is taken. signerd takes
    /// signctl's SoftHSM token lock here (`SoftHSMFiles.RunningTokenLock`,
    /// a bounded wait): SoftHSM reads its token files at `C_Initialize` and
    /// rewrites them at `C_Login`, and a recovery that did so while
    /// `signctl keys import` read its key back made that import report the
    /// token gone (3 in 1,942 imports beside recoveries, when measured).
    /// - Parameter shouldStop: true once recovery is to stop (the token
    ///   closing, ``HSMToken/stopRecovering()``): a wait should end then.
    /// - Returns: the held lock, or nil when none was taken (the step goes
    ///   ahead either way).
    public var storageLock: (@Sendable (_ shouldStop: () -> Bool) -> (any AnyObject & Sendable)?)? = nil

    /// Default options.
    public init() {}
}

/// Where a token stands, as readiness and metrics report it.
public enum TokenStatus: Sendable, Equatable {
    /// Logged in and serving.
    case up
    /// Failed and being recovered in the background; requests fail fast.
    /// `reason` names the `CKR_*` value or condition.
    case down(reason: String)
    /// The token refused the configured PIN; no login is attempted until
    /// the PIN source is reloaded (``HSMToken/reloadPIN(from:)``).
    case pinRejected(PKCS11ReturnValue)
}

/// A signature made by the token, with where the time went.
public struct TokenSignature: Sendable {
    /// Raw `r ‖ s`, 64 bytes for P-256 (`CKM_ECDSA` output).
    public var raw: [UInt8]
    /// Time spent waiting for a free session, in nanoseconds.
    public var queueNanoseconds: UInt64
    /// Time spent in `C_SignInit` + `C_Sign`, in nanoseconds (retries included).
    public var hsmNanoseconds: UInt64
    /// The public key of the key object that made the signature (from its
    /// `CKA_EC_POINT`, read with the handle); nil when the token has no
    /// public key object for it. Verifying with this one needs no second
    /// look-up, which could fail if the key vanished meanwhile.
    public var publicKey: ECPublicKey? = nil
}

/// One PKCS#11 token holding App Store keys: module, slot, login, a pool of
/// sessions and the key handles, with recovery from token faults.
///
/// Thread-safe: any number of threads may call ``sign(digest:keyID:)`` at
/// once; each uses its own session from the pool.
///
/// Fault handling, as PKCS#11 return values demand it:
/// - `CKR_SESSION_HANDLE_INVALID`, `CKR_SESSION_CLOSED`,
///   `CKR_OPERATION_ACTIVE`: the session is closed and replaced, the call retried;
/// - `CKR_OBJECT_HANDLE_INVALID`, `CKR_KEY_HANDLE_INVALID`: the key is looked up again;
/// - `CKR_USER_NOT_LOGGED_IN`: one re-login (shared by all threads), then retry;
/// - `CKR_PIN_INCORRECT`, `CKR_PIN_LOCKED`, `CKR_PIN_EXPIRED`: never retried;
///   every later login is refused until the PIN is reloaded;
/// - device and module failures (`CKR_DEVICE_REMOVED`,
///   `CKR_TOKEN_NOT_PRESENT`, `CKR_DEVICE_ERROR`, …) and escalations that did
///   not help: the token is marked down and one background thread
///   reinitializes the module (`C_Finalize` + `C_Initialize`), finds the
///   token again and logs in, with bounded jittered backoff.
public final class HSMToken: @unchecked Sendable {
    // Immutable after init except `state` (Mutex), `pin` (Mutex) and the
    // pool (its own lock).
    /// The URI the token was opened with.
    public let uri: PKCS11URI
    let functions: PKCS11Functions
    let pool: SessionPool
    let options: TokenOptions
    private let state: Locked<State>
    private let pin: Locked<SecureBytes>
    /// The PIN of the last successful login (or the one `C_SetPIN` set while
    /// logged in): the PIN in use, which a reload's PIN is compared with.
    private let loggedInPIN = Locked<SecureBytes?>(nil)
    /// PINs the token called wrong since its last successful login, with
    /// what it returned (at most ``refusedPINLimit``): a reload whose PIN
    /// source gives any of them again does not send it, whichever PIN was
    /// tried last.
    private let refusedPINs = Locked<[(pin: SecureBytes, rv: PKCS11ReturnValue)]>([])
    /// How many refused PINs are remembered.
    static let refusedPINLimit = 16
    /// Return values that say the PIN itself is wrong, as opposed to locked
    /// or expired (after which the SO may make that same PIN right again).
    static let wrongPINFailures: Set<PKCS11ReturnValue> = [.pinIncorrect, .pinInvalid, .pinLenRange]
    /// Serializes logins and recovery so two threads never log in or
    /// reinitialize the same token at once.
    private let loginLock = Locked(())
    /// `C_SignInit`/`C_Sign` calls now inside the module, with their start time.
    private let inFlight = Locked<[ObjectIdentifier: (lease: SessionLease, started: UInt64)]>([:])
    var logger: Logger { options.logger }

    struct CachedKey: Sendable {
        var handle: UInt
        var publicKey: ECPublicKey?
        /// When the objects were read (``MonotonicClock`` nanoseconds).
        var readAt = MonotonicClock.now()
    }

    struct State: Sendable {
        var slot: UInt
        var label: String
        var serial: String
        var keys: [String: CachedKey] = [:]
        /// Bumped whenever cached keys are dropped (an outage, a recovery,
        /// ``forgetKey(_:)``): a look-up begun before then caches nothing,
        /// since its handles may be stale.
        var keysEpoch: UInt64 = 0
        /// Every key ID found on the token since it was opened: recovery checks they are back.
        var knownKeys: Set<String> = []
        /// The SHA-256 fingerprint of the public key last found for each
        /// key ID; kept when cached keys are dropped, to notice a key ID
        /// that now names another key (at a look-up, or when recovery finds the keys again).
        var fingerprints: [String: String] = [:]
        /// Reinitialized recovery steps in this outage that found the token
        /// without some of its keys (``reinitializationsBeforeDeleted``).
        var missingAfterReinitialize = 0
        /// The keys the application still uses (nil: all known ones).
        var expectedKeys: Set<String>?
        var loginGeneration: UInt64 = 0
        var anchorSession: UInt?
        var status: TokenStatus = .up
        var recovering = false
        /// The recovery thread could not be started in this outage
        /// (logged once; cleared when the token is up again).
        var recoveryThreadFailed = false
        var downSince: UInt64 = 0
        /// The `CK_RV` that took the token down, when one did: requests
        /// refused during the outage are counted under its `CKR_*` name.
        var downReturnValue: PKCS11ReturnValue?
        /// Whether recovery must start with `C_Finalize` + `C_Initialize`
        /// (device and module failures) or may first try new sessions.
        var needsReinitialize = false
        var closed = false
        /// Set by ``HSMToken/stopRecovering()``: no recovery starts, and a
        /// running one ends before its next step.
        var recoveryStopped = false
        /// Recovery is inside a step that calls the module (not between steps).
        var recoveryStepRunning = false
        /// When that step began (``MonotonicClock`` nanoseconds); 0 when none runs.
        var recoveryStepStarted: UInt64 = 0

        /// Drops the cached objects of `keyID` (nil: of every key) and bumps
        /// ``keysEpoch``, so that look-ups begun before cache nothing.
        mutating func dropKeys(_ keyID: String? = nil) {
            if let keyID { keys[keyID] = nil } else { keys.removeAll() }
            keysEpoch &+= 1
        }

        /// Records `fingerprint` as the one last found for `keyID`.
        /// - Returns: the fingerprint recorded before, when there was one
        ///   and it differs (the key ID now names another key), else nil.
        mutating func noteFingerprint(_ keyID: String, _ fingerprint: String?) -> String? {
            guard let fingerprint else { return nil }
            defer { fingerprints[keyID] = fingerprint }
            return fingerprints[keyID].flatMap { $0 == fingerprint ? nil : $0 }
        }
    }

    /// The token's label (`CK_TOKEN_INFO.label`).
    public var label: String { state.withLock { $0.label } }
    /// The token's serial number.
    public var serial: String { state.withLock { $0.serial } }
    /// Where the token stands.
    public var status: TokenStatus { state.withLock { $0.status } }
    /// Sessions leased and idle, and threads waiting for one.
    public var sessionUsage: (inUse: Int, idle: Int, waiting: Int) { pool.usage }
    /// The most sessions the pool opens.
    public var sessionCapacity: Int { pool.capacity }
    /// The slot the token was last found in, and the session holding its
    /// login (nil while none is open): what the module should hold besides
    /// the pool's sessions.
    var slotAndAnchor: (slot: UInt, anchor: UInt?) { state.withLock { ($0.slot, $0.anchorSession) } }

    /// When the token was last marked down (``markDown(reason:reinitialize:cause:)``),
    /// in ``MonotonicClock`` nanoseconds; 0 when never. With ``status`` `.up`,
    /// a later instant than some start means the token recovered since.
    public var lastDownAt: UInt64 { state.withLock { $0.downSince } }

    /// Whether a PKCS#11 session came back from the module (its call
    /// returned, well or not) within the last `seconds`. A request that
    /// waited that long for a session while this is true met a busy token,
    /// not a hung one.
    /// - Parameter seconds: how far back to look.
    /// - Returns: true when some call returned that recently.
    public func sessionReturned(withinSeconds seconds: Double) -> Bool {
        let last = pool.lastReturn
        return last != 0 && MonotonicClock.nanoseconds(from: last, to: MonotonicClock.now()) <= UInt64(seconds * 1e9)
    }

    /// Opens the token: loads the module, finds the token the URI names,
    /// reads the PIN and logs in.
    /// - Parameters:
    ///   - uri: the RFC 7512 URI (token, module, PIN source).
    ///   - options: pool size, timeouts, logger.
    /// - Throws: ``HSMError`` — `module_not_found`, `token_not_found`,
    ///   `pin_source_unreadable`, `pin_source_insecure`, `pin_rejected`, or
    ///   `pkcs11_failure` with the function and `CKR_*` value.
    public convenience init(uri: PKCS11URI, options: TokenOptions = TokenOptions()) throws(HSMError) {
        try self.init(uri: uri, options: options, interposer: nil)
    }

    /// As ``init(uri:options:)``, with a seam in front of the function table.
    package init(uri: PKCS11URI, options: TokenOptions, interposer: (any PKCS11Interposer)?) throws(HSMError) {
        self.uri = uri
        self.options = options
        if uri.hasPINValue {
            options.logger.warning("pin_value_in_uri", ["hint": .string(PKCS11URI.pinValueHint)])
        }
        let pin = try uri.readPIN()
        self.pin = Locked(pin)
        let module = try PKCS11Module.acquire(path: try uri.resolveModulePath())
        let functions = PKCS11Functions(module: module, interposer: interposer)
        self.functions = functions
        let found: (UInt, TokenInfo)
        do {
            found = try HSMToken.findSlot(functions, uri: uri)
        } catch {
            module.release()
            throw error
        }
        let (slot, info) = found
        state = Locked(State(slot: slot, label: info.label, serial: info.serial))
        var capacity = max(1, options.sessionPoolSize)
        if let maxSessions = info.maxSessions {
            // Keep one for the login anchor and one for key management.
            capacity = max(1, min(capacity, maxSessions - 2))
        }
        pool = SessionPool(
            capacity: capacity,
            slot: slot,
            open: { functions.openSession(slot: $0, readWrite: false) },
            close: { functions.closeSession($0) })
        do {
            try login(afterGeneration: nil, opening: true)
        } catch {
            close()
            throw error
        }
        logger.info("token_opened", ["token.label": .string(info.label), "token.serial": .string(info.serial), "pool.capacity": .int(Int64(capacity))])
    }

    /// Stops recovery for good without closing the token: an outage from
    /// now on is logged and marks the token down, but nothing tries to bring
    /// it back, and a recovery under way ends before its next step. A
    /// daemon that is stopping calls it first: recovery's login and test
    /// signature are new PKCS#11 work, which can hang in a module that
    /// already hangs, for a token that is about to be closed.
    public func stopRecovering() {
        state.withLock { $0.recoveryStopped = true }
    }

    /// Whether a recovery step that calls the module is under way: after
    /// ``stopRecovering()`` and ``close()``, one still running is inside a
    /// PKCS#11 call that has not returned (a stopping daemon must then leave
    /// without exit handlers). A recovery waiting between steps is not counted.
    public var isRecovering: Bool { state.withLock { $0.recoveryStepRunning } }

    /// The recovery step under way, if any: when it began
    /// (``MonotonicClock`` nanoseconds, which also tells one step from the
    /// next) and how long it has been inside the module, in seconds. A step
    /// is a module reinitialization or new sessions, `C_Login`, the key
    /// look-up and a test signature; it normally takes well under a second.
    /// One that does not end is a call that has not returned: the token
    /// stays down until it does.
    /// - Returns: nil while no step runs (the token is up, or recovery waits between tries).
    public var recoveryStep: (started: UInt64, seconds: Double)? {
        let started = state.withLock { $0.recoveryStepRunning ? $0.recoveryStepStarted : 0 }
        guard started != 0 else { return nil }
        return (started, Double(MonotonicClock.nanoseconds(from: started, to: MonotonicClock.now())) / 1e9)
    }

    /// Closes every session and releases the module (the last user finalizes it).
    ///
    /// From the start of `close()` every new operation fails with
    /// ``HSMError/Code/tokenUnavailable`` and recovery stops. `C_Finalize`
    /// waits up to 2 s for calls already inside the module (a server left
    /// running by its stop may still be signing) and is skipped when one
    /// stays inside; the corresponding PKCS#11 functions are
    /// `C_CloseSession` and `C_Finalize`.
    public func close() {
        let anchor: UInt? = state.withLock { state in
            guard !state.closed else { return nil }
            state.closed = true
            defer { state.anchorSession = nil }
            return state.anchorSession ?? 0
        }
        guard let anchor else { return }
        pool.reset(moduleReinitialized: false)
        // Sessions still leased (a call hung in the module) must not be closed
        // later by number: after release the numbers may belong to someone else.
        pool.reset(moduleReinitialized: true)
        if anchor != 0 { functions.closeSession(anchor) }
        functions.module.release()
    }

    deinit {
        close()
    }

    // MARK: Slots and login

    static func findSlot(_ functions: PKCS11Functions, uri: PKCS11URI) throws(HSMError) -> (UInt, TokenInfo) {
        let (rv, slots) = functions.slotsWithToken()
        guard rv == .ok else {
            throw HSMError(pkcs11: .getSlotList, rv, message: "cannot list the slots of \(functions.module.path)")
        }
        var matches: [(UInt, TokenInfo)] = []
        var present: [String] = []
        var uninitialized = 0
        for slot in slots {
            let (infoRV, info) = functions.tokenInfo(slot: slot)
            guard infoRV == .ok, let info else { continue }
            if info.flags & P11.tokenInitialized == 0 {
                uninitialized += 1
            } else {
                present.append("token=\(info.label) (serial \(info.serial))")
            }
            if info.matches(uri) { matches.append((slot, info)) }
        }
        guard matches.count == 1 else {
            let wanted = [uri.tokenLabel.map { "token=\($0)" }, uri.tokenSerial.map { "serial=\($0)" }].compactMap { $0 }.joined(separator: " ")
            if matches.isEmpty {
                // Only what the module has; the label asked for is in `wanted`, not
                // in `tokenLabel`, which the description would append after the list.
                if uninitialized > 0 { present.append("\(uninitialized) uninitialized token\(uninitialized == 1 ? "" : "s") (no label yet)") }
                throw HSMError(.tokenNotFound, "no token matches \(wanted) in \(functions.module.path); the module has \(present.isEmpty ? "no tokens" : present.joined(separator: "; "))")
            }
            throw HSMError(.tokenNotFound, "\(matches.count) tokens match \(wanted); add serial= to the URI to pick one")
        }
        return matches[0]
    }

    /// Logs the user in, unless another thread already did since
    /// `generation` was observed. Uses a dedicated anchor session that keeps
    /// the login alive while pool sessions come and go.
    /// - Parameters:
    ///   - generation: the login generation the caller saw fail; nil to log in regardless.
    ///   - opening: true for the first login, from `init`: a refused PIN is
    ///     then reported by the caller (signerd exits 77, signctl prints it),
    ///     not logged here with a hint to reload a daemon that is not running.
    /// - Throws: ``HSMError/Code/pinRejected`` without calling `C_Login` when
    ///   the PIN was already refused.
    private func login(afterGeneration generation: UInt64?, opening: Bool = false) throws(HSMError) {
        try loginLock.withLock { (_) throws(HSMError) in
            let (current, status, slot, label, oldAnchor) = state.withLock { ($0.loginGeneration, $0.status, $0.slot, $0.label, $0.anchorSession) }
            if case .pinRejected(let rv) = status {
                var error = HSMError(.pinRejected, "the token refused the configured PIN (\(rv)); no login is attempted until the PIN source is reloaded")
                error.returnValue = rv
                error.tokenLabel = label
                throw error
            }
            if let generation, current != generation {
                return  // someone logged in meanwhile
            }
            try checkPINCounter(slot: slot, label: label, opening: opening)
            var anchor = oldAnchor
            if anchor == nil {
                let (rv, handle) = functions.openSession(slot: slot, readWrite: false)
                guard rv == .ok else {
                    throw HSMError(pkcs11: .openSession, rv, message: "cannot open the login session", tokenLabel: label)
                }
                anchor = handle
                state.withLock { $0.anchorSession = handle }
            }
            // The PIN sent, taken under the same lock as the call; a reload
            // waits for that lock, so it never replaces the PIN mid-login.
            var sent: SecureBytes?
            var rv = pin.withLock { current in
                sent = current
                return functions.login(anchor!, pin: current)  // set above
            }
            if PKCS11ReturnValue.sessionFailures.contains(rv) {
                // The anchor itself died: replace it and log in once on the new one.
                functions.closeSession(anchor!)
                let (openRV, handle) = functions.openSession(slot: slot, readWrite: false)
                guard openRV == .ok else {
                    state.withLock { $0.anchorSession = nil }
                    throw HSMError(pkcs11: .openSession, openRV, message: "cannot open the login session", tokenLabel: label)
                }
                state.withLock { $0.anchorSession = handle }
                rv = pin.withLock { current in
                    sent = current
                    return functions.login(handle, pin: current)
                }
            }
            switch rv {
            case .ok, .userAlreadyLoggedIn:
                state.withLock { $0.loginGeneration &+= 1 }
                loggedInPIN.withLock { $0 = sent }
                refusedPINs.withLock { $0.removeAll() }
                logger.debug("token_login", ["token.label": .string(label)])
            case _ where PKCS11ReturnValue.pinFailures.contains(rv):
                state.withLock { $0.status = .pinRejected(rv) }
                refusedPINs.withLock { refused in
                    if Self.wrongPINFailures.contains(rv), let sent {
                        refused.append((sent, rv))
                        if refused.count > Self.refusedPINLimit { refused.removeFirst() }
                    } else {
                        refused.removeAll()  // locked or expired: the SO acts next, and may make an old PIN right
                    }
                }
                if !opening { logger.critical("pin_rejected", ["token.label": .string(label), "p11.rv": .string(rv.name), "hint": "fix the PIN source, then reload (SIGHUP), or restart when systemd passes the PIN with LoadCredential=; no further login is attempted"]) }
                throw HSMError(pkcs11: .login, rv, message: "the token refused the PIN; not retrying, since tokens lock after a few wrong PINs", tokenLabel: label)
            default:
                throw HSMError(pkcs11: .login, rv, message: "cannot log in", tokenLabel: label)
            }
        }
    }

    /// Reads the token's user PIN flags before a `C_Login`: a locked PIN is
    /// not tried at all (the login could only fail, and some tokens count
    /// that too); a PIN counter that has seen wrong PINs is logged, so an
    /// operator learns of it before the token locks. When `C_GetTokenInfo`
    /// fails the login goes ahead, and reports what is wrong itself.
    /// - Throws: ``HSMError/Code/pinRejected`` with `CKR_PIN_LOCKED` when
    ///   the token reports `CKF_USER_PIN_LOCKED`; the status is then
    ///   `pinRejected`, as after a refused login. Also (without a return
    ///   value, with ``HSMError/userPINFlags``, the status unchanged) on
    ///   `CKF_USER_PIN_FINAL_TRY` when ``TokenOptions/loginOnFinalTry`` is false.
    private func checkPINCounter(slot: UInt, label: String, opening: Bool) throws(HSMError) {
        let (rv, info) = functions.tokenInfo(slot: slot)
        guard rv == .ok, let flags = info?.flags else { return }
        if flags & UserPINFlags.locked != 0 {
            state.withLock { $0.status = .pinRejected(.pinLocked) }
            // As after CKR_PIN_LOCKED from C_Login: the SO acts next, and may
            // make a PIN refused before the right one.
            refusedPINs.withLock { $0.removeAll() }
            let hint = "unlock the user PIN with the SO PIN (the vendor's tools, or C_InitPIN), then reload (SIGHUP) or restart; no login is attempted while the token reports it locked"
            if !opening { logger.critical("pin_rejected", ["token.label": .string(label), "p11.rv": .string(PKCS11ReturnValue.pinLocked.name), "hint": .string(hint)]) }
            var error = HSMError(.pinRejected, "token \(label) reports its user PIN locked (CKF_USER_PIN_LOCKED), so no login was attempted: \(hint)")
            error.returnValue = .pinLocked
            error.tokenLabel = label
            throw error
        }
        if flags & UserPINFlags.finalTry != 0 && !options.loginOnFinalTry {
            var error = HSMError(.pinRejected, "token \(label) reports that one more wrong user PIN locks it (CKF_USER_PIN_FINAL_TRY), so no login was attempted")
            error.function = PKCS11Function.getTokenInfo.rawValue
            error.tokenLabel = label
            error.userPINFlags = flags & (UserPINFlags.finalTry | UserPINFlags.countLow | UserPINFlags.locked)
            throw error
        }
        if flags & (UserPINFlags.finalTry | UserPINFlags.countLow) != 0 {
            let finalTry = flags & UserPINFlags.finalTry != 0
            logger.warning("pin_count_low", [
                "token.label": .string(label), "final_try": .bool(finalTry),
                "hint": .string(finalTry ? "the token says one more wrong user PIN locks it; check the PIN files of every program that logs in to it" : "the token has refused a user PIN since the last right one; check the PIN files of every program that logs in to it"),
            ])
        }
    }

    /// Replaces the PIN (after the operator fixed the PIN source) and, if the
    /// token had refused the old one, tries one login with the new one.
    ///
    /// A PIN source that gives a PIN the token called wrong
    /// (`CKR_PIN_INCORRECT`, `CKR_PIN_INVALID`, `CKR_PIN_LEN_RANGE`) since
    /// its last successful login, the last one tried or an earlier one, is
    /// not sent again: each wrong `C_Login` counts toward the token's lock, and
    /// a reload that only re-reads an unchanged file (or systemd's old copy
    /// of it) would spend one. After `CKR_PIN_LOCKED` or `CKR_PIN_EXPIRED`
    /// the same PIN gets its one login: the SO may have unlocked or reset
    /// it to that PIN (a token that still reports the PIN locked gets none).
    ///
    /// While logged in no `C_Login` is made (the token would not check the
    /// PIN): a PIN that differs from the one in use is logged as
    /// `pin_changed` (notice) when the token is up, since it is first sent
    /// at the next login (while the token is down, recovery's next login
    /// sends it within seconds); once, not again at each reload that reads
    /// the same new PIN.
    /// A URI with `pin-value` is logged as `pin_value_in_uri`, as at start.
    /// - Parameter uri: the (possibly changed) token URI; only its PIN source is used.
    /// - Throws: the PIN source errors, or ``HSMError/Code/pinRejected`` if the
    ///   new PIN is refused too, or is the refused PIN itself (then without a
    ///   `C_Login`).
    public func reloadPIN(from uri: PKCS11URI) throws(HSMError) {
        // As at start: a reload may be what put the PIN into the URI.
        if uri.hasPINValue {
            logger.warning("pin_value_in_uri", ["hint": .string(PKCS11URI.pinValueHint)])
        }
        let newPIN = try uri.readPIN()
        // Only a PIN the token called wrong since its last good login:
        // after CKR_PIN_LOCKED or CKR_PIN_EXPIRED the list is emptied, since
        // the SO may unlock or reset the PIN to one of them.
        let refused = refusedPINs.withLock { $0.first { $0.pin.hasSameBytes(as: newPIN) }?.rv }
        if let refused {
            var error = HSMError(.pinRejected, "the PIN source gives a PIN token \(label) refused (\(refused)) since its last good login; it is not sent again, since tokens lock after a few wrong PINs: write the right PIN into the PIN source, then reload")
            error.returnValue = refused
            error.tokenLabel = label
            throw error
        }
        // Against the PIN in use: a wrong PIN read and then the right one
        // again is no change, since the wrong one was never sent. And
        // against the PIN the previous reload read: the same new PIN read
        // again is no news.
        let inUse = loggedInPIN.withLock { $0 }
        let changed = pin.withLock { current in
            defer { current = newPIN }
            return !(inUse ?? current).hasSameBytes(as: newPIN) && !current.hasSameBytes(as: newPIN)
        }
        let (wasRejected, wasUp): (Bool, Bool) = state.withLock { state in
            if case .pinRejected = state.status {
                state.status = .up
                return (true, false)
            }
            return (false, state.status == .up)
        }
        if wasRejected {
            do {
                let storageHold = options.storageLock?({ [self] in recoveryHalted })
                defer { withExtendedLifetime(storageHold) {} }
                try login(afterGeneration: nil)
            } catch {
                if !isPINFailure(error) { markDown(reason: error.returnValue?.name ?? error.code.rawValue) }
                throw error
            }
            logger.notice("token_up", ["token.label": .string(label), "reason": "pin_reloaded"])
        } else if changed && wasUp {
            // Down, recovery's next login uses the new PIN within seconds, and says so if it is refused.
            // Logged in, the token takes no PIN (C_Login answers
            // CKR_USER_ALREADY_LOGGED_IN without checking one): a wrong new
            // PIN would show only at the next login, after an outage, as an
            // outage that does not end. Say so while it is cheap to check.
            logger.notice("pin_changed", [
                "token.label": .string(label),
                "hint": "signerd stays logged in and first uses the new PIN at its next login (after a token outage or a restart), unchecked until then; check it now by logging in with the same PIN from another process, e.g. signctl keys list with a PIN file holding it (a wrong PIN costs one of the token's tries)",
            ])
        }
    }

    private func isPINFailure(_ error: HSMError) -> Bool {
        error.code == .pinRejected
    }

    // MARK: Keys

    /// The cached handle and public key of `keyID`, looked up on first use.
    /// - Parameter settlingKeyInFlux: a look-up failure that ``keyInFlux(_:)``
    ///   counts as a replacement in progress is thrown without marking the
    ///   token down; the caller waits for the key, then escalates with
    ///   ``outlastedReplacement(_:)``.
    func cachedKey(_ keyID: String, settlingKeyInFlux: Bool = false) throws(HSMError) -> CachedKey {
        let (cached, epoch) = state.withLock { ($0.keys[keyID], $0.keysEpoch) }
        if let cached { return cached }
        return try lookUpAndCache(keyID, epoch: epoch, settlingKeyInFlux: settlingKeyInFlux)
    }

    /// Looks `keyID`'s objects up on a pooled session and caches them,
    /// unless cached keys were dropped since `epoch` or the token is down.
    private func lookUpAndCache(_ keyID: String, epoch: UInt64, settlingKeyInFlux: Bool) throws(HSMError) -> CachedKey {
        let found = try withSession(settlingKeyInFlux: settlingKeyInFlux) { (session) throws(HSMError) -> CachedKey in
            try lookUpKey(keyID, session: session)
        }
        let fingerprint = found.publicKey?.fingerprint
        let previous: String? = state.withLock { state in
            state.knownKeys.insert(keyID)
            // A key found without its public key object is not kept: the
            // object may be between two writes of a `keys import --replace`,
            // and a cached gap would fail every verification until a reload.
            if state.keysEpoch == epoch, case .up = state.status, found.publicKey != nil { state.keys[keyID] = found }
            return state.noteFingerprint(keyID, fingerprint)
        }
        if let previous, let fingerprint { logKeyChanged(keyID, before: previous, now: fingerprint) }
        return found
    }

    /// An audit trail for a key replaced on the token (`keys import
    /// --replace` with another key, a tool outside signerd, or another
    /// token's storage put in the place of this one's during an outage).
    private func logKeyChanged(_ keyID: String, before: String, now: String) {
        logger.notice("key_changed", ["key.id": .string(keyID), "fingerprint.before": .string(before), "fingerprint.now": .string(now)])
    }

    /// Forgets the cached handle and public key of `keyID` (or of every key
    /// when nil), so the next use looks the objects up again on the token
    /// (after a reload or an import by another process).
    /// - Parameter keyID: the key, or nil for all.
    public func forgetKey(_ keyID: String?) {
        state.withLock { state in
            state.dropKeys(keyID)
        }
    }

    /// The public key of `keyID` if it is already cached; never calls the token.
    /// - Parameter keyID: the App Store key ID.
    /// - Returns: the cached public key, or nil.
    public func cachedPublicKey(keyID: String) -> ECPublicKey? {
        state.withLock { $0.keys[keyID]?.publicKey }
    }

    /// The public key of `keyID`, read from its public key object.
    /// - Parameter keyID: the App Store key ID (the objects' `CKA_ID`).
    /// - Throws: ``HSMError/Code/keyNotFound``, ``HSMError/Code/keyInvalid``
    ///   when the key has no public key object.
    public func publicKey(keyID: String) throws(HSMError) -> ECPublicKey {
        try Self.publicKey(of: cachedKey(keyID), keyID: keyID)
    }

    /// The public key of `keyID` as the token holds it: the cached one if it
    /// was read less than `maxAge` seconds ago, else its objects are looked
    /// up again (and cached), so a key another process replaced (`signctl
    /// keys import --replace`) shows its new public key within `maxAge`.
    /// For `GET /v1/keys`, not for signing.
    /// - Parameters:
    ///   - keyID: the App Store key ID (the objects' `CKA_ID`).
    ///   - maxAge: how old, in seconds, a cached key may be.
    /// - Throws: as ``publicKey(keyID:)``, after waiting up to
    ///   ``keySettleMicroseconds`` in all when a key that was whole is found
    ///   missing or half-written (another process replacing it);
    ///   ``HSMError/Code/tokenUnavailable`` while the token is down.
    public func currentPublicKey(keyID: String, maxAge: Double) throws(HSMError) -> ECPublicKey {
        try checkUp()
        var settled = 0
        // Whether the key was cached whole when this call began; a signer
        // settling the same key forgets it from the cache meanwhile.
        var wasWhole: Bool?
        while true {
            let (cached, epoch) = state.withLock { ($0.keys[keyID], $0.keysEpoch) }
            if let cached, Double(MonotonicClock.nanoseconds(from: cached.readAt, to: MonotonicClock.now())) < maxAge * 1e9 {
                return try Self.publicKey(of: cached, keyID: keyID)
            }
            if wasWhole == nil { wasWhole = cached?.publicKey != nil }
            do {
                return try Self.publicKey(of: lookUpAndCache(keyID, epoch: epoch, settlingKeyInFlux: true), keyID: keyID)
            } catch {
                // A key read whole before, now missing, doubled or without
                // its public key object: most likely another process is
                // replacing it (`keys import --replace`). Wait for it as
                // sign(digest:keyID:) does; if it stays broken, forget it,
                // so that the next listing does not wait again.
                guard error.code == .keyNotFound || Self.keyInFlux(error), wasWhole == true else {
                    throw outlastedReplacement(error)
                }
                guard settled < Self.keySettleMicroseconds.count else {
                    forgetKey(keyID)
                    throw outlastedReplacement(error)
                }
                usleep(Self.keySettleMicroseconds[settled])
                settled += 1
            }
        }
    }

    private static func publicKey(of key: CachedKey, keyID: String) throws(HSMError) -> ECPublicKey {
        guard let publicKey = key.publicKey else {
            var error = HSMError(.keyInvalid, "key \(keyID) has no public key object on the token; re-import it with signctl keys import --replace")
            error.keyID = keyID
            throw error
        }
        return publicKey
    }

    // MARK: Sessions

    /// Runs `body` with a pooled session, retrying once on a fresh session
    /// when the session itself failed. The session goes back to the pool
    /// unless `body` reported a session failure. A token failure marks the
    /// token down, except one that ``keyInFlux(_:)`` counts as a key
    /// replacement in progress when `settlingKeyInFlux` is true: that
    /// caller waits for the key and escalates with ``outlastedReplacement(_:)``.
    func withSession<R>(settlingKeyInFlux: Bool = false, _ body: (UInt) throws(HSMError) -> R) throws(HSMError) -> R {
        try checkUp()
        var attempt = 0
        while true {
            attempt += 1
            let lease = try checkout()
            do {
                let result = try body(lease.handle)
                pool.checkin(lease)
                return result
            } catch {
                if let rv = error.returnValue, PKCS11ReturnValue.sessionFailures.contains(rv) {
                    pool.discard(lease)
                    if attempt < 3 { continue }
                } else if let rv = error.returnValue, PKCS11ReturnValue.tokenFailures.contains(rv) {
                    pool.discard(lease)
                    if !(settlingKeyInFlux && Self.keyInFlux(error)) { markDown(reason: rv.name) }
                } else if error.returnValue == .userNotLoggedIn, attempt < 3 {
                    pool.checkin(lease)
                    try login(afterGeneration: state.withLock { $0.loginGeneration })
                    continue
                } else {
                    pool.checkin(lease)
                }
                throw error
            }
        }
    }

    private func checkout() throws(HSMError) -> SessionLease {
        var deadline = MonotonicClock.deadline(after: options.sessionCheckoutTimeout)
        if let answerBy = RequestDeadline.current {
            // The caller was already answered (503 at sign_timeout_ms): signing now would be work nobody reads.
            // Late before it asked for a session, it waited for none: the
            // time went elsewhere (signerd's own checks, a call that did
            // return), so it is no sign of a hung token (a re-check of the
            // watchdog fix found this window between checkUp() and here).
            guard MonotonicClock.now() < answerBy else {
                var error = HSMError(.requestExpired, "the request's time (sign_timeout_ms) ran out before it asked for a PKCS#11 session")
                error.retryAfter = 1
                error.tokenLabel = label
                throw error
            }
            deadline = min(deadline, answerBy)
        }
        do {
            // Sessions reset while this request waited: the token went down
            // (recovery) or sessions died; only in the second case look again.
            // In line by the request's own deadline: in the order requests arrived.
            return try pool.checkout(deadline: deadline, priority: RequestDeadline.current) { () throws(HSMError) in try checkUp() }
        } catch {
            var error = error
            error.tokenLabel = label
            if let rv = error.returnValue, PKCS11ReturnValue.tokenFailures.contains(rv) {
                markDown(reason: rv.name)
            }
            throw error
        }
    }

    /// Changes the token's user PIN from the one this token was opened with
    /// to `newPIN`, on a read-write session of the logged-in user; this
    /// object then logs in with `newPIN` from now on. `newPIN` is checked
    /// against the token's `ulMinPinLen`…`ulMaxPinLen` (bytes) first, and
    /// neither PIN ever reaches a message.
    ///
    /// The corresponding PKCS#11 function is `C_SetPIN`.
    /// - Parameter newPIN: the new user PIN.
    /// - Throws: ``HSMError/Code/pinInvalid`` for a new PIN the token does
    ///   not take (`CKR_PIN_LEN_RANGE` before any change, a new PIN equal to
    ///   the current one, or `CKR_PIN_LEN_RANGE`/`CKR_PIN_INVALID` from
    ///   `C_SetPIN`); ``HSMError/Code/pinRejected`` when `C_SetPIN` refuses
    ///   the current PIN (`CKR_PIN_INCORRECT`, …); `pkcs11_failure` naming
    ///   the function otherwise.
    public func changeUserPIN(to newPIN: SecureBytes) throws(HSMError) {
        let slot = state.withLock { $0.slot }
        let (infoRV, info) = functions.tokenInfo(slot: slot)
        if infoRV == .ok, let lengths = info?.pinLengths {
            try TokenAdministration.refusePIN(newPIN, named: "new PIN (--new-pin-file)", outside: lengths, label: label)
        }
        // C_SetPIN accepts the PIN the token already has; saying "changed"
        // then would leave an operator rotating nothing.
        if pin.withLock({ $0.hasSameBytes(as: newPIN) }) {
            var error = HSMError(.pinInvalid, "the new PIN (--new-pin-file) is the PIN token \(label) already has; nothing was changed: write a different PIN into the file")
            error.tokenLabel = label
            throw error
        }
        try withReadWriteSession { (session) throws(HSMError) in
            let rv = pin.withLock { functions.setPIN(session, old: $0, new: newPIN) }
            guard rv == .ok else {
                var error = HSMError(pkcs11: .setPIN, rv, message: "the token did not change the user PIN", tokenLabel: label)
                if rv == .pinInvalid || rv == .pinLenRange {
                    error.code = .pinInvalid  // the new PIN's fault; no try spent
                } else if PKCS11ReturnValue.pinFailures.contains(rv) {
                    error.code = .pinRejected
                }
                throw error
            }
        }
        pin.withLock { $0 = newPIN }
        loggedInPIN.withLock { $0 = newPIN }
    }

    /// Reads the token again from its storage after ``changeUserPIN(to:)``
    /// and logs in with the new PIN: `C_Finalize`, `C_Initialize`, the
    /// token found again, `C_Login`. SoftHSM answers `C_SetPIN` with
    /// `CKR_OK` when it cannot write its token file (a full disk, a file
    /// size limit), and the file it leaves cut short holds no token at all.
    ///
    /// Every session and login of this process on the module ends: call it
    /// only where this is the one token open on the module (signctl).
    /// A refused new PIN costs one try on the token's counter, as the
    /// first login with it would.
    /// - Throws: ``HSMError/Code/pinNotStored`` when the token is gone or
    ///   refuses the new PIN; for any other failure of the read-back, that
    ///   error, its message saying that `C_SetPIN` had returned `CKR_OK`.
    public func confirmPINStored() throws(HSMError) {
        do {
            try readBackFromStorage()
        } catch {
            let label = self.label
            let what: String
            switch error.code {
            case .tokenNotFound:
                what = "the token is gone (\(error.message)): its storage could not be written and the token is damaged; restore the copy of its token directory, for which the old PIN is still right"
            case .pinRejected:
                what = "it refuses the new PIN (\(error.returnValue?.name ?? "refused")): the change was not stored; keep the old PIN in the PIN files"
            default:
                var unread = error
                unread.message = "token \(label) accepted the new PIN (C_SetPIN returned CKR_OK), but could not be read back from its storage to check it (\(error.message)): "
                    + "check that the new PIN logs in (signctl keys list with a configuration naming it) before you put it in the PIN files"
                throw unread
            }
            var failure = HSMError(.pinNotStored, "token \(label) accepted the new PIN, yet read again from its storage \(what)")
            failure.tokenLabel = label
            failure.returnValue = error.returnValue
            failure.function = error.function
            throw failure
        }
    }

    /// Reads the token again from its storage (`C_Finalize`,
    /// `C_Initialize`, the slot search, `C_Login`), to check that it is
    /// still there: SoftHSM rewrites its token file in place at `C_Login`,
    /// and a write cut short (a file size limit) leaves no token.
    ///
    /// Every session and login of this process on the module ends: call it
    /// only where this is the one token open on the module (signctl).
    /// - Throws: ``HSMError/Code/tokenNotFound`` when it is gone; ``HSMError``
    ///   from the reinitialization or the login.
    public func confirmTokenInStorage() throws(HSMError) {
        try readBackFromStorage()
    }

    /// How many times ``readBackFromStorage()`` reads the token before it
    /// believes a failure.
    static let readBackAttempts = 3
    /// The pause between those reads, in microseconds.
    static let readBackPauseMicroseconds: useconds_t = 250_000

    /// `C_Finalize`, `C_Initialize`, the slot search and `C_Login`, for
    /// signctl's read-backs, tried up to ``readBackAttempts`` times while
    /// they fail other than on the PIN: another process's `C_Login`
    /// rewriting SoftHSM's token file (a program that does not take
    /// signctl's lock, or a signerd whose recovery gave up waiting for it)
    /// makes a read meanwhile find the token uninitialized or its PIN not
    /// initialized for a moment, and the read-back then reported the token
    /// gone. A refused PIN is never tried again, since tokens lock after a
    /// few wrong PINs. Call it only where this is the one token open on
    /// the module.
    /// - Throws: the last read's ``HSMError``; at once ``HSMError/Code/pinRejected``.
    func readBackFromStorage() throws(HSMError) {
        var attempt = 1
        while true {
            do {
                try reconnect(reinitialize: true, quietLogin: true)
                return
            } catch where error.code != .pinRejected && attempt < Self.readBackAttempts {
                attempt += 1
                logger.debug("token_read_back_retry", ["attempt": .int(Int64(attempt)), "error": .string(error.returnValue?.name ?? error.code.rawValue)])
                usleep(Self.readBackPauseMicroseconds)
            }
        }
    }

    /// Opens a read-write session outside the pool for key management.
    func withReadWriteSession<R>(_ body: (UInt) throws(HSMError) -> R) throws(HSMError) -> R {
        try checkUp()
        let slot = state.withLock { $0.slot }
        let (rv, session) = functions.openSession(slot: slot, readWrite: true)
        guard rv == .ok else {
            throw HSMError(pkcs11: .openSession, rv, message: "cannot open a read-write session", tokenLabel: label)
        }
        defer { functions.closeSession(session) }
        return try body(session)
    }

    // MARK: Signing

    /// Signs a digest with `CKM_ECDSA` (the hash is computed by the caller,
    /// SHA-256 on the host; SoftHSM 2.6 has no `CKM_ECDSA_SHA256`).
    ///
    /// The corresponding PKCS#11 functions are `C_SignInit` and `C_Sign`.
    /// - Parameters:
    ///   - digest: 32 bytes (SHA-256).
    ///   - keyID: the App Store key ID (`CKA_ID` of the private key).
    /// - Returns: raw `r ‖ s` (64 bytes for P-256) and timings.
    /// - Throws: ``HSMError`` — `key_not_found`, `key_invalid` (two
    ///   private keys under the key ID after a replacement that stopped
    ///   half-way, or a key that is not P-256), `session_unavailable` (pool
    ///   exhausted until the checkout timeout), `sign_timeout` (the call
    ///   was written off while a session stayed quarantined),
    ///   `token_unavailable` (down, with `retryAfter`), `pin_rejected`,
    ///   `pkcs11_failure`.
    public func sign(digest: [UInt8], keyID: String) throws(HSMError) -> TokenSignature {
        try checkUp()
        var queue: UInt64 = 0
        var hsm: UInt64 = 0
        var sessionRetries = 0
        var keyRetried = false
        var reloggedIn = false
        // The failure that made the key be looked up again, if one did.
        var staleKeyFailure: HSMError?
        // Waits for a key another process is replacing (`keys import
        // --replace` creates the new objects, then destroys the old ones):
        // for those milliseconds the key has two objects, stale handles, or
        // none in this process's view of the token.
        var settled = 0
        func settle() -> Bool {
            guard settled < Self.keySettleMicroseconds.count else { return false }
            usleep(Self.keySettleMicroseconds[settled])
            settled += 1
            forgetKey(keyID)
            return true
        }
        while true {
            let generation = state.withLock { $0.loginGeneration }
            let key: CachedKey
            do {
                key = try cachedKey(keyID, settlingKeyInFlux: true)
            } catch {
                var error = error
                error.keyID = keyID
                let known = state.withLock { $0.knownKeys.contains(keyID) && ($0.expectedKeys?.contains(keyID) ?? true) }
                let vanished = error.code == .keyNotFound && (keyRetried || known)
                // Gone, or caught mid-replacement by another process: wait for it.
                if (vanished || Self.keyInFlux(error)) && settle() { continue }
                if vanished {
                    // The key signed here before and is gone now that its handle
                    // went stale: the token's storage itself may have gone (a
                    // network HSM partition away, SoftHSM's token directory
                    // moved). Reinitialize the module before believing it.
                    markDown(reason: "key_vanished", reinitialize: true, cause: staleKeyFailure?.returnValue)
                    throw unavailable(reason: "key \(keyID) vanished from the token", underlying: staleKeyFailure ?? error)
                }
                throw outlastedReplacement(error)
            }
            let waitStart = MonotonicClock.now()
            let lease = try checkout()
            let signStart = MonotonicClock.now()
            queue += signStart - waitStart
            let call = ObjectIdentifier(lease)
            inFlight.withLock { $0[call] = (lease, signStart) }
            let (rv, function, raw) = functions.signECDSA(lease.handle, key: key.handle, digest: digest)
            inFlight.withLock { _ = $0.removeValue(forKey: call) }
            hsm += MonotonicClock.now() - signStart
            if lease.quarantined.load(ordering: .acquiring) {
                // Written off while it ran (a hung call): its caller was already
                // answered; the session is closed, never reused.
                pool.checkin(lease)
                var error = HSMError(.signTimeout, "the signing call with key \(keyID) outlived the timeout; its session was quarantined")
                error.keyID = keyID
                error.tokenLabel = label
                throw error
            }
            if rv == .ok {
                pool.checkin(lease)
                return TokenSignature(raw: raw, queueNanoseconds: queue, hsmNanoseconds: hsm, publicKey: key.publicKey)
            }
            // A failed C_SignInit on a bad key handle leaves the session
            // clean; any other failure may leave an operation active, so
            // the session is closed rather than reused.
            // A key handle that went stale, or now names another object (a
            // public key: CKR_KEY_FUNCTION_NOT_PERMITTED), at C_SignInit.
            let staleHandle = function == .signInit && Self.keyInFluxFailures.contains(rv)
            if staleHandle {
                pool.checkin(lease)
            } else {
                pool.discard(lease)
            }
            let failure = HSMError(pkcs11: function, rv, message: "cannot sign with key \(keyID)", tokenLabel: label, keyID: keyID)
            logger.debug("sign_failed", ["key.id": .string(keyID), "p11.function": .string(function.rawValue), "p11.rv": .string(rv.name)])
            switch rv {
            case _ where PKCS11ReturnValue.sessionFailures.contains(rv) && sessionRetries < 2:
                sessionRetries += 1
                if rv == .sessionHandleInvalid || rv == .sessionClosed {
                    // Sessions seldom die alone (a token reset takes them all):
                    // close the idle ones too, so the retry gets a fresh session.
                    pool.reset(moduleReinitialized: false)
                }
            case _ where staleHandle && !keyRetried:
                keyRetried = true
                staleKeyFailure = failure
                forgetKey(keyID)
            case _ where Self.keyInFlux(rv, at: function) && settle():
                // Caught mid-replacement by another process; look the key
                // up again and sign anew before believing it.
                staleKeyFailure = failure
            case .userNotLoggedIn where !reloggedIn:
                reloggedIn = true
                try login(afterGeneration: generation)
            case _ where PKCS11ReturnValue.pinFailures.contains(rv):
                throw failure
            case _ where PKCS11ReturnValue.tokenFailures.contains(rv)
                || PKCS11ReturnValue.sessionFailures.contains(rv)
                || PKCS11ReturnValue.objectFailures.contains(rv)
                || rv == .userNotLoggedIn:
                // The fault survived the step meant for it: escalate.
                markDown(reason: rv.name)
                throw unavailable(reason: rv.name, underlying: failure)
            default:
                throw failure
            }
        }
    }

    /// How many signatures a check makes before it believes that the
    /// token's signature does not verify with the key's public key.
    package static let verificationAttempts = 3

    /// Gets ready to sign again after a signature that did not verify with
    /// the key's public key (or found none): forgets the cached objects,
    /// which may predate a key replaced by another process, and before the
    /// last attempt waits 50 ms for a replacement still being written.
    /// - Parameters:
    ///   - keyID: the key that signed.
    ///   - attempt: the attempt that failed, from 1.
    /// - Returns: false when that was the last of ``verificationAttempts``.
    package func prepareVerificationRetry(keyID: String, after attempt: Int) -> Bool {
        guard attempt < Self.verificationAttempts else { return false }
        if attempt == Self.verificationAttempts - 1 { usleep(50_000) }
        forgetKey(keyID)
        return true
    }

    /// The pauses, in microseconds, a signer waits for a key another
    /// process is replacing before it believes a key gone, doubled or
    /// stale for good: 155 ms in all.
    package static let keySettleMicroseconds: [useconds_t] = [5_000, 10_000, 20_000, 40_000, 80_000]

    /// How many reinitialized recovery steps in a row must find the token
    /// without a key it had before that the key counts as deleted (about
    /// 1 s with recovery's default backoff).
    static let reinitializationsBeforeDeleted = 4

    /// Whether a failure is what another process replacing the key
    /// (`keys import --replace` creates the new objects, then destroys the
    /// old ones) leaves for a moment: two objects where the key has one
    /// (`key_invalid`), or a return value ``keyInFlux(_:at:)`` counts.
    /// Callers wait ``keySettleMicroseconds`` for such a failure before
    /// they believe it, then escalate with ``outlastedReplacement(_:)``.
    static func keyInFlux(_ error: HSMError) -> Bool {
        guard error.code != .keyInvalid else { return true }
        guard let rv = error.returnValue else { return false }
        return keyInFlux(rv, at: error.function.flatMap(PKCS11Function.init(rawValue:)))
    }

    /// Whether `rv` from `function` is what a key's objects answer while
    /// another process replaces them: ``keyInFluxFailures`` from any call
    /// that takes a key or object handle (not `C_Sign`, which takes none:
    /// from it they mark the token down at once, as before), or
    /// `CKR_GENERAL_ERROR` from a call that reads the key's objects
    /// (SoftHSM answers it when an object is destroyed while it reads the
    /// object: `getECPrivateKey` under `C_SignInit`, then `C_Sign`,
    /// attribute reads under `C_GetAttributeValue` and the search).
    static func keyInFlux(_ rv: PKCS11ReturnValue, at function: PKCS11Function?) -> Bool {
        if rv == .generalError { return function.map(keyReadingFunctions.contains) == true }
        return keyInFluxFailures.contains(rv) && function != .sign
    }

    /// What a key's objects answer while another process replaces them:
    /// stale handles, a handle that now names another object, attributes
    /// of an object being written or removed. From `C_SignInit` the
    /// session stays clean, so it is checked in rather than discarded.
    static let keyInFluxFailures: Set<PKCS11ReturnValue> = PKCS11ReturnValue.objectFailures.union([
        .keyFunctionNotPermitted, .keyTypeInconsistent, .attributeValueInvalid, .attributeTypeInvalid,
    ])

    /// The calls that read a key's objects, where a replacement in another
    /// process can surface as `CKR_GENERAL_ERROR`.
    static let keyReadingFunctions: Set<PKCS11Function> = [
        .findObjectsInit, .findObjects, .findObjectsFinal, .getAttributeValue, .signInit, .sign,
    ]

    /// A failure ``keyInFlux(_:)`` counted as a replacement, after the wait
    /// for it ran out: a token failure (`CKR_GENERAL_ERROR`) is then the
    /// module's own, so the token is marked down and the caller gets
    /// `token_unavailable`; any other failure is returned as it is.
    func outlastedReplacement(_ error: HSMError) -> HSMError {
        guard Self.keyInFlux(error), let rv = error.returnValue, PKCS11ReturnValue.tokenFailures.contains(rv) else { return error }
        markDown(reason: rv.name)
        return unavailable(reason: rv.name, underlying: error)
    }

    /// Signs a random digest with `keyID` and verifies it with the key's
    /// public key: the readiness check and the import self-test.
    /// - Parameter keyID: the key to test.
    /// - Throws: the signing errors, ``HSMError/Code/keyInvalid`` without a
    ///   public key, ``HSMError/Code/verificationFailed``.
    public func selfTest(keyID: String) throws(HSMError) {
        // The public key of the objects that signed, not one read before:
        // a key replaced on the token meanwhile (`signctl keys import
        // --replace` from another process) is looked up again by the sign.
        // A mismatch is retried once after forgetting the cached objects,
        // so only a pair that disagrees on the token itself fails.
        var attempt = 1
        while true {
            let digest = SecureRandom.bytes(32)
            let signature = try sign(digest: digest, keyID: keyID)
            do {
                if try signingPublicKey(signature, keyID: keyID).verify(rawSignature: signature.raw, digest: digest) { return }
            } catch where attempt < Self.verificationAttempts {
                // No public key object at this moment: a replacement still being written.
            }
            guard prepareVerificationRetry(keyID: keyID, after: attempt) else { break }
            attempt += 1
        }
        var error = HSMError(.verificationFailed, "the token's signature with key \(keyID) did not verify with its public key")
        error.keyID = keyID
        error.tokenLabel = label
        throw error
    }

    /// The public key to check `signature` with: the one of the objects
    /// that made it, or, when the token has no public key object for them,
    /// a fresh look-up (which throws ``HSMError/Code/keyInvalid``).
    /// - Parameters:
    ///   - signature: what ``sign(digest:keyID:)`` returned.
    ///   - keyID: the key it was made with.
    /// - Throws: ``HSMError`` from ``publicKey(keyID:)``.
    public func signingPublicKey(_ signature: TokenSignature, keyID: String) throws(HSMError) -> ECPublicKey {
        if let used = signature.publicKey { return used }
        return try publicKey(keyID: keyID)
    }

    // MARK: Health and recovery

    private func checkUp() throws(HSMError) {
        // Every operation a request asks of the token begins here. One whose
        // time ran out before it got here was answered already (503 by the
        // watchdog) while it was still being checked: it starts nothing, and
        // its lateness is not the token's (a session wait that "ended" at
        // once would otherwise take an idle token down).
        if let progress = RequestDeadline.progress {
            if !progress.hasReachedToken, let answerBy = RequestDeadline.current, MonotonicClock.now() >= answerBy {
                var error = HSMError(.requestExpired, "the request's time (sign_timeout_ms) ran out before it asked the token for anything")
                error.retryAfter = 1
                throw error
            }
            progress.markReachedToken()
        }
        let (status, closed) = state.withLock { ($0.status, $0.closed) }
        guard !closed else {
            // close() ran (signerd is stopping): no call may start in a module being finalized.
            var error = HSMError(.tokenUnavailable, "token \(label) is closed: signerd is stopping")
            error.tokenLabel = label
            error.retryAfter = 1
            throw error
        }
        switch status {
        case .up:
            return
        case .down(let reason):
            var error = unavailable(reason: reason, underlying: nil)
            error.returnValue = state.withLock { $0.downReturnValue }
            restartRecoveryIfIdle()
            throw error
        case .pinRejected(let rv):
            var error = HSMError(.pinRejected, "the token refused the configured PIN (\(rv)); fix the PIN source and reload")
            error.returnValue = rv
            error.tokenLabel = label
            throw error
        }
    }

    private func unavailable(reason: String, underlying: HSMError?) -> HSMError {
        var error = HSMError(.tokenUnavailable, "the token \(label) is unavailable (\(reason)); recovery is running")
        error.retryAfter = max(1, options.recoveryInitialBackoff)
        error.tokenLabel = label
        error.function = underlying?.function
        error.returnValue = underlying?.returnValue
        error.keyID = underlying?.keyID
        return error
    }

    /// Marks the token down and starts the one recovery thread, unless one
    /// is already running. Logs once per outage.
    /// - Parameters:
    ///   - reason: the `CKR_*` name or condition, for readiness and the log.
    ///   - reinitialize: whether recovery must begin with `C_Finalize` +
    ///     `C_Initialize`; defaults to whether `reason` names a device or
    ///     module failure.
    ///   - cause: the `CK_RV` behind a `reason` that is not itself a
    ///     `CKR_*` name (`key_vanished` after `CKR_KEY_HANDLE_INVALID`).
    public func markDown(reason: String, reinitialize: Bool? = nil, cause: PKCS11ReturnValue? = nil) {
        let named = PKCS11ReturnValue(name: reason)
        let full = reinitialize ?? named.map { PKCS11ReturnValue.tokenFailures.contains($0) } ?? false
        let (wentDown, start): (Bool, Bool) = state.withLock { state in
            guard !state.closed else { return (false, false) }
            if case .pinRejected = state.status { return (false, false) }
            state.needsReinitialize = state.needsReinitialize || full
            var wentDown = false
            if case .up = state.status {
                state.status = .down(reason: reason)
                state.downSince = MonotonicClock.now()
                state.downReturnValue = named ?? cause
                // Handles may not survive the outage, and what is shown of a
                // key (GET /v1/keys, signerd_keys) should say it is unreachable.
                state.dropKeys()
                wentDown = true
            }
            guard !state.recovering, !state.recoveryStopped else { return (wentDown, false) }
            state.recovering = true
            return (wentDown, true)
        }
        // Once per outage, even when recovery is started again (its thread could not be made).
        if wentDown { logger.error("token_down", ["token.label": .string(label), "reason": .string(reason)]) }
        if start { startRecovery() }
    }

    /// Where the token stands, for a request about to use it: as
    /// ``status``, and when the token is down with no recovery running
    /// (its thread could not be made), recovery is started again.
    /// - Returns: the token's status.
    public func statusForRequest() -> TokenStatus {
        let status = self.status
        if case .down = status { restartRecoveryIfIdle() }
        return status
    }

    /// Starts recovery again when the token is down and none is running:
    /// its thread could not be made when the token went down.
    private func restartRecoveryIfIdle() {
        let restart = state.withLock { state in
            guard case .down = state.status, !state.recovering, !state.closed, !state.recoveryStopped else { return false }
            state.recovering = true
            return true
        }
        if restart { startRecovery() }
    }

    /// Starts the recovery thread for a caller that set `recovering`. When
    /// the process has no thread to give, recovery does not run inline (its
    /// callers include the HTTP server's supervisor, holding the server's
    /// locks, and recovery loops until the token is back): `recovering` is
    /// cleared, `recovery_thread_failed` is logged once per outage, and the
    /// next request that finds the token down (``statusForRequest()``, or
    /// a signature's own check) tries again.
    private func startRecovery() {
        if OSThread.start({ [weak self] in self?.recover() }) { return }
        let firstFailure = state.withLock { state in
            state.recovering = false
            defer { state.recoveryThreadFailed = true }
            return !state.recoveryThreadFailed
        }
        if firstFailure {
            logger.error("recovery_thread_failed", [
                "token.label": .string(label),
                "hint": "the process is out of threads (systemd TasksMax=, RLIMIT_NPROC, kernel.threads-max); recovery is tried again by the next request that finds the token down",
            ])
        }
    }

    /// The recovery loop: reinitialize the module, find the token, log in,
    /// look the keys up again; back off (doubling, jittered, bounded) between tries.
    /// The module is reinitialized only while no lease is out; after a
    /// device or module failure, the first attempt waits up to
    /// ``leaseWaitSeconds`` for the leases out to come back (not for
    /// written-off ones), and otherwise the attempt only replaces the sessions.
    private func recover() {
        var backoff = options.recoveryInitialBackoff
        var attempt = 0
        var waitedForLeases = false
        state.withLock { $0.missingAfterReinitialize = 0 }
        while true {
            attempt += 1
            let jitter = Double.random(in: 0.5...1.0)
            usleep(useconds_t(min(backoff * jitter, options.recoveryMaximumBackoff) * 1_000_000))
            if recoveryHalted {
                state.withLock { $0.recovering = false }
                return
            }
            // Held for the whole step, released at the end of this iteration.
            let storageHold = options.storageLock?({ [self] in recoveryHalted })
            defer { withExtendedLifetime(storageHold) {} }
            // Escalate: new sessions and a fresh login first when the module
            // itself did not fail; C_Finalize + C_Initialize when it did or
            // when the lighter step failed, but never while a call is still
            // inside the module (finalizing under it is undefined behaviour):
            // a C_Sign being written off, or any call on a session still
            // leased (a hung C_FindObjects holds its lease).
            let moduleFailed = state.withLock { $0.needsReinitialize }
            let full = moduleFailed || attempt > 1
            // freezeIfIdle() also keeps any session from being leased until
            // reconnect() has reset the pool on the reinitialized module.
            var reinitializing = full && callsInModule == 0 && pool.freezeIfIdle()
            // After a module failure, C_Finalize also ends the sessions whose
            // C_CloseSession failed in the outage, which new sessions alone
            // would leave open in the module. The leases out then are mostly
            // calls failing or finishing: wait for them once per outage, a
            // bounded time, before falling back.
            if moduleFailed && !reinitializing && !waitedForLeases {
                waitedForLeases = true
                reinitializing = freezeWhenIdle(until: MonotonicClock.deadline(after: Self.leaseWaitSeconds))
                if !reinitializing && state.withLock({ $0.closed }) {
                    state.withLock { $0.recovering = false }
                    return
                }
            }
            state.withLock {
                $0.recoveryStepRunning = true
                $0.recoveryStepStarted = MonotonicClock.now()
            }
            let outcome = rebuild(reinitialize: reinitializing)
            state.withLock {
                $0.recoveryStepRunning = false
                $0.recoveryStepStarted = 0
            }
            switch outcome {
            case .success:
                let recovered = state.withLock { state -> (String, UInt64)? in
                    state.recovering = false
                    // close() ran during the last step: the token stays closed.
                    guard !state.closed else { return nil }
                    state.status = .up
                    // A module failure recovered on new sessions only (a lease
                    // was out) still wants C_Finalize: sessions whose close it
                    // refused may be open in the module. The next outage
                    // begins with it.
                    if reinitializing { state.needsReinitialize = false }
                    state.recoveryThreadFailed = false
                    return (state.label, state.downSince)
                }
                guard let (label, since) = recovered else { return }
                logger.notice("token_up", ["token.label": .string(label), "recovery.attempts": .int(Int64(attempt)),
                                           "recovery.ms": .int(Int64(MonotonicClock.nanoseconds(from: since, to: MonotonicClock.now()) / 1_000_000)),
                                           "module.reinitialized": .bool(reinitializing)])
                return
            case .failure(let error) where error.code == .pinRejected:
                state.withLock { $0.recovering = false }
                return  // status already .pinRejected; login() logged it
            case .failure where recoveryHalted:
                state.withLock { $0.recovering = false }
                return
            case .failure(let error):
                logger.debug("token_recovery_attempt_failed", ["attempt": .int(Int64(attempt)), "error": .string(error.returnValue?.name ?? error.code.rawValue)])
                backoff = min(backoff * 2, options.recoveryMaximumBackoff)
            }
        }
    }

    /// Whether recovery must make no further call: ``stopRecovering()`` was
    /// called or the token closed.
    private var recoveryHalted: Bool { state.withLock { $0.recoveryStopped || $0.closed } }

    /// Throws `token_unavailable` once ``stopRecovering()`` was called or the
    /// token closed: checked before each step of recovery that calls the module.
    private func refuseOnceRecoveryStopped() throws(HSMError) {
        if recoveryHalted {
            throw HSMError(.tokenUnavailable, "recovery stopped: signerd is stopping")
        }
    }

    /// How long recovery after a device or module failure waits, at most,
    /// for leased sessions to come back so that it can reinitialize the
    /// module, in seconds.
    static let leaseWaitSeconds = 2.0

    /// Waits until no call is inside the module and no lease is out, then
    /// freezes the pool (``SessionPool/freezeIfIdle()``) for a module
    /// reinitialization; polls every 5 ms.
    /// - Parameter deadline: ``MonotonicClock`` nanoseconds.
    /// - Returns: true when frozen; false at the deadline, as soon as every
    ///   lease out is written off (a call that outlived `sign_timeout_ms`
    ///   may never return), or when the token was closed meanwhile.
    private func freezeWhenIdle(until deadline: UInt64) -> Bool {
        while !state.withLock({ $0.closed }) {
            if callsInModule == 0 && pool.freezeIfIdle() { return true }
            if pool.onlyWrittenOffLeasesOut || MonotonicClock.now() >= deadline { return false }
            usleep(5_000)
        }
        return false
    }

    /// New sessions, the token's slot found again and a new login; first
    /// `C_Finalize` + `C_Initialize` when `reinitialize`, which ends every
    /// session and login of this process on the module.
    /// - Parameter quietLogin: a refused PIN is left to the caller to
    ///   report (signctl's read-backs), not logged with a daemon's advice.
    /// - Throws: ``HSMError`` from `C_Initialize`, the slot search or the login.
    func reconnect(reinitialize: Bool, quietLogin: Bool = false) throws(HSMError) {
        if reinitialize {
            // Recovery froze the pool (freezeIfIdle) to finalize under no lease.
            defer { pool.unfreeze() }
            let rv = loginLock.withLock { _ in functions.reinitializeModule() }
            guard rv == .ok || rv == .cryptokiAlreadyInitialized else {
                throw HSMError(pkcs11: .initialize, rv, message: "cannot reinitialize the module")
            }
            pool.reset(moduleReinitialized: true)
            state.withLock { $0.anchorSession = nil }
        } else {
            pool.reset(moduleReinitialized: false)
        }
        let (slot, info) = try HSMToken.findSlot(functions, uri: uri)
        state.withLock { state in
            state.slot = slot
            state.label = info.label
            state.serial = info.serial
        }
        pool.reset(moduleReinitialized: false, slot: slot)
        try login(afterGeneration: nil, opening: quietLogin)
    }

    private func rebuild(reinitialize: Bool) -> Result<Void, HSMError> {
        let (keyIDs, epoch): ([String], UInt64) = state.withLock { state in
            state.dropKeys()
            return (state.knownKeys.filter { state.expectedKeys?.contains($0) ?? true }.sorted(), state.keysEpoch)
        }
        do {
            try refuseOnceRecoveryStopped()
            try reconnect(reinitialize: reinitialize)
            // Look the keys up again so the first request does not pay for
            // it, and sign once to prove the token signs again.
            var keys: [String: CachedKey] = [:]
            var missing: [String] = []
            for keyID in keyIDs {
                do {
                    keys[keyID] = try withSessionDuringRecovery { (session) throws(HSMError) in try lookUpKey(keyID, session: session) }
                } catch where error.code == .keyNotFound {
                    missing.append(keyID)
                }
            }
            // New sessions on a module that was not reinitialized can still
            // see the token while its storage is gone (SoftHSM keeps the token
            // in memory when its directory is moved away; the objects are
            // gone): that tells a lost key from a deleted one only after
            // C_Finalize + C_Initialize. So escalate instead of concluding.
            if !missing.isEmpty && !reinitialize {
                state.withLock { $0.needsReinitialize = true }
                logger.warning("keys_not_found_before_reinitialize", ["keys": .string(missing.joined(separator: ",")), "token.label": .string(label),
                                                                      "hint": "the module is reinitialized before these keys count as deleted"])
                return .failure(HSMError(.keyNotFound, "keys \(missing.joined(separator: ", ")) not found on new sessions"))
            }
            // The reinitialized token itself answered (found, logged in): a
            // key that is not on it now was deleted (by signctl in another
            // process, say). It is no longer expected, so asking for it is a
            // plain 404 rather than another outage.
            // Storage that comes back a moment later (SoftHSM's token
            // directory renamed and renamed back) can also look like this
            // once: only several reinitializations in a row without the key,
            // with recovery's backoff between them, take it as deleted.
            if !missing.isEmpty {
                let attempts = state.withLock { state -> Int in
                    state.missingAfterReinitialize += 1
                    return state.missingAfterReinitialize
                }
                guard attempts >= Self.reinitializationsBeforeDeleted else {
                    state.withLock { $0.needsReinitialize = true }
                    logger.warning("keys_not_found_after_reinitialize", ["keys": .string(missing.joined(separator: ",")), "token.label": .string(label),
                                                                         "attempt": .int(Int64(attempts)),
                                                                         "hint": "the module is reinitialized again before these keys count as deleted"])
                    return .failure(HSMError(.keyNotFound, "keys \(missing.joined(separator: ", ")) not found after reinitialization \(attempts)"))
                }
                state.withLock { state in
                    for keyID in missing { state.knownKeys.remove(keyID) }
                }
                logger.warning("key_missing_after_recovery", ["keys": .string(missing.joined(separator: ",")), "token.label": .string(label)])
            }
            if let (keyID, key) = keys.first(where: { $0.value.publicKey != nil }) {
                let digest = SecureRandom.bytes(32)
                let raw = try withSessionDuringRecovery { (session) throws(HSMError) -> [UInt8] in
                    let (rv, function, raw) = functions.signECDSA(session, key: key.handle, digest: digest)
                    guard rv == .ok else { throw HSMError(pkcs11: function, rv, message: "recovery test signature failed", keyID: keyID) }
                    return raw
                }
                guard key.publicKey!.verify(rawSignature: raw, digest: digest) else {  // filtered above
                    return .failure(HSMError(.verificationFailed, "the recovery test signature did not verify"))
                }
            }
            // Unless the cache was dropped meanwhile (a reload's forget): then
            // these handles are older than the drop and are not kept.
            // The fingerprints are noted either way: the token holds these
            // keys now, and a key ID that names another key than before the
            // outage is logged here, not at some later look-up.
            let changed: [(keyID: String, before: String, now: String)] = state.withLock { state in
                if state.keysEpoch == epoch { state.keys.merge(keys) { _, new in new } }
                return keys.keys.sorted().compactMap { keyID in
                    guard let now = keys[keyID]?.publicKey?.fingerprint, let before = state.noteFingerprint(keyID, now) else { return nil }
                    return (keyID, before, now)
                }
            }
            for change in changed { logKeyChanged(change.keyID, before: change.before, now: change.now) }
            return .success(())
        } catch {
            return .failure(error)
        }
    }

    /// Forgets that `keyID` was ever on the token (it was deleted on purpose).
    func forgetKnownKey(_ keyID: String) {
        state.withLock { _ = $0.knownKeys.remove(keyID) }
    }

    /// Tells recovery which keys must be back before the token counts as
    /// recovered: the configured ones. A key deleted on purpose and dropped
    /// from the configuration then no longer keeps the token down.
    /// - Parameter keyIDs: the configured key IDs.
    public func expectKeys(_ keyIDs: Set<String>) {
        state.withLock { $0.expectedKeys = keyIDs }
    }

    /// Calls now inside the module (`C_SignInit`/`C_Sign`).
    public var callsInModule: Int { inFlight.withLock { $0.count } }

    /// Writes off every signing call that has been inside the module longer
    /// than `seconds`: its session is quarantined (its place in the pool is
    /// freed now; it is closed, never reused, when the call returns) and the
    /// token is marked down so that new requests fail fast while recovery
    /// checks it with fresh sessions.
    /// - Parameter seconds: the signing timeout.
    /// - Returns: how many calls were written off now.
    @discardableResult
    public func abandonCalls(olderThan seconds: Double) -> Int {
        let limit = UInt64(seconds * 1e9)
        let now = MonotonicClock.now()
        let overdue: [SessionLease] = inFlight.withLock { calls in
            calls.values.filter { now > $0.started + limit && !$0.lease.quarantined.load(ordering: .relaxed) }.map(\.lease)
        }
        // A call that returned since it was found overdue gave its lease back: nothing to write off.
        let abandoned = overdue.filter { pool.quarantine($0) }.count
        if abandoned > 0 {
            logger.warning("sign_call_quarantined", ["calls": .int(Int64(abandoned)), "timeout.seconds": .double(seconds)])
            markDown(reason: "sign_timeout", reinitialize: false)
        }
        return abandoned
    }

    /// A session for recovery work, while the status is still down.
    /// - Throws: `token_unavailable` at once once recovery was stopped
    ///   (``stopRecovering()``) or the token closed: no new call starts.
    private func withSessionDuringRecovery<R>(_ body: (UInt) throws(HSMError) -> R) throws(HSMError) -> R {
        try refuseOnceRecoveryStopped()
        let lease = try pool.checkout(deadline: MonotonicClock.deadline(after: options.sessionCheckoutTimeout))
        do {
            let result = try body(lease.handle)
            pool.checkin(lease)
            return result
        } catch {
            pool.discard(lease)
            throw error
        }
    }
}
