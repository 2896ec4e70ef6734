import Foundation
import HSMSigner
import Synchronization
internal import CSignerShim

#if canImport(Glibc)
import Glibc
#endif

/// What a benchmark run measured (`signctl bench --json`).
public struct BenchmarkReport: Codable, Sendable {
    /// `socket` (through signerd) or `direct` (PKCS#11 in-process).
    public var mode: String
    /// The endpoint (socket mode) or `sign` (direct).
    public var endpoint: String
    /// Connections (socket) or threads (direct).
    public var concurrency: Int
    /// Completed requests or signatures, errors included.
    public var requests: Int
    /// Wall-clock duration of the run, in seconds.
    public var durationSeconds: Double
    /// Successful requests per second.
    public var throughput: Double
    /// Latency percentiles and mean, in milliseconds (successful requests).
    public var latencyMs: [String: Double]
    /// The same statistics over the failed requests (an error response, a
    /// malformed or unverified signature, a socket failure), in
    /// milliseconds; empty when none failed. A stall that ends in errors
    /// (a token outage, a daemon held by `SIGSTOP`) shows here, not in
    /// ``latencyMs``.
    public var errorLatencyMs: [String: Double]
    /// Errors by code (`http_503`, `hsm_unavailable`, `malformed_signature`,
    /// `short_signature` (valid DER under 70 bytes), `invalid_signature`, `socket_ERRNO`,
    /// and for `/v1/offers` the offer's own `signature_error_<code>`, such as `signature_error_7234`).
    public var errors: [String: Int]
    /// Whether each signature was verified with the public key by the client.
    public var verified: Bool
    /// The daemon's resident set size before and after, in KiB (socket
    /// mode); a key is missing when `/proc` could not be read.
    public var rssKiB: [String: Int]?
    /// The daemon's open file descriptors before and after (socket mode);
    /// a key is missing when `/proc/PID/fd` could not be read (only root
    /// may list a non-dumpable process's descriptors).
    public var openFDs: [String: Int]?
    /// CPU time (user + system) per completed request, in microseconds:
    /// `signctl` is this process over the run (in direct mode, the signing
    /// loop with the PKCS#11 module in it), `signerd` is the daemon (socket
    /// mode, when its `/proc/PID/stat` is readable). From getrusage(2) and
    /// proc(5) `utime` + `stime`, whose resolution is one clock tick (10 ms
    /// on Linux), so a run should last seconds, not milliseconds: `signerd`
    /// is left out when the daemon used less than 10 ticks in the run.
    public var cpuMicrosecondsPerRequest: [String: Double]?
    /// The process whose RSS, descriptors and CPU time the report gives
    /// (socket mode): the socket's peer (`SO_PEERCRED`), or under socket
    /// activation, where the peer is the listener (systemd), its one
    /// `signerd` child. Nil in direct mode and when the listener has
    /// several.
    public var daemonPID: Int32?
    /// Why the daemon's RSS, descriptors and CPU time are missing (socket
    /// mode), when they are: the socket's listener is not signerd and has
    /// more than one signerd child.
    public var daemonNotMeasured: String?

    enum CodingKeys: String, CodingKey {
        case mode, endpoint, concurrency, requests, durationSeconds = "duration_s", throughput = "throughput_rps"
        case latencyMs = "latency_ms", errorLatencyMs = "error_latency_ms", errors, verified, rssKiB = "rss_kib", openFDs = "open_fds"
        case cpuMicrosecondsPerRequest = "cpu_us_per_request", daemonPID = "daemon_pid", daemonNotMeasured = "daemon_not_measured"
    }

    /// Total errors.
    public var errorCount: Int { errors.values.reduce(0, +) }
}

/// How long a run lasts: a time, or a number of requests in total.
public enum BenchmarkLength: Sendable {
    case seconds(Double)
    case requests(Int)
}

/// Per-thread results, merged at the end.
final class BenchmarkTally: @unchecked Sendable {
    // Each instance is written by one thread and read after it finished.
    var latencies: [UInt64] = []
    var errorLatencies: [UInt64] = []
    var errors: [String: Int] = [:]
    var count = 0

