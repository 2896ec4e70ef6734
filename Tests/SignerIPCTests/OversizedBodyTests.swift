import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// Bodies over `max_body_bytes`, and bodies of requests answered from the head. The daemon used to
/// answer 413 from the head and close without reading the body, so a client
/// that writes its whole body before it reads (Python's `http.client`,
/// `requests`) failed its write with EPIPE or ECONNRESET once the socket
/// buffers were full, and never saw the 413.
@Suite("Oversized bodies, and bodies of requests answered from the head", .serialized)
struct OversizedBodyTests {
    static let path = "/v1/sign/promotional-offer"

    /// The head of a JSON POST declaring `length` bytes of body.
    static func head(length: Int, extra: String = "") -> [UInt8] {
        Array("POST \(path) HTTP/1.1\r\nHost: signerd\r\nContent-Type: application/json\r\n\(extra)Content-Length: \(length)\r\n\r\n".utf8)
    }

    @Test("a client that writes its whole body first gets the JSON 413, and the connection and the daemon keep serving",
          arguments: [300 * 1024, 1024 * 1024])
    func writeAllThenRead(size: Int) throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 10)
        defer { connection.close() }
        // One write of head and body, as http.client does, before any read.
        try connection.write(Self.head(length: size) + [UInt8](repeating: UInt8(ascii: "a"), count: size))
        let answer = try connection.readResponse()
        #expect(answer.head.hasPrefix("HTTP/1.1 413"), "\(answer.head)")
        let error = try JSONDecoder().decode(ErrorResponse.self, from: Data(answer.body.utf8)).error
        #expect(error.code == "payload_too_large" && error.message.contains("65536"), "\(error)")
        // The body was read to its end, so the connection is still in step.
        try connection.write(Array("GET /healthz HTTP/1.1\r\nHost: signerd\r\n\r\n".utf8))
        #expect(try connection.readResponse().head.hasPrefix("HTTP/1.1 200"))
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        #expect(daemon.verifies(try client.send("POST", Self.path, body: daemon.offerBody)))
    }

    /// The same broken pipe met a large body sent to an unknown path or
    /// with the wrong `Content-Type`: those are answered from the head too.
    /// `size` bytes of body as one chunk and the last chunk (RFC 9112 §7.1).
    static func chunked(_ size: Int) -> [UInt8] {
        Array("\(String(size, radix: 16))\r\n".utf8) + [UInt8](repeating: UInt8(ascii: "a"), count: size) + Array("\r\n0\r\n\r\n".utf8)
    }

    @Test("answers decided from the head (404, 415) reach a client that writes a 300 KB body first, with Content-Length or chunked, and the connection keeps serving",
          arguments: [("/v1/no-such-endpoint", "application/json", 404, "not_found"), (path, "text/plain", 415, "unsupported_media_type")], [false, true])
    func headAnswersAfterTheBody(case: (target: String, contentType: String, status: Int, code: String), chunked: Bool) throws {
        let (target, contentType, status, code) = `case`
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 10)
        defer { connection.close() }
        let size = 300 * 1024
        // A chunked body used to be answered from the head and the
        // connection closed unread: the client's write met a broken pipe.
        let framing = chunked ? "Transfer-Encoding: chunked" : "Content-Length: \(size)"
        try connection.write(Array("POST \(target) HTTP/1.1\r\nHost: signerd\r\nContent-Type: \(contentType)\r\n\(framing)\r\n\r\n".utf8)
                             + (chunked ? Self.chunked(size) : [UInt8](repeating: UInt8(ascii: "a"), count: size)))
        let answer = try connection.readResponse()
        #expect(answer.head.hasPrefix("HTTP/1.1 \(status)"), "\(answer.head)")
        #expect(answer.body.contains("\"\(code)\""), "\(answer.body)")
        try connection.write(Array("GET /healthz HTTP/1.1\r\nHost: signerd\r\n\r\n".utf8))
        #expect(try connection.readResponse().head.hasPrefix("HTTP/1.1 200"))
    }

    @Test("a body past the drain limit, or sent with Expect: 100-continue, is answered 413 from the head, before any body byte")
    func answeredFromTheHead() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        #expect(HTTPServerOptions().drainedBodyLimit == 1024 * 1024)
        for (length, extra) in [(1024 * 1024 + 1, ""), (300 * 1024, "Expect: 100-continue\r\n")] {
            // A 2 s read timeout: well under the 10 s a body never sent would take to time out.
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 2)
            defer { connection.close() }
            try connection.write(Self.head(length: length, extra: extra))
            let answer = try connection.readResponse()
            #expect(answer.head.hasPrefix("HTTP/1.1 413"), "\(length) \(extra): \(answer.head)")
            #expect(answer.body.contains("payload_too_large"), "\(answer.body)")
        }
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        #expect(try client.send("GET", "/healthz").status == 200)
    }

    @Test("a chunked body past the drain limit is answered (413, or the head's 404) once the limit is passed, and the connection closed")
    func chunkedPastTheDrainLimit() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        for (target, status) in [(Self.path, 413), ("/v1/no-such-endpoint", 404)] {
            // A 3 s read timeout: well under the 10 s request timeout that
            // used to end a chunked body that never ends.
            let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 3)
            defer { connection.close() }
            let limit = HTTPServerOptions().drainedBodyLimit
            // 64 KiB chunks past the limit, and no last chunk.
            var request = Array("POST \(target) HTTP/1.1\r\nHost: signerd\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n".utf8)
            for _ in 0..<(limit / 0x10000 + 2) {
                request += Array("10000\r\n".utf8) + [UInt8](repeating: UInt8(ascii: "a"), count: 0x10000) + Array("\r\n".utf8)
            }
            // The write may meet the close once the limit is passed.
            try? connection.write(request)
            let answer = try connection.readResponse()
            #expect(answer.head.hasPrefix("HTTP/1.1 \(status)"), "\(target): \(answer.head)")
            #expect(answer.head.lowercased().contains("connection: close"), "\(answer.head)")
            // Closed: end of stream, or a reset (Linux resets a Unix socket
            // closed with bytes unread); not a read that times out.
            var rest: [UInt8] = []
            let closed: Bool
            do { closed = try connection.read(appendingTo: &rest) == 0 } catch { closed = "\(error)".contains("reset by peer") }
            #expect(closed, "the connection is closed after the answer")
        }
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        #expect(try client.send("GET", "/healthz").status == 200)
    }
}
