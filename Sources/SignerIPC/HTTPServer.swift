// HTTP/1.1 on the Unix socket, parsed by libmicrohttpd. This file owns the
// MHD daemon and its callbacks; no MHD type leaves it.
internal import CMicroHTTPD
internal import CSignerShim
import HSMSigner
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// A request as the handler sees it: the head, the whole body, and who sent it.
public struct HTTPRequest: Sendable {
    /// `GET`, `POST`, …
    public var method: String
    /// The path without the query string.
    public var path: String
    /// The `Content-Type` header, if any.
    public var contentType: String?
    /// The body (at most the configured limit).
    public var body: [UInt8]
    /// The peer's credentials from `SO_PEERCRED`.
    public var peer: PeerCredentials
    /// When the request had fully arrived (``MonotonicClock`` nanoseconds).
    public var receivedAt: UInt64

    /// Makes a request.
    public init(method: String, path: String, contentType: String? = nil, body: [UInt8] = [], peer: PeerCredentials, receivedAt: UInt64 = MonotonicClock.now()) {
        self.method = method
        self.path = path
        self.contentType = contentType
        self.body = body
        self.peer = peer
        self.receivedAt = receivedAt
    }
}

/// A response: status, extra headers, body (JSON unless said otherwise).
public struct HTTPResponse: Sendable {
    /// The HTTP status code.
    public var status: Int
    /// The `Content-Type`.
    public var contentType: String
    /// Extra headers (`Retry-After`, `Allow`).
    public var headers: [(String, String)]
    /// The body bytes.
    public var body: [UInt8]

    /// Makes a response.
    public init(status: Int, contentType: String = "application/json", headers: [(String, String)] = [], body: [UInt8]) {
        self.status = status
        self.contentType = contentType
        self.headers = headers
        self.body = body
    }

    /// The contract's error response for `error`, with `Retry-After` when set.
    public init(error: APIError) {
        var headers: [(String, String)] = []
        if let retryAfter = error.retryAfter { headers.append(("Retry-After", String(retryAfter))) }
        self.init(status: error.status, headers: headers, body: Array(error.jsonBody.utf8))
    }
}

/// What the server asks of the application.
public protocol HTTPHandler: Sendable {
    /// Called once the request head is in, before any body is read. A
    /// response returned here is sent at once and the body is not read
    /// (403 for a peer not allowed, 404, 405, 413 by `Content-Length`, 415).
    ///
    /// `contentTypes` holds every `Content-Type` header's value, in order
    /// (RFC 9110 §8.3 allows one); `contentCodings` every
    /// `Content-Encoding` header's value (RFC 9110 §8.4), in order.
    func preflight(method: String, path: String, contentTypes: [String], contentCodings: [String], contentLength: Int?, peer: PeerCredentials) -> HTTPResponse?
    /// Handles a complete request on its connection's thread. When
    /// ``mayBlock(path:)`` says so it may block in PKCS#11, and the watchdog
    /// answers for it if it is still inside at the signing timeout.
    func handle(_ request: HTTPRequest) -> HTTPResponse
    /// The response for a body over the limit.
    func payloadTooLarge(path: String, limit: Int) -> HTTPResponse
    /// Whether a request to `path` may block in PKCS#11, and so runs under
    /// the signing timeout; false for requests that never wait.
    func mayBlock(path: String) -> Bool
    /// The answer the watchdog sends for a request to `path` still not
    /// answered at the signing timeout (sent with `Connection: close`);
    /// `reachedToken` tells whether the request had asked the token for
    /// anything (``RequestProgress``), or was still being read and checked.
    func timedOut(path: String, reachedToken: Bool) -> HTTPResponse
    /// Called by the request watchdog a few times a second (the application
    /// writes off calls that hang there).
    func watchdogTick()
    /// Whether `peer` may use the server at all. A peer that may not (every
    /// request of its gets 403) may hold at most
    /// ``HTTPServerOptions/forbiddenConnectionsPerUID`` connections, so that
    /// it cannot take the slots of those that may.
    /// - Parameter peer: the connection's `SO_PEERCRED` credentials (nil: unreadable).
    func mayConnect(_ peer: PeerCredentials?) -> Bool
    /// Called once for each response the server sends: queued with
    /// libmicrohttpd, or written on the socket by the watchdog. A handler's
    /// response that is dropped because the watchdog already answered is
    /// not reported, so a request is never counted twice.
    /// - Parameters:
    ///   - status: the HTTP status sent.
    ///   - path: the request path.
    func sent(status: Int, path: String)
}

/// Limits of the server. Each connection has its own thread
/// (libmicrohttpd's `MHD_USE_THREAD_PER_CONNECTION`), which reads the
/// request, runs the handler and writes the response.
public struct HTTPServerOptions: Sendable {
    /// Most connections (and so connection threads) at once.
    public var connectionLimit = 1024
    /// Most connections one uid (from `SO_PEERCRED`) may hold at once; a
    /// further one is answered 429 and closed on arrival. By default equal
    /// to ``connectionLimit``: one uid may hold them all. Lower, it keeps
    /// one client from taking every slot from the others.
    public var connectionsPerUIDLimit = 1024
    /// Most connections a uid that may not use the server at all
    /// (``HTTPHandler/mayConnect(_:)`` false) may hold at once; enough to be
    /// told 403.
    public var forbiddenConnectionsPerUID = 4
    /// Connections beyond ``connectionLimit`` kept for root and the
    /// server's own uid (the systemd watchdog's `/healthz` check, an
    /// operator), so that other clients can never take every slot.
    public var reservedConnections = 8
    /// Every connection slot libmicrohttpd is given: ``connectionLimit``,
    /// the ``reservedConnections`` and one more that only this process's
    /// own connection (its watchdog check) may take.
    public var connectionSlots: Int { connectionLimit + reservedConnections + 1 }
    /// Idle keep-alive connections are closed after this many seconds.
    public var idleTimeoutSeconds = 60
    /// A request still arriving after this many seconds (from its request
    /// line) is dropped, and so is a connection whose request line is still
    /// incomplete ``idleTimeoutSeconds`` plus this many seconds after it
    /// connected or its last request ended (libmicrohttpd reports nothing
    /// earlier than a whole request line).
    public var requestTimeoutSeconds = 10.0
    /// Largest body in bytes (413 above).
    public var maxBodyBytes = 64 * 1024
    /// Largest declared body (`Content-Length`) over ``maxBodyBytes`` that
    /// is still read, and thrown away, before the 413: max(1 MiB, 16 ×
    /// ``maxBodyBytes``), in bytes. A client that writes its whole body
    /// before it reads (Python's `http.client`, `requests`) would otherwise
    /// fail to write once the socket buffers fill, and never see the 413.
    /// A larger declared body, or one sent with `Expect: 100-continue`, is
    /// answered from the head. A chunked body has its answer sent, and the
    /// connection closed, once more than this has arrived.
    public var drainedBodyLimit: Int { max(1024 * 1024, 16 * maxBodyBytes) }
    /// Largest request head (request line and headers) in bytes (431 above, from libmicrohttpd).
    public var maxHeaderBytes = 8 * 1024
    /// Seconds from the arrival of a request that may block to its answer
    /// (`sign_timeout_ms`); one still in its handler then is answered by the
    /// watchdog with ``HTTPHandler/timedOut(path:)``.
    public var signTimeoutSeconds = 5.0

