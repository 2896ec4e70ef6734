import HSMSigner

/// Lets through at most `linesPerWindow` log lines per window of
/// `windowSeconds` and counts the rest, so that a client sending malformed
/// requests or connections in a loop cannot fill the disk with one line each.
final class LogThrottle: Sendable {
    private let linesPerWindow: Int
    private let windowNanoseconds: UInt64
    private let state = Locked<(windowStart: UInt64, lines: Int, suppressed: Int)>((0, 0, 0))

    init(linesPerWindow: Int, windowSeconds: Double) {
        self.linesPerWindow = linesPerWindow
        self.windowNanoseconds = UInt64(windowSeconds * 1e9)
    }

    /// Calls `log` with the number of lines suppressed since the last one
    /// logged, unless this window's lines are used up.
    func admit(_ log: (_ suppressed: Int) -> Void) {
        let now = MonotonicClock.now()
        let suppressed: Int? = state.withLock { state in
            if MonotonicClock.nanoseconds(from: state.windowStart, to: now) >= windowNanoseconds && now > state.windowStart {
                state.windowStart = now
                state.lines = 0
            }
            guard state.lines < linesPerWindow else {
                state.suppressed += 1
                return nil
            }
            state.lines += 1
            defer { state.suppressed = 0 }
            return state.suppressed
        }
        if let suppressed { log(suppressed) }
    }
}
