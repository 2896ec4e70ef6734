import Foundation
import HSMSigner
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// The API's endpoints (API contract v1).
public enum Route: String, Sendable, CaseIterable {
    case healthz = "/healthz"
    case readyz = "/readyz"
    case metrics = "/metrics"
    case keys = "/v1/keys"
    case promotionalOffer = "/v1/sign/promotional-offer"
    case offers = "/v1/offers"
    case promotionalOfferV2 = "/v1/sign/promotional-offer-v2"
    case introductoryOfferEligibility = "/v1/sign/introductory-offer-eligibility"
    case advancedCommerceRequest = "/v1/sign/advanced-commerce-request"
    case serverAPIToken = "/v1/tokens/app-store-server-api"

    /// The endpoint at `path`, or nil. Looked up in a table built once:
    /// `init(rawValue:)` compares the path with each case in turn, and a
    /// request asks up to four times (measured: 3.6k instructions a request).
    /// - Parameter path: the request path, without a query.
    public init?(path: String) {
        guard let route = Self.byPath[path] else { return nil }
        self = route
    }

    private static let byPath: [String: Route] = Dictionary(uniqueKeysWithValues: allCases.map { ($0.rawValue, $0) })

    /// The one method the endpoint accepts.
    public var method: String {
        switch self {
        case .healthz, .readyz, .metrics, .keys: "GET"
        default: "POST"
        }
    }
}

/// The signing service behind the socket: routing, who may call, field
/// rules, key choice, signing through the token, verification before
/// return, readiness and metrics. The HTTP layer calls it on its own
/// threads; everything here is thread-safe.
public final class SignerService: HTTPHandler, Sendable {
    /// The token the keys live on.
    public let token: HSMToken
    /// The daemon's counters.
    public let metrics: Metrics
    let logger: Logger
    private let current: Locked<SignerConfiguration>
    /// The last readiness result, with the key IDs it checked and the token
    /// state (status and when it last went down) the check began under: a check that
    /// began before a reload must not answer for the configuration after it.
    private let readiness = Locked<(response: ReadinessResponse, ready: Bool, checkedAt: UInt64, status: TokenStatus, downAt: UInt64, keyIDs: [String])?>(nil)
    /// The readiness check now running, if any: only one runs at a time.
    private let readinessRun = ReadinessRun()
    private let rateBuckets = Locked<[UInt32: (tokens: Double, at: UInt64)]>([:])
    /// A refused peer sending in a loop must not write a log line per request.
    /// Per uid: one caller refused in a loop cannot hide another's attempt.
    private let forbiddenWarnings = PerCallerLogThrottle(linesPerWindow: 10, windowSeconds: 10)
    private let groupCache = Locked<[UInt32: (groups: [UInt32], at: UInt64)]>([:])
    private let ownUID = getuid()
    /// `sign_timeout_ms` at start, in seconds (the request deadline is fixed at start too).
    private let signTimeoutSeconds: Double
    /// The start of the recovery step last logged as `recovery_stuck`: once per step.
    private let stuckRecoveryLogged = Locked<UInt64>(0)
    /// Large bodies are read a few at a time (their values take about 20 × the body's size).
    let bodyReading = BodyReadingGate.forThisHost()

    /// Makes the service.
    /// - Parameters:
    ///   - configuration: the checked configuration.
    ///   - token: the opened token.
    ///   - logger: request-independent events (forbidden peers, verification failures).
    ///   - metrics: where counters go.
    public init(configuration: SignerConfiguration, token: HSMToken, logger: Logger, metrics: Metrics = Metrics()) {
        self.current = Locked(configuration)
        self.signTimeoutSeconds = Double(configuration.signTimeoutMs) / 1000
        self.token = token
        self.logger = logger
        self.metrics = metrics
        token.expectKeys(Set(configuration.keys.map(\.keyID)))
    }

    /// The configuration in effect.
    public var configuration: SignerConfiguration { current.withLock { $0 } }

    /// Applies a new configuration (SIGHUP) without dropping connections:
    /// keys, bundle IDs, issuer IDs, allow-lists, the rate limit and
    /// `verify_before_return` change at once; the PIN is re-read, and key
    /// handles are looked up again on next use. Socket, HTTP limits, thread
    /// and session counts and the log level keep their start values until a restart.
    /// - Parameter new: the new, already checked configuration.
    /// - Throws: ``ConfigurationError`` when the new one needs a restart
    ///   (another socket or another token); the old one then stays.
    public func reload(_ new: SignerConfiguration) throws(ConfigurationError) {
        let old = configuration
        // Compared by what they do, not how they are written: `//` in a
        // path, or a group by name where it was left to default, is no change.
        let socketChanges = [("socket_path", !UnixListener.samePath(new.socketPath, old.socketPath)), ("socket_mode", new.socketMode != old.socketMode),
                             ("socket_group", !UnixListener.sameGroup(new.socketGroup, old.socketGroup, socketAt: old.socketPath))].filter(\.1).map(\.0)
        guard socketChanges.isEmpty else {
            throw ConfigurationError("\(socketChanges.joined(separator: " and ")) changed: socket_path, socket_mode and socket_group change only with a restart (run by hand, stop signerd and start it again; with the shipped signerd.socket, systemd owns the socket: change ListenStream=, SocketMode= or SocketGroup= there and run systemctl restart signerd.socket signerd)")
        }
        let oldURI: PKCS11URI
        let newURI: PKCS11URI
        do {
            oldURI = try PKCS11URI(old.tokenURI)
            newURI = try PKCS11URI(new.tokenURI)
        } catch {
            throw ConfigurationError(key: "token_uri", error.message)
        }
        guard oldURI.modulePath == newURI.modulePath, oldURI.moduleName == newURI.moduleName,
              oldURI.tokenLabel == newURI.tokenLabel, oldURI.tokenSerial == newURI.tokenSerial else {
            throw ConfigurationError("token_uri names another module or token; that needs a restart (only the PIN source may change on reload)")
        }
        do {
            try token.reloadPIN(from: newURI)
        } catch {
            throw ConfigurationError(key: "token_uri", error.message)
        }
        token.forgetKey(nil)
        token.expectKeys(Set(new.keys.map(\.keyID)))
        if new.auditLog != old.auditLog {
            // Before the change takes effect: auditing turned off leaves a trace.
            noteAuditTrail(on: new.auditLog, reason: "reload")
        }
        current.withLock { $0 = new }
        readiness.withLock { $0 = nil }
    }

    // MARK: HTTPHandler

