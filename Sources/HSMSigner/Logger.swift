import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// Severity levels, as swift-log names them.
public enum LogLevel: String, Sendable, Comparable, CaseIterable {
    case trace, debug, info, notice, warning, error, critical

    private var rank: Int { LogLevel.allCases.firstIndex(of: self)! }  // every case is in allCases

    /// Orders levels by severity: `trace` lowest, `critical` highest.
    public static func < (lhs: LogLevel, rhs: LogLevel) -> Bool { lhs.rank < rhs.rank }
}

/// A value in a log line's metadata.
public enum LogValue: Sendable, Equatable, ExpressibleByStringLiteral, ExpressibleByIntegerLiteral, CustomStringConvertible {
    case string(String)
    case int(Int64)
    case double(Double)
    case bool(Bool)

    /// Makes a ``string(_:)`` value from a string literal.
    public init(stringLiteral value: String) { self = .string(value) }
    /// Makes an ``int(_:)`` value from an integer literal.
    public init(integerLiteral value: Int64) { self = .int(value) }

    /// The value as plain text, without JSON quoting.
    public var description: String {
        switch self {
        case .string(let value): value
        case .int(let value): String(value)
        case .double(let value): String(value)
        case .bool(let value): String(value)
        }
    }
}

/// Structured logging: one JSON object per line, `ts` (RFC 3339 UTC with
/// milliseconds), `level`, `msg` (a constant), then dotted metadata keys
/// (`key.id`, `p11.rv`, `peer.uid`).
///
/// Callers never pass PINs, key bytes or payload secrets; the messages are
/// constants and metadata values are identifiers, numbers and `CKR_*` names.
public struct Logger: Sendable {
    /// Lines below this level are dropped.
    public var minimumLevel: LogLevel
    /// Writes one line; false when it could not be written whole.
    private let sink: @Sendable (String) -> Bool
    /// Set by ``init(minimumLevel:events:)``: takes each event unformatted.
    private var events: (@Sendable (LogLevel, String, [(key: String, value: LogValue)]) -> Void)?

    /// A logger writing to standard error.
    /// - Parameter minimumLevel: the lowest level written (default `info`).
    public init(minimumLevel: LogLevel = .info) {
        self.minimumLevel = minimumLevel
        self.sink = Logger.standardError
    }

    /// A logger handing each finished line (without newline) to `sink`; for tests.
    /// - Parameters:
    ///   - minimumLevel: the lowest level passed on.
    ///   - sink: receives one JSON line per call.
    public init(minimumLevel: LogLevel = .trace, sink: @escaping @Sendable (String) -> Void) {
        self.minimumLevel = minimumLevel
        self.sink = { line in sink(line); return true }
    }

    /// A logger handing each finished line (without newline) to `writer`,
    /// which says whether the line was written: a failed ``audit(_:fields:)``
    /// line then returns false. For tests of what a lost audit line does.
    /// - Parameters:
    ///   - minimumLevel: the lowest level passed on.
    ///   - writer: receives one JSON line per call; returns whether it was kept.
    public init(minimumLevel: LogLevel = .trace, writer: @escaping @Sendable (String) -> Bool) {
        self.minimumLevel = minimumLevel
        self.sink = writer
    }

    /// A logger handing each event to `events` as it is, unformatted: for a
    /// program that shows events in its own words (signctl on a terminal).
    /// - Parameters:
    ///   - minimumLevel: the lowest level passed on.
    ///   - events: receives the level, the constant message and the metadata in order.
    public init(minimumLevel: LogLevel, events: @escaping @Sendable (_ level: LogLevel, _ message: String, _ metadata: [(key: String, value: LogValue)]) -> Void) {
        self.minimumLevel = minimumLevel
        self.sink = { _ in true }
        self.events = events
    }

    /// A logger that drops everything.
    public static let disabled = Logger(minimumLevel: .critical) { _ in }

    private static let writeLock = Locked(())

