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
    func preflight(method: String, path: String, contentType: String?, contentLength: Int?, peer: PeerCredentials) -> HTTPResponse?
    /// Handles a complete request: on a worker thread when ``needsWorker(path:)``
    /// says so (it may then block in PKCS#11, bounded by the request timeout),
    /// else on the HTTP thread (it must not block).
    func handle(_ request: HTTPRequest) -> HTTPResponse
    /// The response for a body over the limit.
    func payloadTooLarge(path: String, limit: Int) -> HTTPResponse
    /// Whether the request may block (PKCS#11) and so runs on a worker
    /// thread under the request timeout; false runs it on the HTTP thread.
    func needsWorker(path: String) -> Bool
    /// The answer for a request that waited (`running` false) or ran
    /// (`running` true) longer than the timeout.
    func timedOut(_ request: HTTPRequest, running: Bool) -> HTTPResponse
    /// The answer when the worker queue is full.
    func overloaded(_ request: HTTPRequest) -> HTTPResponse
    /// Called by the request watchdog a few times a second (the application
    /// writes off calls that hang there).
    func watchdogTick()
}

/// Limits and threads of the server.
public struct HTTPServerOptions: Sendable {
    /// libmicrohttpd threads (each runs its own epoll loop; they parse and
    /// write HTTP and never wait for the HSM). Default 2.
    public var threads = 2
    /// Most connections at once.
    public var connectionLimit = 1024
    /// Idle keep-alive connections are closed after this many seconds.
    public var idleTimeoutSeconds = 60
    /// A request still arriving after this many seconds (from its request line) is dropped.
    public var requestTimeoutSeconds = 10.0
    /// Largest body in bytes (413 above).
    public var maxBodyBytes = 64 * 1024
    /// Largest request head (request line and headers) in bytes (431 above, from libmicrohttpd).
    public var maxHeaderBytes = 8 * 1024
    /// Worker threads for requests that may block (one per PKCS#11 session).
    public var workers = 8
    /// Seconds from a worker request's arrival to its answer; later ones get ``HTTPHandler/timedOut(_:)``.
    public var workerTimeoutSeconds = 5.0
    /// Requests waiting for a worker beyond this are answered with ``HTTPHandler/overloaded(_:)``.
    public var maximumQueued = 4096

    /// Default options.
    public init() {}
}

/// One accepted connection: the peer, a private duplicate of its descriptor
/// (so a slow request can be cut with `shutdown(2)` without racing a reuse
/// of the number), and when its current request began.
final class ConnectionState: Sendable {
    let peer: PeerCredentials?
    let descriptor: Int32
    /// `MonotonicClock` nanoseconds of the current request's request line; 0 between requests.
    let requestStarted = Atomic<UInt64>(0)
    let dropped = Atomic<Bool>(false)

    init(peer: PeerCredentials?, descriptor: Int32) {
        self.peer = peer
        self.descriptor = descriptor
    }
}

/// A suspended MHD connection, handed to the worker that resumes it.
/// libmicrohttpd documents `MHD_resume_connection` as callable from any
/// thread, and a suspended connection is neither processed nor freed until
/// it is resumed, so the pointer stays valid until then.
struct SuspendedConnection: @unchecked Sendable {
    let pointer: OpaquePointer
}

/// One request in progress.
final class RequestState: @unchecked Sendable {
    // Touched only by the MHD thread that owns the connection.
    let connection: ConnectionState?
    var path: String
    var headProcessed = false
    var body: [UInt8] = []
    var tooLarge = false
    var answered = false
    var processing = false
    var suspended = false
    /// Written by a worker, read by the HTTP thread after the resume.
    let pendingResponse = Mutex<HTTPResponse?>(nil)

    init(connection: ConnectionState?, path: String) {
        self.connection = connection
        self.path = path
    }
}

