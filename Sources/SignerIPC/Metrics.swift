import HSMSigner
import Synchronization

/// One lock-free counter (`Atomic` cannot live in an array itself).
final class AtomicCounter: Sendable {
    private let value = Atomic<UInt64>(0)

    /// Adds `amount` (relaxed: counters need no ordering with other memory).
    func add(_ amount: UInt64) { value.add(amount, ordering: .relaxed) }

    /// The current value.
    var load: UInt64 { value.load(ordering: .relaxed) }
}

/// A Prometheus histogram with fixed upper bounds, in seconds. Observations
/// are atomic increments: every signature records two, from every worker.
final class Histogram: Sendable {
    /// Upper bounds in seconds, ascending.
    let bounds: [Double]
    private let boundsNanoseconds: [UInt64]
    /// One counter per bound, then one for +Inf.
    private let buckets: [AtomicCounter]
    private let sumNanoseconds = AtomicCounter()

    init(bounds: [Double]) {
        self.bounds = bounds
        boundsNanoseconds = bounds.map { UInt64($0 * 1e9) }
        buckets = (0...bounds.count).map { _ in AtomicCounter() }
    }

    /// Records one observation.
    /// - Parameter nanoseconds: the duration.
    func observe(nanoseconds: UInt64) {
        let index = boundsNanoseconds.firstIndex { nanoseconds <= $0 } ?? bounds.count
        buckets[index].add(1)
        sumNanoseconds.add(nanoseconds)
    }

    func render(name: String, into out: inout String) {
        var cumulative: UInt64 = 0
        for (index, bound) in bounds.enumerated() {
            cumulative += buckets[index].load
            out += "\(name)_bucket{le=\"\(bound)\"} \(cumulative)\n"
        }
        cumulative += buckets[bounds.count].load
        out += "\(name)_bucket{le=\"+Inf\"} \(cumulative)\n"
        out += "\(name)_sum \(Double(sumNanoseconds.load) / 1e9)\n"
        out += "\(name)_count \(cumulative)\n"
    }
}

/// The daemon's counters, rendered as Prometheus text format 0.0.4 by
/// ``render(token:keys:)``.
public final class Metrics: Sendable {
    private struct RequestKey: Hashable {
        var endpoint: String
        var status: Int
    }

