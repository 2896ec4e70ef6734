import Foundation

/// JSON text as signerd reads it, from a client or a file: UTF-8 only
/// (RFC 8259 §8.1), parsed by Foundation's `JSONSerialization`, with what
/// that parser lets through and RFC 8259 does not refused around it (a
/// byte-order mark, a trailing comma), and a raw U+FEFF inside a string
/// kept. Request bodies, the configuration file and the parts of a compact
/// JWS that `signctl verify jws` reads all go through ``parse(_:fragmentsAllowed:)``.
package enum JSONText {
    /// Why bytes are not JSON text signerd reads, without naming where they came from.
    package enum Problem: Error, Sendable {
        /// Not UTF-8 (RFC 8259 §8.1): what ``notUTF8(_:)`` found.
        case notUTF8(String)
        /// Not JSON: the parser's own reason and position, when it gave one.
        case notJSON(String?)
    }

    /// Parses UTF-8 JSON text with Foundation's `JSONSerialization` (a third
    /// of `JSONDecoder`'s cost for an untyped tree, measured: 8 µs against
    /// 68 µs for a request), after ``notUTF8(_:)``: request bodies and the
    /// configuration file go through here.
    /// - Parameters:
    ///   - body: the text.
    ///   - fragmentsAllowed: whether a top-level scalar is parsed (to name
    ///     its kind) rather than refused as not JSON.
    /// - Returns: what `JSONSerialization.jsonObject(with:)` returns, how
    ///   many member names the text holds, and whether any number in it is
    ///   written with a fraction or an exponent (``structure(_:)``).
    /// - Throws: ``Problem``; `notJSON` also for a trailing comma,
    ///   which Foundation's parser accepts and RFC 8259 does not, and for
    ///   arrays and objects nested deeper than ``nestingLimit``.
    package static func parse(_ body: [UInt8], fragmentsAllowed: Bool = false) throws(Problem) -> (value: Any, memberNames: Int, fractionalNumbers: Bool) {
        if let problem = notUTF8(body) { throw .notUTF8(problem) }
        // Before the parser: Foundation takes 512 levels, and the work per
        // value that follows grows with the depth (a fuzzing round: 3.5 s
        // for a 64 KB body 500 deep).
        let structure = Self.structure(body)
        if structure.depth > nestingLimit {
            throw .notJSON("arrays and objects are nested more than \(nestingLimit) deep; signerd reads at most \(nestingLimit) levels (RFC 8259 §9 lets a parser limit the depth)")
        }
        let value: Any
        do {
            value = try JSONSerialization.jsonObject(with: Data(escapingByteOrderMarks(body)), options: fragmentsAllowed ? .fragmentsAllowed : [])
        } catch {
            // Foundation's parser says "Unexpected end of file during string
            // parse" for a lone UTF-16 surrogate escape: name it instead.
            if let lone = loneSurrogateEscape(in: body) {
                throw .notJSON("the escape \(lone.escape) at byte \(lone.offset) is half of a UTF-16 surrogate pair and no character "
                               + "(\\uD800–\\uDBFF must be followed by \\uDC00–\\uDFFF)")
            }
            // The parser says where and why ("Too many nested arrays or dictionaries around character 513.").
            // It can quote the input (a 60,000-digit number whole): keep the reason short.
            throw .notJSON(((error as NSError).userInfo[NSDebugDescriptionErrorKey] as? String).map(Self.reason))
        }
        if structure.trailingComma {
            throw .notJSON("a comma directly before } or ] (a trailing comma)")
        }
        return (value, structure.memberNames, structure.fractionalNumbers)
    }

    /// Whether `raw` is one number as RFC 8259 §6 writes it:
    /// `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
    /// - Parameter raw: the number's bytes.
    package static func isNumber(_ raw: ArraySlice<UInt8>) -> Bool {
        var index = raw.startIndex
        func digits() -> Int {
            let start = index
            while index < raw.endIndex, (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(raw[index]) { index += 1 }
            return index - start
        }
        if index < raw.endIndex, raw[index] == UInt8(ascii: "-") { index += 1 }
        guard index < raw.endIndex else { return false }
        if raw[index] == UInt8(ascii: "0") {
            index += 1
        } else if digits() == 0 {
            return false
        }
        if index < raw.endIndex, raw[index] == UInt8(ascii: ".") {
            index += 1
            guard digits() > 0 else { return false }
        }
        if index < raw.endIndex, raw[index] == UInt8(ascii: "e") || raw[index] == UInt8(ascii: "E") {
            index += 1
            if index < raw.endIndex, raw[index] == UInt8(ascii: "+") || raw[index] == UInt8(ascii: "-") { index += 1 }
            guard digits() > 0 else { return false }
        }
        return index == raw.endIndex
    }

    /// The first `\uXXXX` escape inside a string of `body` that is half of
    /// a UTF-16 surrogate pair with no other half (RFC 8259 §7): a high
    /// surrogate (`D800`–`DBFF`) not followed at once by a low one
    /// (`DC00`–`DFFF`), or a low one on its own. Read only after the parser
    /// refused the body, to say why.
    /// - Returns: the escape as sent and its byte offset, or nil.
    package static func loneSurrogateEscape(in body: [UInt8]) -> (escape: String, offset: Int)? {
        func unit(at index: Int) -> UInt16? {
            guard index + 6 <= body.count, body[index] == UInt8(ascii: "\\"), body[index + 1] == UInt8(ascii: "u") else { return nil }
            return UInt16(String(decoding: body[(index + 2)..<(index + 6)], as: UTF8.self), radix: 16)
        }
        var index = 0
        var inString = false
        while index < body.count {
            let byte = body[index]
            if !inString {
                if byte == UInt8(ascii: "\"") { inString = true }
                index += 1
                continue
            }
            if byte == UInt8(ascii: "\"") {
                inString = false
                index += 1
            } else if byte == UInt8(ascii: "\\") {
                guard let code = unit(at: index) else {
                    index += 2  // another escape: skip the character it escapes
                    continue
                }
                if (0xD800...0xDBFF).contains(code), let next = unit(at: index + 6), (0xDC00...0xDFFF).contains(next) {
                    index += 12
                    continue
                }
                if (0xD800...0xDFFF).contains(code) {
                    return (String(decoding: body[index..<(index + 6)], as: UTF8.self), index)
                }
                index += 6
            } else {
                index += 1
            }
        }
        return nil
    }

    /// The parser's reason as a clause of signerd's sentence: shortened,
    /// without its closing period ("Unexpected end of file during JSON parse").
    package static func reason(_ text: String) -> String {
        var text = Self.shortened(text)
        while text.hasSuffix(".") { text.removeLast() }
        return text
    }

    /// `text` cut to 200 characters, followed by "…" and how many were left out.
    /// Counted in Unicode scalars: one `Character` can hold any number of
    /// combining marks (`"e"` and 30,000 U+0301 are one).
    package static func shortened(_ text: String) -> String {
        let scalars = text.unicodeScalars
        guard scalars.count > 200 else { return text }
        return "\(String(String.UnicodeScalarView(scalars.prefix(200))))… (\(scalars.count - 200) more characters)"
    }

    /// `body` with each U+FEFF written as raw UTF-8 inside a string replaced
    /// by its escape `\ufeff`. Foundation's parser decodes the raw stretches
    /// of a string (from its start, and after each escape) as if each were
    /// a file, and drops a U+FEFF that begins one as a byte-order mark, so
    /// `"\u{FEFF}abc"` would be signed as `abc`; the escape is the same
    /// character and is kept. Marks outside strings, or right after a
    /// backslash, are left alone: they are not JSON either way.
    package static func escapingByteOrderMarks(_ body: [UInt8]) -> [UInt8] {
        guard body.contains(0xEF) else { return body }
        var out: [UInt8] = []
        out.reserveCapacity(body.count + 16)
        var inString = false
        var index = 0
        while index < body.count {
            let byte = body[index]
            if inString && byte == UInt8(ascii: "\\") && index + 1 < body.count {
                out.append(byte)
                out.append(body[index + 1])
                index += 2
                continue
            }
            if byte == UInt8(ascii: "\"") {
                inString.toggle()
            } else if inString && byte == 0xEF && index + 2 < body.count && body[index + 1] == 0xBB && body[index + 2] == 0xBF {
                out.append(contentsOf: Array("\\ufeff".utf8))
                index += 3
                continue
            }
            out.append(byte)
            index += 1
        }
        return out
    }

    /// Why `body` is not UTF-8 JSON text, or nil: a byte-order mark, a NUL
    /// byte (never valid in JSON text, and present in any UTF-16 or UTF-32
    /// encoding of `{`), or an invalid UTF-8 sequence.
    package static func notUTF8(_ body: [UInt8]) -> String? {
        if body.starts(with: [0xEF, 0xBB, 0xBF]) || body.starts(with: [0xFE, 0xFF]) || body.starts(with: [0xFF, 0xFE]) {
            return "it starts with a byte-order mark"
        }
        // One pass for NUL and ASCII; the decoder only for text that is not all ASCII.
        var ascii = true
        for byte in body {
            if byte == 0 { return "it holds a NUL byte, as UTF-16 and UTF-32 text does" }
            if byte >= 0x80 { ascii = false }
        }
        if !ascii, String(validating: body, as: UTF8.self) == nil { return "invalid UTF-8 sequence" }
        return nil
    }

    /// One pass of ``scanMemberNames(in:_:)``: how many member names `body`
    /// holds, whether a `,` comes directly before a `}` or `]`, whether
    /// any number is written with a fraction or an exponent, and how deep
    /// arrays and objects nest (1 for `{}`).
    package static func structure(_ body: [UInt8]) -> (memberNames: Int, trailingComma: Bool, fractionalNumbers: Bool, depth: Int) {
        var count = 0
        var trailingComma = false
        var fractional = false
        var depth = 0
        var deepest = 0
        scanMemberNames(in: body) { event, raw in
            switch event {
            case .name: count += 1
            case .trailingComma: trailingComma = true
            case .number: fractional = fractional || hasFractionOrExponent(raw)
            case .objectStart, .arrayStart:
                depth += 1
                deepest = max(deepest, depth)
            case .objectEnd, .arrayEnd: depth -= 1
            default: break
            }
            return true
        }
        return (count, trailingComma, fractional, deepest)
    }

    /// How deep arrays and objects may nest in text signerd reads: 32
    /// levels, the body's own object included. The deepest request the
    /// API defines (an Advanced Commerce `request`) needs about five.
    package static let nestingLimit = 32

    /// Whether a JSON number literal (as ``scanMemberNames(in:_:)`` reports
    /// it) has a fraction or an exponent (RFC 8259 §6: `.`, `e` or `E`).
    /// Foundation's parser cannot say: it returns a `Double` for some such
    /// numbers and an `NSDecimalNumber` for others, and an `NSDecimalNumber`
    /// for some plain integers too (`-1234567890123456789`).
    package static func hasFractionOrExponent(_ literal: ArraySlice<UInt8>) -> Bool {
        literal.contains { $0 == UInt8(ascii: ".") || $0 == UInt8(ascii: "e") || $0 == UInt8(ascii: "E") }
    }


    /// What ``scanMemberNames(in:_:)`` reports.
    package enum ScanEvent {
        case objectStart
        case objectEnd
        case arrayStart
        case arrayEnd
        /// A comma between two elements of an array.
        case nextElement
        /// A member name (its raw bytes are passed alongside); `escaped`
        /// when they hold a backslash escape.
        case name(escaped: Bool)
        /// A `,` directly before the `}` or `]` that follows (reported
        /// before that end): RFC 8259 has no trailing commas.
        case trailingComma
        /// A number (its literal is passed alongside, sign, fraction and
        /// exponent included).
        case number
    }

    /// Walks the JSON text in `body` and reports each object's and array's
    /// start and end, each comma between array elements, each comma right
    /// before an end (a trailing comma), each member name (raw bytes
    /// between the quotes) and each number (its literal), until
    /// `visit` returns false. A string is a name when it sits directly in an
    /// object after `{` or `,`. Meant for text the parser accepted; stays in
    /// bounds on any input.
    package static func scanMemberNames(in body: [UInt8], _ visit: (ScanEvent, ArraySlice<UInt8>) -> Bool) {
        let quote = UInt8(ascii: "\""), backslash = UInt8(ascii: "\\")
        // One entry per open container: true for an object, false for an array.
        var open: [Bool] = []
        var previous: UInt8 = 0  // the last structural byte outside strings
        var index = 0
        while index < body.count {
            let byte = body[index]
            switch byte {
            case quote:
                let start = index + 1
                var end = start
                var escaped = false
                while end < body.count && body[end] != quote {
                    if body[end] == backslash { escaped = true; end += 1 }
                    end += 1
                }
                index = end
                let isName = (open.last ?? false) && (previous == UInt8(ascii: "{") || previous == UInt8(ascii: ","))
                previous = quote
                if isName && !visit(.name(escaped: escaped), body[start..<min(end, body.count)]) { return }
            case UInt8(ascii: "{"):
                open.append(true)
                previous = byte
                if !visit(.objectStart, []) { return }
            case UInt8(ascii: "["):
                open.append(false)
                previous = byte
                if !visit(.arrayStart, []) { return }
            case UInt8(ascii: "}"), UInt8(ascii: "]"):
                if previous == UInt8(ascii: ","), !visit(.trailingComma, []) { return }
                let wasObject = open.popLast() ?? false
                previous = byte
                if !visit(wasObject ? .objectEnd : .arrayEnd, []) { return }
            case UInt8(ascii: ","):
                previous = byte
                if open.last == false && !visit(.nextElement, []) { return }
            case UInt8(ascii: ":"):
                previous = byte
            case 0x20, 0x09, 0x0a, 0x0d:
                break  // whitespace
            case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"):
                let start = index
                while index + 1 < body.count, isNumberByte(body[index + 1]) { index += 1 }
                previous = UInt8(ascii: "0")  // a value
                if !visit(.number, body[start...index]) { return }
            default:
                previous = UInt8(ascii: "0")  // inside true, false or null: a value
            }
            index += 1
        }
    }

    /// Whether `byte` can continue a JSON number: a digit, `.`, `e`, `E`, `+` or `-`.
    private static func isNumberByte(_ byte: UInt8) -> Bool {
        switch byte {
        case UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "."), UInt8(ascii: "e"), UInt8(ascii: "E"), UInt8(ascii: "+"), UInt8(ascii: "-"): true
        default: false
        }
    }
}
