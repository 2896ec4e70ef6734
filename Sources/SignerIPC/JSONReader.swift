import HSMSigner

/// Reads one JSON text (RFC 8259) into a ``JSONValue`` in a single pass
/// over its bytes, as strictly as the RFC: every request body and the
/// configuration file go through it (``FieldReader``).
///
/// signerd reads request bodies itself because the checks it needs are
/// part of what it signs: a member name given twice (RFC 8259 §4 leaves
/// the value to the parser), a number whose spelling decides whether it is
/// an exact integer (§6), a U+FEFF at the start of a string (kept; Foundation's
/// `JSONSerialization` dropped it as a byte-order mark, so `"\u{FEFF}abc"`
/// would have been signed as `abc`), a lone UTF-16 surrogate escape (§8.2),
/// a trailing comma, and nesting beyond ``JSONText/nestingLimit``. With
/// Foundation's parser each of these needed a second scan of the text whose
/// reading had to agree with the parser's; here there is one reading.
///
/// Text that is not UTF-8 is refused before this reader runs
/// (``JSONText/notUTF8(_:)``), so every string it makes is valid UTF-8
/// as sent.
struct JSONReader {
    /// Why the text is not JSON, as a clause: "a comma directly before } or ]
    /// (a trailing comma)", "the text ends inside the string that starts at
    /// byte 12". Byte offsets count from 0.
    struct Syntax: Error {
        /// The reason, without a closing period.
        var reason: String
    }

    /// What the whole text held: the value, and the first of each problem
    /// that is not a syntax error, in the order of the text, for
    /// ``FieldReader`` to report in its own order.
    struct Document {
        /// The value. A number that could not be read exactly stands as
        /// `.integer(0)` where its problem is recorded below.
        var value: JSONValue
        /// The first integer outside `Int64` when numbers are read exactly
        /// (never otherwise), short of one beyond a `Double` (that one is
        /// ``beyondDouble``): its text as an error names it, and where it sits.
        var inexact: (text: String, path: String)?
        /// The first member name given twice in one object (the one whose
        /// second name comes first in the text), and its path; `firstSpelling`
        /// is the other name when the two differ in their bytes but are
        /// canonically equivalent (`"e\u{301}"` and `"\u{E9}"`), which Swift's
        /// `String`, and so signerd, takes for one name.
        var repeated: (name: String, path: String, firstSpelling: String?)?
        /// ``repeated`` in words for an error message, quoting 200
        /// characters of the name and of the path (they come from the text):
        /// `"offer_id" appears more than once in one object (generate_offers[0].offer_id)`,
        /// the path left out when it is the bare name.
        var repeatedInWords: String? {
            guard let repeated else { return nil }
            let place = repeated.path == repeated.name ? "" : " (\(JSONText.shortened(repeated.path)))"
            var spellings = ""
            if let first = repeated.firstSpelling {
                func codePoints(_ name: String) -> String {
                    JSONText.shortened(name.unicodeScalars.map { "U+" + String($0.value, radix: 16, uppercase: true) }.joined(separator: " "))
                }
                spellings = ", spelled \(codePoints(first)) and \(codePoints(repeated.name)): one name in Unicode canonical equivalence, which signerd does not tell apart"
            }
            return "\"\(JSONText.shortened(repeated.name))\" appears more than once in one object\(spellings)\(place)"
        }
        /// The first number beyond what a `Double` holds (`1e309`, an
        /// integer of 310 digits): its text (shortened past 200
        /// characters) and where it sits.
        var beyondDouble: (text: String, path: String)?
        /// How each member of the top object that was read into a
        /// ``JSONValue/number(_:)`` was written (`1.796091280327E12`),
        /// shortened past 40 characters, by member name: for an error that
        /// quotes such a value as it was sent, not as the `Double` it became.
        var topLevelNumbers: [String: String] = [:]
    }

