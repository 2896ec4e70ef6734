import Foundation
import HSMSigner
import SignerIPC
import Synchronization
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// Where the built `signerd` and `signctl` are: `SIGNERD_BIN_DIR`, else this
/// checkout's `.build/debug` (built by `swift build --build-tests`).
enum Binaries {
    static let root: String = {
        var url = URL(fileURLWithPath: #filePath)
        for _ in 0..<4 { url.deleteLastPathComponent() }  // Tests/EndToEndTests/Support/DaemonHarness.swift
        return url.path
    }()
    static let directory = ProcessInfo.processInfo.environment["SIGNERD_BIN_DIR"] ?? root + "/.build/debug"
    static let signerd = directory + "/signerd"
    static let signctl = directory + "/signctl"
}

/// A real `signerd` process on a real SoftHSM token made by
/// `scripts/softhsm-setup.sh`, with keys imported by `signctl`, in a
/// directory of its own.
final class DaemonHarness: @unchecked Sendable {
    // Mutated only by the test that owns the harness.
    let directory: String
    let socketPath: String
    let configPath: String
    let tokenURI: String
    let softHSMConf: String
    /// Key ID → the key files and public key.
    private(set) var keys: [String: TestKeyFiles] = [:]
    private(set) var process: Process?
    private var logPipe = Pipe()
    private let logLines = LogBuffer()

    /// Makes the token and imports `keyIDs` (fresh P-256 keys), but does not start the daemon.
    init(keyIDs: [String] = ["ABC123DEFG"]) throws {
        directory = TemporaryDirectory.make(prefix: "signerd-e2e")
        chmod(directory, 0o755)
        socketPath = directory + "/signerd.sock"
        configPath = directory + "/signerd.json"
        let hsm = directory + "/hsm"
        let uri = try run(["env", "SIGNCTL=\(Binaries.signctl)", Binaries.root + "/scripts/softhsm-setup.sh", hsm])
        tokenURI = String(decoding: uri, as: UTF8.self).trimmingCharacters(in: .whitespacesAndNewlines)
        softHSMConf = hsm + "/softhsm2.conf"
        for keyID in keyIDs {
            try importKey(keyID)
        }
        try writeConfig()
    }

    var environment: [String: String] {
        var environment = ProcessInfo.processInfo.environment
        environment["SOFTHSM2_CONF"] = softHSMConf
        return environment
    }

    /// Makes a fresh key, writes it as `AuthKey_<ID>.p8` (Apple's layout) and imports it with signctl.
    func importKey(_ keyID: String) throws {
        let files = try TestKeyFiles.make()
        let named = directory + "/AuthKey_\(keyID).p8"
        try FileManager.default.copyItem(atPath: files.pkcs8Apple, toPath: named)
        chmod(named, 0o600)  // the directory is 0755 (uid 65534 reaches the socket); the key stays private
        try writeConfig()  // signctl needs token_uri
        try run([Binaries.signctl, "--config", configPath, "keys", "import", named], environment: environment)
        keys[keyID] = files
    }

    /// The configuration written by ``writeConfig(_:)``; tests change it and write again.
    var config: [String: Any] = [:]

    /// Writes signerd.json: the token, the socket, the keys (all for
    /// `com.example.app`, the first also for `com.example.other`), plus `extra`.
    func writeConfig(_ extra: [String: Any] = [:], keys keyIDs: [String]? = nil, removing: [String] = []) throws {
        let ids = keyIDs ?? keys.keys.sorted()
        var object: [String: Any] = [
            "token_uri": tokenURI,
            "socket_path": socketPath,
            "socket_mode": "0666",
            "issuer_id": "57246542-96fe-1a63-e053-0824d011072a",
            "keys": ids.enumerated().map { index, id in
                ["key_id": id, "bundle_ids": index == 0 ? ["com.example.app", "com.example.other"] : ["com.example.app"]] as [String: Any]
            },
            "readiness_cache_seconds": 1,
        ]
        if ids.count > 1 { object["default_key_id"] = ids[0] }
        for (key, value) in extra { object[key] = value }
        for key in removing { object[key] = nil }
        config = object
        let data = try JSONSerialization.data(withJSONObject: object, options: [.sortedKeys, .prettyPrinted, .withoutEscapingSlashes])
        try data.write(to: URL(fileURLWithPath: configPath))
    }