    /// One completed request or signature: `nil` `error` for a success.
    func record(_ elapsed: UInt64, error: String?) {
        count += 1
        if let error {
            errors[error, default: 0] += 1
            errorLatencies.append(elapsed)
        } else {
            latencies.append(elapsed)
        }
    }

    /// All threads' requests, latencies (successful and failed) and errors together.
    static func merge(_ tallies: [BenchmarkTally]) -> (count: Int, latencies: [UInt64], errorLatencies: [UInt64], errors: [String: Int]) {
        var errors: [String: Int] = [:]
        var latencies: [UInt64] = []
        var errorLatencies: [UInt64] = []
        var count = 0
        for tally in tallies {
            latencies.append(contentsOf: tally.latencies)
            errorLatencies.append(contentsOf: tally.errorLatencies)
            count += tally.count
            for (code, n) in tally.errors { errors[code, default: 0] += n }
        }
        return (count, latencies, errorLatencies, errors)
    }
}

/// Shared stop condition for the worker threads.
final class BenchmarkClock: Sendable {
    let remaining: Atomic<Int>
    let deadline: UInt64
    let limitedByCount: Bool
    private let halted = Atomic(false)

    init(_ length: BenchmarkLength) {
        switch length {
        case .seconds(let seconds):
            remaining = Atomic(Int.max)
            deadline = MonotonicClock.deadline(after: seconds)
            limitedByCount = false
        case .requests(let count):
            remaining = Atomic(count)
            deadline = UInt64.max
            limitedByCount = true
        }
    }

    /// Ends the run for every thread: one of them could not be started.
    func stop() { halted.store(true, ordering: .relaxed) }

    /// Whether ``stop()`` ended the run.
    var stopped: Bool { halted.load(ordering: .relaxed) }

    /// Claims one more request; false when the run is over.
    func next() -> Bool {
        if stopped { return false }
        if limitedByCount {
            return remaining.subtract(1, ordering: .relaxed).newValue >= 0
        }
        return MonotonicClock.now() < deadline
    }
}

/// Statistics over nanosecond samples.
enum LatencyStatistics {
    static func summarize(_ samples: [UInt64]) -> [String: Double] {
        guard !samples.isEmpty else { return [:] }
        let sorted = samples.sorted()
        func percentile(_ p: Double) -> Double {
            let index = min(sorted.count - 1, Int((p / 100 * Double(sorted.count)).rounded(.up)) - 1)
            return Double(sorted[max(0, index)]) / 1e6
        }
        let mean = Double(sorted.reduce(0, +)) / Double(sorted.count) / 1e6
        return ["p50": percentile(50), "p90": percentile(90), "p99": percentile(99), "p99.9": percentile(99.9),
                "max": Double(sorted.last!) / 1e6, "mean": mean]  // non-empty: checked above
    }
}

/// Reads a process's resident memory and open descriptors from /proc.
public enum ProcessStatistics {
    /// `VmRSS` of `pid` in KiB, or nil.
    public static func residentKiB(_ pid: Int32) -> Int? {
        guard let status = try? String(contentsOfFile: "/proc/\(pid)/status", encoding: .utf8) else { return nil }
        for line in status.split(separator: "\n") where line.hasPrefix("VmRSS:") {
            return Int(line.split(separator: " ", omittingEmptySubsequences: true).dropFirst().first ?? "")
        }
        return nil
    }

    /// The number of open descriptors of `pid` (`/proc/PID/fd`), or nil
    /// when it cannot be listed: only root may list those of a process that
    /// is not dumpable, as signerd is, even for its own user.
    public static func openDescriptors(_ pid: Int32) -> Int? {
        (try? FileManager.default.contentsOfDirectory(atPath: "/proc/\(pid)/fd"))?.count
    }

