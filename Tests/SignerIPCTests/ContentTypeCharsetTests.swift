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

    static func sign(contentType: String) throws -> ClientResponse {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        let body = Array(#"{"bundle_id":"\#(daemon.bundleID)","product_id":"p","offer_id":"o"}"#.utf8)
        return try client.send("POST", "/v1/sign/promotional-offer", body: body, contentType: contentType)
    }

    @Test("a charset other than UTF-8 gets 415 unsupported_media_type naming it", arguments: refused)
    func otherCharset(_ contentType: String) throws {
        let response = try Self.sign(contentType: contentType)
        #expect(response.status == 415, "\(String(decoding: response.body, as: UTF8.self))")
        let error = try #require(response.error)
        #expect(error.code == "unsupported_media_type")
        #expect(error.message.contains("\"\(Self.charset(in: contentType))\"") && error.message.contains("UTF-8 only"), "\(error.message)")
    }

    @Test("UTF-8, in any case and quoted or not, is accepted", arguments: accepted)
    func utf8(_ contentType: String) throws {
        let response = try Self.sign(contentType: contentType)
        #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
        #expect(try response.decode(PromotionalOfferResponse.self).signature.isEmpty == false)
    }
}
