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
        var line = "{\"ts\":\"" + Logger.timestamp() + "\",\"level\":\"" + level.rawValue + "\",\"msg\":"
        Logger.appendJSONString(message, to: &line)
        for (key, value) in metadata {
            line += ","
            Logger.appendJSONString(key, to: &line)
            line += ":"
            switch value {
            case .string(let text): Logger.appendJSONString(text, to: &line)
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

    /// Appends `text` as a JSON string literal (RFC 8259 §7).
    public static func appendJSONString(_ text: String, to out: inout String) {
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
        out += "\""
        for scalar in text.unicodeScalars {
            switch scalar {
            case "\"": out += "\\\""
            case "\\": out += "\\\\"
            case "\n": out += "\\n"
            case "\r": out += "\\r"
            case "\t": out += "\\t"
            default:
                if scalar.value < 0x20 || scalar.value == 0x2028 || scalar.value == 0x2029 {
                    out += "\\u" + String(scalar.value, radix: 16).leftPadded(to: 4)
                } else {
                    out.unicodeScalars.append(scalar)
                }
            }
        }
        out += "\""
    }
}
