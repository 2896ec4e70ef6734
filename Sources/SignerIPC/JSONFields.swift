import Foundation
import HSMSigner

/// A JSON value as Foundation's `JSONDecoder` reads it, keeping the
/// difference between `true` and `1` and between `1` and `1.5`.
public enum JSONValue: Sendable, Equatable, Codable {
    case null
    case bool(Bool)
    case integer(Int64)
    case number(Double)
    case string(String)
    case array([JSONValue])
    case object([String: JSONValue])

    struct AnyKey: CodingKey {
        var stringValue: String
        var intValue: Int? { nil }
        init(stringValue: String) { self.stringValue = stringValue }
        init?(intValue: Int) { nil }
    }

    /// Decodes any JSON value, trying null, string, boolean, integer (`Int64`)
    /// and number (`Double`), then object, then array.
    /// - Parameter decoder: the decoder positioned at the value.
    /// - Throws: `DecodingError` when the value is none of these.
    public init(from decoder: any Decoder) throws {
        // Scalars first, strings before anything else: request bodies are
        // mostly strings, and every failed attempt costs a thrown DecodingError.
        if let single = try? decoder.singleValueContainer() {
            if single.decodeNil() {
                self = .null
                return
            }
            if let text = try? single.decode(String.self) {
                self = .string(text)
                return
            }
            if let flag = try? single.decode(Bool.self) {
                self = .bool(flag)
                return
            }
            if let integer = try? single.decode(Int64.self) {
                self = .integer(integer)
                return
            }
            if let number = try? single.decode(Double.self) {
                self = .number(number)
                return
            }
        }
        if let object = try? decoder.container(keyedBy: AnyKey.self) {
            var values: [String: JSONValue] = [:]
            for key in object.allKeys {
                values[key.stringValue] = try object.decode(JSONValue.self, forKey: key)
            }
            self = .object(values)
            return
        }
        var array = try decoder.unkeyedContainer()
        var values: [JSONValue] = []
        while !array.isAtEnd {
            values.append(try array.decode(JSONValue.self))
        }
        self = .array(values)
    }

    /// Encodes the value as the JSON type it holds.
    /// - Parameter encoder: the encoder to write to.
    /// - Throws: what the encoder throws, e.g. `EncodingError.invalidValue` from
    ///   `JSONEncoder` for a non-finite ``number(_:)``.
    public func encode(to encoder: any Encoder) throws {
        switch self {
        case .null:
            var single = encoder.singleValueContainer()
            try single.encodeNil()
        case .bool(let flag):
            var single = encoder.singleValueContainer()
            try single.encode(flag)
        case .integer(let number):
            var single = encoder.singleValueContainer()
            try single.encode(number)
        case .number(let number):
            var single = encoder.singleValueContainer()
            try single.encode(number)
        case .string(let text):
            var single = encoder.singleValueContainer()
            try single.encode(text)
        case .array(let values):
            var array = encoder.unkeyedContainer()
            for value in values { try array.encode(value) }
        case .object(let members):
            var object = encoder.container(keyedBy: AnyKey.self)
            for (key, value) in members { try object.encode(value, forKey: AnyKey(stringValue: key)) }
        }
    }

    /// Converts what `JSONSerialization` returns. `true`/`false` come back
    /// as NSNumbers whose `objCType` is `c`; other numbers are integers
    /// unless their type is floating point.
    /// - Parameter value: a value from `JSONSerialization.jsonObject(with:)`.
    /// - Returns: nil for a type JSON does not have, or a number that has no
    ///   exact ``integer(_:)`` or ``number(_:)`` form (see
    ///   ``init(foundation:path:exact:)``, which names it).
    public init?(foundation value: Any) {
        guard let converted = try? JSONValue(foundation: value, path: "") else { return nil }
        self = converted
    }

