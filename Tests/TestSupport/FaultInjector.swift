import HSMSigner
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// A seam in front of the PKCS#11 function table: counts every call and
/// answers chosen calls with chosen `CKR_*` values instead of the module,
/// modelling the faults real tokens show (sessions lost, logins dropped,
/// object handles gone stale, the device away for a while, calls that hang).
package final class FaultInjector: PKCS11Interposer {
    struct Rule {
        var function: PKCS11Function
        var returnValue: PKCS11ReturnValue
        /// How many calls to answer; nil for "until cleared".
        var remaining: Int?
        /// Seconds to block before answering (a slow or hanging module).
        var delay: Double = 0
        /// After the delay, fail with `CKR_FUNCTION_FAILED` instead of calling the module.
        var failAfterDelay = false
        /// Calls to let through to the module before the rule applies.
        var skip = 0
    }

    struct State {
        var rules: [Rule] = []
        var calls: [PKCS11Function: Int] = [:]
        /// Session handles the "token" lost: every call on them fails until closed.
        var deadSessions: Set<UInt> = []
        var seenSessions: Set<UInt> = []
        /// The "token" logged the user out: signing fails until a C_Login.
        var loggedOut = false
        /// Flags `C_GetTokenInfo` reports beyond the module's own.
        var extraTokenFlags: UInt = 0
        /// Object handles went stale: C_SignInit fails until the key is searched again.
        var staleObjects = false
        /// The token's objects are gone (its storage lost): searches find
        /// nothing and C_SignInit fails with `CKR_KEY_HANDLE_INVALID`.
        var objectsHidden = false
        /// The device is away until this instant (MonotonicClock ns), answering `outageValue`.
        var outageUntil: UInt64 = 0
        var outageValue: PKCS11ReturnValue = .deviceRemoved
        /// Raw signatures to hand back, in order, in place of the next `C_Sign` outputs.
        var replacementSignatures: [[UInt8]] = []
    }

    private let state = Mutex(State())

    package init() {}

    /// Answers the next `count` calls of `function` with `rv` (nil: every
    /// call until ``clear()``), after blocking `delay` seconds; `.ok` lets
    /// the call through to the module after the delay (a slow module).
    /// `after` calls of `function` reach the module first.
    package func inject(_ function: PKCS11Function, _ rv: PKCS11ReturnValue, count: Int? = 1, delay: Double = 0, after: Int = 0) {
        state.withLock { $0.rules.append(Rule(function: function, returnValue: rv, remaining: count, delay: delay, skip: after)) }
    }

    /// The next `count` calls of `function` hang for `seconds`, then fail
    /// with `CKR_FUNCTION_FAILED` without reaching the module (so a call
    /// that outlives its test never touches another test's sessions).
    package func hang(_ function: PKCS11Function, seconds: Double, count: Int = 1) {
        state.withLock { $0.rules.append(Rule(function: function, returnValue: .functionFailed, remaining: count, delay: seconds, failAfterDelay: true)) }
    }

    /// Every session open now becomes invalid (`CKR_SESSION_HANDLE_INVALID`) until closed.
    public func invalidateAllSessions() {
        state.withLock { $0.deadSessions = $0.seenSessions }
    }

    /// The token forgets the login (`CKR_USER_NOT_LOGGED_IN` on signing until `C_Login`).
    public func logOut() {
        state.withLock { $0.loggedOut = true }
    }

    /// Object handles go stale (`CKR_OBJECT_HANDLE_INVALID` until a new search).
    public func invalidateObjects() {
        state.withLock { $0.staleObjects = true }
    }

    /// The token's storage goes away while the token still answers (as
    /// SoftHSM does when its token directory is moved): object searches find
    /// nothing and signing fails with `CKR_KEY_HANDLE_INVALID`, until ``clear()``.
    public func hideObjects() {
        state.withLock { $0.objectsHidden = true }
    }

    /// The device answers `rv` to everything for `seconds`.
    public func outage(_ rv: PKCS11ReturnValue, seconds: Double) {
        state.withLock {
            $0.outageValue = rv
            $0.outageUntil = MonotonicClock.deadline(after: seconds)
        }
    }

    /// The next `signatures.count` successful `C_Sign` calls return these
    /// raw `r ‖ s` values instead of the module's output (a module whose
    /// signatures have a given shape).
    package func replaceSignatures(_ signatures: [[UInt8]]) {
        state.withLock { $0.replacementSignatures += signatures }
    }

    /// Makes `C_GetTokenInfo` report `flags` (``UserPINFlags``) in addition
    /// to the module's own, until ``clear()``.
    package func addTokenFlags(_ flags: UInt) {
        state.withLock { $0.extraTokenFlags |= flags }
    }

    /// The module's flags with those of ``addTokenFlags(_:)``.
    package func tokenFlags(_ flags: UInt) -> UInt {
        state.withLock { flags | $0.extraTokenFlags }
    }

    /// The next replacement from ``replaceSignatures(_:)``, or the module's own output.
    package func signed(_ signature: [UInt8]) -> [UInt8] {
        state.withLock { $0.replacementSignatures.isEmpty ? signature : $0.replacementSignatures.removeFirst() }
    }

    public func clear() {
        state.withLock { $0 = State(calls: $0.calls) }
    }

    package func calls(_ function: PKCS11Function) -> Int {
        state.withLock { $0.calls[function] ?? 0 }
    }

    package func intercept(_ function: PKCS11Function, session: UInt) -> PKCS11ReturnValue? {
        let (answer, delay): (PKCS11ReturnValue?, Double) = state.withLock { state in
            state.calls[function, default: 0] += 1
            if session != 0 { state.seenSessions.insert(session) }
            if MonotonicClock.now() < state.outageUntil {
                return (state.outageValue, 0)
            }
            if function == .closeSession, state.deadSessions.remove(session) != nil {
                state.seenSessions.remove(session)
                return (nil, 0)  // really close it: the number may be reused
            }
            if function == .closeSession { state.seenSessions.remove(session) }
            if session != 0, state.deadSessions.contains(session) {
                return (.sessionHandleInvalid, 0)
            }
            if function == .login { state.loggedOut = false }
            if state.loggedOut, function == .signInit || function == .sign {
                return (.userNotLoggedIn, 0)
            }
            if state.objectsHidden, function == .findObjects {
                return (.ok, 0)  // answered without the module: an empty result
            }
            if state.objectsHidden, function == .signInit {
                return (.keyHandleInvalid, 0)
            }
            if function == .findObjectsInit { state.staleObjects = false }
            if state.staleObjects, function == .signInit {
                return (.objectHandleInvalid, 0)
            }
            guard let index = state.rules.firstIndex(where: { $0.function == function && ($0.remaining ?? 1) > 0 }) else {
                return (nil, 0)
            }
            if state.rules[index].skip > 0 {
                state.rules[index].skip -= 1
                return (nil, 0)
            }
            let rule = state.rules[index]
            if let remaining = rule.remaining { state.rules[index].remaining = remaining - 1 }
            return (rule.returnValue == .ok ? nil : rule.returnValue, rule.delay)
        }
        if delay > 0 {
            usleep(useconds_t(delay * 1_000_000))
        }
        return answer
    }
}
