internal import CSignerShim
import Foundation
import HSMSigner

#if canImport(Glibc)
import Glibc
#endif

/// A socket-level failure (bind, connect, permissions), with the path and `errno` text.
public struct SocketError: Error, Sendable, CustomStringConvertible {
    /// What failed, with the path and the system's reason.
    public var message: String
    /// The `errno` value, when one applies.
    public var errno: Int32?
    /// Where the peer closed the connection (a read returned 0), when that is what failed.
    public var peerClosed: PeerClosed?

    /// Where in an exchange the peer closed the connection.
    public enum PeerClosed: Sendable {
        /// Before any byte of the response: a kept-alive connection the
        /// server had closed meanwhile, which a client may retry.
        case beforeResponse
        /// After part of the response.
        case midResponse
    }

    init(_ message: String, errno code: Int32? = nil, peerClosed: PeerClosed? = nil) {
        self.errno = code
        self.peerClosed = peerClosed
        self.message = code.map { "\(message): \(String(cString: strerror($0)))" } ?? message
    }

    /// The message, with the path and the `strerror` text.
    public var description: String { message }
}

/// The credentials of the process at the other end of a Unix socket
/// (`SO_PEERCRED`, socket(7)): taken when it connected.
public struct PeerCredentials: Sendable, Equatable, CustomStringConvertible {
    /// The peer's effective uid.
    public var uid: UInt32
    /// The peer's effective gid.
    public var gid: UInt32
    /// The peer's pid.
    public var pid: Int32
    /// The peer process's supplementary groups when it connected
    /// (`SO_PEERGROUPS`); nil when the kernel gives none (before Linux 4.13).
    public var groups: [UInt32]?

    /// Makes credentials.
    /// - Parameters:
    ///   - uid: the effective uid.
    ///   - gid: the effective gid.
    ///   - pid: the pid.
    ///   - groups: the supplementary groups, or nil when unknown.
    public init(uid: UInt32, gid: UInt32, pid: Int32, groups: [UInt32]? = nil) {
        self.uid = uid
        self.gid = gid
        self.pid = pid
        self.groups = groups
    }

    /// `uid=… gid=… pid=…`, for logs.
    public var description: String { "uid=\(uid) gid=\(gid) pid=\(pid)" }

    /// Whether the peer is this process (`SO_PEERCRED` pid equal to
    /// `getpid()`): in signerd, its own systemd watchdog check, which the
    /// rate limit and the connection shares never refuse.
    public var isThisProcess: Bool { pid == Self.thisProcess }

    private static let thisProcess = getpid()
}

enum UnixAddress {
    /// Fills a `sockaddr_un` for `path` and calls `body` with it.
    static func with<R>(_ path: String, _ body: (UnsafePointer<sockaddr>, socklen_t) -> R) throws(SocketError) -> R {
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        let bytes = Array(path.utf8)
        let capacity = MemoryLayout.size(ofValue: address.sun_path)
        guard bytes.count < capacity else {
            throw SocketError("the socket path \(path) is \(bytes.count) bytes; Unix socket paths must be under \(capacity)")
        }
        withUnsafeMutableBytes(of: &address.sun_path) { buffer in
            buffer.copyBytes(from: bytes)
            buffer[bytes.count] = 0
        }
        return withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { body($0, socklen_t(MemoryLayout<sockaddr_un>.size)) }
        }
    }
}

/// A file's device and inode numbers (`st_dev`, `st_ino`) and whether it is a socket.
public struct SocketFileIdentity: Sendable, Equatable {
    /// `st_dev`.
    public var device: UInt64
    /// `st_ino`.
    public var inode: UInt64
    /// Whether the file type is `S_IFSOCK`.
    public var isSocket: Bool
}

/// The daemon's listening Unix socket.
public enum UnixListener {
    /// Refuses a path another process listens on, without changing
    /// anything: the check ``bind(path:mode:group:)`` makes, for a caller
    /// with work to do before it binds (signerd logs in to the token, which
    /// SoftHSM records by rewriting its token file, only when no other
    /// signerd serves the socket).
    /// - Parameter path: the socket path.
    /// - Throws: ``SocketError`` when a socket at `path` accepts a connection.
    public static func refuseIfListening(path: String) throws(SocketError) {
        var info = stat()
        guard lstat(path, &info) == 0, (info.st_mode & S_IFMT) == S_IFSOCK else { return }
        if let probe = try? UnixConnection.connect(path: path) {
            probe.close()
            throw SocketError("another process is listening on \(path); is signerd already running?")
        }
    }

