import Foundation
import HSMSigner

#if canImport(Glibc)
import Glibc
#endif

/// Where SoftHSM keeps its tokens, for the checks signctl and signerd make
/// on SoftHSM's files before they load the module: its token directory is
/// `directories.tokendir` (default /var/lib/softhsm/tokens) of the file
/// `SOFTHSM2_CONF` names, else of ~/.config/softhsm2/softhsm2.conf when it
/// exists, else of /etc/softhsm/softhsm2.conf (SoftHSM 2.6's order), with
/// one directory per token holding `token.object` and one file per object.
public enum SoftHSMFiles {
    /// SoftHSM's token directory for a module, or nil when the module is
    /// not SoftHSM (its file name says so) or the configuration does not
    /// name one.
    /// - Parameter module: `module-path` or `module-name` of the token URI.
    public static func tokenDirectory(module: String?) -> String? {
        guard let module, module.lowercased().contains("softhsm") else { return nil }
        let conf = configurationFile
        guard let text = try? String(contentsOfFile: conf, encoding: .utf8) else { return nil }
        // SoftHSM reads every `key = value` line in order (comments start with
        // #), so of two `directories.tokendir` lines the last one counts.
        let set = text.split(whereSeparator: \.isNewline).compactMap { line -> String? in
            let trimmed = line.trimmingCharacters(in: .whitespaces)
            guard !trimmed.hasPrefix("#"), let equals = trimmed.firstIndex(of: "="),
                  trimmed[..<equals].trimmingCharacters(in: .whitespaces) == "directories.tokendir" else { return nil }
            return trimmed[trimmed.index(after: equals)...].trimmingCharacters(in: .whitespaces)
        }
        return set.last ?? "/var/lib/softhsm/tokens"  // SoftHSM's default
    }

    /// The SoftHSM configuration file this process's SoftHSM reads, in
    /// SoftHSM 2.6's order: `SOFTHSM2_CONF`, then
    /// ~/.config/softhsm2/softhsm2.conf when it exists, then
    /// /etc/softhsm/softhsm2.conf.
    public static var configurationFile: String {
        let environment = ProcessInfo.processInfo.environment
        let userConf = environment["HOME"].map { $0 + "/.config/softhsm2/softhsm2.conf" }
        return environment["SOFTHSM2_CONF"]
            ?? userConf.flatMap { FileManager.default.fileExists(atPath: $0) ? $0 : nil }
            ?? "/etc/softhsm/softhsm2.conf"
    }

    /// What to check when SoftHSM shows no token with the label, and no
    /// file explains it (``unreadableTokens(module:)`` found nothing): which
    /// configuration and token directory this process's SoftHSM reads.
    /// - Parameter module: `module-path` or `module-name` of the token URI.
    /// - Returns: the hint, or nil when the module is not SoftHSM.
    public static func tokenMissingHint(module: String?) -> String? {
        guard let directory = tokenDirectory(module: module) else { return nil }
        let source = ProcessInfo.processInfo.environment["SOFTHSM2_CONF"] != nil ? "from SOFTHSM2_CONF" : "SOFTHSM2_CONF is not set"
        return "check token= in token_uri; SoftHSM looked in \(directory) (directories.tokendir in \(configurationFile), \(source)): check that this is the configuration the token was made with, "
            + "and that the token's directory is there, made by the user signerd runs as (runuser -u signerd -- signctl token init); a token that was there and now counts as uninitialized had its token.object cut short "
            + "(a process ended while writing it, a full disk): restore the copy of its token directory"
    }

    /// An exclusive `flock(2)` on SoftHSM's token lock file, released when
    /// this object is released (or the process exits).
    public final class TokenLock: Sendable {
        private let descriptor: Int32

        fileprivate init(descriptor: Int32) {
            self.descriptor = descriptor
        }

        deinit {
            close(descriptor)
        }
    }

    /// What ``lockTokens(in:timeout:shouldStop:waiting:)`` found.
    public enum LockOutcome: Sendable {
        /// Held until the ``TokenLock`` is released.
        case held(TokenLock)
        /// Not locked: this user may not open (or create) the lock file,
        /// so it cannot change the tokens either, or there is no token
        /// directory (`problem` nil); or the lock file is not a plain file
        /// (`problem` says what it is).
        case notApplicable(problem: String?)
        /// Another process held it for the whole timeout.
        /// - `holder`: "PID 1234 (signctl)" from /proc/locks, when found.
        case timedOut(holder: String?)
        /// `shouldStop` said to stop before the lock was free.
        case stopped
    }

    /// The lock file in a SoftHSM token directory. SoftHSM takes only the
    /// directories in it for tokens, and ignores files.
    public static let lockFileName = ".signctl.lock"