    /// As ``init(foundation:)``, refusing numbers that would change: an
    /// integer beyond `Int64` (Foundation returns `UInt64` up to 2⁶⁴ − 1 and
    /// `NSDecimalNumber` beyond), or a number only `NSDecimalNumber` holds,
    /// would otherwise be signed as a different value.
    ///
    /// Without the text, how a number was written is taken from the type
    /// Foundation returned, which cannot always tell: an `NSDecimalNumber`
    /// equal to −2⁶³ is taken for an integer, and any other for a number
    /// out of range. ``FieldReader/init(json:allowed:exactNumbers:)`` reads
    /// the spelling from the text instead.
    /// - Parameters:
    ///   - value: a value from `JSONSerialization.jsonObject(with:)`.
    ///   - path: where `value` sits, for errors (`request.price`; empty at the top).
    ///   - exact: false for a request none of whose numbers is ever signed
    ///     (`/v1/offers`): such a number is then kept as the nearest
    ///     ``number(_:)`` instead of refused, so that it fails only the field
    ///     that holds it.
    /// - Throws: ``APIError`` `invalid_field` naming the member that holds such
    ///   a number; `invalid_json` for a type JSON does not have.
    public init(foundation value: Any, path: String, exact: Bool = true) throws(APIError) {
        // Strings first (most members are strings), then containers:
        // testing a Swift dictionary `as NSNumber` bridges the whole
        // dictionary to NSDictionary (measured: a third of the request's
        // parsing cost).
        if let text = value as? String {
            self = .string(text)
            return
        }
        switch value {
        case let object as [String: Any]:
            var members: [String: JSONValue] = [:]
            members.reserveCapacity(object.count)
            for (key, member) in object {
                members[key] = try JSONValue(foundation: member, path: path.isEmpty ? key : "\(path).\(key)", exact: exact)
            }
            self = .object(members)
        case let array as [Any]:
            var values: [JSONValue] = []
            values.reserveCapacity(array.count)
            for (index, element) in array.enumerated() {
                values.append(try JSONValue(foundation: element, path: "\(path)[\(index)]", exact: exact))
            }
            self = .array(values)
        case let decimal as NSDecimalNumber:
            // Foundation's form for what neither Int64 nor Double holds exactly
            // (big integers, long fractions), but also for some numbers that
            // one of them holds, written either way.
            if decimal.compare(NSDecimalNumber(value: Int64.min)) == .orderedSame {
                self = .integer(Int64.min)
                return
            }
            guard exact else {
                self = .number(decimal.doubleValue)
                return
            }
            throw JSONValue.inexact(decimal.stringValue, path: path)
        case let number as NSNumber:
            switch String(cString: number.objCType) {
            case "c", "B": self = .bool(number.boolValue)
            case "d", "f": self = .number(number.doubleValue)
            case "Q", "L", "I", "S":
                guard number.uint64Value <= UInt64(Int64.max) else {
                    guard exact else {
                        self = .number(Double(number.uint64Value))
                        return
                    }
                    throw JSONValue.inexact(number.stringValue, path: path)
                }
                self = .integer(Int64(number.uint64Value))
            default: self = .integer(number.int64Value)
            }
        case is NSNull:
            self = .null
        default:
            throw APIError(.invalidJSON, "the request body holds a value JSON does not have")
        }
    }

    /// `invalid_field` for a number at `path` that signerd would not sign
    /// exactly, quoting it as `text`.
    static func inexact(_ text: String, path: String) -> APIError {
        var error = APIError(.invalidField, "\(path.isEmpty ? "the value" : JSONText.shortened(path)) is \(text), beyond the numbers signerd signs exactly: integers from -9223372036854775808 to 9223372036854775807, written without a fraction or exponent", field: path.isEmpty ? nil : path)
        error.numberSent = text
        return error
    }

    /// The path of the first number with a fraction or exponent in the
    /// value (`items[0].price`), or nil. Such a number is held as a
    /// `Double`, whose shortest form may differ from what was sent
    /// (`9007199254740993e0` reads as 9007199254740992, `1e-400` as 0).
    /// - Parameter path: the value's own path.
    public func firstFractionalNumber(path: String) -> String? {
        // The path is built only for the number found: building one per
        // value would cost the depth times the names' length for each.
        var steps: [JSONStep] = []
        guard firstFractionalNumber(below: &steps) else { return nil }
        return JSONStep.path(steps, after: path)
    }

    /// Whether the value holds a number with a fraction or exponent; if so,
    /// `steps` leads to the first one (members in name order).
    private func firstFractionalNumber(below steps: inout [JSONStep]) -> Bool {
        switch self {
        case .number: return true
        case .object(let members):
            for key in members.keys.sorted() {
                steps.append(.member(key))
                if members[key]!.firstFractionalNumber(below: &steps) { return true }  // key from the dictionary
                steps.removeLast()
            }
            return false
        case .array(let values):
            for (index, value) in values.enumerated() {
                steps.append(.element(index))
                if value.firstFractionalNumber(below: &steps) { return true }
                steps.removeLast()
            }
            return false
        default: return false
        }
    }

