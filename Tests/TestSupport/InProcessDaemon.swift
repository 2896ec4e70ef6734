import Foundation
import HSMSigner
import SignerIPC
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// signerd's service and HTTP server in this process, on a real Unix socket
/// and a real SoftHSM token, with a ``FaultInjector`` in front of the
/// PKCS#11 function table: the daemon of `signerd/main.swift` minus argument
/// parsing and signals, so that tests can inject `CKR_*` faults.
public final class InProcessDaemon: @unchecked Sendable {
    // Set up in init, torn down once in stop().
    package let faults = FaultInjector()
    public let token: HSMToken
    public let service: SignerService
    public let server: HTTPServer
    public let socketPath: String
    /// The RFC 7512 URI of the daemon's SoftHSM token (with its PIN source).
    public let tokenURI: String
    public let keyID = "FAULTKEY01"
    public let bundleID = "com.example.faults"
    public let publicKey: ECPublicKey
    public let directory: String
    public let logLines: LineCollector
    private var stopped = false

    /// - Parameters:
    ///   - signTimeoutMs: `sign_timeout_ms`.
    ///   - sessions: `session_pool_size`.
    ///   - socketMode: the socket file's mode (its directory is made
    ///     searchable by all when others may connect).
    ///   - logLevel: the least level ``logLines`` collects.
    ///   - configure: changes to the configuration before the service starts.
    ///   - keepsLine: whether a log line is written (it is collected
    ///     either way); false makes ``Logger/audit(_:fields:)`` fail, as a
    ///     full standard error would.
    public init(signTimeoutMs: Int = 1000, sessions: Int = 4, socketMode: mode_t = 0o600, logLevel: LogLevel = .info,
                configure: (inout SignerConfiguration) -> Void = { _ in },
                keepsLine: @escaping @Sendable (String) -> Bool = { _ in true }) throws {
        let made = try SoftHSMFixture.shared.makeToken("daemon")
        directory = TemporaryDirectory.make(prefix: "signerd-inproc")
        socketPath = directory + "/signerd.sock"
        tokenURI = made.uri
        let files = try TestKeyFiles.make()
        publicKey = try ECPublicKey(pem: files.publicKeyPEM)
        var plain = TokenOptions()
        plain.logger = .disabled
        let importer = try HSMToken(uri: PKCS11URI(made.uri), options: plain)
        _ = try importer.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: keyID, replace: false)
        importer.close()

        var config = SignerConfiguration(tokenURI: made.uri)
        config.socketPath = socketPath
        config.keys = [KeyConfiguration(keyID: keyID, bundleIDs: [bundleID])]
        config.issuerID = "00000000-0000-4000-8000-000000000000"
        config.sessionPoolSize = sessions
        config.signTimeoutMs = signTimeoutMs
        config.readinessCacheSeconds = 0
        configure(&config)
        let lines = LineCollector()
        logLines = lines
        let logger = Logger(minimumLevel: logLevel, writer: { line in lines.append(line); return keepsLine(line) })
        var options = TokenOptions()
        options.sessionPoolSize = sessions
        options.logger = logger
        token = try HSMToken(uri: PKCS11URI(made.uri), options: options, interposer: faults)
        service = SignerService(configuration: config, token: token, logger: logger)
        if socketMode & 0o007 != 0 { chmod(directory, 0o755) }
        let listener = try UnixListener.bind(path: socketPath, mode: socketMode, group: nil)
        var serverOptions = HTTPServerOptions()
        serverOptions.signTimeoutSeconds = Double(signTimeoutMs) / 1000
        serverOptions.idleTimeoutSeconds = config.idleTimeoutSeconds
        serverOptions.requestTimeoutSeconds = Double(config.requestTimeoutSeconds)
        server = HTTPServer(listenDescriptor: listener, options: serverOptions, handler: service, logger: logger, metrics: service.metrics)
        try server.start()
    }

    /// Stops the server and closes the token.
    public func stop() {
        guard !stopped else { return }
        stopped = true
        let listening = server.stopAccepting()
        if listening >= 0 { close(listening) }
        unlink(socketPath)
        _ = server.waitForRequestsInProgress(seconds: 5)
        server.stop()
        token.close()
    }

    deinit { stop() }

    /// Log lines whose `msg` is `message`.
    public func logged(_ message: String) -> Int {
        logLines.lines.filter { $0.contains("\"msg\":\"\(message)\"") }.count
    }

    /// A `POST /v1/sign/promotional-offer` body for this daemon's bundle,
    /// product `p`, offer `o`.
    public var offerBody: [UInt8] {
        Array(#"{"bundle_id":"\#(bundleID)","product_id":"p","offer_id":"o"}"#.utf8)
    }

    /// Whether `response` answers ``offerBody`` with a 200 whose signature
    /// verifies with this daemon's public key (made by the test, not read
    /// from the daemon) over the payload rebuilt here.
    public func verifies(_ response: ClientResponse) -> Bool {
        offerVerifies(response, publicKey: publicKey, bundleID: bundleID, keyID: keyID)
    }
}

/// The classic payload rebuilt here, independently of HSMSigner's builder:
/// the seven values joined by U+2063 (apple-signatures.md).
public func independentPayload(bundleID: String, keyID: String, productID: String, offerID: String, token: String, nonce: String, timestamp: Int64) -> [UInt8] {
    Array([bundleID, keyID, productID, offerID, token, nonce, String(timestamp)].joined(separator: "\u{2063}").utf8)
}