    /// Takes an exclusive `flock(2)` on ``lockFileName`` in SoftHSM's token
    /// directory, so that two `signctl` commands never work on the same
    /// SoftHSM tokens at once. SoftHSM rewrites a token's files at `C_Login`
    /// and at every write; another process reading them meanwhile saw the
    /// token uninitialized, objects gone, or `C_Login` fail with
    /// `CKR_GENERAL_ERROR`. signerd takes the lock while it starts (from
    /// before `C_Initialize` until its socket is bound), and once running
    /// only for its token recovery, with a short wait (``RunningTokenLock``);
    /// never for a request: it waits out a key another process is replacing
    /// instead, and must not stop signing while an operator's command runs.
    ///
    /// The file has the token directory's owner and group and mode 0660:
    /// only who may write the tokens (that user, that group as in Debian's
    /// `root:softhsm 2770`, root) can open it, so a user who may only read
    /// them cannot hold the lock to stop others (such a user goes on
    /// without it). Its owner (or root) sets that mode and ownership again
    /// on every take. SoftHSM's own `fcntl` locks are separate. A symbolic
    /// link, a directory, a socket or a file with another hard link at the
    /// path is not used (`notApplicable` with the problem), nor changed; a
    /// file removed or replaced while this process waited is opened again
    /// from its path, so that two processes never hold two files.
    /// - Parameters:
    ///   - directory: the token directory (``tokenDirectory(module:)``).
    ///   - timeout: how long to wait for another holder, in seconds.
    ///   - shouldStop: asked while waiting; true gives up (a Ctrl-C).
    ///   - waiting: called once, with the holder when known, when the lock
    ///     is busy, before the wait.
    /// - Returns: the lock, or why there is none.
    public static func lockTokens(in directory: String, timeout: Double, shouldStop: () -> Bool = { false }, waiting: (String?) -> Void) -> LockOutcome {
        let path = directory + "/" + lockFileName
        let deadline = MonotonicClock.deadline(after: timeout)
        var waited = false
        // Again from the open when the file was removed or replaced while
        // this process waited: the lock it then got is on a file no one else
        // opens, and another process may hold the one at the path.
        while true {
            let descriptor: Int32
            switch openLockFile(path, directory: directory) {
            case .failure(let refusal): return refusal.outcome
            case .success(let opened): descriptor = opened
            }
            while true {
                if flock(descriptor, LOCK_EX | LOCK_NB) == 0 {
                    if isStillAtPath(descriptor, path) { return .held(TokenLock(descriptor: descriptor)) }
                    break
                }
                let failure = errno
                guard failure == EWOULDBLOCK || failure == EINTR else {
                    close(descriptor)
                    return .notApplicable(problem: nil)
                }
                if shouldStop() {
                    close(descriptor)
                    return .stopped
                }
                guard MonotonicClock.now() < deadline else {
                    let holder = lockHolder(descriptor)
                    close(descriptor)
                    return .timedOut(holder: holder)
                }
                if !waited {
                    waited = true
                    waiting(lockHolder(descriptor))
                }
                usleep(20_000)
            }
            close(descriptor)
        }
    }