    /// Starts signerd and waits until /healthz answers.
    /// - Parameters:
    ///   - extraEnvironment: added to the daemon's environment (NOTIFY_SOCKET, WATCHDOG_USEC).
    ///   - launcher: a command that runs signerd (systemd-socket-activate …), or empty.
    func start(extraEnvironment: [String: String] = [:], launcher: [String] = []) throws {
        if config.isEmpty { try writeConfig() }
        let process = Process()
        let command = launcher + [Binaries.signerd, "--config", configPath]
        process.executableURL = URL(fileURLWithPath: command[0].hasPrefix("/") ? command[0] : "/usr/bin/" + command[0])
        process.arguments = Array(command.dropFirst())
        process.environment = environment.merging(extraEnvironment) { _, new in new }
        logPipe = Pipe()
        process.standardError = logPipe
        process.standardOutput = FileHandle.nullDevice
        let lines = logLines
        lines.reopen()
        logPipe.fileHandleForReading.readabilityHandler = { handle in
            let data = handle.availableData
            guard !data.isEmpty else {
                // End of file: every writer (signerd) has gone.
                handle.readabilityHandler = nil
                lines.close()
                return
            }
            lines.append(String(decoding: data, as: UTF8.self))
        }
        try process.run()
        self.process = process
        DaemonHarness.register(process.processIdentifier)
        let deadline = Date().addingTimeInterval(20)
        while Date() < deadline {
            if let response = try? SignerClient(socketPath: socketPath, timeout: 2).send("GET", "/healthz"), response.status == 200 {
                return
            }
            guard process.isRunning else {
                throw FixtureError("signerd exited with \(process.terminationStatus): \(log.joined(separator: "\n"))")
            }
            usleep(50_000)
        }
        throw FixtureError("signerd did not answer /healthz within 20 s: \(log.joined(separator: "\n"))")
    }

    /// Daemons still running when the test process exits are stopped then
    /// (suites that share one daemon have no teardown of their own).
    private static let running = Mutex<Set<Int32>>([])
    private static let exitHook: Void = {
        atexit {
            for pid in DaemonHarness.running.withLock({ $0 }) { kill(pid, SIGKILL) }
        }
    }()

    static func register(_ pid: Int32) {
        _ = exitHook
        running.withLock { _ = $0.insert(pid) }
    }

    static func unregister(_ pid: Int32) {
        running.withLock { _ = $0.remove(pid) }
    }

    /// Everything signerd logged so far.
    var log: [String] { logLines.lines }

    /// Log lines that satisfy `predicate`, waiting up to `seconds` for at least
    /// `count` of them: signerd's stderr is read on another thread, so a line
    /// written just before a response may arrive here just after it.
    func logged(atLeast count: Int = 1, within seconds: Double = 5, _ predicate: (String) -> Bool) -> [String] {
        _ = poll(seconds: seconds) { log.filter(predicate).count >= count }
        return log.filter(predicate)
    }

    /// Sends `signal` to signerd.
    func send(_ signal: Int32) {
        if let process { kill(process.processIdentifier, signal) }
    }

    /// SIGHUP, then waits for signerd to log that the new configuration is in
    /// effect (`config_reloaded`); false if it logged nothing of the kind in 5 s.
    @discardableResult
    func reload() -> Bool {
        let before = log.filter { $0.contains("\"config_reloaded\"") }.count
        send(SIGHUP)
        return logged(atLeast: before + 1) { $0.contains("\"config_reloaded\"") }.count > before
    }

    /// SIGTERM, then waits for the exit status.
    @discardableResult
    func stop() -> Int32 {
        guard let process else { return -1 }
        if process.isRunning { kill(process.processIdentifier, SIGTERM) }
        process.waitUntilExit()
        DaemonHarness.unregister(process.processIdentifier)
        // The log is read on another thread: wait for end of file so that
        // what signerd wrote last is in `log` when stop() returns.
        if !logLines.waitUntilClosed(seconds: 5) { logPipe.fileHandleForReading.readabilityHandler = nil }
        self.process = nil
        return process.terminationStatus
    }

    deinit {
        if let process, process.isRunning {
            kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
        }
    }

    func client() -> SignerClient {
        SignerClient(socketPath: socketPath, timeout: 30)
    }

    /// Whether `response` is a 200 classic promotional offer signed by the
    /// key it names, one of the keys this harness made (their public keys
    /// come from the test, not from the daemon), verifying over the payload
    /// rebuilt from the request's values.
    func verifies(_ response: ClientResponse, bundleID: String = "com.example.app", productID: String = "p", offerID: String = "o", token: String = "") -> Bool {
        response.status == 200 && verifies(body: response.body, bundleID: bundleID, productID: productID, offerID: offerID, token: token)
    }

    /// The same for a raw HTTP/1.1 answer read from a socket: a 200 status
    /// line, and the body after the head.
    func verifies(rawResponse text: String, bundleID: String = "com.example.app", productID: String = "p", offerID: String = "o", token: String = "") -> Bool {
        guard text.hasPrefix("HTTP/1.1 200"), let headEnd = text.range(of: "\r\n\r\n") else { return false }
        return verifies(body: Array(text[headEnd.upperBound...].utf8), bundleID: bundleID, productID: productID, offerID: offerID, token: token)
    }