    /// CPU time `pid` has used so far (all threads, user + system), in
    /// microseconds, from fields 14 and 15 (`utime`, `stime`, in clock ticks)
    /// of proc(5) `/proc/PID/stat`; nil when unreadable.
    public static func cpuMicroseconds(_ pid: Int32) -> UInt64? {
        // utime and stime are fields 14 and 15.
        guard let fields = statFields(pid), fields.count > 12, let user = UInt64(fields[11]), let system = UInt64(fields[12]) else { return nil }
        return (user + system) * 1_000_000 / UInt64(max(1, sysconf(Int32(_SC_CLK_TCK))))
    }

    /// CPU time this process has used so far (all threads, user + system), in
    /// microseconds, from getrusage(2) `RUSAGE_SELF`.
    public static func ownCPUMicroseconds() -> UInt64 {
        var usage = rusage()
        getrusage(__rusage_who_t(RUSAGE_SELF.rawValue), &usage)
        func micros(_ time: timeval) -> UInt64 { UInt64(time.tv_sec) * 1_000_000 + UInt64(time.tv_usec) }
        return micros(usage.ru_utime) + micros(usage.ru_stime)
    }

    /// The command name of `pid` (`/proc/PID/comm`: the executable's name,
    /// at most 15 bytes), or nil when unreadable.
    public static func commandName(_ pid: Int32) -> String? {
        (try? String(contentsOfFile: "/proc/\(pid)/comm", encoding: .utf8))?.trimmingCharacters(in: .newlines)
    }

    /// The parent process ID of `pid` (field 4 of proc(5) `/proc/PID/stat`), or nil.
    public static func parentPID(_ pid: Int32) -> Int32? {
        guard let fields = statFields(pid), fields.count > 1 else { return nil }
        return Int32(fields[1])
    }

    /// Fields 3 onwards of proc(5) `/proc/PID/stat` (field N at offset
    /// N − 3), or nil when unreadable. Field 2, the command, may hold
    /// spaces and parentheses, so the fields are counted after its last ")".
    private static func statFields(_ pid: Int32) -> [Substring]? {
        guard let stat = try? String(contentsOfFile: "/proc/\(pid)/stat", encoding: .utf8),
              let commandEnd = stat.lastIndex(of: ")") else { return nil }
        return stat[stat.index(after: commandEnd)...].split(separator: " ")
    }

    /// The server process behind a socket whose peer (`SO_PEERCRED`: the
    /// process that called listen(2)) is `peer`: the peer itself when its
    /// command name is `signerd` or when it has no child of that name (a
    /// server that is not signerd, such as scripts/mhd-sign-floor.c); under
    /// socket activation (sd_listen_fds(3), where systemd or another
    /// listener passes the socket to signerd), its one child named `signerd`.
    /// - Returns: the process ID, or nil when the peer has more than one
    ///   child named `signerd` and which one serves cannot be told.
    public static func daemonProcess(peer: Int32) -> Int32? {
        if commandName(peer) == "signerd" { return peer }
        let children = ((try? FileManager.default.contentsOfDirectory(atPath: "/proc")) ?? []).compactMap { entry -> Int32? in
            guard let pid = Int32(entry), parentPID(pid) == peer, commandName(pid) == "signerd" else { return nil }
            return pid
        }
        switch children.count {
        case 0: return peer
        case 1: return children[0]
        default: return nil
        }
    }

    /// One clock tick of proc(5)'s `utime` and `stime`, in microseconds
    /// (10,000 where `_SC_CLK_TCK` is 100).
    static var procTickMicroseconds: UInt64 { 1_000_000 / UInt64(max(1, sysconf(Int32(_SC_CLK_TCK)))) }

    /// CPU microseconds per request between two readings; nil without both,
    /// with no requests, or when less than 10 × `resolution` (µs) of CPU
    /// passed: a reading at /proc's one-tick resolution over a run of a
    /// few milliseconds of CPU is off by up to all of it (a CLI audit saw
    /// `"signerd": 0` for a 20-request run).
    static func perRequest(_ before: UInt64?, _ after: UInt64?, requests: Int, resolution: UInt64 = 1) -> Double? {
        guard let before, let after, after >= before, requests > 0, after - before >= 10 * resolution else { return nil }
        return Double(after - before) / Double(requests)
    }
}

