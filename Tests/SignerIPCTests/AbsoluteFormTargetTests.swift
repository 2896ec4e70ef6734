import Foundation
import SignerIPC
import TestSupport
import Testing

/// RFC 9112 §3.2.2: a server must accept a request target in absolute-form
/// (`GET http://signerd/healthz HTTP/1.1`), and route it on its path. It
/// used to get 404, the whole URL taken for the path.
@Suite("Absolute-form request targets", .serialized)
struct AbsoluteFormTargetTests {
    struct Case: Sendable, CustomTestStringConvertible {
        let method: String
        let target: String
        let status: Int
        /// For an error, the path its message names.
        var named: String? = nil
        /// For an error, its code: `not_found` for 404, `method_not_allowed` for 405.
        var code: String? { status == 404 ? "not_found" : status == 405 ? "method_not_allowed" : nil }
        var testDescription: String { "\(method) \(target)" }
    }

    static let cases: [Case] = [
        Case(method: "GET", target: "http://signerd/healthz", status: 200),
        Case(method: "GET", target: "HTTP://SIGNERD/healthz?probe=1", status: 200),
        Case(method: "GET", target: "https://signerd:443/v1/keys", status: 200),
        Case(method: "GET", target: "http://user@signerd/readyz", status: 200),
        Case(method: "POST", target: "http://signerd/v1/sign/promotional-offer", status: 200),
        Case(method: "POST", target: "http://signerd/healthz", status: 405, named: "/healthz"),
        Case(method: "GET", target: "http://signerd/healthz/", status: 404, named: "/healthz/"),
        Case(method: "GET", target: "http://signerd/v1/nothing?x=/healthz", status: 404, named: "/v1/nothing"),
        Case(method: "GET", target: "http://signerd", status: 404, named: "at /;"),
        Case(method: "GET", target: "http://signerd?/healthz", status: 404, named: "at /;"),
        // An attack round: the text after `#` was taken for the path.
        Case(method: "GET", target: "http://signerd#/healthz", status: 404, named: "at /;"),
        Case(method: "POST", target: "http://signerd#/v1/sign/promotional-offer", status: 404, named: "at /;"),
    ]

    @Test("the target's path is routed, as in origin-form", arguments: cases)
    func routedOnPath(_ target: Case) throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        let body = target.method == "POST" ? daemon.offerBody : nil
        let response = try client.send(target.method, target.target, body: body)
        #expect(response.status == target.status, "\(String(decoding: response.body, as: UTF8.self))")
        if let named = target.named {
            #expect(response.error?.code == target.code, "\(String(decoding: response.body, as: UTF8.self))")
            #expect(response.error?.message.contains(named) == true, "\(response.error?.message ?? "")")
        }
        if target.target.hasSuffix("/healthz") && target.status == 200 {
            #expect(String(decoding: response.body, as: UTF8.self) == #"{"status":"ok"}"#)
        }
        if target.method == "POST" && target.status == 200 {
            #expect(daemon.verifies(response), "the signature verifies with the daemon's public key")
        }
        // The same connection still serves a signature after an error.
        let next = try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
        #expect(daemon.verifies(next), "after \(target.testDescription): \(String(decoding: next.body, as: UTF8.self))")
    }
}
