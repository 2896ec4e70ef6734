import Foundation
import HSMSigner

/// A response as the client reads it.
public struct ClientResponse: Sendable {
    /// The HTTP status.
    public var status: Int
    /// Header names lowercased.
    public var headers: [String: String]
    /// The body.
    public var body: [UInt8]

    /// Decodes the body as `T`.
    /// - Throws: `DecodingError` when the body is not a `T`.
    public func decode<T: Decodable>(_ type: T.Type) throws -> T {
        try JSONDecoder().decode(type, from: Data(body))
    }

    /// The contract's error object, when the body carries one.
    public var error: ErrorResponse.Body? {
        (try? JSONDecoder().decode(ErrorResponse.self, from: Data(body)))?.error
    }
}

/// A small HTTP/1.1 client for signerd's Unix socket, used by `signctl`,
/// the benchmark and the tests. It speaks only what signerd answers
/// (responses with `Content-Length`), keeps the connection alive and
/// reconnects when the server closed it.
///
/// Not thread-safe: one client per thread.
public final class SignerClient {
    /// The socket path.
    public let socketPath: String
    private let timeout: Double
    private var connection: UnixConnection?
    private var buffer: [UInt8] = []

    /// Makes a client; it connects on the first request.
    /// - Parameters:
    ///   - socketPath: signerd's socket.
    ///   - timeout: per read and write, in seconds.
    public init(socketPath: String, timeout: Double = 30) {
        self.socketPath = socketPath
        self.timeout = timeout
    }

    /// The credentials of the process at the other end (the daemon), once connected.
    public var peer: PeerCredentials? {
        if connection == nil {
            connection = try? UnixConnection.connect(path: socketPath, timeout: timeout)
        }
        return connection.flatMap { UnixListener.peerCredentials($0.fd) }
    }

    /// Closes the connection.
    public func close() {
        connection?.close()
        connection = nil
        buffer.removeAll()
    }

    /// Sends one request and reads the response.
    /// - Parameters:
    ///   - method: `GET` or `POST`.
    ///   - path: e.g. `/v1/sign/promotional-offer`.
    ///   - body: JSON bytes for `POST`.
    ///   - contentType: defaults to `application/json` when a body is sent.
    /// - Returns: status, headers and body.
    /// - Throws: ``SocketError`` when the daemon is unreachable or the
    ///   connection breaks. A kept-alive connection found closed before any
    ///   response byte arrived is replaced and the request sent once more
    ///   (signing requests are safe to repeat: each gets a fresh nonce).
    public func send(_ method: String, _ path: String, body: [UInt8]? = nil, contentType: String? = nil) throws(SocketError) -> ClientResponse {
        var head = "\(method) \(path) HTTP/1.1\r\nHost: signerd\r\n"
        if let body {
            head += "Content-Type: \(contentType ?? "application/json")\r\nContent-Length: \(body.count)\r\n"
        }
        head += "\r\n"
        var request = Array(head.utf8)
        if let body { request += body }
        // A kept-alive connection the server closed meanwhile fails on the
        // first write or read with nothing received: retry once on a new one.
        let reused = connection != nil
        do {
            return try exchange(request)
        } catch {
            close()
            guard reused, error.errno == EPIPE || error.errno == ECONNRESET || error.peerClosed == .beforeResponse else { throw error }
            return try exchange(request)
        }
    }