/// A closed-loop load generator over signerd's socket: `concurrency`
/// keep-alive connections, each sending the next request as soon as the
/// previous answer arrived. A response counts as an error unless it is a 200
/// carrying a well-formed signature (DER of 70–72 bytes, 96 Base64
/// characters, for the classic kinds; 64-byte
/// ES256 for JWS); with `verify`, each signature is also verified with the
/// key's public key.
public struct LoadGenerator: Sendable {
    /// The endpoints the generator can drive.
    public enum Endpoint: String, Sendable, CaseIterable {
        case promotionalOffer = "promotional-offer"
        case offers
        case promotionalOfferV2 = "promotional-offer-v2"
        case introductoryOfferEligibility = "introductory-offer-eligibility"
        case advancedCommerceRequest = "advanced-commerce-request"
        case serverAPIToken = "server-api-token"
        case healthz
    }

    /// The daemon's Unix socket path (the configuration's `socket_path`).
    public var socketPath: String
    /// The endpoint every request goes to (`signctl bench --endpoint`).
    public var endpoint: Endpoint
    /// Keep-alive connections, each on its own thread with one request in flight.
    public var concurrency: Int
    /// How long the run lasts: seconds, or requests in total over all connections.
    public var length: BenchmarkLength
    /// Whether each signature is verified with the key's public key from
    /// `GET /v1/keys`; a key without one makes ``run()`` throw.
    public var verify: Bool
    /// The bundle ID to sign for; nil takes the key's first `bundle_ids` entry.
    public var bundleID: String?
    /// The key to use; nil takes the first key `GET /v1/keys` lists.
    public var keyID: String?

    /// Makes a generator.
    public init(socketPath: String, endpoint: Endpoint, concurrency: Int, length: BenchmarkLength, verify: Bool, bundleID: String? = nil, keyID: String? = nil) {
        self.socketPath = socketPath
        self.endpoint = endpoint
        self.concurrency = concurrency
        self.length = length
        self.verify = verify
        self.bundleID = bundleID
        self.keyID = keyID
    }

