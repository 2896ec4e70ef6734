import HSMSigner

#if canImport(Glibc)
import Glibc
#endif

/// The systemd service protocol without libsystemd: `sd_notify(3)` datagrams
/// to `$NOTIFY_SOCKET`, the watchdog interval from `$WATCHDOG_USEC`, and
/// socket activation from `$LISTEN_FDS` (`sd_listen_fds(3)`).
public enum Systemd {
    /// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
    public static let listenFDsStart: Int32 = 3

    /// Sends `state` (newline-separated `KEY=VALUE` lines such as
    /// `READY=1`, `RELOADING=1`, `STATUS=…`, `WATCHDOG=1`) to the service
    /// manager, if `$NOTIFY_SOCKET` names one (a path, or `@name` for the
    /// abstract namespace).
    /// - Parameter state: the message.
    /// - Returns: false when there is no notify socket or the send failed.
    @discardableResult
    public static func notify(_ state: String) -> Bool {
        guard let socketPath = environment("NOTIFY_SOCKET"), !socketPath.isEmpty else { return false }
        let fd = socket(AF_UNIX, Int32(SOCK_DGRAM.rawValue) | Int32(SOCK_CLOEXEC.rawValue), 0)
        guard fd >= 0 else { return false }
        defer { close(fd) }
        var address = sockaddr_un()
        address.sun_family = sa_family_t(AF_UNIX)
        var path = Array(socketPath.utf8)
        let abstract = path.first == UInt8(ascii: "@")
        if abstract { path[0] = 0 }
        guard path.count < MemoryLayout.size(ofValue: address.sun_path) else { return false }
        withUnsafeMutableBytes(of: &address.sun_path) { $0.copyBytes(from: path) }
        let length = socklen_t(MemoryLayout<sa_family_t>.size + path.count + (abstract ? 0 : 1))
        let message = Array(state.utf8)
        let sent = withUnsafePointer(to: &address) { pointer in
            pointer.withMemoryRebound(to: sockaddr.self, capacity: 1) { addressPointer in
                message.withUnsafeBytes { sendto(fd, $0.baseAddress, $0.count, Int32(MSG_NOSIGNAL), addressPointer, length) }
            }
        }
        return sent == message.count
    }

    /// The longest ping interval, in seconds: one hour. A longer
    /// `WatchdogSec=` is pinged every hour, which systemd accepts (more
    /// pings than needed are harmless), and the interval stays within what
    /// `usleep(3)` takes (`useconds_t`, about 71 minutes).
    public static let longestWatchdogPingInterval: Double = 3600

    /// The shortest ping interval, in seconds: 50 ms. Each ping follows a
    /// `GET /healthz` of signerd's own; a `WatchdogSec=` of a few
    /// microseconds made that a loop at 100 % of a CPU.
    public static let shortestWatchdogPingInterval: Double = 0.05

    /// Half the watchdog interval the unit set (`WatchdogSec=`, from
    /// `$WATCHDOG_USEC` in microseconds), in seconds, at most
    /// ``longestWatchdogPingInterval`` and at least
    /// ``shortestWatchdogPingInterval``, when it is meant for this process
    /// (`$WATCHDOG_PID` absent or this process); nil when there is no
    /// watchdog. See sd_watchdog_enabled(3).
    public static var watchdogPingInterval: Double? {
        guard let usec = environment("WATCHDOG_USEC").flatMap(UInt64.init), usec > 0 else { return nil }
        if let pid = environment("WATCHDOG_PID").flatMap(Int32.init), pid != getpid() { return nil }
        return min(max(Double(usec) / 2e6, shortestWatchdogPingInterval), longestWatchdogPingInterval)
    }

    /// The listening socket systemd passed (`signerd.socket`), if any:
    /// `$LISTEN_PID` must be this process and `$LISTEN_FDS` at least 1; the
    /// first descriptor must be a listening `AF_UNIX` stream socket. The
    /// variables are removed so that no child inherits them.
    /// - Returns: the descriptor, or nil when not socket-activated.
    /// - Throws: ``SocketError`` when systemd passed something unusable.
    public static func takeListeningSocket() throws(SocketError) -> Int32? {
        guard let pid = environment("LISTEN_PID").flatMap(Int32.init), pid == getpid(),
              let count = environment("LISTEN_FDS").flatMap(Int32.init), count >= 1 else {
            return nil
        }
        unsetenv("LISTEN_PID")
        unsetenv("LISTEN_FDS")
        unsetenv("LISTEN_FDNAMES")
        let fd = listenFDsStart
        var type: Int32 = 0
        var domain: Int32 = 0
        var listening: Int32 = 0
        var size = socklen_t(MemoryLayout<Int32>.size)
        guard getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &size) == 0,
              getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &size) == 0,
              getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &size) == 0 else {
            throw SocketError("LISTEN_FDS names descriptor 3, which is not a socket", errno: errno)
        }
        guard type == Int32(SOCK_STREAM.rawValue), domain == AF_UNIX, listening != 0 else {
            throw SocketError("the socket systemd passed is not a listening AF_UNIX stream socket (check ListenStream= in signerd.socket)")
        }
        _ = fcntl(fd, F_SETFD, FD_CLOEXEC)
        _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK)
        return fd
    }

    /// `CLOCK_MONOTONIC` in microseconds, for `MONOTONIC_USEC=` with `RELOADING=1`.
    public static var monotonicMicroseconds: UInt64 { MonotonicClock.now() / 1000 }

    private static func environment(_ name: String) -> String? {
        getenv(name).map { String(cString: $0) }
    }
}
