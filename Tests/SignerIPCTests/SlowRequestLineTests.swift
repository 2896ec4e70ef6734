import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// A request line sent a byte at a time. libmicrohttpd's idle timeout starts
/// again with every byte and it reports nothing before a whole request line,
/// so without signerd's own bound such a client holds its connection (and
/// its thread) for as long as it keeps trickling.
@Suite("Request lines trickled a byte at a time", .serialized)
struct SlowRequestLineTests {
    static let idle = 1
    static let request = 1

    static func daemon() throws -> InProcessDaemon {
        try InProcessDaemon { config in
            config.idleTimeoutSeconds = idle
            config.requestTimeoutSeconds = request
        }
    }

    /// Writes `bytes` one at a time, `interval` seconds apart, until the
    /// daemon cuts the connection; returns the seconds from the first byte
    /// to the cut, or nil when every byte was written and the connection is
    /// still open.
    static func trickle(_ bytes: [UInt8], interval: Double, on connection: UnixConnection, between: () throws -> Void) throws -> Double? {
        let started = MonotonicClock.now()
        func elapsed() -> Double { Double(MonotonicClock.now() - started) / 1e9 }
        for byte in bytes {
            do {
                try connection.write([byte])
            } catch {
                return elapsed()
            }
            usleep(useconds_t(interval * 1e6))
            try between()
        }
        var received: [UInt8] = []
        let closed = ((try? connection.read(appendingTo: &received)) ?? 0) == 0
        return closed ? elapsed() : nil
    }

    @Test("a request line trickled one byte per 300 ms is cut at idle_timeout_seconds + request_timeout_seconds; others are served meanwhile")
    func trickledRequestLine() throws {
        let daemon = try Self.daemon()
        defer { daemon.stop() }
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 30)
        defer { connection.close() }
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        // 42 bytes at 300 ms: 12.6 s for the request line, each byte well
        // inside the 1 s idle timeout.
        let line = Array("POST /v1/sign/promotional-offer HTTP/1.1\r\n".utf8)
        let cut = try Self.trickle(line, interval: 0.3, on: connection) {
            let status = try client.send("GET", "/healthz").status
            #expect(status == 200, "another client was not served while one trickled")
        }
        let seconds = try #require(cut, "the whole request line was trickled in and the connection is still open")
        // Allowed: 2 s, checked every 250 ms, plus one 300 ms byte interval.
        #expect(seconds >= Double(Self.idle + Self.request) - 0.3, "cut after \(seconds) s, before the bound")
        #expect(seconds < 5, "cut after \(seconds) s")
        let metrics = String(decoding: try client.send("GET", "/metrics").body, as: UTF8.self)
        #expect(metrics.contains("signerd_dropped_slow_requests_total 1"))
        let dropped = daemon.logLines.lines.filter { $0.contains("\"msg\":\"slow_request_dropped\"") }
        #expect(dropped.count == 1)
        #expect(dropped.first?.contains("\"phase\":\"request_line\"") == true, "\(dropped)")
    }

    @Test("a keep-alive client that waits under idle_timeout_seconds between whole requests is served every time")
    func promptRequestsAfterIdle() throws {
        let daemon = try Self.daemon()
        defer { daemon.stop() }
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 30)
        defer { connection.close() }
        // Idle 0.8 s before each request (under the 1 s idle timeout), over
        // 4 s: past idle + request timeout counted from the connect.
        for round in 0..<5 {
            usleep(800_000)
            try connection.write(Array("GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n".utf8))
            var received: [UInt8] = []
            while !String(decoding: received, as: UTF8.self).contains("\"ok\"") {
                let count = try connection.read(appendingTo: &received)
                try #require(count > 0, "round \(round): connection closed; received \(String(decoding: received, as: UTF8.self))")
            }
            #expect(String(decoding: received, as: UTF8.self).hasPrefix("HTTP/1.1 200"), "round \(round)")
        }
        #expect(daemon.logged("slow_request_dropped") == 0)
    }
}