    /// Refuses a path where ``bind(path:mode:group:)`` would fail, found
    /// without changing anything: a path too long for `sun_path`, a
    /// directory that is missing, not a directory, not writable by this
    /// process or not safe (``unsafeDirectory(of:)``), a file there that is
    /// not a socket, or a `group` that does not exist or this process may
    /// not give the file to. ``bind(path:mode:group:)`` starts with it;
    /// signerd also asks before it logs in to the token (SoftHSM rewrites
    /// its token file at `C_Login`), so that a restart loop on a socket
    /// problem costs no login.
    /// - Parameters:
    ///   - path: the socket path.
    ///   - group: the `socket_group`, if any.
    /// - Throws: ``SocketError`` with the reason, as the bind's error would give it.
    public static func refuseIfUnbindable(path: String, group: String?) throws(SocketError) {
        if let problem = try bindProblem(path: path, group: group) { throw SocketError(problem) }
    }

    private static func bindProblem(path: String, group: String?) throws(SocketError) -> String? {
        _ = try UnixAddress.with(path) { _, _ in 0 }
        let directory = socketDirectory(of: path)
        var info = stat()
        guard stat(directory, &info) == 0 else {
            return "cannot bind \(path): the directory \(directory): \(String(cString: strerror(errno)))"
        }
        guard info.st_mode & S_IFMT == S_IFDIR else { return "cannot bind \(path): \(directory) is not a directory" }
        guard faccessat(AT_FDCWD, directory, W_OK | X_OK, AT_EACCESS) == 0 else {
            return "cannot bind \(path): this user (uid \(geteuid())) may not create files in \(directory): \(String(cString: strerror(errno)))"
        }
        if let problem = unsafeDirectory(of: path) { return problem }
        if lstat(path, &info) == 0, (info.st_mode & S_IFMT) != S_IFSOCK {
            return "\(path) exists and is not a socket; refusing to replace it"
        }
        if let group {
            guard groupID(group) != nil else { return "socket_group \(group) is not a group on this host" }
            guard mayGiveSocket(toGroup: group) else {
                return "cannot give \(path) to group \(group) (the user signerd runs as must be a member of \(group): `m USER \(group)` in sysusers, or usermod -aG)"
            }
        }
        return nil
    }

    /// The directory `path` would be bound in: `path` without its last component.
    /// - Parameter path: a socket path.
    public static func socketDirectory(of path: String) -> String {
        (path as NSString).deletingLastPathComponent
    }