    /// Default options.
    public init() {}
}

/// A request whose handler may block, while its connection's thread runs it.
struct BlockingCall {
    /// The request path, for the watchdog's answer.
    var path: String
    /// ``MonotonicClock`` nanoseconds after which the watchdog answers.
    var deadline: UInt64
    /// Set by the watchdog once it answered; the handler's own response is then dropped.
    var answered = false
    /// Whether the request has reached the token yet, for the watchdog's answer.
    let progress = RequestProgress()
}

/// One accepted connection: the peer, a private duplicate of its descriptor
/// (so a slow request can be cut with `shutdown(2)`, or a hung one answered,
/// without racing a reuse of the number), and when its current request began.
final class ConnectionState: Sendable {
    let peer: PeerCredentials?
    /// The peer's uid, `UInt32.max` when its credentials were unreadable.
    var uid: UInt32 { peer?.uid ?? UInt32.max }
    let descriptor: Int32
    /// `MonotonicClock` nanoseconds of the current request's request line; 0 between requests.
    let requestStarted = Atomic<UInt64>(0)
    /// `MonotonicClock` nanoseconds since which the connection has waited
    /// for a request line: its accept, or the end of its last request;
    /// 0 from a request line to that request's end.
    let waitingSince = Atomic<UInt64>(MonotonicClock.now())
    let dropped = Atomic<Bool>(false)
    /// The request in a handler that may block, if any.
    let blockingCall = Locked<BlockingCall?>(nil)
    /// Requests read in full whose handler has not returned yet: 0 or 1.
    /// Not counted to the end of the request: libmicrohttpd reports that
    /// only after the client may have read the answer, closed and
    /// connected again, and the old connection would still count.
    let requestsInHandler = Atomic<Int>(0)
    /// Taken from the listen backlog at shutdown and no request line seen
    /// yet: the drain waits for it (a while).
    let awaitingFirstRequest: Atomic<Bool>

    init(peer: PeerCredentials?, descriptor: Int32, adopted: Bool = false) {
        self.peer = peer
        self.descriptor = descriptor
        awaitingFirstRequest = Atomic(adopted)
    }
}

/// One request in progress.
final class RequestState: @unchecked Sendable {
    // Touched only by the MHD thread that owns the connection.
    let connection: ConnectionState?
    var path: String
    /// Bytes of the request target as sent, query string included.
    var targetBytes = 0
    var headProcessed = false
    /// Header lines, and cookies with query arguments, in libmicrohttpd's pool, counted with the head.
    var headRecords = (headers: 0, parsed: 0)
    var body: [UInt8] = []
    /// The body is over the limit: it is read and thrown away, and answered 413 once it has arrived.
    var tooLarge = false
    /// Bytes of body received so far, kept or thrown away.
    var received = 0
    var answered = false
    var processing = false
    /// An error found from the head of a request without a body, answered
    /// once libmicrohttpd has the whole request (queued earlier, it would
    /// close the keep-alive connection).
    var earlyAnswer: HTTPResponse?

    init(connection: ConnectionState?, path: String) {
        self.connection = connection
        self.path = path
    }
}

/// The HTTP/1.1 server on a listening Unix socket, built on libmicrohttpd
/// with one thread per connection. Keep-alive is the normal case.
///
/// A request runs on its connection's thread from the first byte to the
/// last, PKCS#11 call included: no hand-off between threads, so a signature
/// costs two wakeups (the request, the response), as in the
/// `p11-kit server` model, and a hung HSM call holds only its own
/// connection. A watchdog answers a request still in its handler at
/// ``HTTPServerOptions/signTimeoutSeconds`` with 503 and closes that
/// connection.
public final class HTTPServer: @unchecked Sendable {
    // `daemon` is set in start() and cleared in stop(), both called from
    // one controlling thread; callbacks only read immutable fields and
    // the Mutex/Atomic ones.
    private var daemon: OpaquePointer?
    private let listenDescriptor: Int32
    let options: HTTPServerOptions
    let handler: any HTTPHandler
    let logger: Logger
    let metrics: Metrics?
    private let connections = Locked<[ObjectIdentifier: ConnectionState]>([:])
    /// Keeps a flood of refused connections or malformed requests from flooding the log.
    private let libraryWarnings = LogThrottle(linesPerWindow: 20, windowSeconds: 10)
    private let refusalWarnings = LogThrottle(linesPerWindow: 5, windowSeconds: 10)
    private let slowWarnings = LogThrottle(linesPerWindow: 10, windowSeconds: 10)
    private let processing = Atomic<Int>(0)
    /// Set when draining: responses carry `Connection: close`.
    let draining = Atomic<Bool>(false)
    /// Set when ``stop()`` closes every connection (`MHD_stop_daemon`).
    let closingConnections = Atomic<Bool>(false)
    private let supervising = Atomic<Bool>(false)

    /// Prepares a server on an already listening socket (from ``UnixListener`` or systemd).
    /// - Parameters:
    ///   - listenDescriptor: a listening `SOCK_STREAM` Unix socket.
    ///   - options: limits and threads.
    ///   - handler: the application.
    ///   - logger: where server events go.
    ///   - metrics: counts dropped slow requests.
    public init(listenDescriptor: Int32, options: HTTPServerOptions, handler: any HTTPHandler, logger: Logger, metrics: Metrics? = nil) {
        self.listenDescriptor = listenDescriptor
        self.options = options
        self.handler = handler
        self.logger = logger
        self.metrics = metrics
    }

    /// Open connections, for tests and metrics.
    public var connectionCount: Int { connections.withLock { $0.count } }

    /// Requests received in full and not yet answered and sent.
    public var requestsInProgress: Int { processing.load(ordering: .relaxed) }

    /// Starts libmicrohttpd's listening thread (connection threads follow
    /// connections) and the thread that drops slow requests and answers
    /// hung ones.
    /// - Throws: ``SocketError`` when `MHD_start_daemon` fails, or no thread
    ///   is left for the supervisor that answers hung calls.
    public func start() throws(SocketError) {
        var settings = CSignerShim_mhd_options()
        // ITC lets MHD_quiesce_daemon stop the listening thread's accepts.
        settings.flags = UInt32(MHD_USE_INTERNAL_POLLING_THREAD.rawValue | MHD_USE_THREAD_PER_CONNECTION.rawValue
                                | MHD_USE_POLL.rawValue | MHD_USE_ITC.rawValue | MHD_USE_ERROR_LOG.rawValue)
        settings.listen_fd = listenDescriptor
        // One more than the reserve: the slot only this process's own
        // connection (its watchdog check) may take, whoever holds the rest.
        settings.connection_limit = UInt32(options.connectionSlots)
        settings.connection_timeout_s = UInt32(options.idleTimeoutSeconds)
        settings.connection_memory_limit = max(16 * 1024, 2 * options.maxHeaderBytes)
        let context = Unmanaged.passUnretained(self).toOpaque()
        settings.access_handler = HTTPServer.accessHandler
        settings.access_context = context
        settings.completed_callback = HTTPServer.requestCompleted
        settings.completed_context = context
        settings.connection_callback = HTTPServer.connectionNotified
        settings.connection_context = context
        settings.uri_log_callback = HTTPServer.requestLineReceived
        settings.uri_log_context = context
        settings.log_callback = HTTPServer.libraryLog
        settings.log_context = context
        guard let started = CSignerShim_mhd_start(&settings) else {
            throw SocketError("libmicrohttpd could not start on the listening socket")
        }
        daemon = started
        supervising.store(true, ordering: .releasing)
        guard OSThread.start({ [self] in superviseConnections() }) else {
            // No watchdog for hung calls and slow requests: do not serve without it.
            supervising.store(false, ordering: .releasing)
            MHD_stop_daemon(started)
            daemon = nil
            throw SocketError("cannot start the connection supervisor thread (the process is out of threads)")
        }
    }

