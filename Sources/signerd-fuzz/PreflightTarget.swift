import Foundation
import HSMSigner
import SignerIPC

/// Fuzz target `preflight`: `SignerService.preflight(...)`, which answers from
/// the request head alone (method, path, media types, codings, length, peer).
///
/// Input: byte 0 picks the peer; then five NUL-separated parts: method, path,
/// Content-Type values (LF-separated), Content-Encoding values
/// (LF-separated), and the Content-Length as decimal text.
enum PreflightTarget {
    /// Runs one input; traps when a refusal is not a 4xx/5xx JSON error.
    static func run(_ input: UnsafeBufferPointer<UInt8>, in env: FuzzEnvironment) {
        guard input.count >= 1 else { return }
        let peer = env.peers[Int(input[0] & 3)]
        let parts = input[1...].split(separator: 0, maxSplits: 4, omittingEmptySubsequences: false)
            .map { String(decoding: $0, as: UTF8.self) }
        func part(_ i: Int) -> String { i < parts.count ? parts[i] : "" }
        func lines(_ i: Int) -> [String] {
            i < parts.count ? part(i).split(separator: "\n", omittingEmptySubsequences: false).map(String.init) : []
        }
        let method = part(0), path = part(1)
        if let response = env.service.preflight(method: method, path: path, contentTypes: lines(2),
                                                contentCodings: lines(3), contentLength: Int(part(4)), peer: peer) {
            env.check(response, statuses: 400..<600, what: "preflight \(method) \(path)")
        }
        _ = env.service.mayBlock(path: path)
    }
}