    /// Set by ``markStandardErrorDiscarded()``: standard error goes to
    /// `/dev/null` (closed at start, or so redirected).
    private static let standardErrorDiscarded = Atomic<Bool>(false)
    /// A line was cut short (standard error refused the rest): the next one
    /// starts on a new line, so that it still parses.
    private static let lineTorn = Atomic<Bool>(false)
    /// The longest one line may wait for standard error to take it, in
    /// milliseconds, before it counts as not written.
    static let lineWriteLimitMilliseconds = 1000

    /// Tells every logger writing to standard error that it goes nowhere
    /// (descriptor 2 was closed at start and now holds `/dev/null`, or was
    /// `/dev/null` already): ``audit(_:fields:)`` lines then fail, so that
    /// an audit trail is not written to nothing while signatures go out.
    public static func markStandardErrorDiscarded() {
        standardErrorDiscarded.store(true, ordering: .releasing)
    }

    /// Writes `line` and a newline to descriptor 2 within
    /// ``lineWriteLimitMilliseconds``: `poll(POLLOUT)` before each `write`,
    /// so that a reader who stopped reading (a full pipe or socket, blocking
    /// or not) costs a line, not a thread blocked for ever with the lock held.
    private static let standardError: @Sendable (String) -> Bool = { line in
        guard !standardErrorDiscarded.load(ordering: .acquiring) else { return false }
        var bytes = Array(line.utf8)
        bytes.append(0x0a)
        return writeLock.withLock { _ in
            if lineTorn.load(ordering: .relaxed) { bytes.insert(0x0a, at: 0) }
            let deadline = MonotonicClock.deadline(after: Double(lineWriteLimitMilliseconds) / 1000)
            let written = bytes.withUnsafeBytes { buffer in
                var offset = 0
                while offset < buffer.count {
                    let now = MonotonicClock.now()
                    guard now < deadline else { break }
                    var ready = pollfd(fd: 2, events: Int16(POLLOUT), revents: 0)
                    let polled = poll(&ready, 1, Int32(max(1, (deadline - now) / 1_000_000)))
                    if polled < 0 && errno == EINTR { continue }
                    guard polled == 1, ready.revents & Int16(POLLOUT) != 0 else { break }
                    let n = write(2, buffer.baseAddress! + offset, buffer.count - offset)  // non-empty: has "\n"
                    if n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) { continue }
                    guard n > 0 else { break }
                    offset += n
                }
                return offset
            }
            // Nothing written leaves the line before intact; a part written leaves it torn.
            if written > 0 { lineTorn.store(written < bytes.count, ordering: .relaxed) }
            return written == bytes.count
        }
    }

    /// Writes one line.
    /// - Parameters:
    ///   - level: the severity.
    ///   - message: a constant describing the event (`token_down`).
    ///   - metadata: dotted keys and their values, in order.
    public func log(_ level: LogLevel, _ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) {
        guard level >= minimumLevel else { return }
        log(level, message, fields: metadata.map { ($0.key, $0.value) })
    }

    /// Writes one line whose metadata was put together at run time (a
    /// field present only in some cases); see ``log(_:_:_:)``.
    /// - Parameters:
    ///   - level: the severity.
    ///   - message: a constant describing the event (`token_open_failed`).
    ///   - fields: dotted keys and their values, in order.
    public func log(_ level: LogLevel, _ message: String, fields metadata: [(key: String, value: LogValue)]) {
        guard level >= minimumLevel else { return }
        _ = emit(level, message, metadata)
    }

    /// Writes one audit line at level `notice` whatever ``minimumLevel``
    /// says: an audit trail (signerd's `audit_log`) that `log_level`
    /// `warning` silenced would be no trail. Same format as ``log(_:_:_:)``.
    /// - Parameters:
    ///   - message: a constant describing the event (`signature_issued`).
    ///   - fields: dotted keys and their values, in order.
    /// - Returns: whether the whole line was written: false when standard
    ///   error refused it (a full disk or pipe, a closed reader, no room
    ///   within ``lineWriteLimitMilliseconds``, a reader that stopped
    ///   reading) or goes to `/dev/null` (``markStandardErrorDiscarded()``).
    ///   signerd returns no signature whose line was not written.
    public func audit(_ message: String, fields metadata: [(key: String, value: LogValue)]) -> Bool {
        emit(.notice, message, metadata)
    }

    private func emit(_ level: LogLevel, _ message: String, _ metadata: [(key: String, value: LogValue)]) -> Bool {
        if let events {
            events(level, message, metadata.map { ($0.key, $0.value) })
            return true
        }
        var line = "{\"ts\":\"" + Logger.timestamp() + "\",\"level\":\"" + level.rawValue + "\",\"msg\":"
        Logger.appendJSONString(message, to: &line)
        for (key, value) in metadata {
            line += ","
            Logger.appendJSONString(key, to: &line)
            line += ":"
            switch value {
            case .string(let text): Logger.appendJSONString(text, to: &line, escapingInvisible: true)
            case .int(let number): line += String(number)
            case .double(let number): line += number.isFinite ? String(number) : "null"
            case .bool(let flag): line += flag ? "true" : "false"
            }
        }
        line += "}"
        return sink(line)
    }

    /// Writes a `trace` line; see ``log(_:_:_:)``.
    public func trace(_ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) { log(.trace, message, metadata) }
    /// Writes a `debug` line; see ``log(_:_:_:)``.
    public func debug(_ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) { log(.debug, message, metadata) }
    /// Writes a `info` line; see ``log(_:_:_:)``.
    public func info(_ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) { log(.info, message, metadata) }
    /// Writes a `notice` line; see ``log(_:_:_:)``.
    public func notice(_ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) { log(.notice, message, metadata) }
    /// Writes a `warning` line; see ``log(_:_:_:)``.
    public func warning(_ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) { log(.warning, message, metadata) }
    /// Writes a `error` line; see ``log(_:_:_:)``.
    public func error(_ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) { log(.error, message, metadata) }
    /// Writes a `critical` line; see ``log(_:_:_:)``.
    public func critical(_ message: String, _ metadata: KeyValuePairs<String, LogValue> = [:]) { log(.critical, message, metadata) }

    /// RFC 3339 UTC with milliseconds, e.g. `2026-11-29T12:00:58.123Z`.
    public static func timestamp() -> String {
        var now = timespec()
        clock_gettime(CLOCK_REALTIME, &now)
        var seconds = now.tv_sec
        var parts = tm()
        gmtime_r(&seconds, &parts)
        func two(_ value: Int32) -> String { value < 10 ? "0\(value)" : "\(value)" }
        let millis = now.tv_nsec / 1_000_000
        let ms = millis < 10 ? "00\(millis)" : millis < 100 ? "0\(millis)" : "\(millis)"
        return "\(parts.tm_year + 1900)-\(two(parts.tm_mon + 1))-\(two(parts.tm_mday))T\(two(parts.tm_hour)):\(two(parts.tm_min)):\(two(parts.tm_sec)).\(ms)Z"
    }

    /// Appends `text` as a JSON string literal (RFC 8259 §7): the same
    /// escapes as the `[UInt8]` form of `appendJSONString`, which does the
    /// work for any text that needs one.
    public static func appendJSONString(_ text: String, to out: inout String) {
        appendJSONString(text, to: &out, escapingInvisible: false)
    }

    /// The `String` form of `appendJSONString(_:to:)` with, when
    /// `escapingInvisible`, also C1 controls (U+0080–U+009F) and format
    /// characters (general category Cf: the bidirectional controls such as
    /// U+202E, zero-width spaces and joiners, U+FEFF, tags) as `\uXXXX`:
    /// log lines carry callers' text (an audit line's product ID), and a
    /// viewer showing them raw would reorder what follows or make two IDs
    /// look alike. Responses and signed JSON keep their characters.
    static func appendJSONString(_ text: String, to out: inout String, escapingInvisible: Bool) {
        // Fast path: printable ASCII without quote or backslash goes in as is.
        var text = text
        let plain = text.withUTF8 { bytes in
            !bytes.contains { $0 < 0x20 || $0 >= 0x7f || $0 == 0x22 || $0 == 0x5c }
        }
        if plain {
            out += "\""
            out += text
            out += "\""
            return
        }
        var escaped: [UInt8] = []
        appendJSONString(text, to: &escaped, escapingInvisible: escapingInvisible)
        out += String(decoding: escaped, as: UTF8.self)
    }

    /// Appends `text` as a JSON string literal (RFC 8259 §7), as UTF-8
    /// bytes: `"` and `\` escaped, `\n` `\r` `\t` by name, other control
    /// characters and U+2028/U+2029 (line breaks to JavaScript) as `\uXXXX`,
    /// everything else as its own UTF-8.
    /// - Parameters:
    ///   - text: any string.
    ///   - out: the buffer appended to.
    public static func appendJSONString(_ text: String, to out: inout [UInt8]) {
        appendJSONString(text, to: &out, escapingInvisible: false)
    }

    static func appendJSONString(_ text: String, to out: inout [UInt8], escapingInvisible: Bool) {
        out.append(UInt8(ascii: "\""))
        var text = text
        text.withUTF8 { bytes in
            // Printable ASCII without quote or backslash, and any UTF-8
            // sequence but E2 80 A8/A9, is copied in runs.
            var runStart = 0
            var index = 0
            func flush() {
                if runStart < index { out.append(contentsOf: UnsafeBufferPointer(rebasing: bytes[runStart..<index])) }
            }
            while index < bytes.count {
                let byte = bytes[index]
                // Most bytes need nothing: test for the four that might first.
                guard byte < 0x20 || byte == 0x22 || byte == 0x5c || byte == 0xe2 || (escapingInvisible && (byte == 0x7f || byte >= 0xc2)) else {
                    index += 1
                    continue
                }
                var width = 1
                let escape: String
                switch byte {
                case 0x22: escape = "\\\""
                case 0x5c: escape = "\\\\"
                case 0x0a: escape = "\\n"
                case 0x0d: escape = "\\r"
                case 0x09: escape = "\\t"
                case 0x00..<0x20, 0x7f: escape = "\\u" + String(byte, radix: 16).leftPadded(to: 4)
                case 0xe2 where index + 2 < bytes.count && bytes[index + 1] == 0x80 && (bytes[index + 2] == 0xa8 || bytes[index + 2] == 0xa9):
                    escape = bytes[index + 2] == 0xa8 ? "\\u2028" : "\\u2029"
                    width = 3
                case _ where escapingInvisible:
                    guard let (scalar, length) = Self.invisibleScalar(bytes, at: index) else {
                        index += 1
                        continue
                    }
                    // Beyond the BMP (the tags, U+E0001…) as its UTF-16 surrogate pair (RFC 8259 §7).
                    let units = scalar > 0xffff ? [0xd800 + ((scalar - 0x10000) >> 10), 0xdc00 + ((scalar - 0x10000) & 0x3ff)] : [scalar]
                    escape = units.map { "\\u" + String($0, radix: 16).leftPadded(to: 4) }.joined()
                    width = length
                default:
                    index += 1
                    continue
                }
                flush()
                out.append(contentsOf: escape.utf8)
                index += width
                runStart = index
            }
            flush()
        }
        out.append(UInt8(ascii: "\""))
    }

    /// The invisible character whose UTF-8 starts at `index`, with its
    /// length in bytes: a C1 control (U+0080–U+009F) or a format character
    /// (Unicode general category Cf: the bidirectional controls, zero-width
    /// spaces and joiners, U+FEFF, the soft hyphen, tags); nil for any other.
    /// `bytes` is valid UTF-8 (a `String`'s).
    private static func invisibleScalar(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> (UInt32, Int)? {
        let first = bytes[index]
        let length = first >= 0xf0 ? 4 : first >= 0xe0 ? 3 : first >= 0xc0 ? 2 : 1
        guard length > 1, index + length <= bytes.count else { return nil }
        var value = UInt32(first) & (0xff >> (length + 1))
        for offset in 1..<length { value = value << 6 | UInt32(bytes[index + offset] & 0x3f) }
        guard let scalar = Unicode.Scalar(value) else { return nil }
        switch scalar.properties.generalCategory {
        case .control, .format: return (value, length)
        default: return nil
        }
    }
}