    /// Stops accepting new connections (`MHD_quiesce_daemon`); open ones are still served.
    /// - Returns: the listening descriptor, which the caller closes.
    public func stopAccepting() -> Int32 {
        draining.store(true, ordering: .releasing)
        guard let daemon else { return -1 }
        return Int32(MHD_quiesce_daemon(daemon))
    }

    /// Hands the connections waiting in `listening`'s backlog to
    /// libmicrohttpd (`accept`, then `MHD_add_connection`), after
    /// ``stopAccepting()``: their clients' `connect()` returned, so closing
    /// the socket would reset connections that may already hold a request.
    /// Takes what is queued now and stops at the first empty accept, or
    /// after `connectionLimit` + `reservedConnections` accepts (a socket
    /// systemd keeps open can go on filling while the daemon stops).
    /// - Parameter listening: the descriptor ``stopAccepting()`` returned.
    /// - Returns: how many connections were handed over.
    @discardableResult
    public func adoptPendingConnections(from listening: Int32) -> Int {
        guard let daemon, listening >= 0 else { return 0 }
        let flags = fcntl(listening, F_GETFL)
        guard flags >= 0, fcntl(listening, F_SETFL, flags | O_NONBLOCK) == 0 else { return 0 }
        var adopted = 0
        var attempts = 0
        while attempts < options.connectionLimit + options.reservedConnections {
            attempts += 1
            var address = sockaddr_storage()
            var length = socklen_t(MemoryLayout<sockaddr_storage>.size)
            let client = withUnsafeMutablePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { accept(listening, $0, &length) }
            }
            guard client >= 0 else {
                if errno == EINTR { continue }
                break  // EAGAIN: the backlog is empty (or accept failed: nothing more to take)
            }
            _ = fcntl(client, F_SETFD, FD_CLOEXEC)
            // libmicrohttpd registers the connection later, on its polling
            // thread: until then it is in no count the drain looks at, so
            // it is remembered by its socket's inode.
            let identity = Self.socketIdentity(client)
            if let identity { adoption.withLock { _ = $0.pending.insert(identity) } }
            // libmicrohttpd closes the socket itself if it cannot take it.
            let added = withUnsafePointer(to: &address) {
                $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { MHD_add_connection(daemon, client, $0, length) }
            }
            if added == .YES {
                adopted += 1
            } else if let identity {
                adoption.withLock { _ = $0.pending.remove(identity) }
            }
        }
        // A connection libmicrohttpd refuses later (its connection limit) is
        // never registered: the drain waits for adopted ones only this long.
        adoption.withLock { $0.waitUntil = MonotonicClock.deadline(after: Self.adoptionWaitSeconds) }
        return adopted
    }

    /// How long the drain waits for a connection taken from the backlog
    /// to be registered and to send its request line, in seconds.
    static let adoptionWaitSeconds = 2.0

    /// Connections taken from the backlog (socket inodes) not registered
    /// yet, and until when the drain waits for adopted connections.
    private let adoption = Locked<(pending: Set<UInt64>, waitUntil: UInt64)>(([], 0))

    /// A socket's identity across descriptors: its inode in sockfs.
    private static func socketIdentity(_ descriptor: Int32) -> UInt64? {
        var status = stat()
        guard fstat(descriptor, &status) == 0 else { return nil }
        return UInt64(status.st_ino)
    }

    /// Whether the connection on `descriptor`, just registered, is one
    /// ``adoptPendingConnections(from:)`` took from the backlog (and no
    /// longer pending). No system call unless some are pending.
    fileprivate func registerAdopted(_ descriptor: Int32) -> Bool {
        guard descriptor >= 0, !adoption.withLock({ $0.pending.isEmpty }), let identity = Self.socketIdentity(descriptor) else { return false }
        return adoption.withLock { $0.pending.remove(identity) != nil }
    }

    /// Waits until no request is arriving (request line in, the rest not
    /// yet; bytes sent on a connection that libmicrohttpd has not read yet;
    /// or, for up to ``adoptionWaitSeconds``, a connection taken from the
    /// backlog that has sent no request line yet), being processed or being
    /// sent, or `seconds` pass. A request that arrives too slowly is
    /// still dropped at `requestTimeoutSeconds`.
    /// - Returns: true when nothing was left in progress.
    public func waitForRequestsInProgress(seconds: Double) -> Bool {
        let deadline = MonotonicClock.deadline(after: seconds)
        while processing.load(ordering: .acquiring) > 0 || requestsOnTheirWay > 0 {
            if MonotonicClock.now() > deadline { return false }
            usleep(5_000)
        }
        return true
    }

    /// Requests on their way in, in one pass over the connections: the
    /// request line in and the rest not yet; bytes on the socket that
    /// libmicrohttpd has not read (`FIONREAD`); and, for up to
    /// ``adoptionWaitSeconds``, connections taken from the backlog that
    /// are not registered yet or have sent no request line yet.
    private var requestsOnTheirWay: Int {
        let (pending, waitUntil) = adoption.withLock { ($0.pending.count, $0.waitUntil) }
        let waitingForAdopted = MonotonicClock.now() < waitUntil
        return (waitingForAdopted ? pending : 0) + connections.withLock { all in
            all.values.reduce(0) { count, connection in
                if connection.requestStarted.load(ordering: .acquiring) != 0 { return count + 1 }
                if waitingForAdopted && connection.awaitingFirstRequest.load(ordering: .acquiring) { return count + 1 }
                var unread: Int32 = 0
                return connection.descriptor >= 0 && ioctl(connection.descriptor, UInt(FIONREAD), &unread) == 0 && unread > 0 ? count + 1 : count
            }
        }
    }

    /// Handlers that are inside a call that may block (a hung HSM call stays counted).
    private var blockingCallsInProgress: Int {
        connections.withLock { $0.values.reduce(0) { $0 + ($1.blockingCall.withLock { $0 == nil } ? 0 : 1) } }
    }

    /// Stops every thread and closes every connection (`MHD_stop_daemon`).
    ///
    /// `MHD_stop_daemon` joins every connection thread, and a thread inside
    /// a hung PKCS#11 call may never return: with such a call left after a
    /// second's wait, the daemon object is left running (it no longer
    /// accepts after ``stopAccepting()``) and this server stays allocated
    /// for its callbacks, so that the caller can exit.
    /// - Returns: whether every connection thread was joined (false: the
    ///   daemon was left running for a hung call).
    @discardableResult
    public func stop() -> Bool {
        supervising.store(false, ordering: .releasing)
        guard let daemon else { return true }
        self.daemon = nil
        // A call merely in progress (a request that came on an open
        // connection after the drain) ends soon; only one still inside
        // after a second is taken for hung.
        var waited = 0
        while blockingCallsInProgress > 0 && waited < 100 {
            usleep(10_000)
            waited += 1
        }
        let stuck = blockingCallsInProgress
        if stuck > 0 {
            logger.warning("http_stop_left_threads", ["calls": .int(Int64(stuck)), "hint": "connection threads inside a hung HSM call cannot be joined"])
            _ = Unmanaged.passRetained(self)
            return false
        }
        closingConnections.store(true, ordering: .releasing)
        MHD_stop_daemon(daemon)
        return true
    }

    // MARK: Slow and hung requests

    /// One thread, one pass over the connections per tick (under the
    /// connections lock: a connection closed meanwhile has been removed, and
    /// our duplicate descriptor is closed only after that removal). Hung
    /// requests are checked every tick (100 ms, or a tenth of the signing
    /// timeout when that is under 1 s, but no more often than every 10 ms);
    /// slow ones at least every 250 ms.
    private func superviseConnections() {
        let tick = UInt64(min(100_000, max(10_000, options.signTimeoutSeconds * 1e6 / 10))) * 1_000
        let reapInterval: UInt64 = 250_000_000
        let slowLimit = UInt64(options.requestTimeoutSeconds * 1e9)
        let lineLimit = UInt64(options.idleTimeoutSeconds) * 1_000_000_000 + slowLimit
        var lastReap = MonotonicClock.now()
        while supervising.load(ordering: .acquiring) {
            usleep(useconds_t(tick / 1_000))
            let now = MonotonicClock.now()
            let reap = now + tick > lastReap + reapInterval  // so never more than 250 ms apart
            if reap { lastReap = now }
            connections.withLock { connections in
                for connection in connections.values {
                    if reap { dropIfSlow(connection, now: now, limit: slowLimit, lineLimit: lineLimit) }
                    answerIfHung(connection, now: now)
                }
            }
            handler.watchdogTick()
        }
    }

    /// Shuts down a connection whose request is still arriving `limit`
    /// nanoseconds after its request line, or whose request line is still
    /// incomplete `lineLimit` nanoseconds after the connection began to
    /// wait for it.
    ///
    /// libmicrohttpd reports nothing before a whole request line, and its
    /// idle timeout starts again with every byte, so a request line sent a
    /// byte at a time is bounded only here: an idle connection is closed by
    /// libmicrohttpd after the idle timeout, so one still open without a
    /// request line after the idle timeout plus the request timeout has been
    /// trickling it.
    private func dropIfSlow(_ connection: ConnectionState, now: UInt64, limit: UInt64, lineLimit: UInt64) {
        guard !connection.dropped.load(ordering: .relaxed), connection.descriptor >= 0 else { return }
        let started = connection.requestStarted.load(ordering: .acquiring)
        let waiting = connection.waitingSince.load(ordering: .acquiring)
        let slowRequest = started != 0 && now > started + limit
        let slowLine = waiting != 0 && now > waiting + lineLimit
        guard slowRequest || slowLine else { return }
        connection.dropped.store(true, ordering: .relaxed)
        // Our own duplicate descriptor: shutting it down ends the socket for
        // libmicrohttpd too, and its number cannot have been reused since we
        // hold it open.
        shutdown(connection.descriptor, Int32(SHUT_RDWR))
        metrics?.count("dropped_slow_requests")
        slowWarnings.admit { suppressed in
            logger.warning("slow_request_dropped", [
                "peer.uid": .int(Int64(connection.peer?.uid ?? 0)), "peer.pid": .int(Int64(connection.peer?.pid ?? 0)),
                "phase": .string(slowRequest ? "request" : "request_line"),
                "limit.seconds": .double(slowRequest ? options.requestTimeoutSeconds : Double(options.idleTimeoutSeconds) + options.requestTimeoutSeconds),
                "suppressed_before": .int(Int64(suppressed)),
            ])
        }
    }

    /// Answers a request still in a blocking handler past its deadline.
    private func answerIfHung(_ connection: ConnectionState, now: UInt64) {
        connection.blockingCall.withLock { call in
            guard var current = call, !current.answered, now > current.deadline, connection.descriptor >= 0 else { return }
            current.answered = true
            call = current
            // Written with the lock held: the connection's thread, back from
            // the call, reads `answered` under this lock and returns MHD_NO,
            // and libmicrohttpd then shuts the socket down; an answer written
            // after that never reached the client (7 in 48,506 timeouts under
            // load, counted as sent all the same).
            let response = handler.timedOut(path: current.path, reachedToken: current.progress.hasReachedToken)
            answerAndClose(connection, with: response)
            handler.sent(status: response.status, path: current.path)
        }
    }

    /// Checks a new connection against its uid's share
    /// (``HTTPServerOptions/connectionsPerUIDLimit``, or
    /// ``HTTPServerOptions/forbiddenConnectionsPerUID`` for a peer that may
    /// not connect) and, except for root and this process's uid, against
    /// ``HTTPServerOptions/connectionLimit``. One over is answered 429 and
    /// closed at once, so it never holds a thread until the idle timeout;
    /// the client sees the answer if it reads before it writes.
    private func admit(_ connection: ConnectionState) {
        // The daemon's own process always gets one connection: its systemd
        // watchdog check, which must not fail because other processes of
        // its uid (or root) hold their whole share. One at a time, so the
        // exemption cannot be used to hold more.
        if connection.peer?.isThisProcess == true {
            // A check whose client has hung up (libmicrohttpd reports the
            // close a little later) does not count against the next one.
            let own = connections.withLock { all in
                all.values.filter { $0.peer?.isThisProcess == true && ($0 === connection || !Self.isGone($0)) }.count
            }
            if own <= 1 { return }
        }
        // Counted from the open connections (at most max_connections + the reserve), this one included.
        var (held, open) = connections.withLock { all in (all.values.reduce(0) { $0 + ($1.uid == connection.uid ? 1 : 0) }, all.count) }
        let limit = handler.mayConnect(connection.peer) ? options.connectionsPerUIDLimit : options.forbiddenConnectionsPerUID
        let privileged = connection.uid == 0 || connection.uid == getuid()
        let ceiling = privileged ? options.connectionLimit + options.reservedConnections : options.connectionLimit
        if held > limit || open > ceiling {
            // Over a limit: count again without connections whose client has
            // closed its socket. libmicrohttpd reports those closed a few
            // milliseconds later, and a client that reconnects at once would
            // otherwise be refused for connections it no longer has.
            (held, open) = connections.withLock { all in
                let live = all.values.filter { $0 === connection || !Self.isGone($0) }
                return (live.reduce(0) { $0 + ($1.uid == connection.uid ? 1 : 0) }, live.count)
            }
        }
        let message: String
        if held > limit {
            message = "uid \(connection.uid) already holds \(limit) connections, the most one uid may hold (max_connections_per_uid); reuse keep-alive connections or close idle ones"
        } else if open > ceiling {
            message = privileged
                ? "signerd already holds max_connections (\(options.connectionLimit)) connections and the \(options.reservedConnections) kept for root and signerd's own uid"
                : "signerd already holds max_connections (\(options.connectionLimit)) connections; the rest are kept for root and signerd's own uid"
        } else {
            return
        }
        metrics?.count("refused_connections")
        refusalWarnings.admit { suppressed in
            logger.warning("connection_refused", ["peer.uid": .int(Int64(connection.uid)), "peer.pid": .int(Int64(connection.peer?.pid ?? 0)),
                                                  "uid.connections": .int(Int64(held)), "uid.limit": .int(Int64(limit)),
                                                  "suppressed_before": .int(Int64(suppressed))])
        }
        var error = APIError(.rateLimited, message)
        error.retryAfter = 1
        answerAndClose(connection, with: HTTPResponse(error: error))
    }

    /// Whether `connection` no longer holds its slot: its client has closed
    /// its socket and no request of it is arriving or in the handler. One
    /// whose client left while it is signing (or hung in the module) still
    /// holds a libmicrohttpd slot and a thread, so it still counts.
    private static func isGone(_ connection: ConnectionState) -> Bool {
        peerHungUp(connection.descriptor) && connection.requestStarted.load(ordering: .acquiring) == 0
            && connection.requestsInHandler.load(ordering: .acquiring) == 0
    }

    /// Whether the client at the other end of `descriptor` has closed its
    /// socket (`POLLHUP` on a Unix stream socket: both directions shut). A
    /// client that only shut its writing side still counts.
    private static func peerHungUp(_ descriptor: Int32) -> Bool {
        guard descriptor >= 0 else { return false }
        var entry = pollfd(fd: descriptor, events: 0, revents: 0)
        return poll(&entry, 1, 0) == 1 && entry.revents & Int16(POLLHUP) != 0
    }

    /// Writes `response` (with `Connection: close`) on the connection's own
    /// descriptor, then shuts the socket down, for answers that cannot go
    /// through libmicrohttpd: the watchdog's 503 while the connection's
    /// thread is still inside its handler (the request was read in full, so
    /// the thread is not using the socket; its own response is dropped when
    /// it returns), a 429 on arrival, and a 431 for a head too large to
    /// leave libmicrohttpd room for a response.
    private func answerAndClose(_ connection: ConnectionState, with response: HTTPResponse) {
        guard connection.descriptor >= 0 else { return }
        let reason = MHD_get_reason_phrase_for(UInt32(response.status)).map { String(cString: $0) } ?? "Error"
        var head = "HTTP/1.1 \(response.status) \(reason)\r\n"
        // libmicrohttpd adds Date to the answers it writes; RFC 9110 §6.6.1 wants it here too.
        head += "Date: \(Self.httpDate())\r\n"
        head += "Content-Type: \(response.contentType)\r\n"
        for (name, value) in response.headers { head += "\(name): \(value)\r\n" }
        head += "Connection: close\r\nContent-Length: \(response.body.count)\r\n\r\n"
        // A client gone or not reading gets no answer: the shutdown below ends it.
        _ = UnixConnection.sendAll(Array(head.utf8) + response.body, on: connection.descriptor, blocking: false)
        shutdown(connection.descriptor, Int32(SHUT_RDWR))
    }

    /// The time now as an HTTP date (RFC 9110 §5.6.7 IMF-fixdate:
    /// `Sun, 06 Nov 1994 08:49:37 GMT`), for the `Date` header.
    static func httpDate(_ seconds: time_t = time(nil)) -> String {
        var seconds = seconds
        var parts = tm()
        var text = [CChar](repeating: 0, count: 64)
        // Day and month names in English whatever the process's locale.
        guard gmtime_r(&seconds, &parts) != nil, let posix = posixLocale,
              strftime_l(&text, text.count, "%a, %d %b %Y %H:%M:%S GMT", &parts, posix) > 0 else {
            return "Thu, 01 Jan 1970 00:00:00 GMT"
        }
        // strftime_l wrote a NUL-terminated string into `text` (checked above).
        return text.withUnsafeBufferPointer { String(cString: $0.baseAddress!) }
    }

    /// The POSIX locale, for ``httpDate(_:)``; made once, never freed.
    private nonisolated(unsafe) static let posixLocale: locale_t? = newlocale(1 << LC_TIME, "C", nil)

    // MARK: libmicrohttpd callbacks

    private static func server(_ context: UnsafeMutableRawPointer?) -> HTTPServer {
        Unmanaged<HTTPServer>.fromOpaque(context!).takeUnretainedValue()  // always set in start()
    }

    private static let connectionNotified: MHD_NotifyConnectionCallback = { context, connection, socketContext, event in
        let server = HTTPServer.server(context)
        switch event {
        case .CONNECTION_NOTIFY_STARTED:
            let fd = connection.map { CSignerShim_mhd_connection_fd($0) } ?? -1
            let peer = fd >= 0 ? UnixListener.peerCredentials(fd) : nil
            let duplicate = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1
            let state = ConnectionState(peer: peer, descriptor: duplicate, adopted: server.registerAdopted(fd))
            server.connections.withLock { $0[ObjectIdentifier(state)] = state }
            socketContext?.pointee = Unmanaged.passRetained(state).toOpaque()
            if fd >= 0 && duplicate < 0 {
                // No descriptor of our own (EMFILE): the supervisor could neither
                // answer a hung call on it nor drop it when slow. Not served:
                // shutting the socket down makes libmicrohttpd close it.
                shutdown(fd, Int32(SHUT_RDWR))
                server.metrics?.count("refused_connections")
                return
            }
            server.admit(state)
        case .CONNECTION_NOTIFY_CLOSED:
            guard let raw = socketContext?.pointee else { return }
            let state = Unmanaged<ConnectionState>.fromOpaque(raw).takeRetainedValue()
            socketContext?.pointee = nil
            server.connections.withLock { _ = $0.removeValue(forKey: ObjectIdentifier(state)) }
            if state.descriptor >= 0 { close(state.descriptor) }
        default:
            break
        }
    }

    private static let requestLineReceived: @convention(c) (UnsafeMutableRawPointer?, UnsafePointer<CChar>?, OpaquePointer?) -> UnsafeMutableRawPointer? = { context, uri, connection in
        let connectionState = connection.flatMap { CSignerShim_mhd_socket_context($0) }.map { Unmanaged<ConnectionState>.fromOpaque($0).takeUnretainedValue() }
        connectionState?.requestStarted.store(MonotonicClock.now(), ordering: .releasing)
        connectionState?.waitingSince.store(0, ordering: .releasing)
        connectionState?.awaitingFirstRequest.store(false, ordering: .releasing)
        let path = uri.map(HTTPServer.path(ofTarget:)) ?? "/"
        let state = RequestState(connection: connectionState, path: path)
        state.targetBytes = uri.map { strlen($0) } ?? 1
        return Unmanaged.passRetained(state).toOpaque()
    }

    /// The path a request target names, for routing (RFC 9112 §3.2): an
    /// origin-form target (`/healthz?x=1`) up to any query string; an
    /// absolute-form one (`http://signerd/healthz?x=1`, scheme `http` or
    /// `https` in any case), which a server must accept (§3.2.2), the same
    /// after its scheme and authority (which ends at `/`, `?` or `#`), and `/`
    /// when it has no path. Other
    /// targets are returned as they are (and get 404). Cut on the bytes:
    /// String.firstIndex(of:) walks grapheme clusters and cost 10,000
    /// instructions per request.
    static func path(ofTarget target: UnsafePointer<CChar>) -> String {
        var start = target
        let schemeLength = strncasecmp(target, "http://", 7) == 0 ? 7 : strncasecmp(target, "https://", 8) == 0 ? 8 : 0
        if schemeLength > 0 {
            let authority = target + schemeLength
            // The authority ends at `/`, `?` or `#` (RFC 3986 §3.2): in
            // `http://signerd#/healthz` the path is empty, not `/healthz`.
            start = authority + strcspn(authority, "/?#")
            guard start.pointee == CChar(UInt8(ascii: "/")) else { return "/" }  // `http://signerd`, `http://signerd?x=1`, `http://signerd#x`
        }
        return String(decoding: UnsafeRawBufferPointer(start: start, count: strcspn(start, "?")), as: UTF8.self)
    }

    private static let requestCompleted: MHD_RequestCompletedCallback = { context, _, requestContext, _ in
        guard let raw = requestContext?.pointee else { return }
        let state = Unmanaged<RequestState>.fromOpaque(raw).takeRetainedValue()
        requestContext?.pointee = nil
        state.connection?.requestStarted.store(0, ordering: .releasing)
        state.connection?.waitingSince.store(MonotonicClock.now(), ordering: .releasing)
        if state.processing {
            HTTPServer.server(context).processing.subtract(1, ordering: .acquiringAndReleasing)
        }
    }

    /// What the access handler reads from a request's headers, in one pass
    /// over libmicrohttpd's parsed header list.
    struct HeaderScan {
        /// Every `Content-Length` value, in order.
        var lengths: [String] = []
        /// Every `Transfer-Encoding` value, in order.
        var codings: [String] = []
        /// Every `Content-Type` value, in order.
        var contentTypes: [String] = []
        /// Every `Content-Encoding` value, in order.
        var contentCodings: [String] = []
        /// The header lines' size as sent in the usual form
        /// (`Name: value` CRLF each), in bytes.
        var bytes = 0
        /// How many header lines there are.
        var count = 0
        /// How many cookies (`Cookie: a=b; c=d` is two) and query arguments
        /// (`?a&b` is two) libmicrohttpd parsed out of the head: each takes
        /// a record in its connection pool, as a header line does.
        var parsedPairs = 0

        init(_ connection: OpaquePointer) {
            // With no iterator, libmicrohttpd only counts.
            parsedPairs = Int(MHD_get_connection_values(connection, .COOKIE_KIND, nil, nil))
                + Int(MHD_get_connection_values(connection, .GET_ARGUMENT_KIND, nil, nil))
            withUnsafeMutablePointer(to: &self) { pointer in
                _ = MHD_get_connection_values(connection, .HEADER_KIND, { context, _, key, value in
                    guard let context, let key else { return .YES }
                    let scan = context.assumingMemoryBound(to: HeaderScan.self)
                    scan.pointee.bytes += strlen(key) + 4 + (value.map { strlen($0) } ?? 0)
                    scan.pointee.count += 1
                    if strcasecmp(key, "Content-Length") == 0 {
                        scan.pointee.lengths.append(value.map { String(cString: $0) } ?? "")
                    } else if strcasecmp(key, "Transfer-Encoding") == 0 {
                        scan.pointee.codings.append(value.map { String(cString: $0) } ?? "")
                    } else if strcasecmp(key, "Content-Type") == 0 {
                        scan.pointee.contentTypes.append(value.map { String(cString: $0) } ?? "")
                    } else if strcasecmp(key, "Content-Encoding") == 0 {
                        scan.pointee.contentCodings.append(value.map { String(cString: $0) } ?? "")
                    }
                    return .YES
                }, pointer)
            }
        }
    }

    /// The contract's header limit (`max_header_bytes`, default 8 KiB) on the
    /// request line and headers, answered in JSON. libmicrohttpd's pool is
    /// sized larger (``start()``), so only heads far over the limit reach its
    /// own 431 page.
    private func headerLimitError(_ scan: HeaderScan, method: String, targetBytes: Int) -> APIError? {
        // "METHOD target HTTP/1.1" CRLF, the header lines, the blank line.
        let size = method.utf8.count + 1 + targetBytes + 11 + scan.bytes + 2
        if size > options.maxHeaderBytes {
            return APIError(.headersTooLarge, "the request line and headers are \(size) bytes; the limit is \(options.maxHeaderBytes) bytes (max_header_bytes)")
        }
        // libmicrohttpd keeps about 64 bytes of its pool per header beside the
        // head itself; with many headers the pool had no room left for the
        // response head, and a request already signed got no answer. Each
        // cookie and query argument it parses takes such a record too (a
        // fuzzing round: 215 cookies in a 1.2 KB head, signed and unanswered).
        return HTTPServer.recordLimitError(headers: scan.count, parsed: scan.parsedPairs, trailers: 0)
    }

    /// The 431 for a request whose header fields, cookies, query arguments
    /// and trailer fields together are over ``maximumHeaderCount``, or nil.
    static func recordLimitError(headers: Int, parsed: Int, trailers: Int) -> APIError? {
        let total = headers + parsed + trailers
        guard total > maximumHeaderCount else { return nil }
        if parsed == 0 && trailers == 0 {
            return APIError(.headersTooLarge, "the request has \(headers) header fields; the limit is \(maximumHeaderCount)")
        }
        return APIError(.headersTooLarge, "the request has \(headers) header fields, \(parsed) cookies and query arguments and \(trailers) trailer fields, \(total) in all; "
                        + "the limit is \(maximumHeaderCount) together (the HTTP library keeps each in a fixed pool)")
    }

    /// The most header fields a request may carry (431 above): with the
    /// 8 KiB head limit this keeps libmicrohttpd's 16 KiB connection pool
    /// from running out before the response head is written.
    static let maximumHeaderCount = 100

    /// Why the request's body framing is ambiguous or missing, or nil
    /// (RFC 9112 §6): `Content-Length` values that differ make the message
    /// length unknowable; `Content-Length` beside `Transfer-Encoding` is how
    /// request smuggling starts; a transfer coding other than `chunked`
    /// alone has no length signerd can read; and a POST with neither header
    /// (libmicrohttpd drops a folded `Content-Length` line) would have its
    /// body read as the next request. libmicrohttpd takes the first
    /// `Content-Length` and would read what follows as another request.
    private static func framingProblem(_ headers: HeaderScan, method: String) -> String? {
        if !headers.codings.isEmpty && !headers.lengths.isEmpty {
            return "the request has both Content-Length and Transfer-Encoding"
        }
        if Set(headers.lengths).count > 1 {
            return "the request has Content-Length \(headers.lengths.joined(separator: " and "))"
        }
        if !headers.codings.isEmpty {
            // As libmicrohttpd reads it: the first Transfer-Encoding header, its
            // value exactly "chunked" in any case. Anything else it reads as no
            // coding at all, and waits for a body that ends only when the
            // client closes (a fuzzing round: "chunked,", ", chunked",
            // "chunked " and an empty header before the real one got no answer).
            if headers.codings.count != 1 || headers.codings[0].lowercased() != "chunked" {
                let written = headers.codings.map { "\"\($0)\"" }.joined(separator: " and ")
                return "the request has Transfer-Encoding \(written), which signerd does not read (send one header, Transfer-Encoding: chunked, with nothing around the word)"
            }
        }
        if method == "POST" && headers.lengths.isEmpty && headers.codings.isEmpty {
            return "the POST request has neither Content-Length nor Transfer-Encoding (a header folded onto a second line is not read)"
        }
        return nil
    }

    /// Whether the request carries no body (RFC 9112 §6.3): no
    /// `Transfer-Encoding`, and `Content-Length: 0`, or no `Content-Length`
    /// on a method that has no body without one. A POST or PUT without a
    /// length is not taken as bodiless (``framingProblem(_:method:)``).
    static func hasNoBody(_ headers: HeaderScan, method: String) -> Bool {
        guard headers.codings.isEmpty, headers.lengths.allSatisfy({ $0 == "0" }) else { return false }
        return !headers.lengths.isEmpty || (method != "POST" && method != "PUT")
    }

    private static let libraryLog: CSignerShim_log_callback = { context, message in
        HTTPServer.server(context).noteLibraryMessage(message.map { String(cString: $0) } ?? "")
    }

    /// Logs a message of libmicrohttpd's as `http_library`: a warning, but
    /// at debug for a connection's closure ("Connection socket is closed
    /// …") once ``stop()`` closes the connections: a race inside
    /// `MHD_stop_daemon` with its own read, which an operator audit saw
    /// after a clean `SIGTERM`. Other messages during the stop stay warnings.
    func noteLibraryMessage(_ message: String) {
        // Said whenever the access handler returns MHD_NO, which signerd does
        // only after it wrote its own answer on the socket (a 431, or the
        // watchdog's 503) and wants the connection closed: not an error.
        if message.hasPrefix("Application reported internal error") { return }
        if closingConnections.load(ordering: .acquiring) && message.hasPrefix("Connection socket is closed") {
            logger.debug("http_library", ["detail": .string(message), "phase": "stop"])
            return
        }
        libraryWarnings.admit { suppressed in
            logger.warning("http_library", ["detail": .string(message), "suppressed_before": .int(Int64(suppressed))])
        }
    }

    /// The body length a `Content-Length` value declares, in bytes; a
    /// decimal value too large for `Int` (2⁶³ and up, which libmicrohttpd
    /// still takes as a 64-bit length) as `Int.max`, so that it meets the
    /// body limit at once instead of a client streaming into the connection
    /// until the request timeout. Nil for anything but digits (RFC 9110
    /// §8.6: `Content-Length = 1*DIGIT`).
    static func declaredLength(_ value: String) -> Int? {
        guard !value.isEmpty, value.utf8.allSatisfy({ $0 >= UInt8(ascii: "0") && $0 <= UInt8(ascii: "9") }) else { return nil }
        return Int(value) ?? Int.max
    }

    /// Whether a request answered before its body is read has that body
    /// read and thrown away first, so that a client writing it all before
    /// reading sees the answer: a declared `Content-Length` within
    /// ``HTTPServerOptions/drainedBodyLimit``, or a chunked body (read up
    /// to that limit, then answered and closed), and no
    /// `Expect: 100-continue`.
    private func drainsBody(declared length: Int?, chunked: Bool, _ connection: OpaquePointer) -> Bool {
        if let length {
            guard length <= options.drainedBodyLimit else { return false }
        } else if !chunked {
            return false
        }
        return !HTTPServer.expectsContinue(connection)
    }

    /// Whether the request carries `Expect: 100-continue` (RFC 9110 §10.1.1):
    /// its client waits for a go-ahead before it sends the body, so a final
    /// answer from the head reaches it without a body to throw away.
    private static func expectsContinue(_ connection: OpaquePointer) -> Bool {
        guard let value = MHD_lookup_connection_value(connection, .HEADER_KIND, "Expect") else { return false }
        return strcasecmp(value, "100-continue") == 0
    }

    private static let accessHandler: MHD_AccessHandlerCallback = { context, connection, _, method, _, uploadData, uploadSize, requestContext in
        guard let connection, let requestContext else { return .NO }
        let server = HTTPServer.server(context)
        let state: RequestState
        if let raw = requestContext.pointee {
            state = Unmanaged<RequestState>.fromOpaque(raw).takeUnretainedValue()
        } else {
            // No request-line callback ran (should not happen): make the state here.
            state = RequestState(connection: nil, path: "/")
            requestContext.pointee = Unmanaged.passRetained(state).toOpaque()
        }
        let methodName = method.map { String(cString: $0) } ?? ""
        let peer = state.connection?.peer ?? PeerCredentials(uid: UInt32.max, gid: UInt32.max, pid: 0)

        if !state.headProcessed {
            state.headProcessed = true
            let headers = HeaderScan(connection)
            state.headRecords = (headers.count, headers.parsedPairs)
            if let error = server.headerLimitError(headers, method: methodName, targetBytes: state.targetBytes) {
                state.answered = true
                // Written on the socket, not queued: a head this large can leave
                // too little of libmicrohttpd's pool for the response head, and
                // libmicrohttpd would then close without any answer.
                guard let owner = state.connection, owner.descriptor >= 0 else {
                    var response = HTTPResponse(error: error)
                    response.headers.append(("Connection", "close"))
                    return server.queue(response, path: state.path, on: connection)
                }
                let response = HTTPResponse(error: error)
                server.answerAndClose(owner, with: response)
                server.handler.sent(status: response.status, path: state.path)
                return .NO
            }
            let lengthHeader = MHD_lookup_connection_value(connection, .HEADER_KIND, "Content-Length").map { String(cString: $0) }
            let contentLength = lengthHeader.flatMap(HTTPServer.declaredLength)
            if var early = server.handler.preflight(method: methodName, path: state.path, contentTypes: headers.contentTypes, contentCodings: headers.contentCodings,
                                                          contentLength: contentLength, peer: peer) {
                if HTTPServer.framingProblem(headers, method: methodName) != nil {
                    // Where the body ends is in doubt: answer now and close,
                    // or bytes the client sent as a body would be read as
                    // its next request.
                    early.headers.append(("Connection", "close"))
                    state.answered = true
                    return server.queue(early, path: state.path, on: connection)
                }
                if HTTPServer.hasNoBody(headers, method: methodName) {
                    state.earlyAnswer = early
                    return .YES
                }
                // A body is read and thrown away first, as for a 413, up to
                // the drain limit: a client that writes its whole body
                // before it reads would otherwise meet a broken pipe
                // instead of this answer. One held back for a go-ahead, or
                // declared past the limit, is answered now.
                if server.drainsBody(declared: contentLength, chunked: !headers.codings.isEmpty, connection) {
                    state.earlyAnswer = early
                    state.tooLarge = true  // discard what arrives
                    return .YES
                }
                state.answered = true
                return server.queue(early, path: state.path, on: connection)
            }
            if let problem = HTTPServer.framingProblem(headers, method: methodName) {
                state.answered = true
                var response = HTTPResponse(error: APIError(.badRequest, "\(problem); send one Content-Length, or Transfer-Encoding: chunked alone (RFC 9112 §6)"))
                response.headers.append(("Connection", "close"))
                return server.queue(response, path: state.path, on: connection)
            }
            if let contentLength, contentLength > server.options.maxBodyBytes {
                // Read the body and answer once it is in, as for a chunked body
                // that grows too large: a client that writes it all before
                // reading gets the 413, not a broken pipe. Still bounded by
                // request_timeout_seconds. A body past the drain limit, or one
                // the client holds back until told to go on, is answered now.
                if server.drainsBody(declared: contentLength, chunked: false, connection) {
                    state.tooLarge = true
                    return .YES
                }
                state.answered = true
                return server.queue(server.handler.payloadTooLarge(path: state.path, limit: server.options.maxBodyBytes), path: state.path, on: connection)
            }
            // The declared length at once, not grown by doubling as it arrives
            // (up to twice the body held, for every connection sending one).
            if let contentLength, contentLength > 0 { state.body.reserveCapacity(contentLength) }
            return .YES
        }

        if let uploadSize, uploadSize.pointee > 0 {
            let size = uploadSize.pointee
            uploadSize.pointee = 0
            state.received += size
            guard !state.answered else { return .YES }
            if state.body.count + size > server.options.maxBodyBytes {
                state.tooLarge = true
                state.body = []
            } else if !state.tooLarge, let uploadData {
                state.body.append(contentsOf: UnsafeRawBufferPointer(start: uploadData, count: size))
            }
            // Only a chunked body gets here past the drain limit (a declared
            // one that large was answered from the head): answer now and
            // close, rather than read it until the request timeout.
            // libmicrohttpd 0.9.75 sends nothing queued in the middle of a
            // body, so the answer is written on the socket, as for a 431.
            if state.received > server.options.drainedBodyLimit, let owner = state.connection, owner.descriptor >= 0 {
                state.answered = true
                owner.requestStarted.store(0, ordering: .releasing)
                let response = state.earlyAnswer ?? server.handler.payloadTooLarge(path: state.path, limit: server.options.maxBodyBytes)
                server.answerAndClose(owner, with: response)
                server.handler.sent(status: response.status, path: state.path)
                return .NO
            }
            return .YES
        }
        // libmicrohttpd 0.9.75 says the request is complete with a call
        // whose upload_data is NULL. After it sent "100 Continue" for a
        // request without a body, with the next pipelined request already
        // read, its body loop also calls with data and a size of 0; a
        // response queued then is refused (MHD_NO) and the connection
        // closed with no answer to either request. Wait for the real end.
        if uploadData != nil { return .YES }

        guard !state.answered else { return .YES }
        state.answered = true
        // Trailer fields of a chunked body arrive after the head was checked,
        // and take pool records too: too many, and the answer would not fit.
        let trailers = Int(MHD_get_connection_values(connection, .FOOTER_KIND, nil, nil))
        if trailers > 0, let owner = state.connection, owner.descriptor >= 0,
           let error = HTTPServer.recordLimitError(headers: state.headRecords.headers, parsed: state.headRecords.parsed, trailers: trailers) {
            owner.requestStarted.store(0, ordering: .releasing)
            let response = HTTPResponse(error: error)
            server.answerAndClose(owner, with: response)
            server.handler.sent(status: response.status, path: state.path)
            return .NO
        }
        if let early = state.earlyAnswer {
            state.connection?.requestStarted.store(0, ordering: .releasing)
            return server.queue(early, path: state.path, on: connection)
        }
        if state.tooLarge {
            state.connection?.requestStarted.store(0, ordering: .releasing)
            return server.queue(server.handler.payloadTooLarge(path: state.path, limit: server.options.maxBodyBytes), path: state.path, on: connection)
        }
        state.processing = true
        server.processing.add(1, ordering: .acquiringAndReleasing)
        state.connection?.requestsInHandler.add(1, ordering: .acquiringAndReleasing)
        defer { state.connection?.requestsInHandler.subtract(1, ordering: .acquiringAndReleasing) }
        // The request is in: its arrival deadline no longer applies (signing
        // has its own timeout). Cleared after `processing` counts it, so that
        // a drain never sees it in neither.
        state.connection?.requestStarted.store(0, ordering: .releasing)
        let contentType = MHD_lookup_connection_value(connection, .HEADER_KIND, "Content-Type").map { String(cString: $0) }
        let request = HTTPRequest(method: methodName, path: state.path, contentType: contentType, body: state.body, peer: peer)
        state.body = []
        guard let owner = state.connection, server.handler.mayBlock(path: state.path) else {
            return server.queue(server.handler.handle(request), path: state.path, on: connection)
        }
        let deadline = request.receivedAt + UInt64(server.options.signTimeoutSeconds * 1e9)
        let call = BlockingCall(path: state.path, deadline: deadline)
        owner.blockingCall.withLock { $0 = call }
        let response = RequestDeadline.$progress.withValue(call.progress) { server.handler.handle(request) }
        let answeredByWatchdog = owner.blockingCall.withLock { call in
            defer { call = nil }
            return call?.answered ?? false
        }
        // The watchdog already sent its 503 on this socket: close the connection.
        guard !answeredByWatchdog else { return .NO }
        return server.queue(response, path: state.path, on: connection)
    }

    /// Hands `response` to libmicrohttpd and reports it to the handler.
    private func queue(_ response: HTTPResponse, path: String, on connection: OpaquePointer) -> MHD_Result {
        handler.sent(status: response.status, path: path)
        let created: OpaquePointer? = response.body.withUnsafeBytes { bytes in
            MHD_create_response_from_buffer(bytes.count, UnsafeMutableRawPointer(mutating: bytes.baseAddress), .RESPMEM_MUST_COPY)
        }
        guard let created else { return .NO }
        defer { MHD_destroy_response(created) }
        MHD_add_response_header(created, "Content-Type", response.contentType)
        for (name, value) in response.headers {
            MHD_add_response_header(created, name, value)
        }
        if draining.load(ordering: .relaxed) {
            MHD_add_response_header(created, "Connection", "close")
        }
        return MHD_queue_response(connection, UInt32(response.status), created)
    }
}
