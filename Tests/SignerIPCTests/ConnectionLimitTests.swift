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
    /// Answers 200 `{}`; `allowed` decides ``mayConnect(_:)``.
    final class StubHandler: HTTPHandler {
        let allowed: Bool
        init(allowed: Bool) { self.allowed = allowed }
        func preflight(method: String, path: String, contentType: String?, contentLength: Int?, peer: PeerCredentials) -> HTTPResponse? { nil }
        func handle(_ request: HTTPRequest) -> HTTPResponse { HTTPResponse(status: 200, body: Array("{}".utf8)) }
        func payloadTooLarge(path: String, limit: Int) -> HTTPResponse { HTTPResponse(status: 413, body: []) }
        func mayBlock(path: String) -> Bool { false }
        func timedOut(path: String) -> HTTPResponse { HTTPResponse(status: 503, body: []) }
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
        var received: [UInt8] = []
        while (try? connection.read(appendingTo: &received)) ?? 0 > 0 {}
        return String(decoding: received, as: UTF8.self)
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
        }
    }

    @Test("root keeps the reserved connections beyond max_connections")
    func reserveForRoot() throws {
        guard getuid() == 0 else {
            print("SKIP reserveForRoot: needs root (the reserve is for root and the server's own uid, which are the same here only as root)")
            return
        }
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
