import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

/// signctl's lock on SoftHSM's token directory: four imports at once broke
/// the token, so signctl commands take turns; a user who may only read the
/// tokens must not be able to hold it.
@Suite("SoftHSM token lock")
struct TokenLockTests {
    /// Holds the lock file of `directory` from this test, as another process would.
    static func hold(_ directory: String) -> Int32 {
        let descriptor = open(directory + "/" + SoftHSMFiles.lockFileName, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        #expect(descriptor >= 0 && flock(descriptor, LOCK_EX) == 0)
        return descriptor
    }

    @Test("a held lock makes the next taker wait, naming the holder's PID, and time out; once released it is taken, and only once at a time")
    func waitsAndTimesOut() {
        let directory = TemporaryDirectory.make(prefix: "signerd-token-lock")
        let holder = Self.hold(directory)
        var told: [String?] = []
        guard case .timedOut(let named) = SoftHSMFiles.lockTokens(in: directory, timeout: 0.3, waiting: { told.append($0) }) else {
            Issue.record("taken while another open file description held it")
            return
        }
        #expect(told.count == 1, "told once: \(told)")
        #expect(named?.hasPrefix("PID \(getpid())") == true && told.first??.hasPrefix("PID \(getpid())") == true, "\(named ?? "nil")")
        close(holder)
        guard case .held(let lock) = SoftHSMFiles.lockTokens(in: directory, timeout: 0.3, waiting: { _ in Issue.record("waited for a free lock") }) else {
            Issue.record("not taken once free")
            return
        }
        // While that lock is held, another taker waits, even in this process.
        if case .held = SoftHSMFiles.lockTokens(in: directory, timeout: 0.1, waiting: { _ in }) {
            Issue.record("taken twice at once")
        }
        // A Ctrl-C while waiting gives up at once.
        var asked = 0
        if case .stopped = SoftHSMFiles.lockTokens(in: directory, timeout: 30, shouldStop: { asked += 1; return true }, waiting: { _ in }) {
            #expect(asked == 1)
        } else {
            Issue.record("did not stop when asked")
        }
        withExtendedLifetime(lock) {}
        var info = stat()
        var owner = stat()
        #expect(stat(directory, &owner) == 0)
        #expect(stat(directory + "/" + SoftHSMFiles.lockFileName, &info) == 0 && info.st_mode & 0o7777 == 0o660 && info.st_gid == owner.st_gid,
                "only the tokens' owner and group (and root) may open it")
    }

    @Test("a lock file loosened by hand is made 0660 again; a symbolic link or a directory there is not followed, and named")
    func lockFileKept() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-token-lock")
        let path = directory + "/" + SoftHSMFiles.lockFileName
        #expect(FileManager.default.createFile(atPath: path, contents: nil) && chmod(path, 0o644) == 0)
        guard case .held = SoftHSMFiles.lockTokens(in: directory, timeout: 1, waiting: { _ in }) else {
            Issue.record("not taken")
            return
        }
        var info = stat()
        #expect(stat(path, &info) == 0 && info.st_mode & 0o7777 == 0o660, "mode \(String(info.st_mode & 0o7777, radix: 8))")
        #expect(unlink(path) == 0 && symlink("/etc/passwd", path) == 0)
        guard case .notApplicable(let problem) = SoftHSMFiles.lockTokens(in: directory, timeout: 1, waiting: { _ in }) else {
            Issue.record("a symbolic link was taken for the lock file")
            return
        }
        #expect(problem == "\(path) is a symbolic link")
        #expect(unlink(path) == 0 && mkdir(path, 0o700) == 0)
        guard case .notApplicable(let directoryProblem) = SoftHSMFiles.lockTokens(in: directory, timeout: 1, waiting: { _ in }) else {
            Issue.record("a directory was taken for the lock file")
            return
        }
        #expect(directoryProblem?.hasPrefix(path) == true, "\(directoryProblem ?? "nil")")
    }

    @Test("a user who may not open the lock file (it may only read the tokens) goes on without it, and cannot hold it",
          .enabled(if: geteuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/flock") && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv"),
                   "needs root, flock(1) and setpriv(1) to try as uid 65534"))
    func readOnlyUserCannotHold() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-token-lock")
        #expect(chmod(directory, 0o755) == 0)
        close(Self.hold(directory))  // made by root, 0600 (the directory's group is root's)
        // flock(1) as uid 65534: its open fails, so it cannot take the lock from signctl.
        let asNobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/flock", "-n", directory + "/" + SoftHSMFiles.lockFileName, "true"]
        let refused = #expect(throws: (any Error).self, "a read-only user took the lock") { try run(asNobody) }
        #expect(String(describing: refused).contains("Permission denied"), "\(String(describing: refused))")
        // The same command as root takes it: the refusal above is the file's mode, nothing else.
        try run(["/usr/bin/flock", "-n", directory + "/" + SoftHSMFiles.lockFileName, "true"])
    }

    @Test("a missing token directory (moved away in an outage) is no lock and no problem to report")
    func missingDirectory() {
        let directory = TemporaryDirectory.make(prefix: "signerd-token-lock") + "/tokens"
        guard case .notApplicable(nil) = SoftHSMFiles.lockTokens(in: directory, timeout: 0.1, waiting: { _ in Issue.record("waited") }) else {
            Issue.record("a missing directory was reported as a problem, or locked")
            return
        }
        #expect(!FileManager.default.fileExists(atPath: directory), "nothing was made in its place")
    }
}

