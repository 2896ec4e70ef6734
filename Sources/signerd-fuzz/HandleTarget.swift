import Foundation
import HSMSigner
import SignerIPC

/// Fuzz target `handle`: `SignerService.handle(_:)`, the request router, every
/// endpoint's body reader and field rules, signing included.
///
/// Input: byte 0 picks the path (every route, plus near misses), byte 1 the
/// peer (bits 0–1) and whether the method is wrong (bit 2); the rest is the body.
enum HandleTarget {
    /// The paths byte 0 picks from.
    static let paths = Route.allCases.map(\.rawValue) + ["/v1/sign/", "/", "/v1/keys/", "/V1/KEYS"]

    /// Runs one input; traps when an answer breaks `FuzzEnvironment.check`.
    static func run(_ input: UnsafeBufferPointer<UInt8>, in env: FuzzEnvironment) {
        guard input.count >= 2 else { return }
        let path = paths[Int(input[0]) % paths.count]
        let peer = env.peers[Int(input[1] & 3)]
        let method = input[1] & 4 != 0 ? "PUT" : Route(path: path)?.method ?? "POST"
        let request = HTTPRequest(method: method, path: path, contentType: "application/json", body: Array(input[2...]), peer: peer)
        env.check(env.service.handle(request), statuses: 200..<600, what: "\(method) \(path)")
    }
}