    func verifies(body: [UInt8], bundleID: String, productID: String, offerID: String, token: String) -> Bool {
        guard let offer = try? JSONDecoder().decode(PromotionalOfferResponse.self, from: Data(body)),
              let files = keys[offer.keyID], let key = try? ECPublicKey(pem: files.publicKeyPEM) else { return false }
        return offerVerifies(body: body, publicKey: key, bundleID: bundleID, keyID: offer.keyID, productID: productID, offerID: offerID, token: token)
    }

    /// Runs signctl against this daemon's configuration.
    func signctl(_ arguments: [String]) throws -> String {
        String(decoding: try run([Binaries.signctl, "--config", configPath] + arguments, environment: environment), as: UTF8.self)
    }

    /// Runs signctl and returns its exit status and output (stdout + stderr), never throwing.
    func signctlStatus(_ arguments: [String]) -> (Int32, String) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: Binaries.signctl)
        process.arguments = ["--config", configPath] + arguments
        process.environment = environment
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        do { try process.run() } catch { return (-1, "\(error)") }
        let output = pipe.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        return (process.terminationStatus, String(decoding: output, as: UTF8.self))
    }
}

/// JSON bytes for a request body.
func body(_ object: [String: Any]) -> [UInt8] {
    Array((try? JSONSerialization.data(withJSONObject: object, options: [.withoutEscapingSlashes])) ?? Data())
}

/// signerd's stderr, collected as it arrives.
final class LogBuffer: Sendable {
    private let text = Mutex("")
    private let closed = Atomic<Bool>(false)
    func append(_ chunk: String) { text.withLock { $0 += chunk } }
    var lines: [String] { text.withLock { $0.split(separator: "\n").map(String.init) } }
    /// A new process writes to the buffer.
    func reopen() { closed.store(false, ordering: .sequentiallyConsistent) }
    /// The writer has reached end of file.
    func close() { closed.store(true, ordering: .sequentiallyConsistent) }
    /// Waits until `close()`; false after `seconds` without it.
    func waitUntilClosed(seconds: Double) -> Bool {
        poll(seconds: seconds) { closed.load(ordering: .sequentiallyConsistent) }
    }
}


/// Signing clients against a running daemon, each on its own keep-alive
/// connection, every answer recorded with its time and whether the returned
/// signature verified against the independently rebuilt payload.
final class SigningLoad: @unchecked Sendable {
    struct Sample: Sendable {
        /// When the request was sent (its first attempt; the client
        /// retries once on a kept-alive connection found closed).
        let sent: Date
        /// When the answer, or the socket's failure, arrived.
        let at: Date
        /// The HTTP status; 0 when the socket failed.
        let status: Int
        let valid: Bool
    }

    private let samples = Mutex<[Sample]>([])
    private let running = Atomic<Bool>(true)
    private let group = DispatchGroup()

    /// Starts `clients` threads signing classic offers for `com.example.app`,
    /// verified with `publicKeyPEM`. A thread gives up after `maximumSocketErrors`
    /// socket failures in a row (the daemon has gone).
    init(_ daemon: DaemonHarness, clients: Int, publicKeyPEM: String, maximumSocketErrors: Int = .max) throws {
        let key = try ECPublicKey(pem: publicKeyPEM)
        for _ in 0..<clients {
            group.enter()
            Thread.detachNewThread { [self] in
                defer { group.leave() }
                let client = daemon.client()
                var socketErrors = 0
                while running.load(ordering: .relaxed) && socketErrors < maximumSocketErrors {
                    let sent = Date()
                    guard let response = try? client.send("POST", "/v1/sign/promotional-offer", body: body(["bundle_id": "com.example.app", "product_id": "p", "offer_id": "o"])) else {
                        socketErrors += 1
                        samples.withLock { $0.append(Sample(sent: sent, at: Date(), status: 0, valid: false)) }
                        usleep(20_000)
                        continue
                    }
                    socketErrors = 0
                    var valid = false
                    if response.status == 200, let offer = try? response.decode(PromotionalOfferResponse.self), let der = Data(base64Encoded: offer.signature) {
                        let payload = independentPayload(bundleID: "com.example.app", keyID: offer.keyID, productID: "p", offerID: "o", token: "", nonce: offer.nonce, timestamp: offer.timestamp)
                        valid = key.verify(derSignature: Array(der), digest: SHA256.hash(payload))
                    }
                    samples.withLock { $0.append(Sample(sent: sent, at: Date(), status: response.status, valid: valid)) }
                    if response.status != 200 { usleep(20_000) }
                }
            }
        }
    }

    /// Everything recorded so far.
    var recorded: [Sample] { samples.withLock { $0 } }

    /// Stops the clients and returns every sample.
    func stop() -> [Sample] {
        running.store(false, ordering: .relaxed)
        group.wait()
        return recorded
    }
}