    /// Answers before the body is read, in this order: 403 `forbidden` for a
    /// peer not allowed (so it learns nothing, not even which paths exist),
    /// 404 `not_found` for an unknown path, 405 `method_not_allowed` with
    /// `Allow`, 429 `rate_limited` over the per-uid token bucket
    /// (`rate_limit_per_second`, `rate_limit_burst`), 503 `hsm_unavailable`
    /// with `Retry-After: 1` for a POST while the token is down, and 415
    /// `unsupported_media_type` for a POST that is not `application/json`,
    /// or that names a `charset` other than UTF-8 (or US-ASCII, its subset),
    /// or whose body has a content coding (`gzip`; RFC 9110 §8.4), with
    /// `Accept-Encoding: identity`.
    /// - Parameters:
    ///   - method: the request method.
    ///   - path: the request path.
    ///   - contentTypes: every `Content-Type` header's value, in order.
    ///   - contentCodings: every `Content-Encoding` header's value, in order.
    ///   - contentLength: the `Content-Length` header; unused here (the server
    ///     checks it against the body limit).
    ///   - peer: the caller's `SO_PEERCRED` credentials.
    /// - Returns: the error response, or nil to read the body and go on.
    public func preflight(method: String, path: String, contentTypes: [String], contentCodings: [String], contentLength: Int?, peer: PeerCredentials) -> HTTPResponse? {
        let route = Route(path: path)
        let config = configuration
        // Who may call comes first: a peer that is not allowed learns nothing, not even which paths exist.
        if let refused = refuseIfNotAllowed(peer, path: path, config) { return refused }
        guard let route else {
            return respond(.failure(APIError(.notFound, "no endpoint at \(path); see docs/API.md")))
        }
        guard method == route.method else {
            var response = respond(.failure(APIError(.methodNotAllowed, "\(path) accepts \(route.method), not \(method)")))
            response.headers.append(("Allow", route.method))
            return response
        }
        if let limited = rateLimit(peer, config) {
            return respond(.failure(limited))
        }
        // While the token is down, signing requests fail fast instead of queueing.
        if route.method == "POST", case .down(let reason) = token.statusForRequest() {
            var error = APIError(.hsmUnavailable, "the HSM is unavailable (\(reason)); recovery is running")
            error.retryAfter = 1
            return respond(.failure(error))
        }
        if route.method == "POST" {
            // One media type (RFC 9110 §8.3): with two, which one the body
            // is in cannot be told, and a charset in the second was ignored.
            guard contentTypes.count <= 1 else {
                return respond(.failure(APIError(.unsupportedMediaType, "the request has \(contentTypes.count) Content-Type headers (\(contentTypes.joined(separator: " and "))); send one: application/json")))
            }
            guard let contentType = contentTypes.first, Self.isJSON(contentType) else {
                let sent = contentTypes.first.map { $0.allSatisfy(\.isWhitespace) ? "an empty Content-Type" : $0 } ?? "none"
                return respond(.failure(APIError(.unsupportedMediaType, "send the body as Content-Type: application/json (UTF-8); got \(sent)")))
            }
            // JSON between systems is UTF-8 (RFC 8259 §8.1), and signerd reads
            // nothing else: a body declared otherwise would be read as UTF-8.
            // US-ASCII text is UTF-8 text as it is; "utf8" is a common
            // unregistered spelling of UTF-8.
            if let charset = Self.charsets(of: contentType).first(where: { !["utf-8", "utf8", "us-ascii"].contains($0.lowercased()) }) {
                return respond(.failure(APIError(.unsupportedMediaType, "the body's charset is \"\(charset)\", but signerd reads JSON as UTF-8 only (RFC 8259 §8.1); send it as UTF-8 with Content-Type: application/json or application/json; charset=utf-8")))
            }
            // A compressed body would be read as JSON text and refused as
            // such, with a message about bytes the client never wrote.
            // "identity" (RFC 9110 §8.4.1) means none.
            let codings = contentCodings.joined(separator: ",").split(separator: ",").map { $0.trimmingCharacters(in: .whitespaces) }
            if let coding = codings.first(where: { !$0.isEmpty && $0.lowercased() != "identity" }) {
                var response = respond(.failure(APIError(.unsupportedMediaType, "the body is sent with Content-Encoding \(coding), which signerd does not decode; send it uncompressed, without Content-Encoding")))
                // RFC 9110 §15.5.16: say which content codings would be accepted.
                response.headers.append(("Accept-Encoding", "identity"))
                return response
            }
        }
        return nil
    }

    /// True for every route but `/healthz` and `/metrics` (which never wait
    /// for the HSM); false for an unknown path (a 404).
    /// - Parameter path: the request path.
    /// - Returns: whether the request may block in PKCS#11 and so runs under `sign_timeout_ms`.
    public func mayBlock(path: String) -> Bool {
        Route(path: path).map { $0 != .healthz && $0 != .metrics } ?? false
    }

    /// 503 `hsm_unavailable` with `Retry-After: 1` for a request not answered
    /// within `sign_timeout_ms` of its arrival (waiting for a PKCS#11
    /// session or inside a PKCS#11 call); counted as the HSM error
    /// `sign_timeout`. When no session came back from the module in all
    /// that time the token is marked down, so that new signing requests fail
    /// fast while recovery checks it (a hung `C_Sign` is also written off by
    /// ``watchdogTick()``; a hung `C_FindObjects`, `C_Login` or
    /// `C_OpenSession` is not). When sessions did come back, the request
    /// only queued behind others on a busy token, which stays up. A request
    /// that had not reached the token (still being read and checked: a
    /// body of many numbers, on a loaded machine) gets a 503 that says so,
    /// is not counted as an HSM error, and takes nothing down.
    /// - Parameters:
    ///   - path: the request path.
    ///   - reachedToken: whether the request had asked the token for anything.
    /// - Returns: the error response.
    public func timedOut(path: String, reachedToken: Bool) -> HTTPResponse {
        guard reachedToken else { return respond(.failure(Self.stillCheckingError)) }
        metrics.countHSMError("sign_timeout")
        var error: APIError
        if markDownIfNoSessionReturned() {
            error = APIError(.hsmUnavailable, "the HSM did not answer within sign_timeout_ms; a call hung in the module is written off and its session quarantined")
        } else if path == Route.offers.rawValue {
            // A batch makes one signature per offer, each after a session wait: its time adds up.
            return respond(.failure(Self.ranOutBetweenSignaturesError))
        } else {
            error = APIError(.hsmUnavailable, "no PKCS#11 session came free within sign_timeout_ms: the HSM is busy with other requests; retry later, or raise session_pool_size")
        }
        error.retryAfter = 1
        return respond(.failure(error))
    }

    /// The 503 for a request that had reached the token and whose
    /// `sign_timeout_ms` ran out before its last signature, while the HSM
    /// answers: a `/v1/offers` batch signs its offers one after another, and
    /// with `verify_before_return` a signature that did not verify while its
    /// key was being replaced on the token is made again with the key looked
    /// up anew, so a single request can need two. (A short classic DER made
    /// again is not such a case: its second try is given up, and the short
    /// signature answered, when the deadline is near.)
    static var ranOutBetweenSignaturesError: APIError {
        var error = APIError(.hsmUnavailable, "sign_timeout_ms ran out before the request's last signature: signerd makes a request's signatures one after another "
                             + "(one per offer of a /v1/offers batch; with verify_before_return, another after one that did not verify while its key was being replaced on the token), and the HSM answered the ones made so far; "
                             + "send fewer offers per batch, raise sign_timeout_ms, or retry later (no signature of this request is returned)")
        error.retryAfter = 1
        return error
    }

    /// The 503 for a request whose `sign_timeout_ms` ran out before it
    /// asked the token for anything.
    static var stillCheckingError: APIError {
        var error = APIError(.hsmUnavailable, "signerd was still reading and checking the request when sign_timeout_ms ran out, before it asked the HSM for anything "
                             + "(a body of many values, or a loaded machine); the HSM is not at fault: send a smaller body, or retry later")
        error.retryAfter = 1
        return error
    }

