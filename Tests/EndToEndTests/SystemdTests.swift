import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// A `NOTIFY_SOCKET` of the test's own: a datagram socket that collects what signerd tells systemd.
final class NotifyListener {
    let path: String
    private let fd: Int32

    init(directory: String) throws {
        path = directory + "/notify.sock"
        fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: Array(path.utf8) + [0]) }
        let bound = withUnsafePointer(to: &address) { $0.withMemoryRebound(to: sockaddr.self, capacity: 1) { bind(fd, $0, socklen_t(MemoryLayout<sockaddr_un>.size)) } }
        guard bound == 0 else { throw FixtureError("cannot bind \(path)") }
        var timeout = timeval(tv_sec: 0, tv_usec: 200_000)
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, socklen_t(MemoryLayout<timeval>.size))
    }

    deinit { close(fd) }

    /// Messages received within `seconds`, or until one contains `until`.
    func messages(for seconds: Double, until: String? = nil) -> [String] {
        var out: [String] = []
        let deadline = Date().addingTimeInterval(seconds)
        var buffer = [UInt8](repeating: 0, count: 4096)
        while Date() < deadline {
            let n = recv(fd, &buffer, buffer.count, 0)
            guard n > 0 else { continue }
            let message = String(decoding: buffer[0..<n], as: UTF8.self)
            out.append(message)
            if let until, message.contains(until) { break }
        }
        return out
    }
}

@Suite("systemd integration", .serialized)
struct SystemdTests {
    static let hasSystemdAnalyze = FileManager.default.isExecutableFile(atPath: "/usr/bin/systemd-analyze")
    static let hasSocketActivate = FileManager.default.isExecutableFile(atPath: "/usr/bin/systemd-socket-activate")

    /// Starts a daemon with a `NOTIFY_SOCKET` of the test's own and
    /// `WATCHDOG_USEC` set to `watchdogUSec` (microseconds, as systemd
    /// writes it), after `configure` has set it up.
    /// - Returns: the daemon, the listener, and what signerd said until `READY=1` (5 s at most).
    static func startNotified(watchdogUSec: String, configure: (DaemonHarness) throws -> Void = { _ in }) throws -> (DaemonHarness, NotifyListener, [String]) {
        let daemon = try DaemonHarness()
        try configure(daemon)
        let notify = try NotifyListener(directory: daemon.directory)
        try daemon.start(extraEnvironment: ["NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": watchdogUSec])
        return (daemon, notify, notify.messages(for: 5, until: "READY=1"))
    }

    @Test("the units pass systemd-analyze verify", .enabled(if: hasSystemdAnalyze, "systemd-analyze is not installed (Debian package systemd)"))
    func unitsVerify() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-units")
        for unit in ["signerd.service", "signerd.socket"] {
            let text = try String(contentsOfFile: Binaries.root + "/contrib/systemd/" + unit, encoding: .utf8)
                .replacingOccurrences(of: "/usr/local/bin/signerd", with: Binaries.signerd)
            try text.write(toFile: directory + "/" + unit, atomically: false, encoding: .utf8)
        }
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/usr/bin/systemd-analyze")
        process.arguments = ["verify", "--man=no", directory + "/signerd.socket", directory + "/signerd.service"]
        process.currentDirectoryURL = URL(fileURLWithPath: directory)
        let pipe = Pipe()
        process.standardOutput = pipe
        process.standardError = pipe
        try process.run()
        let output = String(decoding: pipe.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        #expect(process.terminationStatus == 0, "\(output)")
        #expect(output.trimmingCharacters(in: .whitespacesAndNewlines).isEmpty, "\(output)")
        let sysusers = try String(contentsOfFile: Binaries.root + "/contrib/systemd/signerd.sysusers.conf", encoding: .utf8)
        #expect(sysusers.contains("u signerd "))
    }

    @Test("sd_notify: READY=1 once serving, RELOADING=1/READY=1 around SIGHUP, WATCHDOG=1 with WatchdogSec, STOPPING=1")
    func notifications() throws {
        let (daemon, notify, startup) = try Self.startNotified(watchdogUSec: "400000")
        let ready = try #require(startup.last)
        #expect(ready.contains("READY=1"))
        #expect(ready.contains("STATUS=serving 1 key on "), "\(ready)")
        #expect(ready.contains("MAINPID=\(daemon.process!.processIdentifier)"))
        let pings = notify.messages(for: 1.2).filter { $0 == "WATCHDOG=1" }
        #expect(pings.count >= 3, "a ping every 200 ms (half of WATCHDOG_USEC); got \(pings.count)")
        daemon.send(SIGHUP)
        let reload = notify.messages(for: 3, until: "READY=1").filter { $0 != "WATCHDOG=1" }
        #expect(reload.first?.hasPrefix("RELOADING=1\nMONOTONIC_USEC=") == true, "\(reload)")
        #expect(reload.last?.hasPrefix("READY=1") == true, "\(reload)")
        #expect(daemon.stop() == 0)
        #expect(notify.messages(for: 1).contains("STOPPING=1"))
    }

