import Foundation
import Testing
import TestSupport
@testable import SignerIPC

/// signctl trusts nothing the socket's server sends: whatever listens at
/// `socket_path` (a stale path, another program) must not crash it. A
/// negative `Content-Length` made `SignerClient` slice `buffer[0..<-1]`
/// and trap; `signctl bench` indexed `bundle_ids[0]` of a key listed with
/// none.
@Suite("A server at the socket path that is not signerd")
struct HostileServerTests {
    /// Listens at a fresh socket path and answers every connection's first
    /// request with `answer`, then closes it; runs until `connections`
    /// connections were served.
    final class CannedServer: @unchecked Sendable {
        let path: String
        private let fd: Int32
        private let thread: Thread

        init(answer: [UInt8], connections: Int = 1) throws {
            let directory = TemporaryDirectory.make(prefix: "signerd-canned")
            path = directory + "/canned.sock"
            fd = try UnixListener.bind(path: path, mode: 0o600, group: nil)
            let listener = fd
            thread = Thread {
                for _ in 0..<connections {
                    var pollfd = Glibc.pollfd(fd: listener, events: Int16(POLLIN), revents: 0)
                    guard poll(&pollfd, 1, 10_000) == 1 else { return }
                    let connection = accept(listener, nil, nil)
                    guard connection >= 0 else { return }
                    var request = [UInt8](repeating: 0, count: 4096)
                    _ = read(connection, &request, request.count)
                    answer.withUnsafeBytes { _ = write(connection, $0.baseAddress, $0.count) }
                    close(connection)
                }
            }
            thread.start()
        }

        deinit { close(fd) }
    }

    @Test("a response's Content-Length that is not a byte count is an error, not a trap",
          arguments: ["-1", "+5", "5 5", "0x10", "99999999999999999999", "1e3", "", "67108865"])
    func malformedContentLength(value: String) throws {
        let server = try CannedServer(answer: Array("HTTP/1.1 200 OK\r\nContent-Length: \(value)\r\n\r\n{}".utf8))
        let error = #expect(throws: SocketError.self) {
            try SignerClient(socketPath: server.path, timeout: 5).send("GET", "/healthz")
        }
        #expect(error?.message.contains("Content-Length is not a byte count") == true, "\(String(describing: error))")
    }

    @Test("a well-formed Content-Length is read as the body's length")
    func wellFormedContentLength() throws {
        let server = try CannedServer(answer: Array("HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n{\"status\":\"ok\"}trailing".utf8))
        let response = try SignerClient(socketPath: server.path, timeout: 5).send("GET", "/healthz")
        #expect(response.status == 200)
        #expect(response.body == Array("{\"status\":\"ok\"}".utf8))
    }

    @Test("a head that never ends is cut off at 64 KiB")
    func endlessHead() throws {
        let server = try CannedServer(answer: Array("HTTP/1.1 200 OK\r\n".utf8) + Array(repeating: UInt8(ascii: "x"), count: 200_000))
        let error = #expect(throws: SocketError.self) {
            try SignerClient(socketPath: server.path, timeout: 5).send("GET", "/healthz")
        }
        #expect(error?.message.contains("head is longer than 65536 bytes") == true, "\(String(describing: error))")
    }

    @Test("signctl bench against a key listed with no bundle ID says to pass --bundle-id")
    func benchKeyWithoutBundle() throws {
        let keys = #"{"keys":[{"key_id":"ABC123DEFG","issuer_id":"57246542-96fe-1a63-e053-0824d011072a","bundle_ids":[],"curve":"P-256","token_label":"t"}]}"#
        let server = try CannedServer(answer: Array("HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: \(keys.utf8.count)\r\n\r\n\(keys)".utf8))
        let generator = LoadGenerator(socketPath: server.path, endpoint: .promotionalOffer, concurrency: 1, length: .requests(1), verify: false)
        let error = #expect(throws: BenchmarkError.self) {
            _ = try generator.run()
        }
        #expect(error?.description.contains("listed with no bundle ID; pass --bundle-id") == true, "\(String(describing: error))")
    }
}