    /// Marks the token down (`call_timeout`) when no PKCS#11 session came
    /// back from the module within `sign_timeout_ms`: the token is hung,
    /// not busy. Asked for every request that waited in vain, whether the
    /// watchdog answered it (``timedOut(path:)``) or its wait for a session
    /// ended first: under load, the requests stuck in a hung call had each
    /// queued for a session another had just returned, and the ones queueing
    /// behind them are the only ones left to notice.
    /// - Returns: whether the token was marked down.
    private func markDownIfNoSessionReturned() -> Bool {
        guard !token.sessionReturned(withinSeconds: signTimeoutSeconds) else { return false }
        token.markDown(reason: "call_timeout", reinitialize: false)
        return true
    }

    /// Writes off `C_Sign` calls that have been inside the module longer
    /// than `sign_timeout_ms`: their sessions are quarantined and the token
    /// is marked down until recovery has checked it.
    public func watchdogTick() {
        token.abandonCalls(olderThan: signTimeoutSeconds)
        if let step = token.recoveryStep, step.seconds >= recoveryStuckSeconds {
            noteStuckRecovery(started: step.started, seconds: step.seconds)
        }
    }

    /// How long one recovery step may stay inside the module before it
    /// counts as stuck: 6 × `sign_timeout_ms`, at least 5 s (30 s with the
    /// defaults), so that a short `sign_timeout_ms` does not call a slow
    /// network HSM's login stuck. A
    /// step is a few calls (`C_Login`, the key look-up, a test signature),
    /// each of which a healthy HSM answers well within `sign_timeout_ms`.
    public var recoveryStuckSeconds: Double { max(6 * signTimeoutSeconds, 5) }

    /// Whether token recovery has been inside one step for
    /// ``recoveryStuckSeconds`` or longer: a PKCS#11 call that has not
    /// returned, which keeps the token down until it does. Recovery's calls
    /// cannot be written off as requests' are (it holds the login), so only
    /// a new process gets a working module back: signerd stops its systemd
    /// watchdog pings while this holds, and systemd restarts it.
    public var recoveryStuck: Bool { (token.recoveryStep?.seconds ?? 0) >= recoveryStuckSeconds }

    private func noteStuckRecovery(started: UInt64, seconds: Double) {
        let first = stuckRecoveryLogged.withLock { logged in
            defer { logged = started }
            return logged != started
        }
        guard first else { return }
        let restart = Systemd.watchdogPingInterval != nil
            ? "signerd stops its systemd watchdog pings, so systemd restarts it at WatchdogSec= (a new process loads the module afresh)"
            : "restart signerd (no systemd watchdog is set to do it) once the HSM answers"
        logger.error("recovery_stuck", [
            "token.label": .string(token.label), "call.seconds": .double((seconds * 10).rounded() / 10),
            "hint": .string("token recovery has been inside one PKCS#11 call (C_Login, the key look-up or a test signature) for over \(Int(recoveryStuckSeconds)) s (6 × sign_timeout_ms, at least 5 s); "
                + "the token stays down until it returns: \(restart)"),
        ])
    }

    /// `application/json`, any case, optionally followed by parameters (`; charset=utf-8`).
    static func isJSON(_ contentType: String) -> Bool {
        let expected = Array("application/json".utf8)
        var bytes = contentType.utf8.drop { $0 == 0x20 || $0 == 0x09 }.makeIterator()
        for byte in expected {
            // Case-insensitive for letters only (RFC 9110 §8.3.1): OR-ing 0x20
            // into any byte would also take 0x0F for "/".
            guard let next = bytes.next(), (next >= 0x41 && next <= 0x5A ? next | 0x20 : next) == byte else { return false }
        }
        guard let after = bytes.next() else { return true }
        return after == UInt8(ascii: ";") || after == 0x20 || after == 0x09
    }

    /// The values of the `charset` parameters of a `Content-Type` (RFC 9110
    /// §8.3.1: the name in any case, the value a token or a quoted string,
    /// returned without its quotes and escapes), in order; empty when there
    /// are none. Parameters start at the first `;`, after the media type.
    static func charsets(of contentType: String) -> [String] {
        let semicolon = UInt8(ascii: ";"), quote = UInt8(ascii: "\""), backslash = UInt8(ascii: "\\")
        guard contentType.utf8.contains(semicolon) else { return [] }  // the usual case, without a copy
        let bytes = Array(contentType.utf8)
        func isSpace(_ byte: UInt8) -> Bool { byte == 0x20 || byte == 0x09 }
        guard var index = bytes.firstIndex(of: semicolon) else { return [] }
        var found: [String] = []
        while index < bytes.count {
            index += 1  // past the ";"
            while index < bytes.count && isSpace(bytes[index]) { index += 1 }
            let nameStart = index
            while index < bytes.count && bytes[index] != UInt8(ascii: "=") && bytes[index] != semicolon { index += 1 }
            let name = String(decoding: bytes[nameStart..<index], as: UTF8.self).trimmingCharacters(in: .whitespaces)
            guard index < bytes.count, bytes[index] == UInt8(ascii: "=") else { continue }  // no value: at the next ";" or the end
            index += 1
            while index < bytes.count && isSpace(bytes[index]) { index += 1 }  // not in RFC 9110, but unambiguous
            var value: [UInt8] = []
            if index < bytes.count && bytes[index] == quote {
                index += 1
                while index < bytes.count && bytes[index] != quote {
                    if bytes[index] == backslash && index + 1 < bytes.count { index += 1 }
                    value.append(bytes[index])
                    index += 1
                }
                while index < bytes.count && bytes[index] != semicolon { index += 1 }  // the closing quote and what follows it
            } else {
                while index < bytes.count && bytes[index] != semicolon && !isSpace(bytes[index]) {
                    value.append(bytes[index])
                    index += 1
                }
                while index < bytes.count && bytes[index] != semicolon { index += 1 }
            }
            if name.lowercased() == "charset" { found.append(String(decoding: value, as: UTF8.self)) }
        }
        return found
    }

    /// 413 `payload_too_large` naming the limit.
    /// - Parameters:
    ///   - path: the request path (the metrics label).
    ///   - limit: the largest body accepted, in bytes.
    /// - Returns: the error response.
    public func payloadTooLarge(path: String, limit: Int) -> HTTPResponse {
        respond(.failure(APIError(.payloadTooLarge, "the request body is over \(limit) bytes")))
    }

    /// Answers a complete request: `/healthz` (`{"status":"ok"}`), `/readyz`
    /// (200, or 503 with `Retry-After: 5`), `/metrics` (Prometheus text format
    /// 0.0.4), `/v1/keys`, and the signing endpoints; a failure becomes the
    /// contract's JSON error body. The server counts each response it sends
    /// (``sent(status:path:)``).
    /// - Parameter request: the request, body read in full.
    /// - Returns: the response.
    public func handle(_ request: HTTPRequest) -> HTTPResponse {
        // The watchdog answers this request at sign_timeout_ms after its arrival; no PKCS#11 work starts later.
        RequestDeadline.$current.withValue(request.receivedAt + UInt64(signTimeoutSeconds * 1e9)) { route(request) }
    }