    /// Creates, binds and listens on `path`.
    ///
    /// A stale socket file is replaced only if it is a socket nobody
    /// listens on; any other file at the path is left alone and refused.
    /// The file gets `mode` and, when given, `group`, with no window in
    /// which it has wider permissions (bound under a tight umask), by calls
    /// that do not follow a symbolic link (`fchownat`, `fchmodat` with
    /// `AT_SYMLINK_NOFOLLOW`). The path's directory must be one no other
    /// user can rename entries in (``unsafeDirectory(of:)``): there another
    /// user could swap the new socket for a link to any file between the
    /// bind and the chmod, and have this process change that file instead.
    /// - Parameters:
    ///   - path: an absolute path whose directory exists.
    ///   - mode: the socket file's permission bits (e.g. 0o660).
    ///   - group: a group name or number for the socket file.
    /// - Returns: the listening descriptor (non-blocking, close-on-exec).
    /// - Throws: ``SocketError`` naming the path and the reason.
    public static func bind(path: String, mode: UInt32, group: String?) throws(SocketError) -> Int32 {
        try refuseIfUnbindable(path: path, group: group)
        // Only a stale socket is removed; any other file that appeared since
        // the check makes bind(2) fail with EADDRINUSE.
        var info = stat()
        if lstat(path, &info) == 0, (info.st_mode & S_IFMT) == S_IFSOCK {
            try refuseIfListening(path: path)
            guard unlink(path) == 0 else {
                throw SocketError("cannot remove the stale socket \(path)", errno: errno)
            }
        }
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue) | Int32(SOCK_NONBLOCK.rawValue), 0)
        guard fd >= 0 else { throw SocketError("socket(AF_UNIX) failed", errno: errno) }
        // Bind under a umask that leaves the file at most 0600, then widen to `mode`.
        let oldMask = umask(0o177)
        let bound = try UnixAddress.with(path) { Glibc.bind(fd, $0, $1) }
        let bindErrno = errno
        umask(oldMask)
        guard bound == 0 else {
            Glibc.close(fd)
            throw SocketError("cannot bind \(path)", errno: bindErrno)
        }
        if let group {
            guard let gid = groupID(group) else {
                Glibc.close(fd)
                unlink(path)
                throw SocketError("socket_group \(group) is not a group on this host")
            }
            guard fchownat(AT_FDCWD, path, uid_t.max, gid, AT_SYMLINK_NOFOLLOW) == 0 else {
                let code = errno
                Glibc.close(fd)
                unlink(path)
                let why = code == EPERM ? " (the user signerd runs as must be a member of \(group): `m USER \(group)` in sysusers, or usermod -aG)" : ""
                throw SocketError("cannot give \(path) to group \(group)\(why)", errno: code)
            }
        }
        // glibc refuses AT_SYMLINK_NOFOLLOW for a link (EOPNOTSUPP) and
        // changes anything else through an O_PATH descriptor of the path.
        guard fchmodat(AT_FDCWD, path, mode_t(mode), AT_SYMLINK_NOFOLLOW) == 0, lstat(path, &info) == 0, (info.st_mode & S_IFMT) == S_IFSOCK else {
            let code = errno
            Glibc.close(fd)
            unlink(path)
            throw SocketError("cannot chmod \(path), or it is no longer the socket just bound", errno: code)
        }
        guard listen(fd, SOMAXCONN) == 0 else {
            let code = errno
            Glibc.close(fd)
            unlink(path)
            throw SocketError("cannot listen on \(path)", errno: code)
        }
        return fd
    }

    /// Why the directories above `path` are not safe for a socket file
    /// this process creates and then changes by path, or nil: one that
    /// another user owns, or that others may write without the sticky bit
    /// (``PathSafety/unsafeDirectory(above:)``), from `/` down.
    /// - Parameter path: an absolute socket path.
    /// - Returns: a sentence naming the directory, its owner and mode.
    public static func unsafeDirectory(of path: String) -> String? {
        guard let problem = PathSafety.unsafeDirectory(above: path) else { return nil }
        return "socket_path \(path) lies below \(problem), and so could have the socket swapped for a link to any file between its bind and its chmod; "
            + "put socket_path in a directory only root or this user may change, such as /run/signerd (RuntimeDirectory=signerd), or chmod +t the directory"
    }

    /// Which file sits at `path` (device and inode, from `lstat(2)`), or nil
    /// when there is none. Taken right after ``bind(path:mode:group:)`` to
    /// recognize the socket file later.
    /// - Parameter path: the socket path.
    /// - Returns: the file's identity, or nil.
    public static func fileIdentity(_ path: String) -> SocketFileIdentity? {
        var info = stat()
        guard lstat(path, &info) == 0 else { return nil }
        return SocketFileIdentity(device: UInt64(info.st_dev), inode: UInt64(info.st_ino), isSocket: (info.st_mode & S_IFMT) == S_IFSOCK)
    }

    /// Removes the socket file at `path` if it is still the one this
    /// process bound (same device and inode). After the file was deleted
    /// and another process bound the path, that process's socket stays.
    /// - Parameters:
    ///   - path: the socket path.
    ///   - identity: ``fileIdentity(_:)`` taken after binding.
    /// - Returns: true when the file was removed; false when it is gone or
    ///   belongs to someone else now.
    @discardableResult
    public static func removeSocketFile(_ path: String, boundAs identity: SocketFileIdentity) -> Bool {
        guard let current = fileIdentity(path), current == identity else { return false }
        return unlink(path) == 0
    }

    /// Whether this process may give a socket file to `group` (`chown(2)`
    /// to a group needs root or membership in it), as
    /// ``bind(path:mode:group:)`` will try to.
    /// - Parameter group: a group name or number, as `socket_group`.
    /// - Returns: false for a group this process is not in (or that does not exist).
    public static func mayGiveSocket(toGroup group: String) -> Bool {
        guard geteuid() != 0 else { return true }
        guard let gid = groupID(group) else { return false }
        return isInGroup(gid)
    }

    /// Whether this process is in group `gid`: its effective group, or one
    /// of its supplementary groups (`getgroups(2)`).
    /// - Parameter gid: a group number.
    public static func isInGroup(_ gid: UInt32) -> Bool {
        if getegid() == gid { return true }
        var groups = [gid_t](repeating: 0, count: Int(max(0, getgroups(0, nil))))
        let count = getgroups(Int32(groups.count), &groups)
        return count >= 0 && groups.prefix(Int(count)).contains(gid)
    }

    /// Whether two `socket_path` values name the same path once written
    /// the same way: repeated `/` and `.` components do not count (no
    /// symbolic link is followed, and `..` is kept as written, since
    /// `a/../b` need not be `b` when `a` is a link). Repeated slashes are
    /// one separator in POSIX pathname resolution (POSIX.1-2017, XBD 4.13).
    /// - Parameters:
    ///   - a: a socket path.
    ///   - b: another.
    /// - Returns: true when they are the same path, lexically.
    public static func samePath(_ a: String, _ b: String) -> Bool {
        func components(_ path: String) -> [Substring] { path.split(separator: "/").filter { $0 != "." } }
        return a.hasPrefix("/") == b.hasPrefix("/") && components(a) == components(b)
    }

    /// Whether two `socket_group` values give the socket at `path` the same
    /// group: a name and its number are the same group, and an absent
    /// group stands for the group the socket file has now (the one it got
    /// when it was made, `stat(2)`; this process's effective group when the
    /// file cannot be read).
    /// - Parameters:
    ///   - a: a group name or number, or nil.
    ///   - b: another.
    ///   - path: the socket file the absent value stands for.
    /// - Returns: true when both resolve to the same group number; false
    ///   when either names no group on this host.
    public static func sameGroup(_ a: String?, _ b: String?, socketAt path: String) -> Bool {
        if a == b { return true }
        func resolve(_ group: String?) -> gid_t? {
            if let group { return groupID(group) }
            var info = stat()
            return stat(path, &info) == 0 ? info.st_gid : getegid()
        }
        guard let x = resolve(a), let y = resolve(b) else { return false }
        return x == y
    }

    /// The group `group` names: a number as it is, else a name from the group database.
    private static func groupID(_ group: String) -> gid_t? {
        if let number = UInt32(group) { return number }
        return getgrnam(group).map { $0.pointee.gr_gid }
    }

    /// The filesystem path a Unix socket is bound to (`getsockname`), or nil
    /// (unbound, abstract, or not a Unix socket).
    public static func boundPath(_ fd: Int32) -> String? {
        var address = sockaddr_un()
        var length = socklen_t(MemoryLayout<sockaddr_un>.size)
        let result = withUnsafeMutablePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { getsockname(fd, $0, &length) }
        }
        guard result == 0, address.sun_family == sa_family_t(AF_UNIX) else { return nil }
        let path = withUnsafeBytes(of: address.sun_path) { bytes in Array(bytes.prefix { $0 != 0 }) }
        guard let first = path.first, first == UInt8(ascii: "/") else { return nil }
        return String(decoding: path, as: UTF8.self)
    }

    /// Reads `SO_PEERCRED` and `SO_PEERGROUPS` of a connected socket.
    /// - Parameter fd: a connected Unix stream socket.
    /// - Returns: the peer's credentials, or nil when the kernel gives none;
    ///   `groups` nil when only `SO_PEERGROUPS` failed.
    public static func peerCredentials(_ fd: Int32) -> PeerCredentials? {
        var uid: uid_t = 0
        var gid: gid_t = 0
        var pid: pid_t = 0
        guard CSignerShim_peer_credentials(fd, &uid, &gid, &pid) == 0 else { return nil }
        return PeerCredentials(uid: uid, gid: gid, pid: pid, groups: peerGroups(fd))
    }

    /// `SO_PEERGROUPS`: the peer's supplementary groups, or nil.
    private static func peerGroups(_ fd: Int32) -> [UInt32]? {
        var groups = [gid_t](repeating: 0, count: 32)
        var count = CSignerShim_peer_groups(fd, &groups, Int32(groups.count))
        if count > groups.count {
            groups = [gid_t](repeating: 0, count: Int(count))
            count = CSignerShim_peer_groups(fd, &groups, Int32(groups.count))
        }
        guard count >= 0, count <= groups.count else { return nil }
        return Array(groups.prefix(Int(count)))
    }
}

