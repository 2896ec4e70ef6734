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
    private let sink: @Sendable (String) -> Void
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
        self.sink = sink
    }

    /// A logger handing each event to `events` as it is, unformatted: for a
    /// program that shows events in its own words (signctl on a terminal).
    /// - Parameters:
    ///   - minimumLevel: the lowest level passed on.
    ///   - events: receives the level, the constant message and the metadata in order.
    public init(minimumLevel: LogLevel, events: @escaping @Sendable (_ level: LogLevel, _ message: String, _ metadata: [(key: String, value: LogValue)]) -> Void) {
        self.minimumLevel = minimumLevel
        self.sink = { _ in }
        self.events = events
    }

    /// A logger that drops everything.
    public static let disabled = Logger(minimumLevel: .critical) { _ in }

    private static let writeLock = Locked(())

    private static let standardError: @Sendable (String) -> Void = { line in
        var bytes = Array(line.utf8)
        bytes.append(0x0a)
        writeLock.withLock { _ in
            bytes.withUnsafeBytes { buffer in
                var offset = 0
                while offset < buffer.count {
                    let n = write(2, buffer.baseAddress! + offset, buffer.count - offset)  // non-empty: has "\n"
                    if n <= 0 {
                        if n < 0 && errno == EINTR { continue }
                        return
                    }
                    offset += n
                }
            }
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
        emit(level, message, metadata)
    }

    /// Writes one audit line at level `notice` whatever ``minimumLevel``
    /// says: an audit trail (signerd's `audit_log`) that `log_level`
    /// `warning` silenced would be no trail. Same format as ``log(_:_:_:)``.
    /// - Parameters:
    ///   - message: a constant describing the event (`signature_issued`).
    ///   - fields: dotted keys and their values, in order.
    public func audit(_ message: String, fields metadata: [(key: String, value: LogValue)]) {
        emit(.notice, message, metadata)
    }

    private func emit(_ level: LogLevel, _ message: String, _ metadata: [(key: String, value: LogValue)]) {
        if let events {
            events(level, message, metadata.map { ($0.key, $0.value) })
            return
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
        sink(line)
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
    /// `escapingInvisible`, also C1 controls (U+0080–U+009F) and the
    /// bidirectional controls (U+061C, U+200E, U+200F, U+202A–U+202E,
    /// U+2066–U+2069) as `\uXXXX`: log lines carry callers' text (an audit
    /// line's product ID), and a viewer showing them raw would reorder what
    /// follows. Responses and signed JSON keep their characters.
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
                guard byte < 0x20 || byte == 0x22 || byte == 0x5c || byte == 0xe2 || (escapingInvisible && (byte == 0xc2 || byte == 0xd8)) else {
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
                case 0x00..<0x20: escape = "\\u" + String(byte, radix: 16).leftPadded(to: 4)
                case 0xe2 where index + 2 < bytes.count && bytes[index + 1] == 0x80 && (bytes[index + 2] == 0xa8 || bytes[index + 2] == 0xa9):
                    escape = bytes[index + 2] == 0xa8 ? "\\u2028" : "\\u2029"
                    width = 3
                case _ where escapingInvisible:
                    guard let (scalar, length) = Self.invisibleScalar(bytes, at: index) else {
                        index += 1
                        continue
                    }
                    escape = "\\u" + String(scalar, radix: 16).leftPadded(to: 4)
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

    /// The C1 or bidirectional control whose UTF-8 starts at `index`
    /// (C2 80–C2 9F, D8 9C, E2 80 8E/8F, E2 80 AA–AE, E2 81 A6–A9), with its
    /// length in bytes; nil for any other character.
    private static func invisibleScalar(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> (UInt32, Int)? {
        guard index + 1 < bytes.count else { return nil }
        let (first, second) = (bytes[index], bytes[index + 1])
        switch first {
        case 0xc2 where (0x80...0x9f).contains(second): return (UInt32(second), 2)
        case 0xd8 where second == 0x9c: return (0x61c, 2)
        case 0xe2 where index + 2 < bytes.count:
            let third = bytes[index + 2]
            let scalar = (UInt32(first & 0x0f) << 12) | (UInt32(second & 0x3f) << 6) | UInt32(third & 0x3f)
            switch scalar {
            case 0x200e, 0x200f, 0x202a...0x202e, 0x2066...0x2069: return (scalar, 3)
            default: return nil
            }
        default: return nil
        }
    }
}