    /// Runs the load and reports.
    /// - Throws: ``SocketError`` when the daemon is unreachable at the start,
    ///   or a ``BenchmarkError`` when `GET /v1/keys` is refused (with the
    ///   daemon's answer), no key serves a bundle, or a load thread cannot
    ///   be started.
    public func run() throws -> BenchmarkReport {
        let probe = SignerClient(socketPath: socketPath, timeout: 30)
        let listing = try probe.send("GET", "/v1/keys")
        guard listing.status == 200 else {
            // 403 for a user signerd does not serve, 429, 503: the daemon's own words.
            throw BenchmarkError("GET /v1/keys was refused", response: listing)
        }
        let keys = try listing.decode(KeysResponse.self).keys
        // Without --key-id: a key that serves --bundle-id, and one the token
        // holds (listed with its public key) before one it does not. A
        // --bundle-id that no key serves is still sent, so that the daemon's
        // refusal (403 bundle_not_allowed) can be loaded and counted.
        let named = keys.filter { keyID == nil || $0.keyID == keyID }
        let serving = named.filter { listed in bundleID.map { listed.bundleIDs.contains($0) } ?? true }
        let candidates = serving.isEmpty ? named : serving
        guard let key = candidates.first(where: { $0.publicKeyPEM != nil }) ?? candidates.first else {
            throw BenchmarkError("no configured key\(keyID.map { " \($0)" } ?? "") is listed by /v1/keys")
        }
        guard let bundle = bundleID ?? key.bundleIDs.first else {
            throw BenchmarkError("key \(key.keyID) is listed with no bundle ID; pass --bundle-id")
        }
        // Every key's public key: the daemon may choose another key than the first (offers names none).
        var publicKeys: [String: ECPublicKey] = [:]
        for listed in keys {
            if let pem = listed.publicKeyPEM { publicKeys[listed.keyID] = try ECPublicKey(pem: pem) }
        }
        if verify && publicKeys[key.keyID] == nil {
            throw BenchmarkError("key \(key.keyID) has no public key on the token; cannot --verify")
        }
        let listenerPID = probe.peer?.pid
        let daemonPID = listenerPID.flatMap(ProcessStatistics.daemonProcess)
        let rssBefore = daemonPID.flatMap(ProcessStatistics.residentKiB)
        let fdsWithProbe = daemonPID.flatMap(ProcessStatistics.openDescriptors)
        probe.close()
        // The probe's connection held descriptors in the daemon (two, with
        // libmicrohttpd): read "before" once the daemon closed its side, so
        // that "after" (no connection of this run left) is compared with the
        // same state, and a leaked descriptor shows.
        var fdsBefore = fdsWithProbe
        if let daemonPID, let withProbe = fdsWithProbe {
            for _ in 0..<50 {
                fdsBefore = ProcessStatistics.openDescriptors(daemonPID)
                if let now = fdsBefore, now < withProbe { break }
                usleep(10_000)
            }
        }
        var notMeasured: String?
        if let listenerPID, daemonPID == nil {
            notMeasured = "the socket's listener (pid \(listenerPID), \(ProcessStatistics.commandName(listenerPID) ?? "unknown")) is not signerd, and it has more than one signerd child"
        }

        let (path, requestBody) = request(bundle: bundle, keyID: key.keyID)
        let clock = BenchmarkClock(length)
        let tallies = (0..<concurrency).map { _ in BenchmarkTally() }
        let ownCPUBefore = ProcessStatistics.ownCPUMicroseconds()
        let daemonCPUBefore = daemonPID.flatMap(ProcessStatistics.cpuMicroseconds)
        let started = MonotonicClock.now()
        let group = DispatchGroup()
        for tally in tallies {
            group.enter()
            let generator = self
            let verifyKeys = verify ? publicKeys : nil
            let threadStarted = OSThread.start {
                defer { group.leave() }
                generator.loop(path: path, body: requestBody, bundleID: bundle, publicKeys: verifyKeys, clock: clock, tally: tally)
            }
            if !threadStarted {
                group.leave()
                clock.stop()
            }
        }
        group.wait()
        guard !clock.stopped else { throw BenchmarkError.outOfThreads(concurrency) }
        let elapsed = Double(MonotonicClock.now() - started) / 1e9
        let ownCPUAfter = ProcessStatistics.ownCPUMicroseconds()
        let daemonCPUAfter = daemonPID.flatMap(ProcessStatistics.cpuMicroseconds)
        // Let the daemon settle (closed connections reaped) before reading its RSS and descriptors.
        usleep(300_000)
        let (count, latencies, errorLatencies, errors) = BenchmarkTally.merge(tallies)
        var rss: [String: Int]?
        var fds: [String: Int]?
        if let daemonPID {
            // A value /proc would not give (signerd is not dumpable, so only
            // root may list its descriptors) is left out, never shown as 0.
            rss = ["before": rssBefore, "after": ProcessStatistics.residentKiB(daemonPID)].compactMapValues { $0 }
            fds = ["before": fdsBefore, "after": ProcessStatistics.openDescriptors(daemonPID)].compactMapValues { $0 }
        }
        var cpu: [String: Double] = [:]
        cpu["signctl"] = ProcessStatistics.perRequest(ownCPUBefore, ownCPUAfter, requests: count)
        cpu["signerd"] = ProcessStatistics.perRequest(daemonCPUBefore, daemonCPUAfter, requests: count, resolution: ProcessStatistics.procTickMicroseconds)
        return BenchmarkReport(mode: "socket", endpoint: endpoint.rawValue, concurrency: concurrency, requests: count,
                               durationSeconds: elapsed, throughput: Double(latencies.count) / elapsed,
                               latencyMs: LatencyStatistics.summarize(latencies),
                               errorLatencyMs: LatencyStatistics.summarize(errorLatencies), errors: errors, verified: verify,
                               rssKiB: rss, openFDs: fds, cpuMicrosecondsPerRequest: cpu, daemonPID: daemonPID, daemonNotMeasured: notMeasured)
    }