    /// The statuses counted without a lock, per route; others go to `otherRequests`.
    private static let commonStatuses = [200, 400, 403, 404, 405, 413, 415, 429, 500, 503]
    private static let routes = Route.allCases
    /// `routes.count × commonStatuses.count` counters, route-major.
    private let requestCounters = (0..<(Route.allCases.count * commonStatuses.count)).map { _ in AtomicCounter() }
    private let otherRequests = Locked<[RequestKey: UInt64]>([:])
    private let hsmErrors = Locked<[String: UInt64]>([:])
    private let events = Locked<[String: UInt64]>([:])
    private static let latencyBounds = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10]
    let queueTime = Histogram(bounds: latencyBounds)
    let hsmTime = Histogram(bounds: latencyBounds)

    /// Makes empty metrics.
    public init() {}

    /// Counts one finished request (lock-free for the known routes and the common statuses).
    /// - Parameters:
    ///   - route: the endpoint; nil for an unknown path, counted as `other`.
    ///   - status: the HTTP status sent.
    public func countRequest(route: Route?, status: Int) {
        guard let route, let index = Metrics.counterIndex(route: route, status: status) else {
            otherRequests.withLock { $0[RequestKey(endpoint: route?.rawValue ?? "other", status: status), default: 0] += 1 }
            return
        }
        requestCounters[index].add(1)
    }

    /// The position of (`route`, `status`) in `requestCounters`; nil for a status not in the table.
    private static func counterIndex(route: Route, status: Int) -> Int? {
        guard let statusIndex = commonStatuses.firstIndex(of: status), let routeIndex = routes.firstIndex(of: route) else { return nil }
        return routeIndex * commonStatuses.count + statusIndex
    }

    /// Every request counter, lock-free ones and the rest.
    private var requestCounts: [RequestKey: UInt64] {
        var counts = otherRequests.withLock { $0 }
        for route in Metrics.routes {
            for status in Metrics.commonStatuses {
                let value = requestCounters[Metrics.counterIndex(route: route, status: status)!].load
                if value > 0 { counts[RequestKey(endpoint: route.rawValue, status: status), default: 0] += value }
            }
        }
        return counts
    }

    /// Counts a PKCS#11 failure by its `CKR_*` name (or error code when no `CK_RV` applies).
    public func countHSMError(_ name: String) {
        hsmErrors.withLock { $0[name, default: 0] += 1 }
    }

    /// Counts a named event: `verification_failures`, `forbidden`, `rate_limited`,
    /// `dropped_slow_requests`, `refused_connections`, `audit_write_failures`.
    public func count(_ event: String) {
        events.withLock { $0[event, default: 0] += 1 }
    }

    /// The value of a named event counter, for tests and logs.
    public func value(_ event: String) -> UInt64 {
        events.withLock { $0[event] ?? 0 }
    }

    /// Records where a signature's time went.
    public func observe(_ signature: TokenSignature) {
        queueTime.observe(nanoseconds: signature.queueNanoseconds)
        hsmTime.observe(nanoseconds: signature.hsmNanoseconds)
    }

    /// Prometheus text format 0.0.4.
    /// - Parameters:
    ///   - token: the token whose sessions and status are reported.
    ///   - keys: how many configured keys are usable.
    public func render(token: HSMToken?, keys: Int) -> String {
        var out = ""
        out += "# HELP signerd_requests_total HTTP requests by endpoint and status.\n# TYPE signerd_requests_total counter\n"
        let counted = requestCounts.sorted { ($0.key.endpoint, $0.key.status) < ($1.key.endpoint, $1.key.status) }
        for (key, value) in counted {
            out += "signerd_requests_total{endpoint=\"\(key.endpoint)\",status=\"\(key.status)\"} \(value)\n"
        }
        out += "# HELP signerd_sign_queue_seconds Time a signature waited for a free PKCS#11 session.\n# TYPE signerd_sign_queue_seconds histogram\n"
        queueTime.render(name: "signerd_sign_queue_seconds", into: &out)
        out += "# HELP signerd_sign_hsm_seconds Time spent in C_SignInit and C_Sign.\n# TYPE signerd_sign_hsm_seconds histogram\n"
        hsmTime.render(name: "signerd_sign_hsm_seconds", into: &out)
        out += "# HELP signerd_hsm_errors_total PKCS#11 failures by CKR_* name.\n# TYPE signerd_hsm_errors_total counter\n"
        for (name, value) in hsmErrors.withLock({ $0 }).sorted(by: { $0.key < $1.key }) {
            out += "signerd_hsm_errors_total{rv=\"\(name)\"} \(value)\n"
        }
        let eventHelp = [
            "verification_failures": "Signatures that did not verify with the key's public key and were not returned.",
            "forbidden": "Refusals by an allow-list: 403 forbidden (peer uid/gid, or a per-key allowed_uids), and /v1/offers requests whose keys a per-key allowed_uids keeps from the caller.",
            "rate_limited": "Requests refused by the per-uid rate limit.",
            "dropped_slow_requests": "Connections dropped because a request took longer than request_timeout_seconds to arrive.",
            "refused_connections": "Connections closed on arrival because their uid already held max_connections_per_uid, or max_connections were open.",
            "audit_write_failures": "Signatures not returned (503 audit_log_unwritable) because audit_log is on and their signature_issued line could not be written.",
        ]
        let events = self.events.withLock { $0 }
        for (event, help) in eventHelp.sorted(by: { $0.key < $1.key }) {
            out += "# HELP signerd_\(event)_total \(help)\n# TYPE signerd_\(event)_total counter\n"
            out += "signerd_\(event)_total \(events[event] ?? 0)\n"
        }
        let usage: (inUse: Int, idle: Int, waiting: Int) = token?.sessionUsage ?? (0, 0, 0)
        out += "# HELP signerd_sessions PKCS#11 sessions in the pool.\n# TYPE signerd_sessions gauge\n"
        out += "signerd_sessions{state=\"in_use\"} \(usage.inUse)\nsignerd_sessions{state=\"idle\"} \(usage.idle)\n"
        out += "# HELP signerd_session_waiters Requests waiting for a free session.\n# TYPE signerd_session_waiters gauge\nsignerd_session_waiters \(usage.waiting)\n"
        let up: Int
        if let token, case .up = token.status { up = 1 } else { up = 0 }
        out += "# HELP signerd_token_up 1 while the token is logged in and serving.\n# TYPE signerd_token_up gauge\nsignerd_token_up \(up)\n"
        let recoveryCall = token?.recoveryStep?.seconds ?? 0
        out += "# HELP signerd_token_recovery_call_seconds How long token recovery's current step has been inside the module (0 when none runs); one that keeps growing is a call that has not returned.\n"
        out += "# TYPE signerd_token_recovery_call_seconds gauge\nsignerd_token_recovery_call_seconds \((recoveryCall * 1000).rounded() / 1000)\n"
        out += "# HELP signerd_keys Configured keys found on the token.\n# TYPE signerd_keys gauge\nsignerd_keys \(keys)\n"
        return out
    }
}
