import Foundation
import SignerIPC
import Synchronization
import Testing
import TestSupport

/// The signerd process over a PKCS#11 module whose `C_Sign` hangs:
/// scripts/pkcs11-hang-shim.c, a seam in front of SoftHSM's function table
/// in the daemon's own process, which the in-process fault injector cannot
/// reach.
@Suite("signerd over a PKCS#11 module whose C_Sign hangs (a shim in front of SoftHSM)", .serialized)
struct HungModuleTests {
    /// The shim, built with the system's C compiler (or the Swift
    /// toolchain's clang); nil when there is none.
    static let shim: String? = {
        let directories = (ProcessInfo.processInfo.environment["PATH"] ?? "/usr/bin").split(separator: ":").map(String.init)
        let compiler = ["cc", "clang"].lazy.flatMap { name in directories.map { $0 + "/" + name } }
            .first { FileManager.default.isExecutableFile(atPath: $0) }
        guard let compiler else { return nil }
        let output = TemporaryDirectory.make(prefix: "signerd-shim") + "/pkcs11-hang-shim.so"
        let built = runProgram(compiler, ["-shared", "-fPIC", Binaries.root + "/scripts/pkcs11-hang-shim.c", "-o", output, "-ldl"])
        return built.status == 0 ? output : nil
    }()

    /// The lines the shim has logged, one per `C_Sign` that holds a buffer.
    static func signCalls(_ log: String) -> Int {
        ((try? String(contentsOfFile: log, encoding: .utf8)) ?? "").split(separator: "\n").count
    }