    /// `POST` with a JSON-encoded body.
    public func post(_ path: String, _ value: some Encodable) throws -> ClientResponse {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.withoutEscapingSlashes]
        return try send("POST", path, body: Array(try encoder.encode(value)))
    }

    private func exchange(_ request: [UInt8]) throws(SocketError) -> ClientResponse {
        if connection == nil {
            connection = try UnixConnection.connect(path: socketPath, timeout: timeout)
            buffer.removeAll(keepingCapacity: true)
        }
        let connection = connection!  // set above
        do {
            try connection.write(request)
        } catch {
            // The server may have answered early (413, 403) and closed its
            // side: read what it sent before giving up.
            guard (try? fill(connection)) ?? 0 > 0 else { throw error }
        }
        // Head.
        var headEnd: Int?
        var sawBytes = !buffer.isEmpty
        while true {
            if let end = HTTPHead.end(of: buffer) {
                headEnd = end
                break
            }
            guard buffer.count <= Self.maximumHeadBytes else {
                throw SocketError("the response's head is longer than \(Self.maximumHeadBytes) bytes: the socket's server is not signerd")
            }
            if try fill(connection) == 0 {
                throw sawBytes ? SocketError("the daemon closed the connection mid-response", peerClosed: .midResponse)
                               : SocketError("the daemon closed the connection", peerClosed: .beforeResponse)
            }
            sawBytes = true
        }
        let head = try HTTPHead(buffer[0..<headEnd!])  // set in the loop
        buffer.removeFirst(headEnd! + 4)
        let length = try Self.contentLength(head.headers["content-length"])
        while buffer.count < length {
            if try fill(connection) == 0 {
                throw SocketError("the daemon closed the connection mid-response", peerClosed: .midResponse)
            }
        }
        let body = Array(buffer[0..<length])
        buffer.removeFirst(length)
        if head.headers["connection"]?.lowercased() == "close" {
            close()
        }
        return ClientResponse(status: head.status, headers: head.headers, body: body)
    }

    /// The longest response head read, in bytes: signerd's are a few
    /// hundred.
    static let maximumHeadBytes = 64 * 1024

    /// The longest response body read, in bytes: signerd's largest answer
    /// (`/metrics`, `/v1/keys`) is tens of KiB.
    static let maximumBodyBytes = 64 * 1024 * 1024

    /// A response's `Content-Length` (RFC 9110, section 8.6: 1*DIGIT),
    /// 0 when absent.
    /// - Throws: ``SocketError`` for anything but decimal digits, or a
    ///   length over ``maximumBodyBytes``: the socket's server is then not
    ///   signerd, and nothing of its answer is trusted.
    static func contentLength(_ value: String?) throws(SocketError) -> Int {
        guard let value else { return 0 }
        guard !value.isEmpty, value.utf8.count <= 9, value.utf8.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }),
              let length = Int(value), length <= maximumBodyBytes else {
            throw SocketError("the response's Content-Length is not a byte count up to \(maximumBodyBytes): the socket's server is not signerd")
        }
        return length
    }

    private func fill(_ connection: UnixConnection) throws(SocketError) -> Int {
        try connection.read(appendingTo: &buffer)
    }
}

/// The status line and headers of a response, read from bytes (the
/// benchmark client runs this for every response, so no Foundation string
/// splitting here).
struct HTTPHead {
    var status: Int
    var headers: [String: String] = [:]

    /// Index of the blank line ending the head, if it is in `bytes`.
    static func end(of bytes: [UInt8]) -> Int? {
        guard bytes.count >= 4 else { return nil }
        return bytes.withUnsafeBufferPointer { buffer -> Int? in
            var index = 0
            while index + 3 < buffer.count {
                if buffer[index + 3] != 10 {
                    index += 1
                    continue
                }
                if buffer[index] == 13 && buffer[index + 1] == 10 && buffer[index + 2] == 13 {
                    return index
                }
                index += 1
            }
            return nil
        }
    }

    init(_ bytes: ArraySlice<UInt8>) throws(SocketError) {
        // "HTTP/1.1 200 OK"
        guard bytes.count >= 12, bytes.starts(with: Array("HTTP/1.".utf8)) else {
            throw SocketError("the daemon's response does not start with an HTTP/1.1 status line")
        }
        let start = bytes.startIndex
        var status = 0
        for offset in 9..<12 {
            let digit = bytes[start + offset]
            guard digit >= 0x30 && digit <= 0x39 else {
                throw SocketError("the daemon's response has no numeric status")
            }
            status = status * 10 + Int(digit - 0x30)
        }
        self.status = status
        var lineStart = start
        var index = start
        while index < bytes.endIndex {
            if bytes[index] == 10 {
                if lineStart != start {
                    Self.addHeader(bytes[lineStart..<index], to: &headers)
                }
                lineStart = index + 1
            }
            index += 1
        }
        if lineStart < bytes.endIndex && lineStart != start {
            Self.addHeader(bytes[lineStart..<bytes.endIndex], to: &headers)
        }
    }

    private static func addHeader(_ line: ArraySlice<UInt8>, to headers: inout [String: String]) {
        guard let colon = line.firstIndex(of: UInt8(ascii: ":")) else { return }
        let name = String(decoding: line[line.startIndex..<colon].map { $0 >= 0x41 && $0 <= 0x5a ? $0 + 0x20 : $0 }, as: UTF8.self)
        var valueStart = colon + 1
        var valueEnd = line.endIndex
        while valueStart < valueEnd && (line[valueStart] == 0x20 || line[valueStart] == 0x09) { valueStart += 1 }
        while valueEnd > valueStart && (line[valueEnd - 1] == 0x0d || line[valueEnd - 1] == 0x20) { valueEnd -= 1 }
        headers[name] = String(decoding: line[valueStart..<valueEnd], as: UTF8.self)
    }
}