    /// How many members all objects in the value hold together.
    var memberCount: Int {
        switch self {
        case .object(let members): members.count + members.values.reduce(0) { $0 + $1.memberCount }
        case .array(let values): values.reduce(0) { $0 + $1.memberCount }
        default: 0
        }
    }

    /// A word for error messages: "a string", "a number", …
    var kind: String {
        switch self {
        case .null: "null"
        case .bool: "a boolean"
        case .integer: "a number"
        // Integral and beyond Int64: sent as a long integer or with an exponent; which, the Double no longer says.
        case .number(let value) where value.rounded() == value && value.magnitude >= 0x1p63:
            "a number that is not a 64-bit integer (\(value))"
        case .number(let value): "a number written with a fraction or an exponent (\(value))"
        case .string: "a string"
        case .array: "an array"
        case .object: "an object"
        }
    }

    /// Compact JSON text, keys sorted, as JSONSerialization would write it.
    public var compactJSON: String {
        var out = ""
        write(to: &out)
        return out
    }

    private func write(to out: inout String) {
        switch self {
        case .null: out += "null"
        case .bool(let flag): out += flag ? "true" : "false"
        case .integer(let value): out += String(value)
        case .number(let value): out += value.isFinite ? "\(value)" : "null"
        case .string(let text): Logger.appendJSONString(text, to: &out)
        case .array(let values):
            out += "["
            for (index, value) in values.enumerated() {
                if index > 0 { out += "," }
                value.write(to: &out)
            }
            out += "]"
        case .object(let members):
            out += "{"
            for (index, key) in members.keys.sorted().enumerated() {
                if index > 0 { out += "," }
                Logger.appendJSONString(key, to: &out)
                out += ":"
                members[key]!.write(to: &out)  // key comes from the dictionary
            }
            out += "}"
        }
    }
}

/// Reads the members of one JSON object field by field, with the API's
/// error codes: `invalid_json` (not a JSON object), `missing_field`,
/// `invalid_field` (wrong type or value) and, from ``finish()``,
/// `unknown_field` for any member nobody asked for — so a typo such as
/// `productId` is never silently signed as an empty value.
public struct FieldReader {
    private let members: [String: JSONValue]
    /// The names read so far, in order (a request has a handful: an array
    /// searched at the end costs less than hashing each name into a set).
    private var consumed: [String] = []
    /// A prefix for field names in errors (`generate_offers[2].`).
    private let path: String
    /// How each top-level member read into a ``JSONValue/number(_:)`` was
    /// written (``JSONReader/Document/topLevelNumbers``), for quoting it as
    /// it was sent; empty for a reader of a nested object.
    private var numberTexts: [String: String] = [:]

    /// Parses `body` as one JSON object whose members must all be in `allowed`.
    ///
    /// The body is read by ``JSONReader``, strictly: it must be UTF-8
    /// (RFC 8259 §8.1), and a member name given twice in one object is
    /// refused (RFC 8259 §4 leaves it to the parser; one that kept the last
    /// value would sign it without a word). An integer is exact when it is
    /// written without a fraction or exponent and lies in `Int64`.
    /// - Parameters:
    ///   - body: UTF-8 JSON bytes.
    ///   - allowed: the field names the request may carry.
    ///   - exactNumbers: as `exact` of ``JSONValue/init(foundation:path:exact:)``;
    ///     false only for a request none of whose numbers is signed.
    /// - Throws: ``APIError`` `invalid_json` (not UTF-8, not JSON, not an
    ///   object, a repeated member name), `invalid_field` for a number that
    ///   would change (``JSONValue/init(foundation:path:exact:)``), or
    ///   `unknown_field` naming the first unknown member.
    public init(json body: [UInt8], allowed: Set<String>, exactNumbers: Bool = true) throws(APIError) {
        try self.init(parsing: body, allowed: allowed, exactNumbers: exactNumbers)
    }

