import Foundation
import HSMSigner
@testable import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// The HTTP server's connection shares, with a real Unix socket and a
/// handler that answers everything with 200 (no token needed).
@Suite("Connection shares")
struct ConnectionLimitTests {
    /// Answers 200 `{}` (`/slow` after 3 s); `allowed` decides ``mayConnect(_:)``.
    final class StubHandler: HTTPHandler {
        let allowed: Bool
        init(allowed: Bool) { self.allowed = allowed }
        func preflight(method: String, path: String, contentTypes: [String], contentCodings: [String], contentLength: Int?, peer: PeerCredentials) -> HTTPResponse? { nil }
        func handle(_ request: HTTPRequest) -> HTTPResponse {
            if request.path == "/slow" { usleep(3_000_000) }
            return HTTPResponse(status: 200, body: Array("{}".utf8))
        }
        func payloadTooLarge(path: String, limit: Int) -> HTTPResponse { HTTPResponse(status: 413, body: []) }
        func mayBlock(path: String) -> Bool { false }
        func timedOut(path: String, reachedToken: Bool) -> HTTPResponse { HTTPResponse(status: 503, body: []) }
        func watchdogTick() {}
        func mayConnect(_ peer: PeerCredentials?) -> Bool { allowed }
        func sent(status: Int, path: String) {}
    }