    /// Opens (or makes) the lock file, refusing what is not a plain file of
    /// its own, and sets its owner and mode for the token directory.
    private static func openLockFile(_ path: String, directory: String) -> Result<Int32, LockFileRefusal> {
        let descriptor = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0o660)
        guard descriptor >= 0 else {
            let failure = errno
            switch failure {
            case ELOOP: return .failure(LockFileRefusal(problem: "\(path) is a symbolic link"))
            case EISDIR: return .failure(LockFileRefusal(problem: "\(path) is a directory, which SoftHSM takes for a token and writes into (remove it with rm -r)"))
            case ENXIO: return .failure(LockFileRefusal(problem: "\(path) is a socket"))
            case EACCES, EPERM, EROFS: return .failure(LockFileRefusal(problem: nil))  // this user may not write the tokens either
            // No token directory (moved away during an outage, never made):
            // no token files to protect, and opening the token says what is wrong.
            case ENOENT, ENOTDIR: return .failure(LockFileRefusal(problem: nil))
            default: return .failure(LockFileRefusal(problem: "\(path) cannot be opened: \(String(cString: strerror(failure)))"))
            }
        }
        var file = stat()
        var owner = stat()
        guard fstat(descriptor, &file) == 0, (file.st_mode & S_IFMT) == S_IFREG else {
            close(descriptor)
            return .failure(LockFileRefusal(problem: "\(path) is not a regular file"))
        }
        // A hard link to another file (another user's, where
        // fs.protected_hardlinks is off) would have its owner and mode changed below.
        guard file.st_nlink == 1 else {
            close(descriptor)
            return .failure(LockFileRefusal(problem: "\(path) has \(file.st_nlink) hard links: it is another file linked there, whose owner and mode are left alone"))
        }
        if stat(directory, &owner) == 0, geteuid() == 0 || geteuid() == file.st_uid {
            // Root's take in another user's directory, or a mode loosened by
            // hand: the tokens' writers, and only they, may open it.
            if geteuid() == 0, file.st_uid != owner.st_uid || file.st_gid != owner.st_gid {
                _ = fchown(descriptor, owner.st_uid, owner.st_gid)
            } else if file.st_gid != owner.st_gid {
                _ = fchown(descriptor, uid_t.max, owner.st_gid)  // a member of the directory's group may
            }
            if file.st_mode & 0o7777 != 0o660 { _ = fchmod(descriptor, 0o660) }
        }
        return .success(descriptor)
    }

    /// Why ``openLockFile(_:directory:)`` gave no descriptor: the
    /// ``LockOutcome/notApplicable(problem:)`` to return.
    private struct LockFileRefusal: Error {
        let problem: String?
        var outcome: LockOutcome { .notApplicable(problem: problem) }
    }

    /// Whether the file open as `descriptor` is still the one at `path`.
    private static func isStillAtPath(_ descriptor: Int32, _ path: String) -> Bool {
        var opened = stat()
        var named = stat()
        return fstat(descriptor, &opened) == 0 && lstat(path, &named) == 0 && opened.st_dev == named.st_dev && opened.st_ino == named.st_ino
    }

    /// The process holding a `flock` on the file open as `descriptor`, as
    /// "PID 1234 (signctl)", from /proc/locks (proc(5): `FLOCK … PID
    /// MAJOR:MINOR:INODE`); nil when it cannot be told.
    static func lockHolder(_ descriptor: Int32) -> String? {
        var info = stat()
        guard fstat(descriptor, &info) == 0, let table = try? String(contentsOfFile: "/proc/locks", encoding: .utf8) else { return nil }
        for line in table.split(separator: "\n") {
            let fields = line.split(separator: " ", omittingEmptySubsequences: true)
            guard fields.count >= 6, fields[1] == "FLOCK", fields[5].hasSuffix(":\(info.st_ino)"), let pid = Int32(fields[4]) else { continue }
            // A process names itself (prctl PR_SET_NAME): its control characters are shown as "?".
            let command = (try? String(contentsOfFile: "/proc/\(pid)/comm", encoding: .utf8))?.trimmingCharacters(in: .newlines)
                .unicodeScalars.map { $0.value < 0x20 || $0.value == 0x7F ? "?" : String($0) }.joined()
            return "PID \(pid)" + (command.map { " (\($0))" } ?? "")
        }
        return nil
    }

    /// The largest `token.object` under `tokenDirectory` and its size in
    /// bytes: the file SoftHSM rewrites in place at every `C_Login`.
    public static func largestTokenFile(in tokenDirectory: String) -> (path: String, bytes: UInt64)? {
        let entries = (try? FileManager.default.contentsOfDirectory(atPath: tokenDirectory)) ?? []
        var largest: (path: String, bytes: UInt64)?
        for entry in entries {
            let path = tokenDirectory + "/" + entry + "/token.object"
            var info = stat()
            guard stat(path, &info) == 0, UInt64(info.st_size) > largest?.bytes ?? 0 else { continue }
            largest = (path, UInt64(info.st_size))
        }
        return largest
    }

    /// Why SoftHSM, run as this user, cannot see some of its tokens, or nil:
    /// its token directory missing, or the directory or a token's
    /// `token.object` in it that this user may not read. SoftHSM writes each file mode 0600 for the user
    /// that runs it, so a token made as root can be read by root alone;
    /// SoftHSM shows a token it cannot read as an uninitialized one, and
    /// fails `C_Initialize` (`CKR_GENERAL_ERROR`) when it cannot read its
    /// token directory.
    /// - Parameter module: `module-path` or `module-name` of the token URI.
    /// - Returns: a sentence naming the directories, their owners, and
    ///   which user to run as; deleting a token is suggested only for one
    ///   root made that another user needs.
    public static func unreadableTokens(module: String?) -> String? {
        guard let directory = tokenDirectory(module: module) else { return nil }
        func owner(_ path: String) -> (uid: uid_t, text: String) {
            var info = stat()
            guard stat(path, &info) == 0 else { return (0, "unknown owner") }
            return (info.st_uid, "owner \(userName(info.st_uid)), mode \(String(info.st_mode & 0o7777, radix: 8))")
        }
        let user = userName(geteuid())
        var info = stat()
        if stat(directory, &info) != 0 && errno == ENOENT {
            // Not a permission problem: there is nothing to read (a wrong SOFTHSM2_CONF, or the directory moved or not made yet).
            return "SoftHSM's token directory \(directory) (directories.tokendir in \(configurationFile)) does not exist, so SoftHSM has no token to open: "
                + "check that SOFTHSM2_CONF names the SoftHSM configuration signerd's token is in, or make the token (signctl token init)"
        }
        guard access(directory, R_OK | X_OK) == 0 else {
            let (uid, text) = owner(directory)
            if uid == geteuid() {
                return "this user (\(user)) owns SoftHSM's token directory \(directory) (\(text)) but its mode does not let its owner read it, so SoftHSM cannot open its tokens: "
                    + "give the owner its access back (chmod u+rwx \(directory))"
            }
            return "this user (\(user)) cannot read SoftHSM's token directory \(directory) (\(text)), so SoftHSM cannot open its tokens: "
                + "run as the user signerd runs as (runuser -u \(userName(uid)) -- …), or give this user read access to the directory (on Debian, the group softhsm)"
        }
        let entries = ((try? FileManager.default.contentsOfDirectory(atPath: directory)) ?? []).sorted()
        // A token directory this user cannot search, or one whose token.object it cannot read.
        let unreadable: [(path: String, uid: uid_t, text: String)] = entries.map { directory + "/" + $0 }.compactMap { path in
            var info = stat()
            guard stat(path, &info) == 0, (info.st_mode & S_IFMT) == S_IFDIR else { return nil }
            if access(path, R_OK | X_OK) != 0 {
                let (uid, text) = owner(path)
                return (path, uid, text)
            }
            let file = path + "/token.object"
            guard access(file, F_OK) == 0, access(file, R_OK) != 0 else { return nil }
            let (uid, text) = owner(file)
            return (path, uid, "token.object: " + text)
        }
        guard !unreadable.isEmpty else { return nil }
        let named = unreadable.map { "\($0.path) (\($0.text))" }.joined(separator: ", ")
        let what = "\(unreadable.count) token\(unreadable.count == 1 ? "" : "s") in SoftHSM's token directory cannot be read by this user (\(user)), and SoftHSM shows \(unreadable.count == 1 ? "it" : "them") as uninitialized: \(named). "
        if unreadable.allSatisfy({ $0.uid == 0 }) {
            return what + "A token made as root (signctl token init without runuser) can be read by root alone: if it is the token you need, "
                + "delete it (as root: softhsm2-util --delete-token --token LABEL) and make it again as the user signerd runs as (runuser -u signerd -- signctl token init …)"
        }
        // Its own files, shut by their mode (chmod 000): running as the
        // owner is what it does already.
        if unreadable.allSatisfy({ $0.uid == geteuid() }) {
            return what + "They belong to this user, but their mode does not let their owner read them: give the owner its access back "
                + "(chmod u+rwx on the token's directory, chmod u+rw on its files)"
        }
        let owners = Array(Set(unreadable.map(\.uid))).sorted()
        return what + "SoftHSM keeps each token readable by the user that made it: run as that user (runuser -u \(userName(owners[0])) -- …)"
            + (owners.count > 1 ? "; these tokens belong to \(owners.map { userName($0) }.joined(separator: ", "))" : "")
    }

    /// The user name of `uid` (`getpwuid(3)`), or `uid N` when it has none
    /// (`N` alone with `bare`, as `runuser -u` takes it).
    /// - Parameters:
    ///   - uid: the user ID.
    ///   - bare: give the number alone when there is no name.
    public static func userName(_ uid: uid_t, bare: Bool = false) -> String {
        getpwuid(uid).map { String(cString: $0.pointee.pw_name) } ?? (bare ? String(uid) : "uid \(uid)")
    }

    /// Why logging in to SoftHSM under a file size limit of `limit` bytes
    /// would destroy a token (a `token.object` larger than the limit, cut
    /// short as it is rewritten), or nil.
    /// - Parameters:
    ///   - limit: the file size limit in force, in bytes.
    ///   - module: `module-path` or `module-name` of the token URI.
    public static func loginWouldCut(limit: UInt64, module: String?) -> String? {
        guard let directory = tokenDirectory(module: module), let file = largestTokenFile(in: directory), file.bytes > limit else { return nil }
        return "the file size limit (ulimit -f, LimitFSIZE=) is \(limit) bytes, smaller than SoftHSM's token file \(file.path) (\(file.bytes) bytes), which SoftHSM rewrites in place at every login: logging in would cut it short and destroy the token; nothing was done. Run with no file size limit"
    }
}
