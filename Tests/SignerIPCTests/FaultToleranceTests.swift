import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Synchronization
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// What one fault did to a running daemon, as seen by its clients.
struct FaultOutcome: CustomStringConvertible {
    let name: String
    let requests: Int
    let failed: Int
    let invalid: Int
    /// From the fault's start (or the end of a timed outage) to the first
    /// good signature after the last failure, in seconds; 0 when nothing failed.
    let secondsUntilFlowing: Double
    let failureStatuses: [Int: Int]

    var description: String {
        let statuses = failureStatuses.sorted { $0.key < $1.key }.map { "\($0.value) × \($0.key)" }.joined(separator: ", ")
        return String(format: "%@: %d requests, %d failed%@, %d wrong signatures, signatures flowing again %.2f s after the fault",
                      name, requests, failed, statuses.isEmpty ? "" : " (\(statuses))", invalid, secondsUntilFlowing)
    }
}

/// Fault tests through the seam in front of the PKCS#11 function table, on a
/// real SoftHSM token, a real socket and the daemon's own request path; one
/// test per fault. Each prints its outcome (failed requests, time until
/// signatures flow again, wrong signatures: always zero).
@Suite("Token faults under load", .serialized)
struct FaultToleranceTests {
    /// Runs 4 signing clients, lets them flow, calls `inject`, waits until
    /// signatures flow again (at least 20 good ones after the last failure)
    /// or `limit` seconds, and measures.
    /// `outage` is how long a timed fault lasts (recovery time is counted
    /// from its end); `settle` is the least time to watch before deciding.
    func measure(_ name: String, daemon: InProcessDaemon, outage: Double = 0, settle: Double = 0, limit: Double = 20,
                 inject: (InProcessDaemon) -> Void) -> FaultOutcome {
        let load = LoadRecorder(daemon)
        load.start(threads: 4)
        usleep(400_000)
        let start = MonotonicClock.now()
        inject(daemon)
        let faultEnd = start + UInt64(outage * 1e9)
        let watchUntil = start + UInt64(max(outage, settle) * 1e9)
        let deadline = MonotonicClock.deadline(after: limit)
        while MonotonicClock.now() < deadline {
            usleep(50_000)
            if MonotonicClock.now() > watchUntil && load.flowing(since: start, successes: 20) { break }
        }
        usleep(200_000)
        let samples = load.stop().filter { $0.at >= start }
        let failures = samples.filter { $0.status != 200 }
        let lastFailure = failures.map(\.at).max()
        let firstGoodAfter = lastFailure.flatMap { last in samples.filter { $0.at > last && $0.status == 200 }.map(\.at).min() }
        var statuses: [Int: Int] = [:]
        for failure in failures { statuses[failure.status, default: 0] += 1 }
        let flowing = lastFailure == nil ? 0 : Double((firstGoodAfter ?? deadline) - min(faultEnd, firstGoodAfter ?? deadline)) / 1e9
        let outcome = FaultOutcome(name: name, requests: samples.count, failed: failures.count,
                                   invalid: samples.filter { $0.status == 200 && !$0.valid }.count,
                                   secondsUntilFlowing: flowing, failureStatuses: statuses)
        print("FAULT-OUTCOME \(outcome)")
        return outcome
    }

    func expectHealthy(_ daemon: InProcessDaemon, sourceLocation: SourceLocation = #_sourceLocation) throws {
        let client = SignerClient(socketPath: daemon.socketPath)
        #expect(try client.send("GET", "/healthz").status == 200, sourceLocation: sourceLocation)
        #expect(try client.send("GET", "/readyz").status == 200, sourceLocation: sourceLocation)
        let metrics = String(decoding: try client.send("GET", "/metrics").body, as: UTF8.self)
        #expect(metrics.contains("signerd_token_up 1"), sourceLocation: sourceLocation)
    }