/// The HTTP/1.1 server on a listening Unix socket, built on libmicrohttpd
/// (thread pool, epoll). Keep-alive is the normal case.
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
    private let connections = Mutex<[ObjectIdentifier: ConnectionState]>([:])
    private let processing = Atomic<Int>(0)
    /// Set when draining: responses carry `Connection: close`.
    let draining = Atomic<Bool>(false)
    private let reaperRunning = Atomic<Bool>(false)
    private var workQueue: WorkQueue?

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

    /// Starts libmicrohttpd's threads.
    /// - Throws: ``SocketError`` when `MHD_start_daemon` fails.
    public func start() throws(SocketError) {
        var settings = CSignerShim_mhd_options()
        settings.flags = UInt32(MHD_USE_INTERNAL_POLLING_THREAD.rawValue | MHD_USE_EPOLL.rawValue | MHD_USE_ITC.rawValue
                                | MHD_USE_ERROR_LOG.rawValue | MHD_ALLOW_SUSPEND_RESUME.rawValue)
        let handler = self.handler
        workQueue = WorkQueue(
            workers: options.workers, maximumWorkers: 2 * options.workers + 2, maximumQueued: options.maximumQueued,
            timeout: options.workerTimeoutSeconds,
            handle: { job in handler.handle(job.request) },
            timedOut: { job, running in handler.timedOut(job.request, running: running) },
            onTick: { handler.watchdogTick() })
        settings.listen_fd = listenDescriptor
        settings.thread_pool_size = UInt32(max(1, options.threads))
        settings.connection_limit = UInt32(options.connectionLimit)
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
        reaperRunning.store(true, ordering: .releasing)
        OSThread.start { [self] in reapSlowRequests() }
    }

    /// Stops accepting new connections (`MHD_quiesce_daemon`); open ones are still served.
    /// - Returns: the listening descriptor, which the caller closes.
    public func stopAccepting() -> Int32 {
        draining.store(true, ordering: .releasing)
        guard let daemon else { return -1 }
        return Int32(MHD_quiesce_daemon(daemon))
    }

    /// Waits until no request is being processed or sent, or `seconds` pass.
    /// - Returns: true when nothing was left in progress.
    public func waitForRequestsInProgress(seconds: Double) -> Bool {
        let deadline = MonotonicClock.deadline(after: seconds)
        while processing.load(ordering: .acquiring) > 0 {
            if MonotonicClock.now() > deadline { return false }
            usleep(5_000)
        }
        return true
    }

    /// Stops every thread and closes every connection (`MHD_stop_daemon`).
    public func stop() {
        reaperRunning.store(false, ordering: .releasing)
        workQueue?.stop()
        if let daemon {
            MHD_stop_daemon(daemon)
            self.daemon = nil
        }
    }

    // MARK: Slow requests

    private func reapSlowRequests() {
        let limit = UInt64(options.requestTimeoutSeconds * 1e9)
        while reaperRunning.load(ordering: .acquiring) {
            usleep(250_000)
            let now = MonotonicClock.now()
            connections.withLock { connections in
                for connection in connections.values {
                    let started = connection.requestStarted.load(ordering: .acquiring)
                    guard started != 0, now > started + limit, !connection.dropped.load(ordering: .relaxed) else { continue }
                    connection.dropped.store(true, ordering: .relaxed)
                    // Our own duplicate descriptor: shutting it down ends the
                    // socket for libmicrohttpd too, and its number cannot
                    // have been reused since we hold it open.
                    shutdown(connection.descriptor, Int32(SHUT_RDWR))
                    metrics?.count("dropped_slow_requests")
                    logger.warning("slow_request_dropped", [
                        "peer.uid": .int(Int64(connection.peer?.uid ?? 0)), "peer.pid": .int(Int64(connection.peer?.pid ?? 0)),
                        "limit.seconds": .double(options.requestTimeoutSeconds),
                    ])
                }
            }
        }
    }

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
            let state = ConnectionState(peer: peer, descriptor: duplicate)
            server.connections.withLock { $0[ObjectIdentifier(state)] = state }
            socketContext?.pointee = Unmanaged.passRetained(state).toOpaque()
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
        var path = uri.map { String(cString: $0) } ?? "/"
        if let query = path.firstIndex(of: "?") { path = String(path[..<query]) }
        return Unmanaged.passRetained(RequestState(connection: connectionState, path: path)).toOpaque()
    }

    private static let requestCompleted: MHD_RequestCompletedCallback = { context, _, requestContext, _ in
        guard let raw = requestContext?.pointee else { return }
        let state = Unmanaged<RequestState>.fromOpaque(raw).takeRetainedValue()
        requestContext?.pointee = nil
        state.connection?.requestStarted.store(0, ordering: .releasing)
        if state.processing {
            HTTPServer.server(context).processing.subtract(1, ordering: .acquiringAndReleasing)
        }
    }

    private static let libraryLog: CSignerShim_log_callback = { context, message in
        let server = HTTPServer.server(context)
        server.logger.warning("http_library", ["detail": .string(message.map { String(cString: $0) } ?? "")])
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
            let contentType = MHD_lookup_connection_value(connection, .HEADER_KIND, "Content-Type").map { String(cString: $0) }
            let lengthHeader = MHD_lookup_connection_value(connection, .HEADER_KIND, "Content-Length").map { String(cString: $0) }
            let contentLength = lengthHeader.flatMap { Int($0) }
            if let early = server.handler.preflight(method: methodName, path: state.path, contentType: contentType, contentLength: contentLength, peer: peer) {
                state.answered = true
                return server.queue(early, on: connection)
            }
            if let contentLength, contentLength > server.options.maxBodyBytes {
                state.answered = true
                return server.queue(server.handler.payloadTooLarge(path: state.path, limit: server.options.maxBodyBytes), on: connection)
            }
            return .YES
        }

        if let uploadSize, uploadSize.pointee > 0 {
            let size = uploadSize.pointee
            if !state.answered {
                if state.body.count + size > server.options.maxBodyBytes {
                    state.tooLarge = true
                    state.body = []
                } else if !state.tooLarge, let uploadData {
                    state.body.append(contentsOf: UnsafeRawBufferPointer(start: uploadData, count: size))
                }
            }
            uploadSize.pointee = 0
            return .YES
        }

        if state.suspended {
            // Resumed by the worker (or the watchdog): send what it left.
            guard let response = state.pendingResponse.withLock({ $0.take() }) else { return .YES }
            state.suspended = false
            return server.queue(response, on: connection)
        }
        guard !state.answered else { return .YES }
        state.answered = true
        // The request is in: its arrival deadline no longer applies (signing has its own timeout).
        state.connection?.requestStarted.store(0, ordering: .releasing)
        if state.tooLarge {
            return server.queue(server.handler.payloadTooLarge(path: state.path, limit: server.options.maxBodyBytes), on: connection)
        }
        state.processing = true
        server.processing.add(1, ordering: .acquiringAndReleasing)
        let contentType = MHD_lookup_connection_value(connection, .HEADER_KIND, "Content-Type").map { String(cString: $0) }
        let request = HTTPRequest(method: methodName, path: state.path, contentType: contentType, body: state.body, peer: peer)
        state.body = []
        guard let workQueue = server.workQueue, server.handler.needsWorker(path: state.path) else {
            return server.queue(server.handler.handle(request), on: connection)
        }
        // Suspend first: a worker may finish and resume before this handler returns.
        state.suspended = true
        MHD_suspend_connection(connection)
        let suspended = SuspendedConnection(pointer: connection)
        let job = Job(request: request, received: request.receivedAt) { response in
            state.pendingResponse.withLock { $0 = response }
            MHD_resume_connection(suspended.pointer)
        }
        if !workQueue.submit(job) {
            job.complete(server.handler.overloaded(request))
        }
        return .YES
    }

    private func queue(_ response: HTTPResponse, on connection: OpaquePointer) -> MHD_Result {
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