    /// Reads `request`'s body with `read` under ``bodyReading``: a large
    /// body waits for a slot until the request's deadline.
    /// - Throws: what `read` throws; 503 when the deadline passed first.
    func read<R>(_ request: HTTPRequest, _ read: () throws(APIError) -> R) throws(APIError) -> R {
        try bodyReading.run(bodyBytes: request.body.count, deadline: RequestDeadline.current, read)
    }

    /// ``handle(_:)`` under the request's ``RequestDeadline``.
    private func route(_ request: HTTPRequest) -> HTTPResponse {
        guard let route = Route(path: request.path) else {
            return respond(.failure(APIError(.notFound, "no endpoint at \(request.path)")))
        }
        let config = configuration
        // Checked again with the configuration this request is served under:
        // a reload between the head and the body may have revoked the caller.
        if let refused = refuseIfNotAllowed(request.peer, path: request.path, config) { return refused }
        let result: Result<HTTPResponse, APIError>
        switch route {
        case .healthz:
            result = .success(HTTPResponse(status: 200, body: Self.healthyBody))
        case .readyz:
            let (ready, body) = checkReadiness(config)
            var response = json(ready ? 200 : 503, body)
            if !ready { response.headers.append(("Retry-After", "5")) }
            result = .success(response)
        case .metrics:
            // Only what is cached: /metrics runs on an HTTP thread and must never wait for the token.
            let keys = config.keys.filter { token.cachedPublicKey(keyID: $0.keyID) != nil }.count
            result = .success(HTTPResponse(status: 200, contentType: "text/plain; version=0.0.4; charset=utf-8",
                                           body: Array(metrics.render(token: token, keys: keys).utf8)))
        case .keys:
            result = .success(json(200, listKeys(config)))
        case .promotionalOffer:
            result = Result { () throws(APIError) in json(200, try signPromotionalOffer(request, config)) }
        case .offers:
            result = Result { () throws(APIError) in json(200, try signOffers(request, config)) }
        case .promotionalOfferV2, .introductoryOfferEligibility, .advancedCommerceRequest, .serverAPIToken:
            result = Result { () throws(APIError) in try signJWS(route, request, config) }
        }
        return respond(result)
    }

    /// The response for `result`. Not counted here: the server reports
    /// each response it sends through ``sent(status:path:)``.
    private func respond(_ result: Result<HTTPResponse, APIError>) -> HTTPResponse {
        switch result {
        case .success(let value): value
        case .failure(let error): HTTPResponse(error: error)
        }
    }

    /// Whether `peer` may use signerd at all: root, signerd's own uid, or a
    /// uid or group the configuration allows (as ``preflight(method:path:contentTypes:contentLength:peer:)``
    /// checks per request).
    /// - Parameter peer: the connection's credentials; nil (unreadable) may not.
    /// - Returns: false for a peer whose every request would get 403.
    public func mayConnect(_ peer: PeerCredentials?) -> Bool {
        guard let peer else { return false }
        return isAllowed(peer, configuration)
    }

    /// Counts a response sent in `signerd_requests_total`, by endpoint (an
    /// unknown path as `other`) and status.
    /// - Parameters:
    ///   - status: the HTTP status sent.
    ///   - path: the request path.
    public func sent(status: Int, path: String) {
        metrics.countRequest(route: Route(path: path), status: status)
    }