    /// Reads `text` as one JSON value, scalars included.
    /// - Parameters:
    ///   - text: UTF-8 JSON text, already checked by ``JSONText/notUTF8(_:)``.
    ///   - exactNumbers: whether an integer outside `Int64` is recorded as
    ///     ``Document/inexact`` (true), or kept as the nearest `Double` (false,
    ///     for a request none of whose numbers is signed).
    /// - Returns: the value and the problems found in it.
    /// - Throws: ``Syntax`` for text that is not JSON, nested deeper than
    ///   ``JSONText/nestingLimit``, or holding a lone surrogate escape.
    static func read(_ text: [UInt8], exactNumbers: Bool) throws(Syntax) -> Document {
        let result: Result<Document, Syntax> = text.withUnsafeBufferPointer { buffer in
            var reader = JSONReader(buffer, exactNumbers: exactNumbers)
            do throws(Syntax) {
                return .success(try reader.readDocument())
            } catch {
                return .failure(error)
            }
        }
        return try result.get()
    }

    private let text: UnsafeBufferPointer<UInt8>
    private let exactNumbers: Bool
    private var index = 0
    private var depth = 0
    /// Where the value being read sits; kept for error paths, built into a
    /// string only when a problem is recorded.
    private var steps: [JSONStep] = []
    private var inexact: (text: String, path: String)?
    /// With the byte offset of the repeat's name: see ``readObject()``.
    private var repeated: (name: String, path: String, offset: Int, firstSpelling: String?)?
    private var beyondDouble: (text: String, path: String)?
    private var topLevelNumbers: [String: String] = [:]

    private init(_ text: UnsafeBufferPointer<UInt8>, exactNumbers: Bool) {
        self.text = text
        self.exactNumbers = exactNumbers
    }

    private static let quote = UInt8(ascii: "\""), backslash = UInt8(ascii: "\\")

    private mutating func readDocument() throws(Syntax) -> Document {
        skipWhitespace()
        guard index < text.count else { throw Syntax(reason: "the text holds no JSON value") }
        let value = try readValue()
        skipWhitespace()
        guard index == text.count else {
            throw Syntax(reason: "\(describe(at: index)) at byte \(index) follows the JSON value; the text must hold one value only")
        }
        return Document(value: value, inexact: inexact, repeated: repeated.map { ($0.name, $0.path, $0.firstSpelling) }, beyondDouble: beyondDouble,
                        topLevelNumbers: topLevelNumbers)
    }

    /// Skips RFC 8259's four whitespace bytes.
    private mutating func skipWhitespace() {
        while index < text.count {
            switch text[index] {
            case 0x20, 0x09, 0x0A, 0x0D: index += 1
            default: return
            }
        }
    }

    private mutating func readValue() throws(Syntax) -> JSONValue {
        guard index < text.count else { throw endOfText(expecting: "a value") }
        switch text[index] {
        case Self.quote: return .string(try readString())
        case UInt8(ascii: "{"): return try readObject()
        case UInt8(ascii: "["): return try readArray()
        case UInt8(ascii: "t"): try readWord("true"); return .bool(true)
        case UInt8(ascii: "f"): try readWord("false"); return .bool(false)
        case UInt8(ascii: "n"): try readWord("null"); return .null
        case UInt8(ascii: "-"), UInt8(ascii: "0")...UInt8(ascii: "9"): return try readNumber()
        default: throw unexpected(expecting: "a value (a string, a number, an object, an array, true, false or null)")
        }
    }

    private mutating func enter() throws(Syntax) {
        depth += 1
        guard depth <= JSONText.nestingLimit else {
            throw Syntax(reason: "arrays and objects are nested more than \(JSONText.nestingLimit) deep; signerd reads at most \(JSONText.nestingLimit) levels (RFC 8259 §9 lets a parser limit the depth)")
        }
    }