    private func request(bundle: String, keyID: String) -> (String, [UInt8]?) {
        func json(_ object: [String: Any]) -> [UInt8] {
            Array((try? JSONSerialization.data(withJSONObject: object, options: [.sortedKeys])) ?? Data())
        }
        switch endpoint {
        case .promotionalOffer:
            return (Route.promotionalOffer.rawValue, json(["bundle_id": bundle, "key_id": keyID, "product_id": "bench_product", "offer_id": "bench_offer"]))
        case .offers:
            return (Route.offers.rawValue, json(["bundle_id": bundle, "app_user_id": "bench_user", "generate_offers": [["offer_id": "bench_offer", "product_id": "bench_product"]]]))
        case .promotionalOfferV2:
            return (Route.promotionalOfferV2.rawValue, json(["bundle_id": bundle, "key_id": keyID, "product_id": "bench_product", "offer_id": "bench_offer"]))
        case .introductoryOfferEligibility:
            return (Route.introductoryOfferEligibility.rawValue, json(["bundle_id": bundle, "key_id": keyID, "product_id": "bench_product", "allow_introductory_offer": true, "transaction_id": "1"]))
        case .advancedCommerceRequest:
            return (Route.advancedCommerceRequest.rawValue, json(["bundle_id": bundle, "key_id": keyID, "request": ["operation": "BENCH"]]))
        case .serverAPIToken:
            return (Route.serverAPIToken.rawValue, json(["bundle_id": bundle, "key_id": keyID]))
        case .healthz:
            return (Route.healthz.rawValue, nil)
        }
    }

    private func loop(path: String, body: [UInt8]?, bundleID: String, publicKeys: [String: ECPublicKey]?, clock: BenchmarkClock, tally: BenchmarkTally) {
        let client = SignerClient(socketPath: socketPath, timeout: 30)
        defer { client.close() }
        tally.latencies.reserveCapacity(clock.limitedByCount ? 1 << 16 : 1 << 18)
        let method = body == nil ? "GET" : "POST"
        while clock.next() {
            let start = MonotonicClock.now()
            let response: ClientResponse
            do {
                response = try client.send(method, path, body: body)
            } catch {
                tally.record(MonotonicClock.now() - start, error: Self.socketErrorCode(error))
                usleep(10_000)
                continue
            }
            let elapsed = MonotonicClock.now() - start
            tally.record(elapsed, error: check(response, bundleID: bundleID, publicKeys: publicKeys))
        }
    }

    /// The error bucket of a request that failed on the socket, so that a
    /// report says why: `socket_timeout` when the client's 30-s
    /// `SO_RCVTIMEO`/`SO_SNDTIMEO` ran out (`EAGAIN`: a daemon that stopped
    /// answering), otherwise `socket_` and the `errno` name
    /// (`socket_ECONNREFUSED` when nothing listens at the path,
    /// `socket_ENOENT` when the path is gone), `socket_closed` when the
    /// server closed the connection before a whole response, and
    /// `socket_protocol` for an answer that is not HTTP as signerd writes it
    /// (``SignerClient``'s checks).
    static func socketErrorCode(_ error: SocketError) -> String {
        if let code = error.errno {
            if code == EAGAIN || code == EWOULDBLOCK { return "socket_timeout" }
            return "socket_" + (CSignerShim_errno_name(code).map { String(cString: $0) } ?? "errno_\(code)")
        }
        return error.peerClosed != nil ? "socket_closed" : "socket_protocol"
    }