/// Whether `response` is a 200 classic promotional-offer answer for `keyID`
/// whose Base64 DER signature verifies with `publicKey` over the payload
/// rebuilt from the request's values and the nonce and timestamp returned.
public func offerVerifies(_ response: ClientResponse, publicKey: ECPublicKey, bundleID: String, keyID: String,
                          productID: String = "p", offerID: String = "o", token: String = "") -> Bool {
    response.status == 200 && offerVerifies(body: response.body, publicKey: publicKey, bundleID: bundleID, keyID: keyID,
                                            productID: productID, offerID: offerID, token: token)
}

/// Whether `body`, a 200 answer's body, holds a classic promotional offer
/// as ``offerVerifies(_:publicKey:bundleID:keyID:productID:offerID:token:)``
/// checks it.
public func offerVerifies(body: [UInt8], publicKey: ECPublicKey, bundleID: String, keyID: String,
                          productID: String = "p", offerID: String = "o", token: String = "") -> Bool {
    guard let offer = try? JSONDecoder().decode(PromotionalOfferResponse.self, from: Data(body)), offer.keyID == keyID,
          let der = Data(base64Encoded: offer.signature) else { return false }
    let payload = independentPayload(bundleID: bundleID, keyID: keyID, productID: productID, offerID: offerID, token: token, nonce: offer.nonce, timestamp: offer.timestamp)
    return publicKey.verify(derSignature: Array(der), digest: SHA256.hash(payload))
}

extension UnixConnection {
    /// Reads one HTTP/1.1 response: the head (status line and headers, up
    /// to the blank line) and the `Content-Length` bytes of body after it;
    /// what arrived before the peer closed when it closes early.
    public func readResponse() throws -> (head: String, body: String) {
        var received: [UInt8] = []
        let separator = Array("\r\n\r\n".utf8)
        while true {
            if let end = received.firstRange(of: separator) {
                let head = String(decoding: received[..<end.lowerBound], as: UTF8.self)
                let length = head.split(separator: "\r\n").first { $0.lowercased().hasPrefix("content-length:") }
                    .flatMap { Int($0.split(separator: ":")[1].trimmingCharacters(in: .whitespaces)) } ?? 0
                while received.count < end.upperBound + length {
                    guard try read(appendingTo: &received) > 0 else { break }
                }
                return (head, String(decoding: received[end.upperBound...].prefix(length), as: UTF8.self))
            }
            guard try read(appendingTo: &received) > 0 else {
                return (String(decoding: received, as: UTF8.self), "")
            }
        }
    }
}

/// Continuous signing load with every answer recorded: the time, the status,
/// and whether a returned signature verified against the independently
/// rebuilt payload.
public final class LoadRecorder: @unchecked Sendable {
    public struct Sample: Sendable {
        public let at: UInt64
        public let status: Int
        public let valid: Bool
        public let retryAfter: String?
    }

    private let samples = Mutex<[Sample]>([])
    private let running = Atomic<Bool>(false)
    private let group = DispatchGroup()
    private let daemon: InProcessDaemon

    public init(_ daemon: InProcessDaemon) {
        self.daemon = daemon
    }

    /// Starts `threads` client threads, each on its own keep-alive connection.
    public func start(threads: Int) {
        running.store(true, ordering: .releasing)
        for _ in 0..<threads {
            group.enter()
            let daemon = self.daemon
            Thread.detachNewThread { [self] in
                defer { group.leave() }
                let client = SignerClient(socketPath: daemon.socketPath, timeout: 60)
                let body = daemon.offerBody
                while running.load(ordering: .acquiring) {
                    let response: ClientResponse
                    do {
                        response = try client.send("POST", "/v1/sign/promotional-offer", body: body)
                    } catch {
                        samples.withLock { $0.append(Sample(at: MonotonicClock.now(), status: 0, valid: false, retryAfter: nil)) }
                        usleep(20_000)
                        continue
                    }
                    let valid = daemon.verifies(response)
                    samples.withLock { $0.append(Sample(at: MonotonicClock.now(), status: response.status, valid: valid, retryAfter: response.headers["retry-after"])) }
                    if response.status != 200 { usleep(10_000) }  // a client backing off a little
                }
            }
        }
    }

    /// Stops the threads and returns every sample.
    public func stop() -> [Sample] {
        running.store(false, ordering: .releasing)
        group.wait()
        return samples.withLock { $0 }
    }

    /// Whether at least `successes` good answers came after `instant` and after the last failure.
    public func flowing(since instant: UInt64, successes: Int) -> Bool {
        samples.withLock { samples in
            let recent = samples.filter { $0.at >= instant }
            let lastFailure = recent.filter { $0.status != 200 }.map(\.at).max() ?? instant
            return recent.filter { $0.at > lastFailure && $0.status == 200 && $0.valid }.count >= successes
        }
    }
}

/// Log lines collected from a ``Logger`` sink.
public final class LineCollector: Sendable {
    private let storage = Mutex<[String]>([])
    public init() {}
    public func append(_ line: String) { storage.withLock { $0.append(line) } }
    public var lines: [String] { storage.withLock { $0 } }
}

/// Checks `condition` every 10 ms until it holds (true) or `seconds` pass (false).
public func poll(seconds: Double, _ condition: () -> Bool) -> Bool {
    let deadline = Date().addingTimeInterval(seconds)
    while !condition() {
        if Date() >= deadline { return false }
        usleep(10_000)
    }
    return true
}

extension UnixConnection {
    /// Everything the peer sends until it closes the connection (or a read
    /// fails or times out), decoded as UTF-8: for tests that write raw
    /// requests and read every answer on the connection.
    public func readUntilClosed() -> String {
        var received: [UInt8] = []
        while (try? read(appendingTo: &received)) ?? 0 > 0 {}
        return String(decoding: received, as: UTF8.self)
    }
}
