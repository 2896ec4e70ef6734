import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

/// A few seconds of `signctl bench` against the real daemon and the direct
/// baseline: it must run clean (zero errors, every signature verified). Speed
/// is measured by scripts/bench.sh, never asserted here.
@Suite("signctl bench smoke test", .serialized)
struct BenchSmokeTests {
    @Test("a short bench over the socket, every signing endpoint, --verify: zero errors",
          arguments: ["promotional-offer", "offers", "promotional-offer-v2", "introductory-offer-eligibility", "advanced-commerce-request", "server-api-token"])
    func socket(_ endpoint: String) throws {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "XYZ987WVUT"])
        try daemon.start()
        defer { daemon.stop() }
        let output = try daemon.signctl(["bench", "--endpoint", endpoint, "--concurrency", "4", "--duration", "1", "--verify", "--json"])
        let report = try JSONDecoder().decode(BenchmarkReport.self, from: Data(output.utf8))
        #expect(report.errorCount == 0, "\(report.errors)")
        #expect(report.requests > 10)
        #expect(report.latencyMs["p99"] != nil)
        // --verify checks each signature with the public keys GET /v1/keys
        // lists: those are the keys this test made, not the daemon's word.
        let listed = try daemon.client().send("GET", "/v1/keys").decode(KeysResponse.self).keys
        #expect(listed.count == 2)
        for key in listed {
            let made = try ECPublicKey(pem: try #require(daemon.keys[key.keyID]).publicKeyPEM)
            #expect(try ECPublicKey(pem: try #require(key.publicKeyPEM)) == made, "\(key.keyID)")
        }
        #expect((report.rssKiB?["after"] ?? 0) > 0, "the daemon's RSS was read from /proc")
        #expect((report.openFDs?["after"] ?? 99) <= (report.openFDs?["before"] ?? 0) + 4, "no descriptor left over")
        #expect((report.cpuMicrosecondsPerRequest?["signerd"] ?? 0) > 0, "the daemon's CPU time was read from /proc")
        #expect((report.cpuMicrosecondsPerRequest?["signctl"] ?? 0) > 0, "the client's CPU time was read with getrusage")
    }

    /// signctl holds the PIN (every token command) and the private key
    /// (`keys import`); unlike signerd, it could leave them in a core file.
    /// This runner's hard core-file limit (RLIMIT_CORE).
    static let hardCoreLimit: rlim_t = {
        var limit = rlimit()
        getrlimit(Int32(RLIMIT_CORE.rawValue), &limit)
        return limit.rlim_max
    }()

    @Test("signctl lowers a core-file limit it was started with to 0 (RLIMIT_CORE), as signerd does",
          .enabled(if: hardCoreLimit > 0, "the hard core-file limit of this runner is 0, so signctl lowering it cannot be seen"))
    func noCoreDumps() throws {
        // Started with core files allowed, so that the test sees signctl lower
        // the limit itself (a runner with LimitCORE=0 would pass otherwise).
        // The soft limit is raised to the hard one, which needs no privilege
        // (root in a container may lack CAP_SYS_RESOURCE to go higher).
        let raised = "\(Self.hardCoreLimit):\(Self.hardCoreLimit)"
        let daemon = try DaemonHarness()
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/prlimit")
        process.arguments = ["--core=\(raised)", Binaries.signctl, "--config", daemon.configPath, "bench", "--direct", "--concurrency", "1", "--duration", "3"]
        process.environment = daemon.environment
        process.standardOutput = FileHandle.nullDevice
        process.standardError = FileHandle.nullDevice
        try process.run()
        defer {
            kill(process.processIdentifier, SIGKILL)
            process.waitUntilExit()
        }
        usleep(1_000_000)
        // prlimit exec'd signctl (it would have exited had it failed to set the limit).
        try #require(process.isRunning, "prlimit --core=\(raised) did not start signctl (exit \(process.isRunning ? 0 : process.terminationStatus))")
        let command = try String(contentsOfFile: "/proc/\(process.processIdentifier)/comm", encoding: .utf8)
        try #require(command.hasPrefix("signctl"), "\(command)")
        let limits = try String(contentsOfFile: "/proc/\(process.processIdentifier)/limits", encoding: .utf8)
        let core = try #require(limits.split(separator: "\n").first { $0.hasPrefix("Max core file size") })
        #expect(core.split(separator: " ", omittingEmptySubsequences: true).dropFirst(4).prefix(2) == ["0", "0"], "\(core)")
    }

    @Test("a batch whose offers fail is counted by the offers' own code (7234), not as a malformed signature")
    func offersSignatureError() throws {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "XYZ987WVUT"])
        // Two keys serve com.example.app and none is the default: each offer gets 7234 inside a 200.
        try daemon.writeConfig(removing: ["default_key_id"])
        try daemon.start()
        defer { daemon.stop() }
        let run = runSignctl(["--config", daemon.configPath, "bench", "--endpoint", "offers", "--concurrency", "2", "--requests", "20", "--json"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(run.status == 69, "\(run.stderr)")
        let report = try JSONDecoder().decode(BenchmarkReport.self, from: Data(run.stdout.utf8))
        #expect(report.errors == ["signature_error_7234": 20], "\(report.errors)")
    }

    @Test("a run that completes no request exits 69 and says so")
    func nothingCompleted() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let run = runSignctl(["--config", daemon.configPath, "bench", "--duration", "0.000001", "--json"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        let report = try JSONDecoder().decode(BenchmarkReport.self, from: Data(run.stdout.utf8))
        // A round trip over the socket takes far longer than 1 µs, so no request can complete in time.
        try #require(report.requests == 0, "the run was meant to complete nothing")
        #expect(run.status == 69, "\(run.stderr)")
        #expect(run.stderr.contains("error: no request completed in"), "\(run.stderr)")
        // The text report says there is no latency, not "p50 0.000".
        let text = runSignctl(["--config", daemon.configPath, "bench", "--duration", "0.000001"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(text.status == 69 && text.stdout.contains("latency ms: none (no request succeeded)") && !text.stdout.contains("p50 0.000"), "\(text.stdout) \(text.stderr)")
    }

    @Test("the text report names the socket's peer by role (daemon), with its PID and command name")
    func textReportNamesTheDaemon() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        // A second: the daemon's CPU is shown only past 10 ticks of /proc/PID/stat.
        let run = runSignctl(["--config", daemon.configPath, "bench", "--duration", "1"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(run.status == 0, "\(run.stderr)")
        let cpuLine = run.stdout.split(separator: "\n").first { $0.hasPrefix("CPU µs per request: ") }
        // The JSON key stays "signerd" (tested above); the text says what was measured.
        #expect(cpuLine?.contains("daemon ") == true && cpuLine?.contains("signctl ") == true && cpuLine?.contains("signerd") == false, "\(run.stdout)")
        let pid = try #require(daemon.process?.processIdentifier)
        #expect(run.stdout.contains("daemon: pid \(pid) (signerd)"), "\(run.stdout)")
        // A few requests: too little CPU to read at /proc's resolution, and the text says so (it showed "daemon 0.0").
        let short = runSignctl(["--config", daemon.configPath, "bench", "--requests", "20"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        #expect(short.status == 0 && short.stdout.contains("daemon CPU not shown: it used less than 10 clock ticks") && !short.stdout.contains("daemon 0.0"), "\(short.stdout)")
    }

    @Test("--bundle-id without --key-id loads the key that serves that bundle ID, not the first one listed")
    func bundleIDChoosesItsKey() throws {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "XYZ987WVUT"])
        try daemon.writeConfig(["keys": [["key_id": "ABC123DEFG", "bundle_ids": ["com.example.app"]], ["key_id": "XYZ987WVUT", "bundle_ids": ["com.example.two"]]]])
        try daemon.start()
        defer { daemon.stop() }
        // Before, the first listed key (ABC123DEFG) was sent with com.example.two: 403 bundle_not_allowed for every request.
        let output = try daemon.signctl(["bench", "--bundle-id", "com.example.two", "--requests", "40", "--verify", "--json"])
        let report = try JSONDecoder().decode(BenchmarkReport.self, from: Data(output.utf8))
        #expect(report.errors.isEmpty, "\(report.errors)")
        #expect(report.requests == 40)
    }

    @Test("the daemon's descriptors before a run are read with bench's own probe connection closed, so a leak of one shows")
    func descriptorsBeforeAreIdle() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let pid = try #require(daemon.process?.processIdentifier)
        // Idle: the harness's readiness probe has been closed by the daemon too.
        var idle = 0
        _ = poll(seconds: 5) {
            let first = ProcessStatistics.openDescriptors(pid) ?? -1
            usleep(200_000)
            idle = ProcessStatistics.openDescriptors(pid) ?? -2
            return first == idle
        }
        let output = try daemon.signctl(["bench", "--concurrency", "2", "--requests", "200", "--json"])
        let report = try JSONDecoder().decode(BenchmarkReport.self, from: Data(output.utf8))
        // Before, "before" counted the probe connection (two descriptors in
        // the daemon) and a run showed 9 → 7: a leak of two still passed.
        #expect(report.openFDs?["before"] == idle, "\(String(describing: report.openFDs)), idle \(idle)")
        #expect(report.openFDs?["after"] == idle, "\(String(describing: report.openFDs)), idle \(idle)")
        #expect(report.daemonPID == pid)
    }

    /// A listener that does what systemd does for a socket unit: binds and
    /// listens, then starts signerd with the socket as descriptor 3
    /// (`LISTEN_FDS`, `LISTEN_PID`: sd_listen_fds(3)) and stays its parent,
    /// passing on SIGTERM, SIGINT and SIGHUP, which the test runner starts
    /// it with blocked.
    static let socketActivationLauncher = """
        import os, signal, socket, sys
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(sys.argv[1])
        listener.listen(64)
        child = os.fork()
        if child == 0:
            os.dup2(listener.fileno(), 3)
            os.set_inheritable(3, True)
            os.environ["LISTEN_PID"] = str(os.getpid())
            os.environ["LISTEN_FDS"] = "1"
            os.execv(sys.argv[2], sys.argv[2:])
        forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        for number in forwarded:
            signal.signal(number, lambda received, frame: os.kill(child, received))
        # Started with them blocked (signerd, exec'd above, keeps the mask it expects).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, forwarded)
        while True:
            try:
                _, status = os.waitpid(child, 0)
                sys.exit(os.waitstatus_to_exitcode(status))
            except InterruptedError:
                continue
        """

    @Test("under socket activation bench reads signerd's RSS, descriptors and CPU, not the listener's (the socket's SO_PEERCRED peer)")
    func socketActivatedDaemon() throws {
        let daemon = try DaemonHarness()
        try daemon.start(launcher: ["env", "python3", "-c", Self.socketActivationLauncher, daemon.socketPath])
        defer { daemon.stop() }
        #expect(!daemon.logged { $0.contains("\"socket.activated\":true") }.isEmpty, "\(daemon.log)")
        let listener = try #require(daemon.process?.processIdentifier)
        // Enough requests for the daemon's CPU to pass 10 ticks of /proc/PID/stat (about 0.3 s of it).
        let output = try daemon.signctl(["bench", "--concurrency", "2", "--requests", "3000", "--json"])
        let report = try JSONDecoder().decode(BenchmarkReport.self, from: Data(output.utf8))
        #expect(report.errors.isEmpty, "\(report.errors)")
        let measured = try #require(report.daemonPID, "\(report.daemonNotMeasured ?? "")")
        // Before, the listener (here python3; systemd under a socket unit) was measured.
        #expect(measured != listener)
        #expect(ProcessStatistics.commandName(measured) == "signerd")
        #expect(ProcessStatistics.parentPID(measured) == listener)
        #expect((report.rssKiB?["after"] ?? 0) > 0)
        #expect((report.cpuMicrosecondsPerRequest?["signerd"] ?? 0) > 0, "signerd's CPU, not the idle listener's: \(output)")
    }

    @Test("the direct baseline runs clean")
    func direct() throws {
        let daemon = try DaemonHarness()
        let output = try daemon.signctl(["bench", "--direct", "--concurrency", "2", "--requests", "300", "--verify", "--json"])
        let report = try JSONDecoder().decode(BenchmarkReport.self, from: Data(output.utf8))
        #expect(report.errorCount == 0, "\(report.errors)")
        #expect(report.requests == 300)
        #expect(report.mode == "direct")
        #expect((report.cpuMicrosecondsPerRequest?["signctl"] ?? 0) > 0, "the loop's CPU time was read with getrusage")
        #expect(report.cpuMicrosecondsPerRequest?["signerd"] == nil, "no daemon in direct mode")
    }
}

/// `scripts/bench.sh` runs for minutes; an option it cannot use must stop it
/// before the build and the first run, with signctl bench's own limits.
@Suite("scripts/bench.sh: options checked before anything runs")
struct BenchScriptOptionTests {
    @Test("a bad option exits 64 naming it, before the release build",
          arguments: [
              (["--soak", "0"], "--soak must be a whole number of requests, 1 to 100000000; got 0"),
              (["--soak", "100000001"], "--soak must be a whole number of requests, 1 to 100000000; got 100000001"),
              (["--soak", "1e6"], "--soak must be a whole number of requests, 1 to 100000000; got 1e6"),
              (["--duration", "0"], "--duration must be seconds (decimal), more than 0 and at most 86400; got 0"),
              (["--duration", "86400.5"], "--duration must be seconds (decimal), more than 0 and at most 86400; got 86400.5"),
              (["--duration", "1.2.3"], "--duration must be seconds (decimal), more than 0 and at most 86400; got 1.2.3"),
              (["--rounds", "0"], "--rounds must be a whole number, 1 or more; got 0"),
              (["--output", "/nonexistent/BENCHMARKS.md"], "the directory /nonexistent does not exist or is not writable"),
              (["--soak"], "--soak needs a value"),
              (["--warmup", "3"], "unknown argument --warmup"),
              // The limits themselves are taken: only the output is refused.
              (["--soak", "100000000", "--duration", "86400", "--rounds", "1", "--output", "/nonexistent/x.md"], "--output /nonexistent/x.md: the directory"),
          ])
    func refused(_ arguments: [String], _ message: String) {
        let result = runProgram("/bin/bash", [Binaries.root + "/scripts/bench.sh"] + arguments)
        #expect(result.status == 64, "\(result.stderr)")
        #expect(result.stderr.contains(message), "\(result.stderr)")
        #expect(!result.stderr.contains("==> building"), "checked only after the build started: \(result.stderr)")
    }
}