    @Test("CKR_SESSION_HANDLE_INVALID on every session at once: sessions replaced, no request fails")
    func everySessionInvalid() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let outcome = measure("CKR_SESSION_HANDLE_INVALID on every session", daemon: daemon) { $0.faults.invalidateAllSessions() }
        #expect(outcome.invalid == 0)
        #expect(outcome.failed == 0)
        #expect(daemon.faults.calls(.closeSession) >= 1)
        try expectHealthy(daemon)
    }

    @Test("CKR_USER_NOT_LOGGED_IN: one re-login, no request fails")
    func loggedOut() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let logins = daemon.faults.calls(.login)
        let outcome = measure("CKR_USER_NOT_LOGGED_IN", daemon: daemon) { $0.faults.logOut() }
        #expect(outcome.invalid == 0)
        #expect(outcome.failed == 0)
        #expect(daemon.faults.calls(.login) == logins + 1, "exactly one C_Login for all the requests that hit the logged-out token")
        try expectHealthy(daemon)
    }

    @Test("CKR_OBJECT_HANDLE_INVALID: the key is looked up again, no request fails")
    func staleObjects() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let searches = daemon.faults.calls(.findObjectsInit)
        let outcome = measure("CKR_OBJECT_HANDLE_INVALID", daemon: daemon) { $0.faults.invalidateObjects() }
        #expect(outcome.invalid == 0)
        #expect(outcome.failed == 0)
        #expect(daemon.faults.calls(.findObjectsInit) > searches)
        try expectHealthy(daemon)
    }

    @Test("CKR_DEVICE_REMOVED / CKR_TOKEN_NOT_PRESENT for 3 s: fail fast with 503 + Retry-After, recover alone, one log line each way",
          arguments: [PKCS11ReturnValue.deviceRemoved, .tokenNotPresent])
    func deviceAway(_ rv: PKCS11ReturnValue) throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        var sawNotReady = false
        var sawTokenDown = false
        let outcome = measure("\(rv.name) for 3 s", daemon: daemon, outage: 3) { daemon in
            daemon.faults.outage(rv, seconds: 3)
            // While it is away: readiness 503, token_up 0.
            usleep(1_000_000)
            let client = SignerClient(socketPath: daemon.socketPath)
            sawNotReady = (try? client.send("GET", "/readyz"))?.status == 503
            sawTokenDown = (try? client.send("GET", "/metrics")).map { String(decoding: $0.body, as: UTF8.self).contains("signerd_token_up 0") } ?? false
        }
        #expect(outcome.invalid == 0)
        #expect(outcome.failed > 0)
        #expect(Set(outcome.failureStatuses.keys) == [503], "every failure is 503 hsm_unavailable")
        #expect(outcome.secondsUntilFlowing < 8, "flowing again \(outcome.secondsUntilFlowing) s after the device came back")
        #expect(sawNotReady)
        #expect(sawTokenDown)
        #expect(daemon.logged("token_down") == 1)
        #expect(daemon.logged("token_up") == 1)
        let metrics = String(decoding: try SignerClient(socketPath: daemon.socketPath).send("GET", "/metrics").body, as: UTF8.self)
        #expect(metrics.contains("signerd_hsm_errors_total{rv=\"\(rv.name)\"}"))
        try expectHealthy(daemon)
    }

    @Test("CKR_DEVICE_ERROR: the module is reinitialized and signatures flow again")
    func deviceError() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        // The seam sees recovery's C_Finalize + C_Initialize as one C_Finalize;
        // the C_Login after it shows the login was lost with the old module state.
        let finalizes = daemon.faults.calls(.finalize)
        let logins = daemon.faults.calls(.login)
        let outcome = measure("CKR_DEVICE_ERROR (5 calls)", daemon: daemon) { $0.faults.inject(.sign, .deviceError, count: 5) }
        #expect(outcome.invalid == 0)
        #expect(outcome.failed > 0, "the injected CKR_DEVICE_ERROR reached a request")
        #expect(daemon.faults.calls(.finalize) > finalizes, "C_Finalize + C_Initialize: the module was reinitialized")
        #expect(daemon.faults.calls(.login) > logins, "C_Login again on the reinitialized module")
        #expect(outcome.secondsUntilFlowing < 8)
        #expect(daemon.logged("token_down") == 1)
        // Under load a lighter first attempt can fail and escalate; one
        // CKR_DEVICE_ERROR alone must reinitialize at the first attempt.
        let client = SignerClient(socketPath: daemon.socketPath)
        #expect(poll(seconds: 5) { daemon.logged("token_up") == 1 })
        let before = daemon.faults.calls(.finalize)
        daemon.faults.inject(.sign, .deviceError, count: 1)
        #expect(try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody).status == 503)
        #expect(poll(seconds: 5) { daemon.logged("token_up") == 2 }, "\(daemon.logLines.lines.suffix(4))")
        #expect(daemon.faults.calls(.finalize) == before + 1, "one C_Finalize + C_Initialize")
        #expect(daemon.logLines.lines.last { $0.contains("\"msg\":\"token_up\"") }?.contains("\"recovery.attempts\":1") == true, "\(daemon.logLines.lines.suffix(4))")
        try expectHealthy(daemon)
    }

    /// A request still being read and checked at sign_timeout_ms (a body of
    /// many numbers) was answered as if the HSM had hung: on an idle daemon
    /// no session had come back in that time, so the token was marked down
    /// and every request after it got 503 until recovery (a fuzzing round).
    @Test("a request still being checked at sign_timeout_ms: 503 saying so, no HSM error counted, the token stays up")
    func slowCheckIsNotAnOutage() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 20)
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath, timeout: 30)
        let numbers = Array(repeating: "1", count: 28_000).joined(separator: ",")
        let body = Array(#"{"bundle_id":"\#(daemon.bundleID)","request":{"a":[\#(numbers)]}}"#.utf8)
        let response = try client.send("POST", "/v1/sign/advanced-commerce-request", body: body)
        #expect(response.status == 503, "\(String(decoding: response.body.prefix(300), as: UTF8.self))")
        #expect(response.error?.message.hasPrefix("signerd was still reading and checking the request when sign_timeout_ms ran out") == true, "\(response.error?.message ?? "")")
        // The handler goes on after the watchdog's answer, and once reached the
        // token past its deadline: a session wait that "ended" at once, which
        // took the idle token down about 100 ms later (a re-check of the fix).
        let handlerDone = MonotonicClock.deadline(after: 10)
        while daemon.server.requestsInProgress > 0 && MonotonicClock.now() < handlerDone { usleep(10_000) }
        usleep(200_000)
        #expect(daemon.logged("token_down") == 0, "\(daemon.logLines.lines.suffix(4))")
        #expect(daemon.token.status == .up)
        let metrics = String(decoding: try SignerClient(socketPath: daemon.socketPath).send("GET", "/metrics").body, as: UTF8.self)
        #expect(!metrics.contains("signerd_hsm_errors_total{"), "not an HSM error: \(metrics.split(separator: "\n").filter { $0.hasPrefix("signerd_hsm_errors_total{") })")
        let signed = try SignerClient(socketPath: daemon.socketPath, timeout: 10).send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
        #expect(signed.status == 200 && daemon.verifies(signed), "\(String(decoding: signed.body, as: UTF8.self))")
        // One that did reach the token, hung in C_Sign, is still the HSM's: its own answer, and the count.
        let hung = try InProcessDaemon(signTimeoutMs: 300)
        defer { hung.stop() }
        hung.faults.hang(.sign, seconds: 2)
        let waited = try SignerClient(socketPath: hung.socketPath, timeout: 10).send("POST", "/v1/sign/promotional-offer", body: hung.offerBody)
        // "did not answer", or "no session came free" when a busy runner let another call return meanwhile: the HSM's either way.
        #expect(waited.status == 503 && waited.error?.message.hasPrefix("signerd was still reading") == false, "\(waited.error?.message ?? "")")
        let counted = String(decoding: try SignerClient(socketPath: hung.socketPath).send("GET", "/metrics").body, as: UTF8.self)
        #expect(counted.contains("signerd_hsm_errors_total{rv=\"sign_timeout\"} "), "an HSM error")
    }

    /// A batch that outlasted sign_timeout_ms on a healthy token was told
    /// "the HSM is busy with other requests" on an idle daemon, or, when
    /// its own next session checkout answered before the watchdog, that
    /// signerd was still reading it (an attack round on the audit log; a
    /// fresh-clone run caught the second).
    @Test("a /v1/offers batch that outlasts sign_timeout_ms on a healthy, idle token: 503 naming the batch and what to do, the token stays up",
          arguments: 1...3)
    func longBatchTimesOut(run: Int) throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 800)
        defer { daemon.stop() }
        // A slow module, 40 ms a signature: 40 offers take 1.6 s, and a session comes back every 40 ms.
        daemon.faults.inject(.sign, .ok, count: nil, delay: 0.04)
        let offers = (1...40).map { #"{"offer_id":"o\#($0)","product_id":"p"}"# }.joined(separator: ",")
        let body = Array(#"{"bundle_id":"\#(daemon.bundleID)","app_user_id":"u","generate_offers":[\#(offers)]}"#.utf8)
        let response = try SignerClient(socketPath: daemon.socketPath, timeout: 10).send("POST", "/v1/offers", body: body)
        #expect(response.status == 503, "\(String(decoding: response.body, as: UTF8.self))")
        // The watchdog's answer at the deadline, or the handler's own when its next session checkout comes first: the same words.
        #expect(response.error?.message.hasPrefix("sign_timeout_ms ran out before the request's last signature") == true, "\(response.error?.message ?? "")")
        #expect(response.headers["retry-after"] == "1")
        let handlerDone = MonotonicClock.deadline(after: 10)
        while daemon.server.requestsInProgress > 0 && MonotonicClock.now() < handlerDone { usleep(10_000) }
        daemon.faults.clear()
        #expect(daemon.token.status == .up)
        #expect(daemon.logged("token_down") == 0, "\(daemon.logLines.lines.suffix(4))")
        let signed = try SignerClient(socketPath: daemon.socketPath, timeout: 10).send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
        #expect(signed.status == 200 && daemon.verifies(signed), "\(String(decoding: signed.body, as: UTF8.self))")
    }

    /// A request that reached the token just before its deadline and asked
    /// for a session just after it waited for none, yet was answered
    /// `session_unavailable`, counted, and the idle token marked down (a
    /// re-check of the watchdog fix, from the code).
    @Test("a request past its deadline when it asks for a session: request_expired, and the idle token stays up")
    func lateAtCheckout() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 20)
        defer { daemon.stop() }
        let progress = RequestProgress()
        progress.markReachedToken()  // as if checkUp() ran in time
        let digest = [UInt8](repeating: 7, count: 32)
        var caught: HSMError?
        RequestDeadline.$progress.withValue(progress) {
            RequestDeadline.$current.withValue(MonotonicClock.now() &- 1_000_000) {
                do throws(HSMError) { _ = try daemon.token.sign(digest: digest, keyID: daemon.keyID) } catch { caught = error }
            }
        }
        // request_expired is answered as "still reading and checking" and counted nowhere (slowCheckIsNotAnOutage).
        #expect(caught?.code == .requestExpired, "\(String(describing: caught))")
        #expect(daemon.token.status == .up)
        #expect(daemon.logged("token_down") == 0)
    }

    @Test("a C_Sign that blocks 30 s: that request gets 503 at sign_timeout_ms, its session is quarantined, signatures flow again")
    func hungSign() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 1000)
        defer { daemon.stop() }
        let started = MonotonicClock.now()
        let outcome = measure("C_Sign blocking 30 s (sign_timeout_ms 1000)", daemon: daemon, settle: 1.5) { $0.faults.hang(.sign, seconds: 30) }
        #expect(outcome.invalid == 0)
        #expect(outcome.failed >= 1)
        #expect(Set(outcome.failureStatuses.keys) == [503])
        #expect(outcome.secondsUntilFlowing < 6, "flowing again after \(outcome.secondsUntilFlowing) s; log: \(daemon.logLines.lines.suffix(8))")
        #expect(Double(MonotonicClock.now() - started) / 1e9 < 15, "nobody waited for the 30 s call")
        #expect(daemon.logged("sign_call_quarantined") == 1)
        #expect(daemon.token.callsInModule == 1, "the hung call is still inside the module, on a quarantined session")
        try expectHealthy(daemon)
    }

    /// A request that only waited for a session past sign_timeout_ms, while
    /// the token answered every call, marked the token down: under load a
    /// healthy HSM was taken out of service again and again.
    @Test("requests queueing for a session past sign_timeout_ms on a busy but healthy token: 503 for them, the token stays up")
    func queueingIsNotAnOutage() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 300, sessions: 1)
        defer { daemon.stop() }
        // Every C_Sign takes 100 ms in the module: 6 clients on one session queue for up to 500 ms.
        daemon.faults.inject(.sign, .ok, count: nil, delay: 0.1)
        let load = LoadRecorder(daemon)
        let began = MonotonicClock.now()
        load.start(threads: 6)
        usleep(2_500_000)
        let samples = load.stop()
        daemon.faults.clear()
        #expect(samples.contains { $0.status == 503 }, "some requests waited past sign_timeout_ms")
        #expect(!samples.contains { $0.status == 200 && !$0.valid }, "every signature verifies")
        // Signatures in both halves of the run: the token kept signing. (Up
        // to 25 fit in 2.5 s; a busy runner got 6, so no count is asked.)
        let half = began + 1_250_000_000
        #expect(samples.contains { $0.status == 200 && $0.at < half } && samples.contains { $0.status == 200 && $0.at >= half },
                "the token kept signing: \(samples.filter { $0.status == 200 }.count) signatures")
        #expect(daemon.logged("token_down") == 0, "\(daemon.logLines.lines.filter { $0.contains("token_down") })")
        #expect(daemon.token.status == .up)
    }

    /// Only requests answered by the watchdog asked whether a session had
    /// come back. Under queueing load each request stuck in a hung
    /// C_FindObjects (never written off) had waited for its session, which
    /// another had just returned, so it did not count; every request after
    /// them timed out queueing for a session, answered by the handler, which
    /// never asked. The token stayed up, and recovery never began, for as
    /// long as the module hung.
    @Test("every session stuck in a hung C_FindObjects under queueing load: the token is marked down, no wrong signature")
    func hungSearchUnderQueueing() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 500, sessions: 2)
        defer { daemon.stop() }
        // Every C_Sign takes 50 ms: 8 clients on 2 sessions queue for them.
        daemon.faults.inject(.sign, .ok, count: nil, delay: 0.05)
        let load = LoadRecorder(daemon)
        load.start(threads: 8)
        usleep(1_000_000)
        // The key handles go stale and every search for the key hangs.
        daemon.faults.hang(.findObjects, seconds: 4, count: 100_000)
        daemon.faults.invalidateObjects()
        let down = poll(seconds: 3) { daemon.logged("token_down") > 0 }
        let samples = load.stop()
        daemon.faults.clear()
        #expect(down, "\(daemon.logLines.lines.suffix(4))")
        #expect(!samples.contains { $0.status == 200 && !$0.valid }, "every signature verifies")
        #expect(samples.allSatisfy { $0.status == 200 || $0.status == 503 }, "\(Set(samples.map(\.status)))")
    }

    /// Recovery's C_Finalize waited only for C_Sign calls to leave the
    /// module; a hung C_FindObjects (or any call on a leased session) could
    /// have the module finalized under it, which PKCS#11 leaves undefined.
    @Test("recovery does not reinitialize the module while a C_FindObjects is inside it; it recovers with new sessions instead")
    func noFinalizeUnderHungSearch() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 5000)
        defer { daemon.stop() }
        let body = daemon.offerBody
        #expect(daemon.verifies(try SignerClient(socketPath: daemon.socketPath).send("POST", "/v1/sign/promotional-offer", body: body)))
        let searches = daemon.faults.calls(.findObjects)
        // 5 s: longer than recovery's 2 s wait for the search's lease to come back.
        daemon.faults.hang(.findObjects, seconds: 5, count: 1)
        let hungAt = MonotonicClock.now()
        daemon.faults.invalidateObjects()
        OSThread.start { _ = try? SignerClient(socketPath: daemon.socketPath, timeout: 10).send("POST", "/v1/sign/promotional-offer", body: body) }
        #expect(poll(seconds: 2) { daemon.faults.calls(.findObjects) > searches }, "the key's search is hanging")
        let finalizes = daemon.faults.calls(.finalize)
        daemon.token.markDown(reason: PKCS11ReturnValue.deviceError.name, reinitialize: true)
        #expect(poll(seconds: 4) { daemon.logged("token_up") > 0 }, "\(daemon.logLines.lines.suffix(4))")
        #expect(daemon.faults.calls(.finalize) == finalizes, "no C_Finalize while the search was inside the module")
        // Once the search has left the module (5 s), the same request does
        // reinitialize it: the count above stayed still for the search alone.
        while Double(MonotonicClock.now() - hungAt) / 1e9 < 5.5 { usleep(100_000) }
        daemon.token.markDown(reason: PKCS11ReturnValue.deviceError.name, reinitialize: true)
        #expect(poll(seconds: 5) { daemon.faults.calls(.finalize) > finalizes }, "C_Finalize once no call is inside the module")
        #expect(poll(seconds: 5) { daemon.logged("token_up") == 2 }, "\(daemon.logLines.lines.suffix(4))")
        try expectHealthy(daemon)
    }

    @Test("every session stuck in a hung C_Sign: /healthz and /metrics still answer at once; each hung request gets 503 with Connection: close at sign_timeout_ms")
    func everySessionHung() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 1000, sessions: 2)
        defer { daemon.stop() }
        daemon.faults.hang(.sign, seconds: 3, count: 2)
        let body = daemon.offerBody
        let answers = Mutex<[(status: Int, connection: String?, code: String?, seconds: Double)]>([])
        let done = DispatchGroup()
        for _ in 0..<2 {
            done.enter()
            OSThread.start {
                let client = SignerClient(socketPath: daemon.socketPath)
                let started = MonotonicClock.now()
                if let response = try? client.send("POST", "/v1/sign/promotional-offer", body: body) {
                    let seconds = Double(MonotonicClock.now() - started) / 1e9
                    answers.withLock { $0.append((response.status, response.headers["connection"], response.error?.code, seconds)) }
                }
                done.leave()
            }
        }
        usleep(300_000)  // both sessions are now inside the hung C_Sign
        let probe = SignerClient(socketPath: daemon.socketPath, timeout: 2)
        let asked = MonotonicClock.now()
        #expect(try probe.send("GET", "/healthz").status == 200)
        #expect(try probe.send("GET", "/metrics").status == 200)
        let probeSeconds = Double(MonotonicClock.now() - asked) / 1e9
        #expect(probeSeconds < 0.5, "health and metrics took \(probeSeconds) s while the HSM hung")
        #expect(done.wait(timeout: .now() + 5) == .success, "the hung requests were answered before their calls returned")
        let got = answers.withLock { $0 }
        #expect(got.count == 2)
        for answer in got {
            #expect(answer.status == 503)
            #expect(answer.code == "hsm_unavailable")
            #expect(answer.connection?.lowercased() == "close")
            #expect(answer.seconds >= 0.9 && answer.seconds < 3, "answered after \(answer.seconds) s (sign_timeout_ms 1000)")
        }
        // The hung calls return at 3 s and their handlers finish; their late
        // responses are dropped and must not be counted a second time.
        usleep(UInt32(max(0, 3.6 - Double(MonotonicClock.now() - asked) / 1e9 - 0.3) * 1e6))
        let text = String(decoding: try probe.send("GET", "/metrics").body, as: UTF8.self)
        let counted = text.split(separator: "\n").filter { $0.hasPrefix(#"signerd_requests_total{endpoint="/v1/sign/promotional-offer""#) }
        #expect(counted == [#"signerd_requests_total{endpoint="/v1/sign/promotional-offer",status="503"} 2"#], "\(counted)")
        print("FAULT-OUTCOME every session hung: /healthz + /metrics answered in \(String(format: "%.3f", probeSeconds)) s; hung requests answered \(got.map { "\($0.status) after \(String(format: "%.2f", $0.seconds)) s" })")
    }

    /// A client of `daemon` and a promotional-offer body for its bundle,
    /// after one request signed with them.
    func signingOnce(_ daemon: InProcessDaemon, sourceLocation: SourceLocation = #_sourceLocation) throws -> (SignerClient, [UInt8]) {
        let client = SignerClient(socketPath: daemon.socketPath)
        let body = daemon.offerBody
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: body)), sourceLocation: sourceLocation)
        return (client, body)
    }

    /// Found by the real-outage test under load: with a call still inside
    /// the module, recovery tried new sessions without C_Finalize +
    /// C_Initialize, SoftHSM still showed the token (its directory gone), the
    /// key was not found, was taken as deleted, and requests got 404
    /// key_not_found during the outage instead of 503.
    @Test("keys missing on new sessions of a module that was not reinitialized are not taken as deleted: 503 until a reinitialized module answers")
    func keysMissingBeforeReinitialize() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let (client, body) = try signingOnce(daemon)
        // The token's storage goes away: every object search finds nothing.
        daemon.faults.hideObjects()
        daemon.token.markDown(reason: PKCS11ReturnValue.sessionHandleInvalid.name, reinitialize: false)
        #expect(poll(seconds: 5) { daemon.logged("keys_not_found_before_reinitialize") + daemon.logged("token_up") > 0 })
        #expect(daemon.logged("keys_not_found_before_reinitialize") == 1, "the light attempt did not conclude the key was deleted")
        // The storage comes back: the reinitialized module finds the key, and it signs.
        try expectStillDownThenSigning(daemon, client, body)
    }

    /// A stress run renamed SoftHSM's token directory for 0.25 s under load:
    /// the first reinitialized recovery step found the token without the
    /// key, took the key as deleted, and signerd answered 404 for good
    /// (SoftHSM had reloaded the renamed directory; only another
    /// reinitialization would have seen the key again).
    @Test("a key missing after one reinitialization is not yet deleted: 503 while recovery reinitializes again, and the key signs when its storage is back")
    func keyMissingAfterOneReinitialization() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let (client, body) = try signingOnce(daemon)
        daemon.faults.hideObjects()
        #expect(try client.send("POST", "/v1/sign/promotional-offer", body: body).status == 503)
        #expect(poll(seconds: 5) { daemon.logged("keys_not_found_after_reinitialize") > 0 || daemon.logged("key_missing_after_recovery") > 0 })
        #expect(daemon.logged("key_missing_after_recovery") == 0, "taken as deleted after one reinitialization")
        // The storage is back before the last reinitialization: the key is found and signs.
        try expectStillDownThenSigning(daemon, client, body)
    }

    /// While the token's objects are hidden a request gets 503; once they
    /// are back the token comes up, the key signs, and it was never taken
    /// as deleted.
    func expectStillDownThenSigning(_ daemon: InProcessDaemon, _ client: SignerClient, _ body: [UInt8]) throws {
        let during = try client.send("POST", "/v1/sign/promotional-offer", body: body)
        #expect(during.status == 503, "\(String(decoding: during.body, as: UTF8.self))")
        daemon.faults.clear()
        #expect(poll(seconds: 10) { daemon.logged("token_up") == 1 })
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: body)))
        #expect(daemon.logged("key_missing_after_recovery") == 0)
    }

    /// api.md: "HSM errors by CKR name". A key whose handle went stale and
    /// could not be found again (the token's storage gone) was counted as
    /// `token_unavailable`, hiding the `CKR_*` value the token had answered.
    @Test("the token's objects vanishing is counted under the CKR_* value that showed it, not signerd's own condition")
    func vanishedKeyCountedByCKR() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let (client, body) = try signingOnce(daemon)
        daemon.faults.hideObjects()
        let during = try client.send("POST", "/v1/sign/promotional-offer", body: body)
        #expect(during.status == 503, "\(String(decoding: during.body, as: UTF8.self))")
        let metrics = String(decoding: try client.send("GET", "/metrics").body, as: UTF8.self)
        let counted = metrics.split(separator: "\n").filter { $0.hasPrefix("signerd_hsm_errors_total{") }
        #expect(counted == ["signerd_hsm_errors_total{rv=\"CKR_KEY_HANDLE_INVALID\"} 1"], "\(counted)")
        // api.md: readiness names the failing part ("token missing, …").
        let ready = try client.send("GET", "/readyz")
        #expect(ready.status == 503)
        #expect(String(decoding: ready.body, as: UTF8.self).contains("token missing or unavailable (key_vanished)"), "\(String(decoding: ready.body, as: UTF8.self))")
        daemon.faults.clear()
        #expect(poll(seconds: 10) { daemon.logged("token_up") == 1 })
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: body)))
    }

    /// A review found a look-up that began before the cache was dropped (an
    /// outage, a recovery, a forget) wrote its handles back afterwards:
    /// handles from before a module reinitialization could then be used.
    @Test("a key look-up that began before the key cache was dropped does not cache its objects")
    func staleLookupNotCached() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        daemon.token.forgetKey(nil)
        // The search reaches the module after 0.5 s; the cache is dropped meanwhile.
        daemon.faults.inject(.findObjects, .ok, count: 1, delay: 0.5)
        let done = DispatchSemaphore(value: 0)
        let token = daemon.token, keyID = daemon.keyID
        let found = Mutex<Result<ECPublicKey, HSMError>?>(nil)
        DispatchQueue.global().async {
            let result = Result { () throws(HSMError) in try token.currentPublicKey(keyID: keyID, maxAge: 0) }
            found.withLock { $0 = result }
            done.signal()
        }
        usleep(200_000)
        daemon.token.forgetKey(nil)
        done.wait()
        // The look-up itself succeeded: the cache is empty because it was dropped, not because the search failed.
        #expect(try found.withLock { try $0?.get() } == daemon.publicKey)
        #expect(daemon.token.cachedPublicKey(keyID: daemon.keyID) == nil, "the look-up found the key, but from before the drop")
        // A look-up that began after it caches as usual.
        _ = try daemon.token.currentPublicKey(keyID: daemon.keyID, maxAge: 0)
        #expect(daemon.token.cachedPublicKey(keyID: daemon.keyID) == daemon.publicKey)
    }

    /// The same for recovery: it looked the keys up again and merged them
    /// into the cache even when a reload had dropped the cache meanwhile.
    @Test("recovery does not cache keys it looked up before the cache was dropped again")
    func recoveryLookupNotCachedAfterDrop() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        _ = try daemon.token.currentPublicKey(keyID: daemon.keyID, maxAge: 0)
        let searches = daemon.faults.calls(.findObjects)
        daemon.faults.inject(.findObjects, .ok, count: 1, delay: 0.8)
        daemon.token.markDown(reason: PKCS11ReturnValue.sessionHandleInvalid.name, reinitialize: false)
        // Recovery starts after its first back-off (0.1–0.2 s) and then waits 0.8 s in C_FindObjects.
        #expect(poll(seconds: 3) { daemon.faults.calls(.findObjects) > searches }, "recovery's search has begun")
        #expect(daemon.logged("token_up") == 0, "recovery is still inside its search")
        usleep(200_000)
        daemon.token.forgetKey(nil)
        #expect(poll(seconds: 10) { daemon.logged("token_up") == 1 })
        #expect(daemon.token.cachedPublicKey(keyID: daemon.keyID) == nil, "looked up before the drop")
    }

    @Test("CKR_PIN_INCORRECT from SoftHSM on re-login: exactly one C_Login however many requests arrive; readiness says why; a reload of the same PIN sends nothing; a reload with the right PIN recovers")
    func wrongPIN() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        // The token's PIN changes behind the PIN file's back: the daemon
        // changes it itself, then a reload reads the file's (now wrong) PIN.
        let pinPath = try #require(PKCS11URI(daemon.tokenURI).pinSource.flatMap(PKCS11URI.pinFilePath))
        let newPINPath = daemon.directory + "/new.pin"
        try writeSecretFile(newPINPath, SecureRandom.bytes(12).hexString)
        try daemon.token.changeUserPIN(to: TokenAdministration.readPINFile(newPINPath))
        try daemon.service.reload(daemon.service.configuration)
        let logins = daemon.faults.calls(.login)
        let load = LoadRecorder(daemon)
        load.start(threads: 4)
        usleep(300_000)
        // The module starts again (as after a device fault) and SoftHSM
        // refuses the file's PIN at the new C_Login.
        daemon.token.markDown(reason: PKCS11ReturnValue.deviceError.name, reinitialize: true)
        #expect(poll(seconds: 10) { daemon.logged("pin_rejected") == 1 })
        usleep(1_000_000)
        let client = SignerClient(socketPath: daemon.socketPath)
        let ready = try client.send("GET", "/readyz")
        #expect(ready.status == 503)
        #expect(String(decoding: ready.body, as: UTF8.self).contains("PIN"))
        #expect(daemon.faults.calls(.login) == logins + 1, "one C_Login attempt, never retried")
        #expect(daemon.token.status == .pinRejected(.pinIncorrect))
        // A caller is told that retrying cannot help, and asked to wait
        // longer than for a passing fault.
        let refusedSign = try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
        let refusedText = String(decoding: refusedSign.body, as: UTF8.self)
        #expect(refusedSign.status == 503 && refusedText.contains("hsm_unavailable"), "\(refusedText)")
        #expect(refusedText.contains("CKR_PIN_INCORRECT") && refusedText.contains("retrying will not help") && refusedText.contains("fixes or unlocks signerd's PIN"), "\(refusedText)")
        #expect(refusedSign.headers["retry-after"] == String(SignerService.pinRejectedRetryAfter), "\(refusedSign.headers)")
        // A reload that re-reads the unchanged file sends no C_Login.
        let refused = #expect(throws: ConfigurationError.self) { try daemon.service.reload(daemon.service.configuration) }
        #expect(refused?.description.contains("not sent again") == true, "\(String(describing: refused))")
        #expect(daemon.faults.calls(.login) == logins + 1, "the refused PIN was sent again")
        // The operator writes the right PIN into the file and reloads.
        try writeSecretFile(pinPath, String(decoding: FileManager.default.contents(atPath: newPINPath) ?? Data(), as: UTF8.self))
        try daemon.service.reload(daemon.service.configuration)
        let reloaded = MonotonicClock.now()
        usleep(1_000_000)
        let samples = load.stop()
        let failedWhileRejected = samples.filter { $0.status != 200 && $0.at < reloaded }.count
        #expect(samples.filter { $0.status == 200 && !$0.valid }.isEmpty)
        #expect(samples.filter { $0.at > reloaded + 200_000_000 && $0.status == 200 }.count > 10, "signing again after the reload")
        #expect(daemon.faults.calls(.login) == logins + 2)
        print("FAULT-OUTCOME CKR_PIN_INCORRECT on re-login: \(failedWhileRejected) requests failed with 503 while the PIN was refused, \(daemon.faults.calls(.login) - logins) C_Login calls in all (one refused, none for the reload of the same PIN, one after the reload with the right PIN)")
        try expectHealthy(daemon)
    }
}