    /// nil when the response is a 200 with a well-formed (and, with a key, valid) signature.
    func check(_ response: ClientResponse, bundleID: String, publicKeys: [String: ECPublicKey]?) -> String? {
        guard response.status == 200 else {
            return response.error?.code ?? "http_\(response.status)"
        }
        switch endpoint {
        case .healthz:
            return nil
        case .promotionalOffer, .offers:
            // A batch answers 200 with the offer's own error (API.md: code 7234 when no key serves the bundle).
            if endpoint == .offers, let start = Self.end(of: Array("\"signature_error\":".utf8), in: response.body) {
                return "signature_error_" + (Self.integerMember("code", in: Array(response.body[start...])).map(String.init) ?? "unknown")
            }
            guard let text = Self.stringMember("signature", in: response.body), let der = Data(base64Encoded: text),
                  (try? ECDSASignature.raw(fromDER: Array(der), curve: .p256)) != nil else {
                return "malformed_signature"
            }
            // apple-signatures.md: DER of 70–72 bytes, 96 Base64 characters. A
            // shorter one is a valid signature that signerd returns only when
            // signing again failed or would miss the deadline (API.md), as in
            // an outage: counted apart, so that a report tells it from garbage.
            guard (70...72).contains(der.count), text.utf8.count == 96 else {
                return "short_signature"
            }
            guard let publicKeys else { return nil }
            guard let keyID = Self.stringMember("key_id", in: response.body), let publicKey = publicKeys[keyID],
                  let nonce = Self.stringMember("nonce", in: response.body), let timestamp = Self.integerMember("timestamp", in: response.body),
                  let payload = try? PromotionalOfferPayload(bundleID: bundleID, keyID: keyID, productID: "bench_product", offerID: "bench_offer",
                                                             appAccountToken: "", nonce: nonce, timestamp: timestamp) else {
                return "malformed_response"
            }
            return publicKey.verify(derSignature: Array(der), digest: SHA256.hash(payload.payload)) ? nil : "invalid_signature"
        case .promotionalOfferV2, .introductoryOfferEligibility, .advancedCommerceRequest, .serverAPIToken:
            guard let token = Self.stringMember(endpoint == .serverAPIToken ? "token" : "jws", in: response.body),
                  let decoded = try? CompactJWS.decode(token) else {
                return "malformed_signature"
            }
            guard let publicKeys else { return nil }
            guard let publicKey = decoded.keyID.flatMap({ publicKeys[$0] }) else { return "malformed_response" }
            return publicKey.verify(rawSignature: decoded.signature, digest: SHA256.hash(Array(decoded.signingInput.utf8))) ? nil : "invalid_signature"
        }
    }

    /// The value of `"name":"…"` in a signerd response body (values without escapes).
    static func stringMember(_ name: String, in body: [UInt8]) -> String? {
        guard let start = end(of: Array("\"\(name)\":\"".utf8), in: body),
              let end = body[start...].firstIndex(of: UInt8(ascii: "\"")) else { return nil }
        return String(decoding: body[start..<end], as: UTF8.self)
    }

    /// The index just after the first occurrence of `needle` in `body`.
    static func end(of needle: [UInt8], in body: [UInt8]) -> Int? {
        guard let first = needle.first, body.count >= needle.count else { return nil }
        var index = 0
        while index <= body.count - needle.count {
            if body[index] == first && body[index..<(index + needle.count)].elementsEqual(needle) {
                return index + needle.count
            }
            index += 1
        }
        return nil
    }

    static func integerMember(_ name: String, in body: [UInt8]) -> Int64? {
        guard let start = end(of: Array("\"\(name)\":".utf8), in: body) else { return nil }
        let digits = body[start...].prefix { $0 >= 0x30 && $0 <= 0x39 }
        return Int64(String(decoding: digits, as: UTF8.self))
    }
}

/// A benchmark that cannot run.
public struct BenchmarkError: Error, CustomStringConvertible {
    /// Why the run cannot start, for `signctl`'s error line.
    public var description: String
    /// The daemon's error answer that stopped the run before it began
    /// (`GET /v1/keys` refused: 403, 429, 503), when that was the cause.
    public var response: ClientResponse?
    /// Makes an error.
    /// - Parameters:
    ///   - description: a sentence saying why the run cannot start.
    ///   - response: the daemon's error answer behind it, if any.
    public init(_ description: String, response: ClientResponse? = nil) {
        self.description = description
        self.response = response
    }