    /// As ``init(json:allowed:exactNumbers:)``, with the range of each
    /// top-level integer member said in place of the 64-bit one when the
    /// member holds a number beyond what signerd reads: a `ttl_seconds` of
    /// `99999999999999999999` is answered "ttl_seconds must be 1 to 3600
    /// seconds …; got 99999999999999999999", the message a value in the
    /// 64-bit range but outside the field's gets.
    /// - Parameters:
    ///   - body: UTF-8 JSON bytes.
    ///   - allowed: the field names the request may carry.
    ///   - integerRanges: member name → what its value must be, worded to
    ///     follow "`name` must be" (`"1 to 3600 seconds"`).
    /// - Throws: as ``init(json:allowed:exactNumbers:)``.
    public init(json body: [UInt8], allowed: Set<String>, integerRanges: [String: String]) throws(APIError) {
        do {
            try self.init(parsing: body, allowed: allowed, exactNumbers: true)
        } catch {
            if let field = error.field, let range = integerRanges[field], let sent = error.numberSent {
                throw APIError(.invalidField, "\(field) must be \(range); got \(sent)", field: field)
            }
            throw error
        }
    }

    private init(parsing body: [UInt8], allowed: Set<String>, exactNumbers: Bool) throws(APIError) {
        if let problem = JSONText.notUTF8(body) {
            throw APIError(.invalidJSON, "the request body is not UTF-8 (\(problem)); send one JSON object encoded as UTF-8 (RFC 8259 §8.1)")
        }
        let document: JSONReader.Document
        do throws(JSONReader.Syntax) {
            document = try JSONReader.read(body, exactNumbers: exactNumbers)
        } catch {
            throw APIError(.invalidJSON, "the request body is not valid JSON (RFC 8259): \(error.reason); send one JSON object")
        }
        // In this order: a body that is no object, then unknown members,
        // before any problem inside a value (`[9223372036854775808]` is
        // "an array"); then a number that would change, a repeated member,
        // and last a number beyond any Double (each the first in the text).
        guard case .object(let members) = document.value else {
            throw APIError(.invalidJSON, "the request body is \(document.value.kind); send one JSON object")
        }
        try Self.refuseUnknown(members.keys, path: "", allowed: allowed)
        if let inexact = document.inexact {
            throw JSONValue.inexact(inexact.text, path: inexact.path)
        }
        if let member = document.repeated, let words = document.repeatedInWords {
            // `field` holds the whole path; the message quotes 200 characters of it.
            throw APIError(.invalidJSON, "the member \(words); send each field once (which value to sign would be ambiguous)", field: member.path)
        }
        if let number = document.beyondDouble {
            let place = number.path.isEmpty ? "the value" : JSONText.shortened(number.path)
            var error = APIError(.invalidField, "\(place) is \(number.text), beyond any number signerd reads (a JSON number must fit a 64-bit double, at most about 1.8e308 in size; "
                                 + "a number that is signed must be an integer from -9223372036854775808 to 9223372036854775807)", field: number.path.isEmpty ? nil : number.path)
            error.numberSent = number.text
            throw error
        }
        self.init(checked: members, path: "")  // unknown members were refused above
        numberTexts = document.topLevelNumbers
    }

    /// How an error names the value of member `name`: ``JSONValue/kind``,
    /// except that a number read as a `Double` (a fraction, an exponent, or
    /// an integer beyond `Int64`) is quoted as it was sent
    /// (`1.796091280327E12`), not as the `Double` it was read into
    /// (`1796091280327.0`, which nobody sent).
    private func described(_ value: JSONValue, _ name: String) -> String {
        // The reader kept the text of the top object's members only, and this
        // is the top object's reader exactly when `path` is empty.
        guard case .number = value, path.isEmpty, let text = numberTexts[name] else { return value.kind }
        if text.utf8.contains(where: { $0 == UInt8(ascii: ".") || $0 | 0x20 == UInt8(ascii: "e") }) {
            return "a number written with a fraction or an exponent (\(text))"
        }
        // Read as a Double where exact integers were not asked for; a text
        // the reader shortened may have had its exponent cut off.
        return text.hasSuffix("…") ? "a number that is not a 64-bit integer (\(text))" : "an integer beyond 64 bits (\(text))"
    }

    /// Reads an object nested in another request.
    /// - Parameters:
    ///   - members: the object's members.
    ///   - path: the prefix for field names in errors.
    ///   - allowed: the field names the object may carry.
    /// - Throws: `unknown_field` naming the first unknown member (sorted).
    public init(members: [String: JSONValue], path: String, allowed: Set<String>) throws(APIError) {
        try Self.refuseUnknown(members.keys, path: path, allowed: allowed)
        self.init(checked: members, path: path)
    }

