import Foundation
import SignerIPC
import TestSupport
import Testing

/// A body declared in another charset (`application/json; charset=utf-16`)
/// used to be accepted and read as UTF-8. signerd reads JSON as UTF-8 only
/// (RFC 8259 §8.1), so such a request gets 415 naming the charset.
@Suite("Content-Type charset", .serialized)
struct ContentTypeCharsetTests {
    static let refused = [
        "application/json; charset=utf-16",
        "application/json; charset=UTF-16LE",
        "application/json;charset=latin-1",
        #"application/json; charset="ISO-8859-1""#,
        "APPLICATION/JSON; foo=bar; CHARSET=utf-32",
        #"application/json; charset="utf-8"; charset=utf-16"#,
    ]

    static let accepted = [
        "application/json; charset=utf-8",
        "application/json; charset=UTF-8",
        #"application/json; charset="utf-8""#,
        "application/json;charset=Utf-8",
        "application/json; CHARSET=utf-8; foo=bar",
        #"application/json; foo="a;charset=utf-16""#,
        "application/json; Charset=us-ascii",  // ASCII text is UTF-8 text
        "application/json; charset=utf8",  // a common unregistered spelling
    ]

    /// The charset as the message should name it: the value without its quotes.
    static func charset(in contentType: String) -> String {
        let value = contentType.lowercased().components(separatedBy: "charset=").last ?? ""
        let original = contentType.suffix(value.count)
        return String(original).trimmingCharacters(in: CharacterSet(charactersIn: "\""))
    }

    /// The answer to a promotional-offer request sent with `contentType`,
    /// and whether it is a signature that verifies with the daemon's key.
    static func sign(contentType: String) throws -> (response: ClientResponse, verified: Bool) {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        let response = try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody, contentType: contentType)
        return (response, daemon.verifies(response))
    }

    @Test("a charset other than UTF-8 gets 415 unsupported_media_type naming it", arguments: refused)
    func otherCharset(_ contentType: String) throws {
        let response = try Self.sign(contentType: contentType).response
        #expect(response.status == 415, "\(String(decoding: response.body, as: UTF8.self))")
        let error = try #require(response.error)
        #expect(error.code == "unsupported_media_type")
        #expect(error.message.contains("\"\(Self.charset(in: contentType))\"") && error.message.contains("UTF-8 only"), "\(error.message)")
    }

    @Test("UTF-8, in any case and quoted or not, is accepted", arguments: accepted)
    func utf8(_ contentType: String) throws {
        let (response, verified) = try Self.sign(contentType: contentType)
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        #expect(verified, "the signature verifies with the daemon's public key")
    }

    /// Sends `request` and then `GET /healthz` (closing) on one new
    /// connection to `daemon`; returns everything it answered, as text.
    static func thenHealth(_ daemon: InProcessDaemon, _ request: String) throws -> String {
        let connection = try UnixConnection.connect(path: daemon.socketPath, timeout: 5)
        defer { connection.close() }
        try connection.write(Array((request + "GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").utf8))
        return connection.readUntilClosed()
    }

    /// Only the first of two Content-Type headers was read: a second one
    /// declaring UTF-16 was signed as UTF-8, and the other order got 415.
    @Test("two Content-Type headers, in either order or the same twice, get 415 naming both (a single-valued header); the connection keeps serving")
    func twoContentTypes() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let body = #"{"bundle_id":"\#(daemon.bundleID)","product_id":"p","offer_id":"o"}"#
        let pairs = [("application/json", "application/json; charset=utf-16"), ("application/json; charset=utf-16", "application/json"), ("application/json", "application/json")]
        for (first, second) in pairs {
            let text = try Self.thenHealth(daemon, "POST /v1/sign/promotional-offer HTTP/1.1\r\nHost: x\r\nContent-Type: \(first)\r\nContent-Type: \(second)\r\nContent-Length: \(body.utf8.count)\r\n\r\n\(body)")
            #expect(text.hasPrefix("HTTP/1.1 415"), "\(first) + \(second): \(text)")
            #expect(text.contains("unsupported_media_type") && text.contains("2 Content-Type headers (\(first) and \(second))"), "\(text)")
            #expect(text.contains("HTTP/1.1 200") && text.contains(#""status":"ok""#), "the next request on the connection is served: \(text)")
        }
    }

    /// Found by an attack run: an empty header got "…; got " with nothing after it.
    @Test("a missing or empty Content-Type gets 415 saying which; the connection keeps serving")
    func missingOrEmptyContentType() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let body = #"{"bundle_id":"\#(daemon.bundleID)","product_id":"p","offer_id":"o"}"#
        for (header, said) in [("", "got none"), ("Content-Type:\r\n", "got an empty Content-Type"), ("Content-Type:   \r\n", "got an empty Content-Type")] {
            let text = try Self.thenHealth(daemon, "POST /v1/sign/promotional-offer HTTP/1.1\r\nHost: x\r\n\(header)Content-Length: \(body.utf8.count)\r\n\r\n\(body)")
            #expect(text.hasPrefix("HTTP/1.1 415"), "\(header.debugDescription): \(text)")
            #expect(text.contains("unsupported_media_type") && text.contains("application/json (UTF-8); \(said)\""), "\(text)")
            #expect(text.contains("HTTP/1.1 200") && text.contains(#""status":"ok""#), "the next request on the connection is served: \(text)")
        }
    }
}