    private static let healthyBody = Array(#"{"status":"ok"}"#.utf8)

    func json(_ status: Int, _ value: some Encodable) -> HTTPResponse {
        HTTPResponse(status: status, body: WireJSON.encode(value))
    }

    // MARK: Who may call

    /// 403 `forbidden` (counted, and logged as `peer_forbidden`, throttled)
    /// for a peer `config` does not allow; nil for one it allows.
    private func refuseIfNotAllowed(_ peer: PeerCredentials, path: String, _ config: SignerConfiguration) -> HTTPResponse? {
        guard !isAllowed(peer, config) else { return nil }
        metrics.count("forbidden")
        forbiddenWarnings.admit(uid: peer.uid) { suppressed in
            logger.warning("peer_forbidden", ["peer.uid": .int(Int64(peer.uid)), "peer.gid": .int(Int64(peer.gid)), "peer.pid": .int(Int64(peer.pid)),
                                              "http.path": .string(path), "suppressed_before": .int(Int64(suppressed))])
        }
        return respond(.failure(APIError(.forbidden, "uid \(peer.uid) may not use signerd; add it to allowed_uids or its group to allowed_gids")))
    }

    func isAllowed(_ peer: PeerCredentials, _ config: SignerConfiguration) -> Bool {
        if peer.uid == 0 || peer.uid == ownUID || config.allowedUIDs.contains(peer.uid) || config.allowedGIDs.contains(peer.gid) {
            return true
        }
        guard !config.allowedGIDs.isEmpty else { return false }
        // The groups the calling process has (a unit's SupplementaryGroups=
        // included), as the kernel checked them against the socket file's
        // mode; the user database only when the kernel cannot say.
        return (peer.groups ?? supplementaryGroups(of: peer.uid)).contains { config.allowedGIDs.contains($0) }
    }

    /// The groups of the peer's user (`getgrouplist`), cached for a minute:
    /// for a kernel without `SO_PEERGROUPS` (before Linux 4.13).
    private func supplementaryGroups(of uid: UInt32) -> [UInt32] {
        let now = MonotonicClock.now()
        if let cached = groupCache.withLock({ $0[uid] }), MonotonicClock.nanoseconds(from: cached.at, to: now) < 60_000_000_000 {
            return cached.groups
        }
        // getpwuid_r, not getpwuid: connection threads and the accepting
        // thread ask at once, and getpwuid returns one static buffer.
        var storage = [CChar](repeating: 0, count: 16 * 1024)
        // pw_name points into `storage`: use it inside the closure only.
        let groups: [UInt32] = storage.withUnsafeMutableBufferPointer { buffer in
            var entry = passwd()
            var result: UnsafeMutablePointer<passwd>?
            guard let base = buffer.baseAddress, getpwuid_r(uid, &entry, base, buffer.count, &result) == 0, result != nil, let name = entry.pw_name else { return [] }
            var count: Int32 = 64
            var list = [gid_t](repeating: 0, count: Int(count))
            guard getgrouplist(name, entry.pw_gid, &list, &count) >= 0 else { return [] }
            return Array(list.prefix(Int(count)))
        }
        groupCache.withLock { $0[uid] = (groups, now) }
        return groups
    }

    /// A token bucket per uid; nil when the request may go ahead. signerd's
    /// own watchdog check (a connection from this process) is never
    /// limited: clients of signerd's uid over the limit would otherwise stop
    /// its `WATCHDOG=1` pings, and systemd would kill a healthy daemon.
    private func rateLimit(_ peer: PeerCredentials, _ config: SignerConfiguration) -> APIError? {
        guard config.rateLimitPerSecond > 0, !peer.isThisProcess else { return nil }
        let now = MonotonicClock.now()
        let allowed: Bool = rateBuckets.withLock { buckets in
            var bucket = buckets[peer.uid] ?? (config.rateLimitBurst, now)
            // Another thread may have stored a later instant after this one read the clock.
            bucket.tokens = min(config.rateLimitBurst, bucket.tokens + Double(MonotonicClock.nanoseconds(from: bucket.at, to: now)) / 1e9 * config.rateLimitPerSecond)
            bucket.at = max(bucket.at, now)
            let ok = bucket.tokens >= 1
            if ok { bucket.tokens -= 1 }
            buckets[peer.uid] = bucket
            return ok
        }
        guard !allowed else { return nil }
        metrics.count("rate_limited")
        var error = APIError(.rateLimited, "uid \(peer.uid) is over \(Int(config.rateLimitPerSecond)) requests per second (rate_limit_per_second)")
        error.retryAfter = 1
        return error
    }

    // MARK: Keys

    /// Chooses the key for a request: the one named (if configured, allowed
    /// for the bundle and the caller), else the only key serving the bundle,
    /// else the default key.
    /// - Throws: `invalid_field` (malformed key ID), `key_not_found` (404),
    ///   `bundle_not_allowed` (403), `forbidden` (403, per-key uid list:
    ///   field `key_id` for the key named, `bundle_id` when every key that
    ///   serves the bundle leaves the caller out),
    ///   `missing_field` (several keys serve the bundle and none is default).
    func resolveKey(bundleID: String, keyID: String?, peer: PeerCredentials, _ config: SignerConfiguration) throws(APIError) -> KeyConfiguration {
        func callerMay(_ key: KeyConfiguration) -> Bool {
            guard let uids = key.allowedUIDs else { return true }
            return peer.uid == 0 || peer.uid == ownUID || uids.contains(peer.uid)
        }
        /// Counts and logs a caller that per-key allow-lists leave out.
        func noteForbidden(_ keyIDs: String) {
            metrics.count("forbidden")
            forbiddenWarnings.admit(uid: peer.uid) { suppressed in
                logger.warning("peer_forbidden_for_key", ["peer.uid": .int(Int64(peer.uid)), "peer.pid": .int(Int64(peer.pid)), "key.id": .string(keyIDs),
                                                          "suppressed_before": .int(Int64(suppressed))])
            }
        }
        if let keyID {
            do { try AppleFields.checkKeyID(keyID) } catch { throw APIError(error) }
            guard let key = config.keys.first(where: { $0.keyID == keyID }) else {
                throw APIError(.keyNotFound, "key_id \(keyID) is not a key signerd is configured to use; GET /v1/keys lists the keys it serves (an operator adds one to keys[] in signerd.json and reloads)", field: "key_id")
            }
            guard key.allows(bundleID: bundleID) else {
                throw APIError(.bundleNotAllowed, "key \(keyID) may not sign for bundle_id \(bundleID); its bundle_ids are \(key.bundleIDs.joined(separator: ", "))", field: "bundle_id")
            }
            guard callerMay(key) else {
                noteForbidden(keyID)
                throw APIError(.forbidden, "uid \(peer.uid) may not use key \(keyID)", field: "key_id")
            }
            return key
        }
        let forBundle = config.keys.filter { $0.allows(bundleID: bundleID) }
        let serving = forBundle.filter(callerMay)
        if serving.count == 1 { return serving[0] }
        if serving.isEmpty && !forBundle.isEmpty {
            // Keys serve the bundle, but their allow-lists leave the caller
            // out: say so (and log it), rather than that no key exists.
            let keyIDs = forBundle.map(\.keyID).joined(separator: ", ")
            noteForbidden(keyIDs)
            throw APIError(.forbidden, "uid \(peer.uid) may use none of the keys that serve bundle_id \"\(bundleID)\" (\(keyIDs)): their allowed_uids leave it out", field: "bundle_id")
        }
        if serving.isEmpty {
            throw APIError(.bundleNotAllowed, "no configured In-App Purchase key may sign for bundle_id \"\(bundleID)\"", field: "bundle_id")
        }
        if let defaultKey = serving.first(where: { $0.keyID == config.defaultKeyID }) { return defaultKey }
        throw APIError(.missingField, "key_id is required: \(serving.count) keys serve bundle_id \(bundleID) (\(serving.map(\.keyID).joined(separator: ", "))) and none is default_key_id", field: "key_id")
    }

    /// How old, in seconds, the public key `GET /v1/keys` shows may be: it
    /// reads each key's objects on the token at most this often, so a
    /// replaced key shows soon without every listing calling the HSM.
    static let keyListingMaxAge = 5.0

    private func listKeys(_ config: SignerConfiguration) -> KeysResponse {
        KeysResponse(keys: config.keys.map { key in
            KeysResponse.Key(keyID: key.keyID, issuerID: key.issuerID ?? config.issuerID, bundleIDs: key.bundleIDs, curve: ECCurve.p256.rawValue,
                             publicKeyPEM: (try? token.currentPublicKey(keyID: key.keyID, maxAge: Self.keyListingMaxAge))?.pem, tokenLabel: token.label)
        })
    }

    // MARK: Signing

    /// Signs a SHA-256 digest with `keyID` and, when configured, verifies the
    /// signature with the key's public key before it may leave.
    /// A signature that does not verify (or whose key has no public key) is
    /// made again after the key's cached objects are forgotten, as
    /// ``HSMToken/prepareVerificationRetry(keyID:after:)`` paces it, for a
    /// key replaced on the token since they were read.
    /// - Returns: raw `r ‖ s` (64 bytes) and DER.
    /// - Throws: `hsm_unavailable` (503, with `Retry-After`), `key_not_found`,
    ///   `internal` (500) for a signature that did not verify (never returned).
    func sign(digest: [UInt8], keyID: String, _ config: SignerConfiguration, attempt: Int = 1,
              countingErrors: Bool = true) throws(APIError) -> (raw: [UInt8], der: [UInt8]) {
        let signature: TokenSignature
        do {
            signature = try token.sign(digest: digest, keyID: keyID)
        } catch {
            throw apiError(error, keyID: keyID, counting: countingErrors)
        }
        metrics.observe(signature)
        let der: [UInt8]
        do {
            der = try ECDSASignature.der(fromRaw: signature.raw, curve: .p256)
        } catch {
            metrics.count("verification_failures")
            logger.error("signature_malformed", ["key.id": .string(keyID), "raw.bytes": .int(Int64(signature.raw.count))])
            throw APIError(.internalError, "the token returned a malformed signature; nothing was returned")
        }
        if config.verifyBeforeReturn {
            var verified = false
            var keyProblem: HSMError?
            do {
                // The key that signed, not a second look-up: during an outage
                // that could find the key gone and answer 404 for a signature made.
                verified = try token.signingPublicKey(signature, keyID: keyID).verify(derSignature: der, digest: digest)
            } catch {
                keyProblem = error  // no public key object found with the key
            }
            guard verified else {
                // Cached key objects older than a key replaced on the token
                // (or found while its public key object was between two
                // writes) are looked up again before a failure is declared:
                // at once, then once more after 50 ms, in case the
                // replacement (`keys import --replace` in another process)
                // was still being written.
                if token.prepareVerificationRetry(keyID: keyID, after: attempt) {
                    return try sign(digest: digest, keyID: keyID, config, attempt: attempt + 1, countingErrors: countingErrors)
                }
                if let keyProblem { throw apiError(keyProblem, keyID: keyID, counting: countingErrors) }
                metrics.count("verification_failures")
                logger.error("signature_not_verified", ["key.id": .string(keyID), "token.label": .string(token.label)])
                throw APIError(.internalError, "the signature made by the token did not verify with key \(keyID)'s public key; it was not returned")
            }
        }
        return (signature.raw, der)
    }

    /// `Retry-After` in seconds while the token refuses signerd's PIN: an
    /// operator has to act, so clients are asked to wait longer than for a
    /// passing fault (1 s).
    public static let pinRejectedRetryAfter = 30

    /// The answer for a failed signing call; `counting` false for a call
    /// whose failure the request does not answer with (`signerd_hsm_errors_total`
    /// counts "signing failures answered with an error").
    func apiError(_ error: HSMError, keyID: String, counting: Bool = true) -> APIError {
        // Not an HSM error: the request never reached the token.
        if error.code == .requestExpired {
            // Late for its next signature after others were made (a batch, a signature made again after a failed verification), or before it asked the token for anything.
            return RequestDeadline.progress?.hasReachedToken == true ? Self.ranOutBetweenSignaturesError : Self.stillCheckingError
        }
        if counting { metrics.countHSMError(error.returnValue?.name ?? error.code.rawValue) }
        switch error.code {
        case .keyNotFound:
            return APIError(.keyNotFound, "key \(keyID) is configured but not on token \(token.label); import it with signctl keys import", field: "key_id")
        case .pinRejected:
            // Not a passing fault: no login is tried again until an operator
            // reloads with a PIN the token takes, so "retry later" would
            // only send clients round a loop.
            var api = APIError(.hsmUnavailable, "the HSM cannot sign: token \(token.label) refused signerd's PIN or reports it locked (\(error.returnValue?.name ?? error.code.rawValue)), so signerd is not logged in; retrying will not help until an operator fixes or unlocks signerd's PIN and reloads signerd")
            api.retryAfter = Self.pinRejectedRetryAfter
            return api
        case let code where HSMError.Code.tokenProblems.contains(code) || code == .pkcs11Failure:
            if error.code == .sessionUnavailable { _ = markDownIfNoSessionReturned() }
            var api = APIError(.hsmUnavailable, "the HSM cannot sign right now (\(error.returnValue?.name ?? error.code.rawValue)); retry later")
            api.retryAfter = max(1, Int((error.retryAfter ?? 1).rounded(.up)))
            return api
        case .keyInvalid:
            logger.error("sign_error", ["key.id": .string(keyID), "error": .string(error.code.rawValue), "detail": .string(error.message)])
            // The token's own account of what is wrong with the key (key IDs,
            // the token label, what to import): no secret, and what the
            // caller's operator needs.
            var api = APIError(.internalError, "key \(keyID) is unusable on the token: \(error.message)")
            api.keyUnusable = true
            return api
        default:
            logger.error("sign_error", ["key.id": .string(keyID), "error": .string(error.code.rawValue), "detail": .string(error.message)])
            return APIError(.internalError, "key \(keyID) cannot sign: \(error.code)")
        }
    }

    /// `POST /v1/sign/promotional-offer`.
    func signPromotionalOffer(_ request: HTTPRequest, _ config: SignerConfiguration) throws(APIError) -> PromotionalOfferResponse {
        let fields = try read(request) { () throws(APIError) in try PromotionalOfferRequest(body: request.body) }
        let now = AppleFields.nowMilliseconds()
        let payload: PromotionalOfferPayload
        do {
            if let timestamp = fields.timestamp {
                try AppleFields.checkTimestamp(timestamp, now: now)
            }
            try AppleFields.checkIdentifier(fields.bundleID, field: "bundle_id")
            if let keyID = fields.keyID { try AppleFields.checkKeyID(keyID) }
            // Check every field before choosing a key, so a bad value is a 400 whatever the key.
            payload = try PromotionalOfferPayload(
                bundleID: fields.bundleID, keyID: fields.keyID ?? "AAAAAAAAAA", productID: fields.productID, offerID: fields.offerID,
                appAccountToken: fields.appAccountToken ?? "", nonce: fields.nonce ?? AppleFields.randomUUID(), timestamp: fields.timestamp ?? now)
        } catch {
            throw APIError(error)
        }
        let key = try resolveKey(bundleID: fields.bundleID, keyID: fields.keyID, peer: request.peer, config)
        let signed = try signClassic(payload, keyID: key.keyID, config)
        try auditClassic(request, config, bundleID: fields.bundleID, productID: fields.productID, offerID: fields.offerID, signed)
        return signed.response
    }

    /// With `audit_log`, the `signature_issued` line of a classic signature
    /// (a single one, or one offer of a `/v1/offers` batch).
    /// - Throws: 503 `audit_log_unwritable` when the line was not written.
    private func auditClassic(_ request: HTTPRequest, _ config: SignerConfiguration, bundleID: String, productID: String, offerID: String,
                              _ signed: ClassicSignature) throws(APIError) {
        guard config.auditLog else { return }
        let answer = signed.response
        try audit(request, keyID: answer.keyID, bundleID: bundleID, signature: signed.der, [
            ("product.id", .string(productID)), ("offer.id", .string(offerID)), ("nonce", .string(answer.nonce)),
            ("timestamp", .int(answer.timestamp)), ("app_account_token.set", .bool(!answer.appAccountToken.isEmpty)),
        ])
    }

    /// Writes the `audit_log_changed` line into the trail itself, whatever
    /// `log_level` hides: where the trail begins (signerd's start with
    /// `audit_log` on, before the HTTP server starts) and each reload that
    /// turns it on or off, so that auditing turned off leaves a trace.
    /// - Parameters:
    ///   - on: the `audit_log` value from now on.
    ///   - reason: `start` or `reload`.
    public func noteAuditTrail(on: Bool, reason: String) {
        _ = logger.audit("audit_log_changed", fields: [("audit_log", .bool(on)), ("reason", .string(reason)), ("pid", .int(Int64(getpid())))])
    }

    /// Writes the `audit_log` line `signature_issued` for a signature about
    /// to be returned: who asked (the connection's `SO_PEERCRED` uid and
    /// pid), the endpoint, the key and bundle IDs, then `details`, then
    /// `signature.sha256`. Callers check `config.auditLog` first, so that
    /// an audit left off costs nothing. Never a secret, nor the signature
    /// itself (whoever reads the log could redeem an offer not yet used):
    /// identifiers, the nonce, times and the signature's SHA-256.
    /// - Parameters:
    ///   - request: the request being answered.
    ///   - keyID: the key that signed.
    ///   - bundleID: the bundle ID signed for.
    ///   - signature: the signature's bytes as returned (DER for the
    ///     classic kind, raw `r ‖ s` in a JWS), hashed into `signature.sha256`.
    ///   - details: what identifies this signature, by endpoint.
    /// - Throws: 503 `audit_log_unwritable` (counted in
    ///   `signerd_audit_write_failures_total`) when standard error did not
    ///   take the line: the signature must then not be returned.
    func audit(_ request: HTTPRequest, keyID: String, bundleID: String, signature: [UInt8], _ details: [(key: String, value: LogValue)]) throws(APIError) {
        let written = logger.audit("signature_issued", fields: [
            ("peer.uid", .int(Int64(request.peer.uid))), ("peer.pid", .int(Int64(request.peer.pid))), ("http.path", .string(request.path)),
            ("key.id", .string(keyID)), ("bundle.id", .string(bundleID)),
        ] + details + [("signature.sha256", .string(SHA256.hash(signature).hexString))])
        guard written else {
            metrics.count("audit_write_failures")
            var error = APIError(.auditLogUnwritable, "the signature was made but its audit line (audit_log) could not be written to signerd's standard error, so it is not returned; "
                                 + "the operator must free the log's disk or pipe; retry later")
            error.retryAfter = 1
            throw error
        }
    }

    /// A classic signature as answered, with the DER bytes its Base64 holds.
    struct ClassicSignature {
        var response: PromotionalOfferResponse
        var der: [UInt8]
    }

    private func signClassic(_ checked: PromotionalOfferPayload, keyID: String, _ config: SignerConfiguration) throws(APIError) -> ClassicSignature {
        let payload: PromotionalOfferPayload
        do {
            payload = try checked.signed(by: keyID)
        } catch {
            throw APIError(error)
        }
        let digest = SHA256.hash(payload.payload)
        let started = MonotonicClock.now()
        var signature = try sign(digest: digest, keyID: keyID, config)
        let took = MonotonicClock.now() - started
        // When r or s is below 2²⁴⁷ and the other below 2²⁵⁵ (about one
        // signature in 512) the DER is shorter than the 70–72 bytes (96
        // Base64 characters) Apple's format documents. It is a valid
        // signature, but clients that check the documented length refuse
        // it: sign again, with the token's fresh random k, over the same
        // payload. The short one is kept if signing again fails (the token
        // went down), gives the same signature (an HSM with deterministic k,
        // RFC 6979, would give it every time), or might not finish before
        // the request's deadline (twice what the first signature took).
        var attempts = 1
        while signature.der.count < Self.classicDERMinimumBytes && attempts < Self.classicSignAttempts {
            if let deadline = RequestDeadline.current, MonotonicClock.now() + 2 * took > deadline { break }
            attempts += 1
            // A failure here is not the request's answer (the short signature is), so it is not counted.
            guard let again = try? sign(digest: digest, keyID: keyID, config, countingErrors: false), again.raw != signature.raw else { break }
            signature = again
        }
        let der = signature.der
        return ClassicSignature(response: PromotionalOfferResponse(keyID: keyID, appAccountToken: payload.appAccountToken, nonce: payload.nonce,
                                                                   timestamp: payload.timestamp, signature: Data(der).base64EncodedString()),
                                der: der)
    }

    /// The shortest DER signature a classic kind returns: 70 bytes, which
    /// Base64 writes in 96 characters (apple-signatures.md: "70–72 bytes").
    static let classicDERMinimumBytes = 70
    /// How many signatures a classic request makes at most to get one of
    /// ``classicDERMinimumBytes`` or more; the last is returned whatever its
    /// length (eight short ones in a row happen once in 10²¹ requests), and
    /// a short one when signing again fails or repeats it.
    static let classicSignAttempts = 8

    /// `POST /v1/offers` (RevenueCat SDK batch): each offer succeeds or fails
    /// on its own: 7226 for an entry that breaks a field rule (the message
    /// names the field), 7234 when no usable key serves the bundle (none
    /// configured or chosen, not on the token, or unusable there:
    /// HSM `key_invalid`). A malformed request (bundle ID, `app_user_id`, the array itself, an
    /// unknown member in any entry) or an unavailable HSM fails the whole
    /// request.
    func signOffers(_ request: HTTPRequest, _ config: SignerConfiguration) throws(APIError) -> OffersResponse {
        let fields = try read(request) { () throws(APIError) in try OffersRequest(body: request.body) }
        var token = ""
        do {
            try AppleFields.checkIdentifier(fields.bundleID, field: "bundle_id")
            if (try? AppleFields.normalizeUUID(fields.appUserID, field: "app_user_id")) != nil {
                token = try AppleFields.normalizeAppAccountToken(fields.appUserID)
            }
        } catch {
            throw APIError(error)
        }
        let key = try? resolveKey(bundleID: fields.bundleID, keyID: nil, peer: request.peer, config)
        // Set once the key turns out to be missing from the token or
        // unusable: every offer shares the key, so the rest get the same
        // answer without asking the token again.
        let noKey = OffersResponse.SignatureError(code: OffersResponse.noKeyCode, message: "no In-App Purchase key for this app")
        var keyProblem: OffersResponse.SignatureError? = key == nil ? noKey : nil
        var results: [OffersResponse.Offer] = []
        for offer in fields.generateOffers {
            if let problem = offer.problem {
                results.append(.init(keyID: nil, offerID: offer.offerID, productID: offer.productID, signatureData: nil,
                                     signatureError: .init(code: OffersResponse.invalidOfferCode, message: problem.message)))
                continue
            }
            guard let key, keyProblem == nil else {
                results.append(.init(keyID: nil, offerID: offer.offerID, productID: offer.productID, signatureData: nil, signatureError: keyProblem))
                continue
            }
            do {
                let payload = try PromotionalOfferPayload(
                    bundleID: fields.bundleID, keyID: key.keyID, productID: offer.productID, offerID: offer.offerID,
                    appAccountToken: token, nonce: AppleFields.randomUUID(), timestamp: AppleFields.nowMilliseconds())
                let classic = try signClassic(payload, keyID: key.keyID, config)
                try auditClassic(request, config, bundleID: fields.bundleID, productID: offer.productID, offerID: offer.offerID, classic)
                let signed = classic.response
                results.append(.init(keyID: key.keyID, offerID: offer.offerID, productID: offer.productID,
                                     signatureData: .init(nonce: signed.nonce, signature: signed.signature, timestamp: signed.timestamp),
                                     signatureError: nil))
            } catch let error as APIError where error.code == .keyNotFound || error.keyUnusable {
                // The contract's one message for 7234 (docs/API.md: the single-signature endpoints name the case).
                keyProblem = noKey
                results.append(.init(keyID: nil, offerID: offer.offerID, productID: offer.productID, signatureData: nil, signatureError: noKey))
            } catch let error as APIError {
                throw error
            } catch {
                throw APIError(.internalError, "\(error)")
            }
        }
        return OffersResponse(offers: results)
    }

    // MARK: Readiness

    /// Whether an idle-token check is due: `token_check_seconds` is not 0,
    /// a key is configured, the token is up, no session is out (no call in
    /// the module, however slow), and no PKCS#11 call has come back from
    /// the module for `token_check_seconds` (requests, readiness probes and
    /// recovery all count). Reads a clock and two locks; no PKCS#11 call.
    public var tokenCheckDue: Bool {
        let config = configuration
        let seconds = config.tokenCheckSeconds
        return seconds > 0 && !config.keys.isEmpty && token.status == .up && token.sessionUsage.inUse == 0
            && !token.sessionReturned(withinSeconds: Double(seconds))
    }

    /// Runs the readiness check (every key signs a test digest that must
    /// verify) when ``tokenCheckDue``, never answered from the readiness
    /// cache (`readiness_cache_seconds` would otherwise stretch the
    /// interval). Without it an idle daemon learns of an outage only from
    /// its next request: `signerd_token_up` says 1 and recovery waits
    /// meanwhile. A failing check marks the token down and starts
    /// recovery, as a failing `/readyz` probe does.
    /// - Returns: whether a check ran.
    @discardableResult
    public func checkTokenIfIdle() -> Bool {
        guard tokenCheckDue else { return false }
        _ = checkReadiness(configuration, reusingCache: false)
        return true
    }

    /// Every configured key signs a random digest that must verify with its
    /// public key; the result is reused for `readiness_cache_seconds` so
    /// probes cannot load the HSM, and only one check runs at a time.
    /// With `reusingCache` false a cached result made before the call is
    /// not taken (one from a check that was running meanwhile is).
    func checkReadiness(_ config: SignerConfiguration, reusingCache: Bool = true) -> (Bool, ReadinessResponse) {
        let maxAge = UInt64(config.readinessCacheSeconds * 1e9)
        let keyIDs = config.keys.map(\.keyID)
        // A cached answer holds while it is young, the token has not changed
        // state since the check began, and it checked the keys configured
        // now. The time the token last went down counts as state: a check
        // whose own C_Sign took the token down began under "up", and after
        // recovery the status alone would match again.
        func fresh() -> (Bool, ReadinessResponse)? {
            guard let cached = readiness.withLock({ $0 }), MonotonicClock.nanoseconds(from: cached.checkedAt, to: MonotonicClock.now()) <= maxAge,
                  cached.status == token.status, cached.downAt == token.lastDownAt, cached.keyIDs == keyIDs else { return nil }
            return (cached.ready, cached.response)
        }
        // Probes wait for a check already running and share its result, but
        // not past sign_timeout_ms from its start: a check still running then
        // is stuck in a call the watchdog writes off, and a probe waiting
        // behind it until its own deadline would get the watchdog's 503,
        // which marks the token down again.
        // A stuck check whose call was written off, the token having been
        // marked down and come back since it began, answers for nothing: a
        // new check takes its place (a call that never returns would
        // otherwise keep /readyz at 503 for good).
        let limit = UInt64(signTimeoutSeconds * 1e9)
        var waited = false
        while true {
            if reusingCache || waited, let cached = fresh() { return cached }
            enum Turn { case mine(UInt64), again, stuck(UInt64) }
            let turn: Turn = readinessRun.lock.withLock {
                let now = MonotonicClock.now()
                if let started = readinessRun.startedAt {
                    let superseded = now >= started + limit && token.status == .up && token.lastDownAt > started
                    if !superseded {
                        if now >= started + limit { return .stuck(started) }
                        readinessRun.lock.wait(untilMonotonic: started + limit)
                        return .again
                    }
                }
                readinessRun.startedAt = now
                readinessRun.runID &+= 1
                return .mine(readinessRun.runID)
            }
            switch turn {
            case .again:
                waited = true
                continue
            case .stuck(let started):
                return stuckReadiness(config, runningMs: MonotonicClock.nanoseconds(from: started, to: MonotonicClock.now()) / 1_000_000)
            case .mine(let run):
                let status = token.status
                let downAt = token.lastDownAt
                let (ready, response) = runReadinessChecks(config)
                // A check superseded meanwhile neither caches its answer nor ends its successor's run.
                // The answer is cached before the run ends: a probe woken then must find it.
                readinessRun.lock.withLock {
                    if readinessRun.runID == run {
                        readiness.withLock { $0 = (response, ready, MonotonicClock.now(), status, downAt, keyIDs) }
                        readinessRun.startedAt = nil
                    }
                    readinessRun.lock.broadcast()
                }
                return (ready, response)
            }
        }
    }

    /// Not ready, on every key, because the readiness check before this one
    /// has been running for `runningMs` (past `sign_timeout_ms`).
    private func stuckReadiness(_ config: SignerConfiguration, runningMs: UInt64) -> (Bool, ReadinessResponse) {
        let reason = "a readiness check has been running for \(runningMs) ms (a PKCS#11 call did not return)"
        return notReady(reason, keys: Self.failing(config.keys, reason))
    }

    /// Every key in `keys` as failed for `reason`, checked now.
    private static func failing(_ keys: [KeyConfiguration], _ reason: String) -> [ReadinessResponse.Key] {
        let now = AppleFields.nowMilliseconds()
        return keys.map { .init(keyID: $0.keyID, ok: false, lastCheckMs: now, error: reason) }
    }

    /// The not-ready answer: `reason` as the status reason and as the error (`hsm_unavailable`).
    private func notReady(_ reason: String, keys: [ReadinessResponse.Key]) -> (Bool, ReadinessResponse) {
        (false, ReadinessResponse(status: "not_ready", reason: reason, keys: keys,
                                  error: .init(code: APIError.Code.hsmUnavailable.rawValue, message: reason)))
    }

    private func runReadinessChecks(_ config: SignerConfiguration) -> (Bool, ReadinessResponse) {
        let now = AppleFields.nowMilliseconds()
        var keys: [ReadinessResponse.Key] = []
        var failures: [String] = []
        if config.keys.isEmpty {
            failures.append("no keys configured")
        }
        let tokenProblem: String?
        // A probe, too, starts recovery again when its thread could not be made.
        switch token.statusForRequest() {
        case .down(let reason): tokenProblem = "token missing or unavailable (\(reason)); recovery is running"
        case .pinRejected(let rv): tokenProblem = "not logged in: the token refused the PIN (\(rv.name)); fix the PIN source and reload"
        case .up: tokenProblem = nil
        }
        if let tokenProblem {
            failures.append(tokenProblem)
            keys = Self.failing(config.keys, tokenProblem)
        } else {
            for key in config.keys {
                do {
                    try token.selfTest(keyID: key.keyID)
                    keys.append(.init(keyID: key.keyID, ok: true, lastCheckMs: now))
                } catch {
                    let reason: String
                    switch error.code {
                    case .keyNotFound: reason = "key missing from token \(token.label)"
                    case .keyInvalid: reason = "key unusable: \(error.message)"
                    case .verificationFailed: reason = "signature did not verify with the public key"
                    case .tokenUnavailable: reason = "token missing or unavailable"
                    case .pinRejected: reason = "not logged in (PIN refused)"
                    default: reason = error.returnValue?.name ?? error.code.rawValue
                    }
                    keys.append(.init(keyID: key.keyID, ok: false, lastCheckMs: now, error: reason))
                    failures.append("\(key.keyID): \(reason)")
                }
            }
        }
        if failures.isEmpty {
            return (true, ReadinessResponse(status: "ready", keys: keys))
        }
        return notReady(failures.joined(separator: "; "), keys: keys)
    }
}

/// One readiness check at a time: when the running one began, and the lock
/// whose condition wakes the probes waiting for its result.
private final class ReadinessRun: @unchecked Sendable {
    // `startedAt` is only touched with `lock` held.
    let lock = ConditionLock()
    /// ``MonotonicClock`` nanoseconds when the running check began; nil when none runs.
    var startedAt: UInt64?
    /// Which check is the running one: a stuck check superseded by a new one
    /// finds a different number when it returns at last.
    var runID: UInt64 = 0
}
