import HSMSigner

/// Lets through at most `linesPerWindow` log lines per window of
/// `windowSeconds` and counts the rest, so that a client sending malformed
/// requests or connections in a loop cannot fill the disk with one line each.
final class LogThrottle: Sendable {
    private let linesPerWindow: Int
    private let windowNanoseconds: UInt64
    private let state = Locked(ThrottleWindow(windowStart: 0))

    init(linesPerWindow: Int, windowSeconds: Double) {
        self.linesPerWindow = linesPerWindow
        self.windowNanoseconds = UInt64(windowSeconds * 1e9)
    }

    /// Calls `log` with the number of lines suppressed since the last one
    /// logged, unless this window's lines are used up.
    func admit(_ log: (_ suppressed: Int) -> Void) {
        let now = MonotonicClock.now()
        let (limit, window) = (linesPerWindow, windowNanoseconds)
        if let suppressed = state.withLock({ $0.admit(now: now, window: window, limit: limit) }) { log(suppressed) }
    }
}

/// One window of a throttle: when it began, the lines let through in it,
/// and the lines suppressed since the last one let through.
struct ThrottleWindow {
    var windowStart: UInt64
    var lines = 0
    var suppressed = 0

    /// Counts one line at `now`: the lines suppressed before it when it may
    /// be logged (`limit` per `window` nanoseconds), else nil.
    mutating func admit(now: UInt64, window: UInt64, limit: Int) -> Int? {
        if MonotonicClock.nanoseconds(from: windowStart, to: now) >= window && now > windowStart {
            windowStart = now
            lines = 0
        }
        guard lines < limit else {
            suppressed += 1
            return nil
        }
        lines += 1
        defer { suppressed = 0 }
        return suppressed
    }
}

/// A ``LogThrottle`` per caller uid: each uid gets its own `linesPerWindow`
/// lines per window, so one caller in a loop cannot use up the lines that
/// would log another's attempt. At most `maximumCallers` uids are tracked
/// (windows that have ended are dropped first); uids beyond that share one
/// more window of `linesPerWindow` lines, so neither the table nor the log
/// grows with the number of uids.
final class PerCallerLogThrottle: Sendable {
    private let linesPerWindow: Int
    private let windowNanoseconds: UInt64
    private let maximumCallers: Int
    private let state = Locked<(callers: [UInt32: ThrottleWindow], overflow: ThrottleWindow)>(([:], ThrottleWindow(windowStart: 0)))

    init(linesPerWindow: Int, windowSeconds: Double, maximumCallers: Int = 256) {
        self.linesPerWindow = linesPerWindow
        self.windowNanoseconds = UInt64(windowSeconds * 1e9)
        self.maximumCallers = maximumCallers
    }

    /// Calls `log` with the number of lines suppressed for `uid` since its
    /// last one logged, unless `uid`'s lines of this window are used up.
    func admit(uid: UInt32, _ log: (_ suppressed: Int) -> Void) {
        let now = MonotonicClock.now()
        let (limit, window, maximum) = (linesPerWindow, windowNanoseconds, maximumCallers)
        let suppressed: Int? = state.withLock { state in
            if state.callers[uid] == nil && state.callers.count >= maximum {
                state.callers = state.callers.filter { MonotonicClock.nanoseconds(from: $0.value.windowStart, to: now) < window }
                if state.callers.count >= maximum {
                    return state.overflow.admit(now: now, window: window, limit: limit)
                }
            }
            return state.callers[uid, default: ThrottleWindow(windowStart: now)].admit(now: now, window: window, limit: limit)
        }
        if let suppressed { log(suppressed) }
    }
}