    private mutating func readObject() throws(Syntax) -> JSONValue {
        if try readOpening(closedBy: UInt8(ascii: "}")) { return .object([:]) }
        // Room for a request's members without growing (each growth rehashes
        // every key), for the top-level object only: a body of many small
        // nested objects would otherwise hold 8 slots for each of them.
        var members = depth == 1 ? [String: JSONValue](minimumCapacity: 8) : [:]
        while true {
            skipWhitespace()
            guard index < text.count else { throw endOfText(expecting: "a member name") }
            guard text[index] == Self.quote else {
                // Only after a comma: an empty object was read above.
                if text[index] == UInt8(ascii: "}") { throw Self.trailingComma }
                throw unexpected(expecting: "a member name in double quotes")
            }
            let nameOffset = index
            let name = try readString()
            skipWhitespace()
            guard index < text.count else { throw endOfText(expecting: "a colon after the member name") }
            guard text[index] == UInt8(ascii: ":") else { throw unexpected(expecting: "a colon after the member name") }
            index += 1
            skipWhitespace()
            steps.append(.member(name))
            let value = try readValue()
            steps.removeLast()
            // A repeat is found once its value has been read, so one inside
            // that value was found first; this name stands before it in the
            // text and takes its place (at most once per enclosing level).
            if members.updateValue(value, forKey: name) != nil, repeated.map({ nameOffset < $0.offset }) ?? true {
                // The dictionary keeps the first name it was given.
                let first = members.index(forKey: name).map { members[$0].key }
                repeated = (name, path(appending: name), nameOffset, first.flatMap { $0.utf8.elementsEqual(name.utf8) ? nil : $0 })
            }
            if try readSeparator(closedBy: UInt8(ascii: "}"), after: "member's value") { return .object(members) }
        }
    }

    private mutating func readArray() throws(Syntax) -> JSONValue {
        if try readOpening(closedBy: UInt8(ascii: "]")) { return .array([]) }
        var values: [JSONValue] = []
        while true {
            skipWhitespace()
            if index < text.count, text[index] == UInt8(ascii: "]") { throw Self.trailingComma }  // only after a comma
            steps.append(.element(values.count))
            values.append(try readValue())
            steps.removeLast()
            if try readSeparator(closedBy: UInt8(ascii: "]"), after: "array's element") { return .array(values) }
        }
    }

    /// Reads the `{` or `[` at `index` and the whitespace after it, one
    /// level deeper.
    /// - Returns: true when `closing` follows at once (read too): the
    ///   container is empty, and the level is left again.
    private mutating func readOpening(closedBy closing: UInt8) throws(Syntax) -> Bool {
        try enter()
        index += 1
        skipWhitespace()
        guard index < text.count, text[index] == closing else { return false }
        index += 1
        depth -= 1
        return true
    }

    /// Reads what follows a member's value or an array's element: a comma
    /// (false), or `closing` (true: the container ends, and its level is left).
    private mutating func readSeparator(closedBy closing: UInt8, after what: String) throws(Syntax) -> Bool {
        skipWhitespace()
        guard index < text.count else { throw endOfText(expecting: "a comma or \(Character(Unicode.Scalar(closing))) after the \(what)") }
        switch text[index] {
        case UInt8(ascii: ","):
            index += 1
            return false
        case closing:
            index += 1
            depth -= 1
            return true
        default: throw unexpected(expecting: "a comma or \(Character(Unicode.Scalar(closing))) after the \(what)")
        }
    }

    private static let trailingComma = Syntax(reason: "a comma directly before } or ] (a trailing comma)")

    private mutating func readWord(_ word: StaticString) throws(Syntax) {
        let start = index
        let count = word.utf8CodeUnitCount
        let matches = word.withUTF8Buffer { expected in
            index + count <= text.count && (0..<count).allSatisfy { text[index + $0] == expected[$0] }
        }
        guard matches else {
            throw Syntax(reason: "\(describe(at: start)) at byte \(start) begins no JSON value (true, false and null are written in lower case, strings in double quotes)")
        }
        index += count
    }

    // MARK: Strings

    /// Reads a string from its opening quote (at `index`) past its closing one.
    private mutating func readString() throws(Syntax) -> String {
        let opening = index
        index += 1
        let start = index
        while index < text.count {
            let byte = text[index]
            if byte == Self.quote {
                let string = String(decoding: UnsafeBufferPointer(rebasing: text[start..<index]), as: UTF8.self)
                index += 1
                return string
            }
            if byte == Self.backslash { return try readEscapedString(opening: opening, start: start) }
            if byte < 0x20 { throw controlCharacter(byte) }
            index += 1
        }
        throw Syntax(reason: "the text ends inside the string that starts at byte \(opening)")
    }