    /// `WatchdogSec=` of microseconds made signerd ping (and check its own
    /// `/healthz`) in a loop at 100 % of a CPU: 10,625 pings in 3 s.
    @Test("a WatchdogSec of 2 µs is pinged at most every 50 ms")
    func shortWatchdogInterval() throws {
        let (daemon, notify, startup) = try Self.startNotified(watchdogUSec: "2")
        #expect(startup.last?.contains("READY=1") == true)
        let pings = notify.messages(for: 1).filter { $0 == "WATCHDOG=1" }.count
        #expect(pings >= 5 && pings <= 22, "\(pings) pings in 1 s; one per 50 ms is 20")
        #expect(daemon.stop() == 0)
    }

    /// Reloads run on a thread of their own; one still running when
    /// SIGTERM came sent READY=1 after STOPPING=1, telling systemd a
    /// stopping service was ready again.
    @Test("SIGHUP then SIGTERM at once: RELOADING=1 and READY=1 never follow STOPPING=1, and signerd exits 0")
    func reloadThenStop() throws {
        let daemon = try DaemonHarness()
        for round in 1...5 {
            let notify = try NotifyListener(directory: TemporaryDirectory.make(prefix: "signerd-notify"))
            try daemon.start(extraEnvironment: ["NOTIFY_SOCKET": notify.path])
            #expect(notify.messages(for: 5, until: "READY=1").last?.contains("READY=1") == true)
            daemon.send(SIGHUP)
            daemon.send(SIGTERM)
            let status = daemon.stop()
            let messages = notify.messages(for: 0.5)
            #expect(status == 0, "round \(round)")
            let stopping = try #require(messages.firstIndex { $0.hasPrefix("STOPPING=1") }, "round \(round): \(messages)")
            #expect(!messages[stopping...].contains { $0.hasPrefix("READY=1") || $0.hasPrefix("RELOADING=1") },
                    "round \(round): \(messages)")
        }
    }

    /// `WatchdogSec=3h` made the ping thread's `usleep` trap: 5,400 s is
    /// beyond `useconds_t`, and signerd died right after `READY=1`.
    @Test("a WatchdogSec beyond usleep's range (3 h) is pinged hourly, and signerd keeps serving")
    func longWatchdogInterval() throws {
        let (daemon, notify, startup) = try Self.startNotified(watchdogUSec: "10800000000")
        #expect(startup.last?.contains("READY=1") == true, "\(startup)")
        _ = notify.messages(for: 1)
        #expect(daemon.process?.isRunning == true, "signerd exited after READY=1: \(daemon.log.suffix(5))")
        let health = try daemon.client().send("GET", "/healthz")
        #expect(health.status == 200)
        #expect(daemon.stop() == 0)
    }

    /// The watchdog's `/healthz` self-check went through the per-uid rate
    /// limit: clients of signerd's own uid over the limit got its checks
    /// refused, the pings stopped, and systemd would kill a healthy daemon.
    @Test("WATCHDOG=1 keeps coming while clients of signerd's own uid are over the rate limit")
    func watchdogOutsideRateLimit() throws {
        let (daemon, notify, _) = try Self.startNotified(watchdogUSec: "400000") { try $0.writeConfig(["rate_limit_per_second": 1, "rate_limit_burst": 1]) }
        defer { daemon.stop() }
        // A client of the same uid (this test runs as the daemon's user) keeps the bucket empty.
        let client = daemon.client()
        defer { client.close() }
        let end = Date().addingTimeInterval(1.5)
        var limited = 0
        var pings = 0
        while Date() < end {
            let answer = try client.send("GET", "/healthz")
            if answer.status == 429 {
                limited += 1
                let text = String(decoding: answer.body, as: UTF8.self)
                #expect(text.contains("is over 1 requests per second (rate_limit_per_second)"), "the setting as written: \(text)")
            }
            pings += notify.messages(for: 0.05).filter { $0 == "WATCHDOG=1" }.count
        }
        #expect(limited >= 3, "the client was over the limit (\(limited) answers were 429)")
        #expect(pings >= 4, "a ping every 200 ms (half of WATCHDOG_USEC) while over the limit; got \(pings) in 1.5 s")
    }

    @Test("socket activation: signerd takes the listening socket from LISTEN_FDS and leaves it to systemd on exit",
          .enabled(if: hasSocketActivate, "systemd-socket-activate is not installed (Debian package systemd)"))
    func socketActivation() throws {
        let daemon = try DaemonHarness()
        // signerd.json names the same path; systemd-socket-activate binds it and passes it as fd 3.
        try daemon.start(launcher: ["systemd-socket-activate", "-l", daemon.socketPath, "-E", "SOFTHSM2_CONF=\(daemon.softHSMConf)"])
        #expect(!daemon.logged { $0.contains("\"signerd_ready\"") && $0.contains("\"socket.activated\":true") }.isEmpty, "\(daemon.log)")
        try expectServing(daemon)
        #expect(daemon.stop() == 0)
        var info = stat()
        #expect(lstat(daemon.socketPath, &info) == 0, "the socket systemd made is still there")
    }

    @Test("core dumps are off: RLIMIT_CORE is 0 in the running daemon")
    func noCoreDumps() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let limits = try String(contentsOfFile: "/proc/\(daemon.process!.processIdentifier)/limits", encoding: .utf8)
        let core = try #require(limits.split(separator: "\n").first { $0.hasPrefix("Max core file size") })
        #expect(core.split(separator: " ", omittingEmptySubsequences: true).dropFirst(4).prefix(2) == ["0", "0"], "\(core)")
    }
}