    func withServer(allowed: Bool, _ configure: (inout HTTPServerOptions) -> Void, _ body: (String) throws -> Void) throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-conn")
        let path = directory + "/s.sock"
        var options = HTTPServerOptions()
        configure(&options)
        let server = HTTPServer(listenDescriptor: try UnixListener.bind(path: path, mode: 0o600, group: nil), options: options,
                                handler: StubHandler(allowed: allowed), logger: Logger(minimumLevel: .critical))
        try server.start()
        defer { server.stop() }
        try body(path)
    }

    /// What a fresh connection reads before it writes anything (empty when the server waits for a request).
    func firstAnswer(_ path: String) throws -> String {
        let connection = try UnixConnection.connect(path: path, timeout: 0.5)
        defer { connection.close() }
        return connection.readUntilClosed()
    }

    /// Another process (python3, this uid) that holds `count` connections to
    /// `path` until it is killed; returned once they are connected.
    func holdConnections(_ count: Int, to path: String) throws -> Process {
        let holder = Process()
        holder.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        holder.arguments = ["python3", "-c", """
            import socket, sys, time
            held = [socket.socket(socket.AF_UNIX) for _ in range(int(sys.argv[2]))]
            for s in held: s.connect(sys.argv[1])
            print("held", flush=True)
            time.sleep(60)
            """, path, String(count)]
        let output = Pipe()
        holder.standardOutput = output
        try holder.run()
        let ready = String(decoding: output.fileHandleForReading.availableData, as: UTF8.self)
        guard ready.contains("held") else {
            release(holder)
            throw FixtureError("the holder process did not connect: \(ready)")
        }
        return holder
    }

    /// Ends a ``holdConnections(_:to:)`` process. SIGKILL: a child inherits
    /// the signal mask, and the test process may hold SIGTERM blocked for its
    /// in-process daemons.
    func release(_ holder: Process) {
        kill(holder.processIdentifier, SIGKILL)
        holder.waitUntilExit()
    }

    @Test("a uid that may not connect holds at most forbiddenConnectionsPerUID connections; the next is answered 429 and closed")
    func forbiddenShare() throws {
        try withServer(allowed: false, { $0.forbiddenConnectionsPerUID = 2 }) { path in
            let held = try (0..<2).map { _ in try UnixConnection.connect(path: path, timeout: 2) }
            defer { held.forEach { $0.close() } }
            var answer = ""
            _ = poll(seconds: 5) { answer = (try? firstAnswer(path)) ?? ""; return !answer.isEmpty }
            #expect(answer.hasPrefix("HTTP/1.1 429 Too Many Requests"), "\(answer)")
            #expect(answer.contains("max_connections_per_uid"))
            // Written on the socket, not by libmicrohttpd: RFC 9110 §6.6.1 still wants a Date.
            #expect(answer.range(of: #"\r\nDate: [A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT\r\n"#, options: .regularExpression) != nil, "\(answer)")
        }
    }

    @Test("the server's own process always gets one connection (the daemon's watchdog check), however many its uid holds")
    func ownProcessConnection() throws {
        try withServer(allowed: true, { $0.connectionsPerUIDLimit = 2 }) { path in
            // Another process of the same uid takes the uid's whole share.
            let holder = try holdConnections(2, to: path)
            defer { release(holder) }
            // A check whose client has hung up does not count against the
            // next one, even before libmicrohttpd reports the close.
            let earlier = SignerClient(socketPath: path, timeout: 2)
            #expect(try earlier.send("GET", "/healthz").status == 200)
            earlier.close()
            let client = SignerClient(socketPath: path, timeout: 2)
            defer { client.close() }
            #expect(try client.send("GET", "/healthz").status == 200)
            // Only one: a second connection of this process at the same time is over the share.
            var answer = ""
            _ = poll(seconds: 5) { answer = (try? firstAnswer(path)) ?? ""; return !answer.isEmpty }
            #expect(answer.hasPrefix("HTTP/1.1 429 Too Many Requests"), "\(answer)")
        }
    }

    @Test("connections still in the listen backlog when accepting stops are served with Connection: close, not reset")
    func backlogAdopted() throws {
        // libmicrohttpd registers an added connection later, on its own
        // thread; a drain that did not wait for that ended before the
        // answers in some rounds, not all: thirty rounds.
        for round in 0..<30 {
            let directory = TemporaryDirectory.make(prefix: "signerd-conn")
            let path = directory + "/s.sock"
            let server = HTTPServer(listenDescriptor: try UnixListener.bind(path: path, mode: 0o600, group: nil), options: HTTPServerOptions(),
                                    handler: StubHandler(allowed: true), logger: Logger(minimumLevel: .critical))
            try server.start()
            defer { server.stop() }
            let listening = server.stopAccepting()
            // libmicrohttpd accepts nothing now: these wait in the kernel's backlog, each with a request sent.
            let clients = try (0..<5).map { _ in try UnixConnection.connect(path: path, timeout: 5) }
            defer { clients.forEach { $0.close() } }
            for client in clients { try client.write(Array("GET /anything HTTP/1.1\r\nHost: x\r\n\r\n".utf8)) }
            // signerd's shutdown, in its order: adopt, close the socket, drain, stop (which closes every connection).
            #expect(server.adoptPendingConnections(from: listening) == 5, "round \(round)")
            close(listening)
            #expect(server.waitForRequestsInProgress(seconds: 5), "round \(round)")
            server.stop()
            for client in clients {
                let answer = client.readUntilClosed()
                #expect(answer.hasPrefix("HTTP/1.1 200"), "round \(round): \(answer)")
                #expect(answer.lowercased().contains("connection: close"), "round \(round): \(answer)")
            }
        }
    }

    /// A review found that one backend holding max_connections plus root
    /// holding the reserve filled libmicrohttpd's limit, so the daemon's own
    /// watchdog check was closed before signerd could admit it (and systemd
    /// would kill a healthy daemon), and root's next connection was closed
    /// without an answer.
    @Test("with max_connections and the reserve held by another process, root's next connection gets 429 and this process still gets its one",
          .enabled(if: getuid() == 0, "needs root (the reserve is for root and the server's own uid)"))
    func ownProcessSlotBeyondReserve() throws {
        try withServer(allowed: true, { $0.connectionLimit = 2; $0.connectionsPerUIDLimit = 100; $0.reservedConnections = 3 }) { path in
            let holder = try holdConnections(5, to: path)
            defer { release(holder) }
            // Another root process: over max_connections and the reserve, answered 429.
            let probe = "import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\ns.settimeout(3)\nprint(s.recv(200).decode(errors='replace').split('\\r\\n')[0])"
            let line = String(decoding: try run(["python3", "-c", probe, path]), as: UTF8.self)
            #expect(line.hasPrefix("HTTP/1.1 429"), "\(line)")
            // This process (the daemon's own watchdog check in signerd): served.
            let client = SignerClient(socketPath: path, timeout: 2)
            defer { client.close() }
            #expect(try client.send("GET", "/anything").status == 200)
        }
    }

    /// A review found that a connection whose client hung up was left out of
    /// the count even while its request was still in the handler (signing,
    /// or hung in the module), though it still held a libmicrohttpd slot: a
    /// client that sends and closes again and again filled every slot, the
    /// daemon's own watchdog check included.
    @Test("connections whose clients left while their requests are still in the handler keep counting; this process still gets its one")
    func abandonedRequestsCount() throws {
        try withServer(allowed: true, { $0.connectionLimit = 2; $0.connectionsPerUIDLimit = 100; $0.reservedConnections = 1 }) { path in
            // A connection over the limit is answered 429 and closed at once, and its send may then meet a broken pipe.
            let script = "import socket,sys,time\nfor _ in range(6):\n    s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n    try: s.sendall(b'GET /slow HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n')\n    except OSError: pass\n    time.sleep(0.15); s.close()"
            _ = try run(["python3", "-c", script, path])
            // Every /slow request is still in the handler for about 3 s: this process's own check gets in now.
            let client = SignerClient(socketPath: path, timeout: 1.5)
            defer { client.close() }
            #expect((try? client.send("GET", "/anything"))?.status == 200)
        }
    }

    @Test("root keeps the reserved connections beyond max_connections",
          .enabled(if: getuid() == 0, "needs root (the reserve is for root and the server's own uid, which are the same here only as root)"))
    func reserveForRoot() throws {
        try withServer(allowed: true, { $0.connectionLimit = 2; $0.connectionsPerUIDLimit = 100; $0.reservedConnections = 3 }) { path in
            let held = try (0..<4).map { _ in try UnixConnection.connect(path: path, timeout: 2) }
            defer { held.forEach { $0.close() } }
            // Four held, the limit is 2: a fifth from root still reaches the handler.
            let client = SignerClient(socketPath: path, timeout: 2)
            defer { client.close() }
            #expect(try client.send("GET", "/anything").status == 200)
        }
    }
}