/// The lock as a running signerd takes it around its token recovery
/// (`TokenOptions.storageLock`): only once armed, a short wait, logged at
/// most once a minute.
@Suite("SoftHSM token lock, taken by a running signerd's recovery")
struct RunningTokenLockTests {
    func count(_ message: String, in lines: LineCollector) -> Int {
        lines.lines.filter { $0.contains("\"msg\":\"\(message)\"") }.count
    }

    @Test("before arm() it takes nothing (the start lock is still held); armed, it takes the lock, which another taker then finds held")
    func armedOnly() {
        let directory = TemporaryDirectory.make(prefix: "signerd-running-lock")
        let lines = LineCollector()
        let running = SoftHSMFiles.RunningTokenLock(directory: directory, timeout: 0.5, logger: Logger { lines.append($0) })
        // The start lock, held by signerd itself until its socket is bound: taking it again would wait for itself.
        let start = TokenLockTests.hold(directory)
        #expect(running.take(shouldStop: { false }) == nil)
        #expect(lines.lines.isEmpty, "no wait before arm(): \(lines.lines)")
        close(start)
        running.arm()
        let held = running.take(shouldStop: { false })
        #expect(held != nil)
        if case .held = SoftHSMFiles.lockTokens(in: directory, timeout: 0.1, waiting: { _ in }) {
            Issue.record("signctl took the lock while recovery held it")
        }
        withExtendedLifetime(held) {}
        #expect(lines.lines.isEmpty, "\(lines.lines)")
    }

    /// An armed lock on a new directory, its log, and the lock held by "another process".
    func armedAndHeld(timeout: Double) -> (SoftHSMFiles.RunningTokenLock, LineCollector, Int32) {
        let directory = TemporaryDirectory.make(prefix: "signerd-running-lock")
        let lines = LineCollector()
        let running = SoftHSMFiles.RunningTokenLock(directory: directory, timeout: timeout, logger: Logger { lines.append($0) })
        running.arm()
        return (running, lines, TokenLockTests.hold(directory))
    }

    @Test("another holder: recovery waits up to its timeout, then goes ahead without; the wait and timeout are logged once a minute, with the holder")
    func waitsThenGoesAhead() {
        let (running, lines, holder) = armedAndHeld(timeout: 0.3)
        let started = Date()
        #expect(running.take(shouldStop: { false }) == nil)
        #expect(Date().timeIntervalSince(started) >= 0.3, "it waited for the holder first")
        #expect(running.take(shouldStop: { false }) == nil)
        #expect(count("token_lock_wait", in: lines) == 1 && count("token_lock_timeout", in: lines) == 1, "once each in a minute: \(lines.lines)")
        #expect(lines.lines.allSatisfy { $0.contains("\"during\":\"recovery\"") && $0.contains("\"holder\":\"PID \(getpid())") }, "\(lines.lines)")
        // Told to stop (the token closing), it ends the wait at once.
        let stopping = Date()
        #expect(running.take(shouldStop: { true }) == nil)
        #expect(Date().timeIntervalSince(stopping) < 0.3)
        close(holder)
        #expect(running.take(shouldStop: { false }) != nil, "taken once free")
    }

    @Test("released within the wait, the lock is taken and the step goes ahead holding it")
    func takenOnceReleased() {
        let (running, lines, holder) = armedAndHeld(timeout: 5)
        let releaser = Thread {
            usleep(300_000)
            close(holder)
        }
        releaser.start()
        #expect(running.take(shouldStop: { false }) != nil)
        #expect(count("token_lock_wait", in: lines) == 1 && count("token_lock_timeout", in: lines) == 0, "\(lines.lines)")
    }

    @Test("a module that is not SoftHSM has no token directory, so signerd makes no lock for it")
    func notSoftHSM() {
        #expect(SoftHSMFiles.tokenDirectory(module: "/usr/lib/x86_64-linux-gnu/pkcs11/p11-kit-client.so") == nil)
    }
}