    /// A reader over members already checked against the allowed names
    /// (by this type's other initializers, or by
    /// ``refuseUnknownInEntries(of:allowed:)`` for an array's entries).
    /// - Parameters:
    ///   - members: the object's members.
    ///   - path: the prefix for field names in errors (`generate_offers[2].`).
    init(checked members: [String: JSONValue], path: String) {
        self.members = members
        self.path = path
        consumed.reserveCapacity(8)  // one allocation for the requests' field counts
    }

    /// `unknown_field` naming the first of `names` (sorted) not in `allowed`.
    private static func refuseUnknown(_ names: some Sequence<String>, path: String, allowed: Set<String>) throws(APIError) {
        // Sorted only when one is unknown: the common request has none.
        guard names.contains(where: { !allowed.contains($0) }) else { return }
        if let first = names.filter({ !allowed.contains($0) }).sorted().first {
            throw unknownField(first, path: path, fields: allowed.sorted())
        }
    }

    /// `unknown_field` for member `name` of the object at `path`, listing
    /// the `fields` it may carry. The message quotes 200 characters of the
    /// name (a 60,000-character one is not sent back in it); `field` holds it whole.
    private static func unknownField(_ name: String, path: String, fields: [String]) -> APIError {
        let owner = path.isEmpty ? "this request" : String(path.dropLast())
        // An empty name is shown as the JSON string it is: the message began " is not a field".
        let shown = name.isEmpty ? "\"\"" : JSONText.shortened(name)
        return APIError(.unknownField, "\(path)\(shown) is not a field of \(owner) (fields are: \(fields.joined(separator: ", "))); check the spelling (snake_case)", field: path + name)
    }

    /// Refuses unknown members in the objects of the array member `name`,
    /// without reading it: unknown fields are reported before missing or
    /// invalid ones (docs/API.md §1), those of a batch's entries included.
    /// Does nothing when `name` is absent or not an array, and skips
    /// entries that are not objects (later reads name those).
    /// - Parameters:
    ///   - name: the array member (`generate_offers`).
    ///   - allowed: the member names each entry may carry.
    /// - Throws: `unknown_field` naming the first unknown member (sorted)
    ///   of the first entry that has one (`generate_offers[1].productId`).
    public func refuseUnknownInEntries(of name: String, allowed: Set<String>) throws(APIError) {
        guard case .array(let entries)? = members[name] else { return }
        for (index, entry) in entries.enumerated() {
            guard case .object(let entryMembers) = entry else { continue }
            try Self.refuseUnknown(entryMembers.keys, path: "\(path)\(name)[\(index)].", allowed: allowed)
        }
    }

    private mutating func take(_ name: String) -> JSONValue? {
        consumed.append(name)
        guard let value = members[name] else { return nil }
        if case .null = value { return nil }
        return value
    }

    /// A required string.
    /// - Throws: `missing_field` when absent or null, `invalid_field` when not a string.
    public mutating func string(_ name: String, _ expectation: String = "") throws(APIError) -> String {
        guard let value = try optionalString(name) else {
            throw APIError(.missingField, "\(path)\(name) is required\(expectation.isEmpty ? "" : ": \(expectation)")", field: path + name)
        }
        return value
    }

    /// An optional string (absent and null are the same).
    /// - Throws: `invalid_field` when present and not a string.
    public mutating func optionalString(_ name: String) throws(APIError) -> String? {
        guard let value = take(name) else { return nil }
        guard case .string(let text) = value else {
            throw APIError(.invalidField, "\(path)\(name) must be a string; got \(described(value, name))", field: path + name)
        }
        return text
    }

    /// An optional integer.
    /// - Throws: `invalid_field` when present and not an integral JSON number.
    public mutating func optionalInteger(_ name: String, _ unit: String = "") throws(APIError) -> Int64? {
        guard let value = take(name) else { return nil }
        guard case .integer(let number) = value else {
            let detail = unit.isEmpty ? "an integer JSON number" : "an integer JSON number (\(unit))"
            throw APIError(.invalidField, "\(path)\(name) must be \(detail); got \(described(value, name))", field: path + name)
        }
        return number
    }

    /// A required boolean.
    /// - Throws: `missing_field`, or `invalid_field` when not `true`/`false`.
    public mutating func bool(_ name: String) throws(APIError) -> Bool {
        guard let value = take(name) else {
            throw APIError(.missingField, "\(path)\(name) is required: true or false", field: path + name)
        }
        guard case .bool(let flag) = value else {
            throw APIError(.invalidField, "\(path)\(name) must be a JSON boolean (true or false); got \(described(value, name))", field: path + name)
        }
        return flag
    }