/// A server left running by `stop()` (a connection thread inside a hung
/// call cannot be joined) later logged through a fixed ring of 16 logger
/// contexts in the C shim. Sixteen server starts after it, its slot named
/// a server freed since, and the test process crashed in the log callback
/// (seen once in a full run of the suite).
@Suite("HTTP server: a server left running keeps its own log context")
struct LeftRunningServerTests {
    /// `/hang` blocks (and counts as a blocking call) until released.
    final class HangingHandler: HTTPHandler, @unchecked Sendable {
        let release = DispatchSemaphore(value: 0)
        let entered = DispatchSemaphore(value: 0)
        func preflight(method: String, path: String, contentTypes: [String], contentCodings: [String], contentLength: Int?, peer: PeerCredentials) -> HTTPResponse? { nil }
        func handle(_ request: HTTPRequest) -> HTTPResponse {
            entered.signal()
            release.wait()
            return HTTPResponse(status: 200, body: Array("{}".utf8))
        }
        func payloadTooLarge(path: String, limit: Int) -> HTTPResponse { HTTPResponse(status: 413, body: []) }
        func mayBlock(path: String) -> Bool { true }
        func timedOut(path: String, reachedToken: Bool) -> HTTPResponse { HTTPResponse(status: 503, body: Array("{}".utf8)) }
        func watchdogTick() {}
        func mayConnect(_ peer: PeerCredentials?) -> Bool { true }
        func sent(status: Int, path: String) {}
    }

    /// A started server with a `HangingHandler`, its log lines, and a client
    /// whose `GET /hang` is inside the handler; the socket is `directory`/s.sock.
    static func serverInsideCall(_ options: HTTPServerOptions) throws -> (HTTPServer, HangingHandler, LineCollector, UnixConnection, String) {
        let lines = LineCollector()
        let directory = TemporaryDirectory.make(prefix: "signerd-inside")
        let handler = HangingHandler()
        let server = HTTPServer(listenDescriptor: try UnixListener.bind(path: directory + "/s.sock", mode: 0o600, group: nil), options: options,
                                handler: handler, logger: Logger(minimumLevel: .trace) { lines.append($0) })
        try server.start()
        let client = try UnixConnection.connect(path: directory + "/s.sock", timeout: 5)
        try client.write(Array("GET /hang HTTP/1.1\r\nHost: x\r\n\r\n".utf8))
        try #require(handler.entered.wait(timeout: .now() + 5) == .success)
        return (server, handler, lines, client, directory)
    }

    /// A stress run's SIGTERM met a request that had come on an open
    /// connection after the drain: stop() took its call for hung, left the
    /// daemon running, and the process crashed in exit(3) under that thread.
    @Test("stop() with a blocking call that ends within a second waits for it and joins every thread")
    func stopWaitsForCallInProgress() throws {
        let (server, handler, lines, client, _) = try Self.serverInsideCall(HTTPServerOptions())
        defer { client.close() }
        DispatchQueue.global().asyncAfter(deadline: .now() + 0.3) { handler.release.signal() }
        #expect(server.stop(), "the call in progress was taken for hung")
        #expect(!lines.lines.contains { $0.contains("http_stop_left_threads") }, "\(lines.lines)")
    }

    @Test("a server stopped with a hung call, then 20 servers started and freed: libmicrohttpd's next message on it reaches its own log, and the process lives")
    func leftRunningServerLogs() throws {
        var options = HTTPServerOptions()
        options.signTimeoutSeconds = 0.2
        let (left, handler, lines, client, directory) = try Self.serverInsideCall(options)
        defer { client.close() }
        var answer: [UInt8] = []
        while (try? client.read(appendingTo: &answer)) ?? 0 > 0 {}
        #expect(String(decoding: answer, as: UTF8.self).hasPrefix("HTTP/1.1 503"), "the watchdog answered")
        left.stop()  // the call is still inside: the server is left running
        #expect(lines.lines.contains { $0.contains("http_stop_left_threads") }, "\(lines.lines)")
        for index in 0..<20 {
            let other = HTTPServer(listenDescriptor: try UnixListener.bind(path: directory + "/s\(index).sock", mode: 0o600, group: nil), options: HTTPServerOptions(),
                                   handler: ConnectionLimitTests.StubHandler(allowed: true), logger: .disabled)
            try other.start()
            other.stop()
        }
        // The hung call returns on a connection the watchdog shut: libmicrohttpd refuses the
        // late answer and logs it through the left server's context (a freed server's
        // before, which crashed this process).
        // It still accepts: a malformed header line makes libmicrohttpd log on
        // it, through the context the ring had given a freed server since.
        let malformed = try UnixConnection.connect(path: directory + "/s.sock", timeout: 5)
        defer { malformed.close() }
        try malformed.write(Array("GET /x HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n".utf8))
        var ignored: [UInt8] = []
        while (try? malformed.read(appendingTo: &ignored)) ?? 0 > 0 {}
        #expect(poll(seconds: 3) { lines.lines.contains { $0.contains("\"http_library\"") } }, "the message reached the left server's own log: \(lines.lines)")
        handler.release.signal()
    }
}