    /// The rest of a string from its first backslash (at `index`), escapes decoded.
    private mutating func readEscapedString(opening: Int, start: Int) throws(Syntax) -> String {
        var bytes = Array(text[start..<index])
        bytes.reserveCapacity(bytes.count + 16)
        while index < text.count {
            let byte = text[index]
            if byte == Self.quote {
                index += 1
                return String(decoding: bytes, as: UTF8.self)
            }
            if byte < 0x20 { throw controlCharacter(byte) }
            guard byte == Self.backslash else {
                bytes.append(byte)
                index += 1
                continue
            }
            guard index + 1 < text.count else { break }
            let escape = index
            index += 2
            switch text[escape + 1] {
            case Self.quote: bytes.append(Self.quote)
            case Self.backslash: bytes.append(Self.backslash)
            case UInt8(ascii: "/"): bytes.append(UInt8(ascii: "/"))
            case UInt8(ascii: "b"): bytes.append(0x08)
            case UInt8(ascii: "f"): bytes.append(0x0C)
            case UInt8(ascii: "n"): bytes.append(0x0A)
            case UInt8(ascii: "r"): bytes.append(0x0D)
            case UInt8(ascii: "t"): bytes.append(0x09)
            case UInt8(ascii: "u"):
                let scalar = try readUnicodeEscape(at: escape)
                UTF8.encode(scalar) { bytes.append($0) }
            default:
                throw Syntax(reason: "\(describe(at: escape + 1)) at byte \(escape + 1) cannot follow a backslash in a string (RFC 8259 §7: \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)")
            }
        }
        throw Syntax(reason: "the text ends inside the string that starts at byte \(opening)")
    }

    /// The code unit of the `\uXXXX` escape whose backslash is at `escape`, or nil.
    private func codeUnit(at escape: Int) -> UInt16? {
        guard escape + 6 <= text.count, text[escape] == Self.backslash, text[escape + 1] == UInt8(ascii: "u") else { return nil }
        var unit: UInt16 = 0
        for offset in 2..<6 {
            let byte = text[escape + offset]
            let digit: UInt8
            switch byte {
            case UInt8(ascii: "0")...UInt8(ascii: "9"): digit = byte - UInt8(ascii: "0")
            case UInt8(ascii: "a")...UInt8(ascii: "f"): digit = byte - UInt8(ascii: "a") + 10
            case UInt8(ascii: "A")...UInt8(ascii: "F"): digit = byte - UInt8(ascii: "A") + 10
            default: return nil
            }
            unit = unit << 4 | UInt16(digit)
        }
        return unit
    }

    /// Decodes the `\uXXXX` escape at `escape` (`index` is past `\u`), and
    /// the low surrogate's escape after it for a high surrogate (RFC 8259 §7).
    private mutating func readUnicodeEscape(at escape: Int) throws(Syntax) -> Unicode.Scalar {
        guard let unit = codeUnit(at: escape) else {
            throw Syntax(reason: "the escape at byte \(escape) is not \\u followed by four hexadecimal digits")
        }
        index = escape + 6
        if (0xD800...0xDBFF).contains(unit), let low = codeUnit(at: index), (0xDC00...0xDFFF).contains(low) {
            index += 6
            let value = 0x10000 + (UInt32(unit - 0xD800) << 10 | UInt32(low - 0xDC00))
            return Unicode.Scalar(value)!  // 0x10000...0x10FFFF, no surrogate: always a scalar
        }
        guard let scalar = Unicode.Scalar(UInt32(unit)) else {
            let sent = String(decoding: UnsafeBufferPointer(rebasing: text[escape..<(escape + 6)]), as: UTF8.self)
            throw Syntax(reason: "the escape \(sent) at byte \(escape) is half of a UTF-16 surrogate pair and no character "
                         + "(\\uD800–\\uDBFF must be followed by \\uDC00–\\uDFFF)")
        }
        return scalar
    }

    private func controlCharacter(_ byte: UInt8) -> Syntax {
        let hex = String(byte, radix: 16, uppercase: true)
        return Syntax(reason: "the control character U+\(String(repeating: "0", count: 4 - hex.count))\(hex) at byte \(index) is inside a string; RFC 8259 §7 wants it escaped (\\n, \\t, \\u00XX)")
    }

    // MARK: Numbers