    /// An optional boolean.
    public mutating func optionalBool(_ name: String) throws(APIError) -> Bool? {
        guard members[name] != nil, members[name] != .null else {
            consumed.append(name)
            return nil
        }
        return try bool(name)
    }

    /// A required JSON object.
    /// - Throws: `missing_field`, or `invalid_field` when not an object.
    public mutating func object(_ name: String) throws(APIError) -> [String: JSONValue] {
        guard let value = take(name) else {
            throw APIError(.missingField, "\(path)\(name) is required: a JSON object", field: path + name)
        }
        guard case .object(let members) = value else {
            throw APIError(.invalidField, "\(path)\(name) must be a JSON object; got \(described(value, name))", field: path + name)
        }
        return members
    }

    /// A required array.
    public mutating func array(_ name: String) throws(APIError) -> [JSONValue] {
        guard let value = take(name) else {
            throw APIError(.missingField, "\(path)\(name) is required: an array", field: path + name)
        }
        guard case .array(let values) = value else {
            throw APIError(.invalidField, "\(path)\(name) must be an array; got \(described(value, name))", field: path + name)
        }
        return values
    }

    /// An optional array of values.
    public mutating func optionalArray(_ name: String) throws(APIError) -> [JSONValue]? {
        guard members[name] != nil, members[name] != .null else {
            consumed.append(name)
            return nil
        }
        return try array(name)
    }

    /// Marks member `name` read without looking at it: a member the
    /// contract says is accepted and ignored, whatever its type.
    public mutating func ignore(_ name: String) {
        consumed.append(name)
    }

    /// Whether the object has a non-null member `name` (does not mark it read).
    public func has(_ name: String) -> Bool {
        guard let value = members[name] else { return false }
        return value != .null
    }

    /// Refuses members nobody read (a safety net behind `allowed`).
    /// - Throws: `unknown_field` naming the first unread member (sorted).
    public func finish() throws(APIError) {
        let unknown = members.keys.filter { !consumed.contains($0) }.sorted()
        if let first = unknown.first {
            throw Self.unknownField(first, path: path, fields: Set(consumed).sorted())
        }
    }
}

/// One step from a JSON value to one inside it: a member of an object (its
/// name decoded) or an element of an array.
enum JSONStep {
    case member(String)
    case element(Int)

    /// The path `steps` lead to from `prefix`, as the API names fields
    /// (`request.items[0].price`; the bare name at the top). A member name
    /// that is not a plain name (see ``appending(_:to:)``) is written as a
    /// JSON string in brackets (`request["a.b"]`, `request[""]`), so that
    /// `{"a":{"b":1},"a.b":2.0}` names `request["a.b"]`, not `request.a.b`.
    static func path(_ steps: [JSONStep], after prefix: String = "") -> String {
        var path = prefix
        for step in steps {
            switch step {
            case .member(let name): appending(name, to: &path)
            case .element(let index): path += "[\(index)]"
            }
        }
        return path
    }

    /// Appends member `name` to `path`: `.name` (bare at the top) when the
    /// name is plain (1 or more of `A-Z a-z 0-9 _ -`, as every field of the
    /// API is), else `["…"]` with the name as a JSON string (RFC 8259 §7
    /// escapes), which no plain name can be mistaken for.
    static func appending(_ name: String, to path: inout String) {
        let plain = !name.isEmpty && name.utf8.allSatisfy { byte in
            switch byte {
            case UInt8(ascii: "a")...UInt8(ascii: "z"), UInt8(ascii: "A")...UInt8(ascii: "Z"),
                 UInt8(ascii: "0")...UInt8(ascii: "9"), UInt8(ascii: "_"), UInt8(ascii: "-"): true
            default: false
            }
        }
        guard !plain else {
            path += path.isEmpty ? name : ".\(name)"
            return
        }
        path += "["
        Logger.appendJSONString(name, to: &path)
        path += "]"
    }
}

extension APIError {
    /// The API error for a field rule broken in HSMSigner.
    public init(_ error: FieldError, prefix: String = "") {
        self.init(Code(rawValue: error.code), error.message, field: prefix + error.field)
    }
}