    /// Not every one of `concurrency` load threads could be started.
    static func outOfThreads(_ concurrency: Int) -> BenchmarkError {
        BenchmarkError("could not start \(concurrency) threads (the process is out of threads: ulimit -u, TasksMax=); the run was stopped")
    }
}

/// The baseline: the same SHA-256 + `C_SignInit`/`C_Sign` loop through the
/// PKCS#11 module in-process, `concurrency` threads with one session each
/// (the token's pool is sized to the thread count), no socket.
public struct DirectBenchmark: Sendable {
    /// The open token to sign on; its pool should hold at least ``concurrency`` sessions.
    public var token: HSMToken
    /// The key to sign with (its `CKA_ID`).
    public var keyID: String
    /// Signing threads, each running `C_SignInit`/`C_Sign` on a pooled session.
    public var concurrency: Int
    /// How long the run lasts: seconds, or signatures in total over all threads.
    public var length: BenchmarkLength
    /// Whether each signature is verified with the key's public key; one that
    /// fails counts as an `invalid_signature` error.
    public var verify: Bool

    /// Makes a baseline run; `token` should have a pool of at least `concurrency` sessions.
    public init(token: HSMToken, keyID: String, concurrency: Int, length: BenchmarkLength, verify: Bool) {
        self.token = token
        self.keyID = keyID
        self.concurrency = concurrency
        self.length = length
        self.verify = verify
    }

    /// Runs the loop and reports.
    /// - Throws: ``HSMError`` when the key is unusable; ``BenchmarkError``
    ///   when a signing thread cannot be started.
    public func run() throws -> BenchmarkReport {
        let publicKey = try token.publicKey(keyID: keyID)
        _ = try token.sign(digest: SHA256.hash([0]), keyID: keyID)  // warm the key handle cache
        let clock = BenchmarkClock(length)
        let tallies = (0..<concurrency).map { _ in BenchmarkTally() }
        let cpuBefore = ProcessStatistics.ownCPUMicroseconds()
        let started = MonotonicClock.now()
        let group = DispatchGroup()
        for (index, tally) in tallies.enumerated() {
            group.enter()
            let benchmark = self
            let threadStarted = OSThread.start {
                defer { group.leave() }
                var counter = 0
                while clock.next() {
                    counter += 1
                    let start = MonotonicClock.now()
                    let message = Array("bench\u{2063}\(index)\u{2063}\(counter)\u{2063}\(start)".utf8)
                    let digest = SHA256.hash(message)
                    do {
                        let signature = try benchmark.token.sign(digest: digest, keyID: benchmark.keyID)
                        let elapsed = MonotonicClock.now() - start
                        let verified = !benchmark.verify || publicKey.verify(rawSignature: signature.raw, digest: digest)
                        tally.record(elapsed, error: verified ? nil : "invalid_signature")
                    } catch let error as HSMError {
                        tally.record(MonotonicClock.now() - start, error: error.returnValue?.name ?? error.code.rawValue)
                    } catch {
                        tally.record(MonotonicClock.now() - start, error: "\(error)")
                    }
                }
            }
            if !threadStarted {
                group.leave()
                clock.stop()
            }
        }
        group.wait()
        guard !clock.stopped else { throw BenchmarkError.outOfThreads(concurrency) }
        let elapsed = Double(MonotonicClock.now() - started) / 1e9
        let cpuAfter = ProcessStatistics.ownCPUMicroseconds()
        let (count, latencies, errorLatencies, errors) = BenchmarkTally.merge(tallies)
        let cpu = ProcessStatistics.perRequest(cpuBefore, cpuAfter, requests: count).map { ["signctl": $0] }
        return BenchmarkReport(mode: "direct", endpoint: "sign", concurrency: concurrency, requests: count, durationSeconds: elapsed,
                               throughput: Double(latencies.count) / elapsed, latencyMs: LatencyStatistics.summarize(latencies),
                               errorLatencyMs: LatencyStatistics.summarize(errorLatencies), errors: errors, verified: verify, rssKiB: nil, openFDs: nil, cpuMicrosecondsPerRequest: cpu)
    }
}
