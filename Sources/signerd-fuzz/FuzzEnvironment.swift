// The signing service the fuzz targets drive: a real SoftHSM token with the
// test key imported, and a configuration with two keys, allow-lists and
// bundle IDs, so that every endpoint's rules are reachable.
import Foundation
import HSMSigner
import SignerIPC
import Synchronization
import TestSupport

/// A `SignerService` over a throw-away SoftHSM token, made once per process.
///
/// The token holds `ABC123DEFG` (the Apple-form test key); `XYZ987WVUT` is
/// configured but absent, so that a missing key is reachable too. Made with
/// TestSupport's fixtures, as the tests make theirs; the token directory is
/// removed with the fixture's other tokens.
final class FuzzEnvironment: Sendable {
    /// The service under test; its logger is disabled, so fuzzing writes nothing.
    let service: SignerService
    /// The peers an input can pick (2 bits): the caller's own uid, root, an
    /// allow-listed uid (1001) and one that is not allowed (4242).
    let peers: [PeerCredentials] = [
        PeerCredentials(uid: getuid(), gid: getgid(), pid: 1), PeerCredentials(uid: 0, gid: 0, pid: 2),
        PeerCredentials(uid: 1001, gid: 1001, pid: 3), PeerCredentials(uid: 4242, gid: 4242, pid: 4),
    ]

    /// Makes the token, imports the key and opens the service.
    /// - Throws: the fixture's or the token's error; the caller stops, since
    ///   no input can be run without them.
    init() throws {
        let made = try SoftHSMFixture.shared.makeToken("fuzz")
        let files = try TestKeyFiles.make()
        var plain = TokenOptions()
        plain.logger = .disabled
        let importer = try HSMToken(uri: PKCS11URI(made.uri), options: plain)
        _ = try importer.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: "ABC123DEFG", replace: false)
        importer.close()
        var config = SignerConfiguration(tokenURI: made.uri)
        config.keys = [
            KeyConfiguration(keyID: "ABC123DEFG", bundleIDs: ["com.example.app", "com.example.shared"]),
            KeyConfiguration(keyID: "XYZ987WVUT", bundleIDs: ["com.example.other", "com.example.shared"],
                             issuerID: "57246542-96fe-1a63-e053-0824d011072b", allowedUIDs: [1001]),
        ]
        config.issuerID = "57246542-96fe-1a63-e053-0824d011072a"
        config.sessionPoolSize = 2
        config.readinessCacheSeconds = 5
        var options = TokenOptions()
        options.sessionPoolSize = 2
        options.logger = .disabled
        let token = try HSMToken(uri: PKCS11URI(made.uri), options: options)
        service = SignerService(configuration: config, token: token, logger: .disabled)
    }

    /// Fails the input when `response` breaks what every answer promises:
    /// a status between `statuses`, and a JSON body whenever the content type
    /// says JSON (docs/API.md, "Every answer"). With `FUZZ_STRICT` set, a 500
    /// fails it too: no client input may reach the "a bug" status. With
    /// `FUZZ_DEBUG` set, each answer's status and first bytes go to stdout.
    /// Every answer's status is counted in `statusCounts`.
    func check(_ response: HTTPResponse, statuses: Range<Int>, what: String) {
        Self.statusCounts.withLock { $0[response.status, default: 0] += 1 }
        if debug {
            print(response.status, what, String(decoding: response.body.prefix(160), as: UTF8.self))
        }
        precondition(statuses.contains(response.status), "\(what): status \(response.status)")
        if response.contentType.hasPrefix("application/json"),
           (try? JSONSerialization.jsonObject(with: Data(response.body))) == nil {
            fatalError("\(what): body is not JSON: \(String(decoding: response.body.prefix(300), as: UTF8.self))")
        }
        if strict && response.status == 500 {
            fatalError("\(what): 500 for client input: \(String(decoding: response.body.prefix(500), as: UTF8.self))")
        }
    }

    /// How many answers `check` has seen with each HTTP status, in this
    /// process: the replayer prints them (`summary`), so that a replay whose
    /// valid bodies stopped signing shows no 200.
    static let statusCounts = Mutex<[Int: Int]>([:])

    /// The line the replayer ends with after a target that checked answers:
    /// `statuses through TARGET: 200=N 400=N …`, by status, lowest first; nil
    /// when no answer was checked (the `misc` target makes none).
    static func summary(target: String) -> String? {
        let counts = statusCounts.withLock { $0 }
        guard !counts.isEmpty else { return nil }
        return "statuses through \(target): " + counts.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }.joined(separator: " ")
    }

    private let strict = ProcessInfo.processInfo.environment["FUZZ_STRICT"] != nil
    private let debug = ProcessInfo.processInfo.environment["FUZZ_DEBUG"] != nil
}