/// A blocking client connection to a Unix stream socket.
public final class UnixConnection: @unchecked Sendable {
    // Used by one thread at a time (the caller's); `fd` is closed once.
    /// The connected descriptor.
    public private(set) var fd: Int32
    /// The read timeout in milliseconds for poll(2); -1 for none.
    private let readTimeoutMs: Int32

    private init(fd: Int32, readTimeoutMs: Int32) {
        self.fd = fd
        self.readTimeoutMs = readTimeoutMs
    }

    /// Connects to `path`.
    /// - Parameters:
    ///   - path: the socket file.
    ///   - timeout: send and receive timeout in seconds (0 for none).
    /// - Throws: ``SocketError`` (`ENOENT`: no daemon; `EACCES`: socket permissions; `ECONNREFUSED`: nobody listening).
    public static func connect(path: String, timeout: Double = 0) throws(SocketError) -> UnixConnection {
        let fd = socket(AF_UNIX, Int32(SOCK_STREAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { throw SocketError("socket(AF_UNIX) failed", errno: errno) }
        let result = try UnixAddress.with(path) { Glibc.connect(fd, $0, $1) }
        guard result == 0 else {
            let code = errno
            Glibc.close(fd)
            throw SocketError("cannot connect to \(path)", errno: code)
        }
        if timeout > 0 {
            var value = timeval(tv_sec: Int(timeout), tv_usec: Int((timeout - Double(Int(timeout))) * 1_000_000))
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &value, socklen_t(MemoryLayout<timeval>.size))
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &value, socklen_t(MemoryLayout<timeval>.size))
        }
        return UnixConnection(fd: fd, readTimeoutMs: timeout > 0 ? Int32(min(timeout * 1000, Double(Int32.max))) : -1)
    }

