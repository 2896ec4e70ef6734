@testable import HSMSigner
import TestSupport
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// A seam in front of the PKCS#11 function table: counts every call and
/// answers chosen calls with chosen `CKR_*` values instead of the module.
final class FaultInjector: PKCS11Interposer {
    struct Rule {
        var function: PKCS11Function
        var returnValue: PKCS11ReturnValue
        /// How many calls to answer; nil for "until cleared".
        var remaining: Int?
        /// Seconds to block before answering (a hanging module); the call
        /// then goes through to the module when `returnValue` is `.ok`.
        var delay: Double = 0
    }

    private let state = Mutex<(rules: [Rule], calls: [PKCS11Function: Int])>(([], [:]))

    /// Answers the next `count` calls of `function` with `rv` (nil: every call until ``clear()``).
    func inject(_ function: PKCS11Function, _ rv: PKCS11ReturnValue, count: Int? = 1, delay: Double = 0) {
        state.withLock { $0.rules.append(Rule(function: function, returnValue: rv, remaining: count, delay: delay)) }
    }

    func clear() {
        state.withLock { $0.rules.removeAll() }
    }

    func calls(_ function: PKCS11Function) -> Int {
        state.withLock { $0.calls[function] ?? 0 }
    }

    func intercept(_ function: PKCS11Function, session: UInt) -> PKCS11ReturnValue? {
        let rule: Rule? = state.withLock { state in
            state.calls[function, default: 0] += 1
            guard let index = state.rules.firstIndex(where: { $0.function == function && ($0.remaining ?? 1) > 0 }) else {
                return nil
            }
            let rule = state.rules[index]
            if let remaining = rule.remaining { state.rules[index].remaining = remaining - 1 }
            return rule
        }
        guard let rule else { return nil }
        if rule.delay > 0 {
            usleep(useconds_t(rule.delay * 1_000_000))
        }
        return rule.returnValue == .ok ? nil : rule.returnValue
    }
}
