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
            guard reused, error.errno == EPIPE || error.errno == ECONNRESET || error.message.hasSuffix("closed the connection") else { throw error }
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
            if try fill(connection) == 0 {
                throw SocketError(sawBytes ? "the daemon closed the connection mid-response" : "the daemon closed the connection")
            }
            sawBytes = true
        }
        let head = try HTTPHead(Array(buffer[0..<headEnd!]))  // set in the loop
        buffer.removeFirst(headEnd! + 4)
        let length = Int(head.headers["content-length"] ?? "0") ?? 0
        while buffer.count < length {
            if try fill(connection) == 0 {
                throw SocketError("the daemon closed the connection mid-response")
            }
        }
        let body = Array(buffer[0..<length])
        buffer.removeFirst(length)
        if head.headers["connection"]?.lowercased() == "close" {
            close()
        }
        return ClientResponse(status: head.status, headers: head.headers, body: body)
    }

    private func fill(_ connection: UnixConnection) throws(SocketError) -> Int {
        try connection.read(appendingTo: &buffer)
    }
}

/// The status line and headers of a response.
struct HTTPHead {
    var status: Int
    var headers: [String: String] = [:]

    /// Index of the blank line ending the head, if it is in `bytes`.
    static func end(of bytes: [UInt8]) -> Int? {
        guard bytes.count >= 4 else { return nil }
        for index in 0...(bytes.count - 4) where bytes[index] == 13 && bytes[index + 1] == 10 && bytes[index + 2] == 13 && bytes[index + 3] == 10 {
            return index
        }
        return nil
    }

    init(_ bytes: [UInt8]) throws(SocketError) {
        let lines = String(decoding: bytes, as: UTF8.self).components(separatedBy: "\r\n")
        let statusParts = lines.first?.split(separator: " ", maxSplits: 2) ?? []
        guard statusParts.count >= 2, statusParts[0].hasPrefix("HTTP/1."), let status = Int(statusParts[1]) else {
            throw SocketError("the daemon's response does not start with an HTTP/1.1 status line")
        }
        self.status = status
        for line in lines.dropFirst() {
            guard let colon = line.firstIndex(of: ":") else { continue }
            let name = line[..<colon].lowercased()
            let value = line[line.index(after: colon)...].trimmingCharacters(in: .whitespaces)
            headers[name] = value
        }
    }
}