    /// Writes all of `bytes`.
    /// - Throws: ``SocketError`` when the peer closed or the write timed out.
    public func write(_ bytes: [UInt8]) throws(SocketError) {
        let failure = UnixConnection.sendAll(bytes, on: fd, blocking: true)
        guard failure == 0 else { throw SocketError("write to the socket failed", errno: failure) }
    }

    /// Sends all of `bytes` on `fd` with `MSG_NOSIGNAL` (a closed peer is
    /// an error, not `SIGPIPE`), retrying on `EINTR`.
    /// - Parameters:
    ///   - bytes: what to send.
    ///   - fd: a connected stream socket.
    ///   - blocking: false adds `MSG_DONTWAIT` (a full socket buffer is then an error).
    /// - Returns: 0 when all was sent, else the `errno` of the failed `send(2)`.
    static func sendAll(_ bytes: [UInt8], on fd: Int32, blocking: Bool) -> Int32 {
        let flags = Int32(MSG_NOSIGNAL) | (blocking ? 0 : Int32(MSG_DONTWAIT))
        var offset = 0
        while offset < bytes.count {
            let n = bytes.withUnsafeBytes { send(fd, $0.baseAddress! + offset, $0.count - offset, flags) }  // count > 0: non-nil
            if n < 0 {
                if errno == EINTR { continue }
                return errno
            }
            offset += n
        }
        return 0
    }

    /// Reads what is available (up to `maximum` bytes) and appends it to `buffer`.
    /// - Returns: the number of bytes read; 0 means the peer closed.
    /// - Throws: ``SocketError`` on a read error or timeout.
    public func read(appendingTo buffer: inout [UInt8], maximum: Int = 16 * 1024) throws(SocketError) -> Int {
        while true {
            // Wait in poll(2), not in recv(2): a thread asleep in recv on a
            // Unix stream socket is also woken each time the peer reads what
            // this side sent (unix_write_space), so every request cost the
            // caller a spurious wakeup; poll wakes only for POLLIN.
            var waiting = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
            let ready = poll(&waiting, 1, readTimeoutMs)
            if ready < 0 {
                if errno == EINTR { continue }
                throw SocketError("poll on the socket failed", errno: errno)
            }
            if ready == 0 {
                throw SocketError("read from the socket timed out", errno: EAGAIN)
            }
            let n = scratch.withUnsafeMutableBytes { recv(fd, $0.baseAddress, min(maximum, $0.count), 0) }
            if n < 0 {
                if errno == EINTR { continue }
                throw SocketError("read from the socket failed", errno: errno)
            }
            buffer.append(contentsOf: scratch[0..<n])
            return n
        }
    }

    private var scratch = [UInt8](repeating: 0, count: 16 * 1024)

    /// Closes the connection (idempotent).
    public func close() {
        if fd >= 0 {
            Glibc.close(fd)
            fd = -1
        }
    }

    deinit {
        close()
    }
}