    /// Starts signerd with `token_uri`'s module-path pointing at the shim,
    /// and `extra` settings.
    /// - Returns: the daemon, the file whose presence makes C_Sign hang, and the shim's C_Sign log.
    static func startOverShim(_ extra: [String: Any], environment: (DaemonHarness) throws -> [String: String] = { _ in [:] }) throws -> (daemon: DaemonHarness, hang: String, log: String) {
        let shim = try #require(Self.shim)
        let daemon = try DaemonHarness()
        let hang = daemon.directory + "/hang"
        let log = daemon.directory + "/c_sign.log"
        let uri = daemon.tokenURI.replacingOccurrences(of: #"module-path=[^&?;]*"#, with: "module-path=\(shim)", options: .regularExpression)
        try #require(uri.contains(shim))
        try daemon.writeConfig(extra.merging(["token_uri": uri]) { $1 })
        try daemon.start(extraEnvironment: try environment(daemon).merging(["SIGNERD_SHIM_HANG": hang, "SIGNERD_SHIM_LOG": log]) { $1 })
        return (daemon, hang, log)
    }

    /// Waits up to 10 s for one more C_Sign than `before` in the shim's log:
    /// a call that is now hanging.
    /// - Returns: the count of C_Sign calls then.
    static func waitForHungCall(_ log: String, after before: Int, _ daemon: DaemonHarness, _ failure: String) throws -> Int {
        let deadline = Date().addingTimeInterval(10)
        while signCalls(log) == before && Date() < deadline { usleep(20_000) }
        try #require(signCalls(log) == before + 1, "\(failure): \(daemon.log.suffix(5))")
        return signCalls(log)
    }

    /// Sends one classic signing request on a thread of its own and hands
    /// its answer (nil: none, e.g. the connection closed) to `done`.
    static func signInBackground(_ daemon: DaemonHarness, then done: @escaping @Sendable (ClientResponse?) -> Void = { _ in }) {
        let socketPath = daemon.socketPath
        Thread {
            let body = Array(#"{"bundle_id":"com.example.app","product_id":"p","offer_id":"o"}"#.utf8)
            done(try? SignerClient(socketPath: socketPath, timeout: 30).send("POST", "/v1/sign/promotional-offer", body: body))
        }.start()
    }

    /// Seconds a stop may take with a call hung at SIGTERM and `sign_timeout_ms`
    /// 1000: that plus 5 s for the call, up to 2 s for C_Finalize to wait on it, and a margin.
    static let stopBound = 1.0 + 5 + 2 + 3

    /// Sends SIGTERM and waits for the process itself to end (not for the log pipe).
    /// - Returns: the seconds it took and the exit status.
    static func terminate(_ daemon: DaemonHarness) throws -> (seconds: Double, status: Int32) {
        let process = try #require(daemon.process)
        let terminated = Date()
        daemon.send(SIGTERM)
        while process.isRunning && Date().timeIntervalSince(terminated) < 30 { usleep(20_000) }
        let took = Date().timeIntervalSince(terminated)
        return (took, daemon.stop())
    }

    /// The idle token check (`token_check_seconds`) runs on a thread of its
    /// own. An attack round, with a shim like this one, found that a check
    /// could start after SIGTERM, and that one hung in the module at stop
    /// kept signerd from exiting; neither had a test in the suite. This
    /// test then found that the hung check, written off at
    /// `sign_timeout_ms`, took the token down during the stop and started
    /// recovery, whose test signature went into the hanging module too.
    @Test("SIGTERM while the idle token check hangs in C_Sign: token_check_unfinished, exit 0 within sign_timeout_ms + 5 s, and no C_Sign after SIGTERM",
          .enabled(if: shim != nil, "needs a C compiler (cc or clang) to build scripts/pkcs11-hang-shim.c"))
    func sigtermDuringHungTokenCheck() throws {
        let (daemon, hang, log) = try Self.startOverShim(["token_check_seconds": 1, "sign_timeout_ms": 1000])
        defer { try? FileManager.default.removeItem(atPath: hang) }
        #expect(Self.signCalls(log) >= 1, "the start's self-test signed through the shim")
        // From now on every C_Sign hangs: the next idle check goes in and stays.
        #expect(FileManager.default.createFile(atPath: hang, contents: nil))
        let atTerm = try Self.waitForHungCall(log, after: Self.signCalls(log), daemon, "no idle token check came within 10 s")
        let (took, status) = try Self.terminate(daemon)
        #expect(status == 0)
        #expect(took < Self.stopBound, "signerd took \(took) s to stop with a token check hung in C_Sign")
        #expect(!daemon.logged { $0.contains("\"token_check_unfinished\"") }.isEmpty, "\(daemon.log.suffix(6))")
        #expect(Self.signCalls(log) == atTerm, "a C_Sign started after SIGTERM: \(daemon.log.suffix(12))")
    }

    /// The same for a request's own C_Sign: tested in-process before, never
    /// through the daemon's SIGTERM path.
    @Test("SIGTERM while a request hangs in C_Sign: it is answered 503 at sign_timeout_ms, signerd exits 0 in bounded time, and no C_Sign starts after SIGTERM",
          .enabled(if: shim != nil, "needs a C compiler (cc or clang) to build scripts/pkcs11-hang-shim.c"))
    func sigtermDuringHungRequest() throws {
        let (daemon, hang, log) = try Self.startOverShim(["token_check_seconds": 0, "sign_timeout_ms": 1000])
        defer { try? FileManager.default.removeItem(atPath: hang) }
        #expect(FileManager.default.createFile(atPath: hang, contents: nil))
        let before = Self.signCalls(log)
        let answer = Mutex<ClientResponse?>(nil)
        Self.signInBackground(daemon) { response in answer.withLock { $0 = response } }
        let atTerm = try Self.waitForHungCall(log, after: before, daemon, "the request did not reach C_Sign")
        let (took, status) = try Self.terminate(daemon)
        #expect(status == 0)
        #expect(took < Self.stopBound, "signerd took \(took) s to stop with a request hung in C_Sign")
        let waitForAnswer = Date().addingTimeInterval(5)
        while answer.withLock({ $0 }) == nil && Date() < waitForAnswer { usleep(20_000) }
        let response = answer.withLock { $0 }
        #expect(response?.status == 503 && response?.error?.code == "hsm_unavailable", "\(String(describing: response))")
        #expect(Self.signCalls(log) == atTerm, "a C_Sign started after SIGTERM: \(daemon.log.suffix(8))")
        #expect(!FileManager.default.fileExists(atPath: daemon.socketPath))
    }

    /// The stop waited sign_timeout_ms + 5 s for requests, then as long again
    /// for an idle check hung at the same time (23 s with the defaults in an
    /// attack round); they now share one window from the signal.
    @Test("SIGTERM with a request and the idle token check both hung in C_Sign: one window, not two (exit 0 within sign_timeout_ms + 5 s + 3 s and a margin)",
          .enabled(if: shim != nil, "needs a C compiler (cc or clang) to build scripts/pkcs11-hang-shim.c"))
    func sigtermDuringHungRequestAndCheck() throws {
        let (daemon, hang, log) = try Self.startOverShim(["token_check_seconds": 1, "sign_timeout_ms": 1000])
        defer { try? FileManager.default.removeItem(atPath: hang) }
        #expect(FileManager.default.createFile(atPath: hang, contents: nil))
        let checked = try Self.waitForHungCall(log, after: Self.signCalls(log), daemon, "no idle token check came within 10 s")
        Self.signInBackground(daemon)
        _ = try Self.waitForHungCall(log, after: checked, daemon, "the request did not reach C_Sign")
        let (took, status) = try Self.terminate(daemon)
        #expect(status == 0)
        #expect(took < Self.stopBound, "signerd took \(took) s to stop with a request and a token check hung in C_Sign")
    }

    /// Recovery's own calls are not written off as requests' are: one that
    /// never returned kept the token down until a restart, with nothing in
    /// the log after `token_down` and the systemd watchdog still pinged.
    @Test("recovery stuck in C_Sign: recovery_stuck at 6 × sign_timeout_ms (at least 5 s), the gauge shows it, WATCHDOG=1 pings stop, and resume once the call returns",
          .enabled(if: shim != nil, "needs a C compiler (cc or clang) to build scripts/pkcs11-hang-shim.c"))
    func stuckRecoveryStopsWatchdogPings() throws {
        var listener: NotifyListener?
        let (daemon, hang, log) = try Self.startOverShim(["token_check_seconds": 0, "sign_timeout_ms": 500]) { daemon in
            let notify = try NotifyListener(directory: daemon.directory)
            listener = notify
            return ["NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"]
        }
        defer { try? FileManager.default.removeItem(atPath: hang) }
        let notify = try #require(listener)
        #expect(notify.messages(for: 5, until: "READY=1").last?.contains("READY=1") == true)
        #expect(notify.messages(for: 1).filter { $0 == "WATCHDOG=1" }.count >= 3, "pings every 200 ms while healthy")
        #expect(FileManager.default.createFile(atPath: hang, contents: nil))
        // A request's C_Sign hangs and is written off at 500 ms; recovery's test signature then hangs too.
        let request = try Self.waitForHungCall(log, after: Self.signCalls(log), { Self.signInBackground(daemon); return daemon }(), "the request did not reach C_Sign")
        _ = try Self.waitForHungCall(log, after: request, daemon, "recovery's test signature did not reach C_Sign")
        let stuck = daemon.logged(atLeast: 1, within: 10) { $0.contains("\"recovery_stuck\"") }
        #expect(stuck.count == 1, "\(daemon.log.suffix(6))")
        #expect(stuck.first?.contains("stops its systemd watchdog pings") == true, "\(stuck)")
        let metrics = try SignerClient(socketPath: daemon.socketPath, timeout: 5).send("GET", "/metrics")
        let gauge = String(decoding: metrics.body, as: UTF8.self).split(separator: "\n").first { $0.hasPrefix("signerd_token_recovery_call_seconds ") }
        #expect((gauge.flatMap { Double($0.split(separator: " ")[1]) } ?? 0) >= 5, "\(String(describing: gauge))")
        _ = notify.messages(for: 0.3)  // a ping sent just before the stall was seen
        #expect(notify.messages(for: 1.5).filter { $0 == "WATCHDOG=1" }.isEmpty, "no ping while recovery is stuck")
        #expect(daemon.logged { $0.contains("\"recovery_stuck\"") }.count == 1, "logged once per stuck step")
        // The call returns: recovery ends, the token is up, the pings come back.
        try FileManager.default.removeItem(atPath: hang)
        #expect(daemon.logged(atLeast: 1, within: 10) { $0.contains("\"token_up\"") }.count == 1, "\(daemon.log.suffix(6))")
        #expect(notify.messages(for: 1.5).filter { $0 == "WATCHDOG=1" }.count >= 2, "pings again once recovery is done")
        #expect(daemon.stop() == 0)
    }
}