    /// Reads a number (RFC 8259 §6: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`).
    /// An integer is exact in `Int64`; one with a fraction or an exponent is
    /// the nearest `Double`. One that is neither is recorded, and stands as 0.
    private mutating func readNumber() throws(Syntax) -> JSONValue {
        let start = index
        let negative = text[index] == UInt8(ascii: "-")
        if negative { index += 1 }
        guard index < text.count, isDigit(text[index]) else { throw malformedNumber(start) }
        var magnitude: UInt64 = 0
        var overflow = false
        if text[index] == UInt8(ascii: "0") {
            index += 1
            if index < text.count, isDigit(text[index]) {
                throw Syntax(reason: "the number at byte \(start) starts with 0 followed by more digits, which RFC 8259 §6 does not allow")
            }
        } else {
            while index < text.count, isDigit(text[index]) {
                let (times, timesOverflow) = magnitude.multipliedReportingOverflow(by: 10)
                let (sum, sumOverflow) = times.addingReportingOverflow(UInt64(text[index] - UInt8(ascii: "0")))
                overflow = overflow || timesOverflow || sumOverflow
                magnitude = sum
                index += 1
            }
        }
        var fractional = false
        if index < text.count, text[index] == UInt8(ascii: ".") {
            fractional = true
            index += 1
            guard index < text.count, isDigit(text[index]) else { throw malformedNumber(start) }
            while index < text.count, isDigit(text[index]) { index += 1 }
        }
        if index < text.count, text[index] == UInt8(ascii: "e") || text[index] == UInt8(ascii: "E") {
            fractional = true
            index += 1
            if index < text.count, text[index] == UInt8(ascii: "+") || text[index] == UInt8(ascii: "-") { index += 1 }
            guard index < text.count, isDigit(text[index]) else { throw malformedNumber(start) }
            while index < text.count, isDigit(text[index]) { index += 1 }
        }
        if !fractional && !overflow {
            if negative, magnitude <= UInt64(Int64.max) + 1 {
                return .integer(magnitude == UInt64(Int64.max) + 1 ? Int64.min : -Int64(magnitude))
            }
            if !negative, magnitude <= UInt64(Int64.max) { return .integer(Int64(magnitude)) }
        }
        // Off the common path: a fraction, an exponent, or an integer beyond Int64.
        let literal = String(decoding: UnsafeBufferPointer(rebasing: text[start..<index]), as: UTF8.self)
        let nearest = Double(literal) ?? .infinity  // the grammar above is Double's too
        if nearest.isInfinite {
            if beyondDouble == nil { beyondDouble = (JSONText.shortened(literal), path) }
            return .integer(0)
        }
        if fractional || !exactNumbers {
            if depth == 1, steps.count == 1, case .member(let name) = steps[0] {
                topLevelNumbers[name] = literal.utf8.count > 40 ? String(literal.prefix(40)) + "…" : literal
            }
            return .number(nearest)
        }
        if inexact == nil {
            // The integer as sent while it is short enough to read in a message.
            let digits = literal.utf8.count - (negative ? 1 : 0)
            inexact = (literal.utf8.count <= 40 ? literal : "an integer of \(digits) digits", path)
        }
        return .integer(0)
    }

    private func isDigit(_ byte: UInt8) -> Bool {
        (UInt8(ascii: "0")...UInt8(ascii: "9")).contains(byte)
    }

    private func malformedNumber(_ start: Int) -> Syntax {
        Syntax(reason: "the number at byte \(start) is malformed; RFC 8259 §6 writes numbers as -?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?")
    }

    // MARK: Errors

    /// The path of the value being read, as the API names fields
    /// (`request.items[0].price`; empty for the top value).
    private var path: String { JSONStep.path(steps) }

    /// The path of member `name` of the object being read.
    private func path(appending name: String) -> String {
        var outer = path
        JSONStep.appending(name, to: &outer)
        return outer
    }

    private func endOfText(expecting what: String) -> Syntax {
        Syntax(reason: "the text ends where \(what) was expected")
    }

    private func unexpected(expecting what: String) -> Syntax {
        Syntax(reason: "\(describe(at: index)) at byte \(index) where \(what) was expected")
    }

    /// The byte at `offset` as a message shows it: `'x'` for printable
    /// ASCII, `a byte 0xC3` otherwise.
    private func describe(at offset: Int) -> String {
        guard offset < text.count else { return "the end of the text" }
        let byte = text[offset]
        if (0x21...0x7E).contains(byte) { return "'\(Character(Unicode.Scalar(byte)))'" }
        return "a byte 0x\(String(byte, radix: 16, uppercase: true))"
    }
}
