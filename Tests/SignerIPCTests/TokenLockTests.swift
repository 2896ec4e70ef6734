import Foundation
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
}
