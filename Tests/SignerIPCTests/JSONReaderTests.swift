import Foundation
import HSMSigner
@testable import SignerIPC
import Testing

/// signerd's own reader of request bodies (``JSONReader``), against
/// Foundation's `JSONSerialization` where RFC 8259 leaves both nothing to
/// choose, and on the texts RFC 8259 refuses.
@Suite("JSON reader")
struct JSONReaderTests {
    /// A deterministic generator (SplitMix64), so that a failure names a
    /// seed that reproduces it.
    struct SplitMix: RandomNumberGenerator {
        var state: UInt64
        mutating func next() -> UInt64 {
            state &+= 0x9E37_79B9_7F4A_7C15
            var z = state
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            return z ^ (z >> 31)
        }
    }

    /// Pieces of string content, each as JSON writes it: plain ASCII, every
    /// short escape, `\u` escapes (a surrogate pair among them), raw
    /// two-, three- and four-byte UTF-8, and U+2063.
    static let stringPieces = [
        "a", "Z", "09", " ", "offer_id", "\\\"", "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t",
        "\\u0041", "\\u00e9", "\\u20AC", "\\ud83d\\ude00", "\\u0000", "é", "€", "😀", "\u{2063}", "\\u2063", "{", "]", ",", ":",
    ]

    static func string(_ random: inout SplitMix) -> String {
        let count = Int.random(in: 0...6, using: &random)
        return "\"" + (0..<count).map { _ in stringPieces.randomElement(using: &random)! }.joined() + "\""
    }

    static func space(_ random: inout SplitMix) -> String {
        ["", "", " ", "\n", "\t ", "\r\n"].randomElement(using: &random)!
    }

    static func number(_ random: inout SplitMix) -> String {
        switch Int.random(in: 0..<8, using: &random) {
        case 0: return String(Int64.random(in: Int64.min...Int64.max, using: &random))
        case 1: return ["9223372036854775807", "-9223372036854775808", "0", "-0"].randomElement(using: &random)!
        case 2: return String(Int.random(in: -1000...1000, using: &random))
        case 3: return "\(Int.random(in: -999...999, using: &random)).\(Int.random(in: 0...999, using: &random))"
        case 4: return "\(Int.random(in: 1...9, using: &random))e\(Int.random(in: -20...20, using: &random))"
        case 5: return "-\(Int.random(in: 0...9, using: &random)).\(Int.random(in: 1...99, using: &random))E+\(Int.random(in: 0...9, using: &random))"
        case 6: return "0.\(Int.random(in: 0...99_999, using: &random))"
        default: return String(UInt32.random(in: 0...UInt32.max, using: &random))
        }
    }

    /// A random JSON text with no member name repeated in one object.
    static func value(_ random: inout SplitMix, depth: Int) -> String {
        let kind = depth >= 5 ? Int.random(in: 2..<6, using: &random) : Int.random(in: 0..<6, using: &random)
        switch kind {
        case 0:
            var names = Set<String>()
            let members = (0..<Int.random(in: 0...5, using: &random)).compactMap { _ -> String? in
                let name = string(&random)
                // Compared decoded, as the reader and Foundation compare them.
                guard let decoded = try? JSONSerialization.jsonObject(with: Data(name.utf8), options: .fragmentsAllowed) as? String,
                      names.insert(decoded).inserted else { return nil }
                return space(&random) + name + space(&random) + ":" + space(&random) + value(&random, depth: depth + 1) + space(&random)
            }
            return "{" + members.joined(separator: ",") + "}"
        case 1:
            let elements = (0..<Int.random(in: 0...5, using: &random)).map { _ in space(&random) + value(&random, depth: depth + 1) + space(&random) }
            return "[" + elements.joined(separator: ",") + "]"
        case 2: return string(&random)
        case 3: return number(&random)
        case 4: return ["true", "false", "null"].randomElement(using: &random)!
        default: return string(&random)
        }
    }

    /// Foundation's tree as a ``JSONValue``. Its number types do not say
    /// how a number was written, and it returns `NSDecimalNumber` for some
    /// plain integers within `Int64` (`-5916305838422489264`); the
    /// generated texts write every integer plainly and every other number
    /// with a fraction or an exponent of a few digits, which it returns as a
    /// `Double`.
    static func oracle(_ value: Any) throws -> JSONValue {
        switch value {
        case let text as String: return .string(text)
        case let object as [String: Any]: return .object(try object.mapValues(oracle))
        case let array as [Any]: return .array(try array.map(oracle))
        case let decimal as NSDecimalNumber:
            return try .integer(#require(Int64(decimal.stringValue), "a decimal that is no Int64: \(decimal)"))
        case let number as NSNumber:
            switch String(cString: number.objCType) {
            case "c", "B": return .bool(number.boolValue)
            case "d", "f": return .number(number.doubleValue)
            case "Q", "L", "I", "S": return .integer(try #require(Int64(exactly: number.uint64Value)))
            default: return .integer(number.int64Value)
            }
        case is NSNull: return .null
        default: throw APIError(.invalidJSON, "a value JSON does not have: \(value)")
        }
    }

    @Test("reads what Foundation's parser reads, value for value, over 3,000 generated texts", arguments: [1, 2, 3] as [UInt64])
    func agreesWithFoundation(seed: UInt64) throws {
        var random = SplitMix(state: seed)
        for round in 0..<1_000 {
            let text = Self.space(&random) + Self.value(&random, depth: 0) + Self.space(&random)
            let bytes = Array(text.utf8)
            let foundation = try Self.oracle(JSONSerialization.jsonObject(with: Data(bytes), options: .fragmentsAllowed))
            let document = try JSONReader.read(bytes, exactNumbers: true)
            #expect(document.value == foundation, "seed \(seed), text \(round): \(text)")
            #expect(document.inexact == nil && document.repeated == nil && document.beyondDouble == nil, "seed \(seed), text \(round): \(text)")
        }
    }

    @Test("text RFC 8259 refuses is named with what was found and where", arguments: [
        ("", "the text holds no JSON value"),
        ("   \n", "the text holds no JSON value"),
        (#"{"a":01}"#, "the number at byte 5 starts with 0 followed by more digits"),
        (#"{"a":-}"#, "the number at byte 5 is malformed"),
        (#"{"a":1.}"#, "the number at byte 5 is malformed"),
        (#"{"a":.5}"#, "'.' at byte 5 where a value"),
        (#"{"a":+1}"#, "'+' at byte 5 where a value"),
        (#"{"a":1e}"#, "the number at byte 5 is malformed"),
        (#"{"a":"\x"}"#, "'x' at byte 7 cannot follow a backslash"),
        ("{\"a\":\"line\nbreak\"}", "the control character U+000A at byte 10 is inside a string"),
        ("{\"a\":\"tab\there\"}", "the control character U+0009 at byte 9"),
        (#"{"a":1} x"#, "'x' at byte 8 follows the JSON value"),
        (#"{"a":1}{"b":2}"#, "'{' at byte 7 follows the JSON value"),
        (#"{"a" 1}"#, "'1' at byte 5 where a colon after the member name was expected"),
        (#"{"a":1 "b":2}"#, "'\"' at byte 7 where a comma or } after the member's value was expected"),
        (#"[1 2]"#, "'2' at byte 3 where a comma or ] after the array's element was expected"),
        (#"{'a':1}"#, "''' at byte 1 where a member name in double quotes was expected"),
        (#"{a:1}"#, "'a' at byte 1 where a member name in double quotes was expected"),
        (#"{"a":tru}"#, "'t' at byte 5 begins no JSON value"),
        (#"{"a":True}"#, "'T' at byte 5 where a value"),
        (#"{"a":nul"#, "'n' at byte 5 begins no JSON value"),
        (#"{"a":NaN}"#, "'N' at byte 5 where a value"),
        (#"{"a":Infinity}"#, "'I' at byte 5 where a value"),
        (#"{"a":1}/* comment */"#, "'/' at byte 7 follows the JSON value"),
        (#"{"a":"\u12"}"#, "the escape at byte 6 is not \\u followed by four hexadecimal digits"),
        (#"{"a":"\uD83D\u0041"}"#, "the escape \\uD83D at byte 6 is half of a UTF-16 surrogate pair"),
        (#"{"a":[1,]}"#, "a comma directly before } or ] (a trailing comma)"),
        (#"{"a":1,}"#, "a comma directly before } or ] (a trailing comma)"),
        (#"{"a":1,,"b":2}"#, "',' at byte 7 where a member name in double quotes was expected"),
        (#"[,1]"#, "',' at byte 1 where a value"),
        (#"{"a":"x"#, "the text ends inside the string that starts at byte 5"),
        (#"{"a":"x\"#, "the text ends inside the string that starts at byte 5"),
        (#"{"a":"#, "the text ends where a value was expected"),
        (#"{"a""#, "the text ends where a colon after the member name was expected"),
        (#"{"a":1"#, "the text ends where a comma or } after the member's value was expected"),
        (#"[1"#, "the text ends where a comma or ] after the array's element was expected"),
        ("{\"a\":\u{00A0}1}", "a byte 0xC2 at byte 5 where a value"),
    ])
    func refused(text: String, reason: String) {
        let error = #expect(throws: JSONReader.Syntax.self, "\(text)") { _ = try JSONReader.read(Array(text.utf8), exactNumbers: true) }
        #expect(error?.reason.contains(reason) == true, "\(text): \(error?.reason ?? "accepted")")
        // Through the request reader: invalid_json, the same reason.
        let api = #expect(throws: APIError.self) { _ = try FieldReader(json: Array(text.utf8), allowed: ["a", "b"]) }
        #expect(api?.code == .invalidJSON)
        #expect(api?.message == "the request body is not valid JSON (RFC 8259): \(error?.reason ?? ""); send one JSON object")
    }

    @Test("how a number is written decides what it is: Int64 exactly, otherwise the nearest Double, and what neither holds is recorded with its path")
    func numbers() throws {
        func read(_ text: String, exact: Bool = true) throws -> JSONReader.Document { try JSONReader.read(Array(text.utf8), exactNumbers: exact) }
        #expect(try read("-0").value == .integer(0))
        #expect(try read("-9223372036854775808").value == .integer(Int64.min))
        #expect(try read("9223372036854775807").value == .integer(Int64.max))
        #expect(try read("1.0").value == .number(1))
        #expect(try read("1e2").value == .number(100))
        #expect(try read("-0.0").value == .number(-0.0))
        #expect(try read("1e-400").value == .number(0))
        #expect(try read("9007199254740993e0").value == .number(9_007_199_254_740_992))
        let inexact = try read(#"{"a":[1,{"b":9223372036854775808}]}"#)
        #expect(inexact.inexact?.text == "9223372036854775808" && inexact.inexact?.path == "a[1].b")
        #expect(inexact.value == .object(["a": .array([.integer(1), .object(["b": .integer(0)])])]))
        let long = try read("{\"a\":-" + String(repeating: "9", count: 60) + "}")
        #expect(long.inexact?.text == "an integer of 60 digits")
        // Read inexactly (a request none of whose numbers is signed): the nearest Double.
        #expect(try read("18446744073709551616", exact: false).value == .number(18_446_744_073_709_551_616))
        #expect(try read("18446744073709551616", exact: false).inexact == nil)
        let beyond = try read(#"{"x":{"y":[0,-1E400]},"z":1e999}"#)
        #expect(beyond.beyondDouble?.text == "-1E400" && beyond.beyondDouble?.path == "x.y[1]")
        #expect(try read(String(repeating: "1", count: 400)).beyondDouble?.text == String(repeating: "1", count: 200) + "… (200 more characters)")
    }

    @Test("member names are compared decoded: a repeat through an escape is found, with its path; strings keep every character")
    func namesAndStrings() throws {
        let repeated = try JSONReader.read(Array(#"{"o":[{"k":1},{"k":1,"\u006b":2}]}"#.utf8), exactNumbers: true)
        #expect(repeated.repeated?.name == "k" && repeated.repeated?.path == "o[1].k")
        let first = try JSONReader.read(Array(#"{"a":1,"a":2,"b":{"c":1,"c":2}}"#.utf8), exactNumbers: true)
        #expect(first.repeated?.name == "a" && first.repeated?.path == "a")
        let text = try JSONReader.read(Array("\"\u{FEFF}x\\u0000\\ud83d\\ude00\u{2063}\"".utf8), exactNumbers: true)
        #expect(text.value == .string("\u{FEFF}x\u{0000}😀\u{2063}"))
    }

    /// The repeat is found when its value has been read, which puts a repeat
    /// inside that value first unless the reader orders them by where the
    /// names stand: `{"a":1,"a":{"b":1,"b":2}}` was answered with `a.b`.
    @Test("the repeat named is the first in the text, also when the repeated member's value repeats a name of its own", arguments: [
        (#"{"a":1,"a":{"b":1,"b":2}}"#, "a", "a"),
        (#"{"x":[{"k":1,"k":{"z":1,"z":2}}]}"#, "k", "x[0].k"),
        (#"{"a":{"b":1,"b":2},"a":1}"#, "b", "a.b"),
        (#"{"a":1,"b":1,"a":[{"c":{"d":0,"d":0}}],"b":2}"#, "a", "a"),
        (#"{"o":{"p":1,"p":{"q":{"r":1,"r":2},"q":1}}}"#, "p", "o.p"),
    ])
    func firstRepeatInTheText(text: String, name: String, path: String) throws {
        let bytes = Array(text.utf8)
        let document = try JSONReader.read(bytes, exactNumbers: true)
        #expect(document.repeated?.name == name && document.repeated?.path == path, "\(text): \(String(describing: document.repeated))")
        let error = #expect(throws: APIError.self) { _ = try FieldReader(json: bytes, allowed: ["a", "b", "o", "x"]) }
        #expect(error?.code == .invalidJSON && error?.field == path, "\(text): \(error?.message ?? "accepted")")
    }

    /// FieldReader quoted such a number by scanning the body again and
    /// building the path of each number whose last step could end the
    /// member's name; a member named "" ends every name, so numbers in such
    /// members under long names nested deep cost the depth times the names'
    /// length each (timings in the commit). The reader keeps the text as it
    /// reads the number.
    @Test("numbers of the top object read into a Double are kept as written, for messages, whatever is nested beside them")
    func topLevelNumberTexts() throws {
        let long = "0." + String(repeating: "1", count: 60)
        let document = try JSONReader.read(Array(#"{"a":1.796091280327E12,"b":[2.5],"c":{"d":1e2},"e":1,"f":\#(long)}"#.utf8), exactNumbers: true)
        #expect(document.topLevelNumbers == ["a": "1.796091280327E12", "f": String(long.prefix(40)) + "…"])
        #expect(try JSONReader.read(Array(#"{"g":18446744073709551616}"#.utf8), exactNumbers: false).topLevelNumbers == ["g": "18446744073709551616"])
        #expect(try JSONReader.read(Array("[1.5]".utf8), exactNumbers: true).topLevelNumbers.isEmpty)

        let name = String(repeating: "n", count: 1_000)
        let objects = Array(repeating: #"{"":0,"d":0,"id":0,"_id":0,"e_id":0}"#, count: 1_000).joined(separator: ",")
        let body = "{\"request\":" + String(repeating: "{\"\(name)\":", count: 28) + "[" + objects + "]" + String(repeating: "}", count: 28) + ",\"bundle_id\":1.50}"
        let error = #expect(throws: APIError.self) { try AdvancedCommerceSigningRequest(body: Array(body.utf8)) }
        #expect(error?.code == .invalidField && error?.field == "bundle_id")
        #expect(error?.message == "bundle_id must be a string; got a number written with a fraction or an exponent (1.50)")
    }

    /// `/v1/offers` reads its numbers as Doubles (none is signed), so an
    /// integer beyond Int64 arrives as one; it was once described as "a
    /// number written with a fraction or an exponent", which the caller did
    /// not send.
    @Test("an integer beyond Int64 where exact integers are not asked for is named as such, not as a fraction")
    func integerBeyondInt64Wording() throws {
        let top = #expect(throws: APIError.self) {
            try OffersRequest(body: Array(#"{"bundle_id":18446744073709551616,"generate_offers":[{"offer_id":"a","product_id":"b"}]}"#.utf8))
        }
        #expect(top?.message == "bundle_id must be a string; got an integer beyond 64 bits (18446744073709551616)", "\(top?.message ?? "")")
        let long = String(repeating: "9", count: 60)
        let shortened = #expect(throws: APIError.self) {
            try OffersRequest(body: Array(#"{"bundle_id":\#(long)e2,"generate_offers":[{"offer_id":"a","product_id":"b"}]}"#.utf8))
        }
        #expect(shortened?.message == "bundle_id must be a string; got a number that is not a 64-bit integer (\(long.prefix(40))…)", "\(shortened?.message ?? "")")
        let request = try OffersRequest(body: Array(#"{"bundle_id":"com.example","generate_offers":[{"offer_id":1e30,"product_id":"b"},{"offer_id":2.5,"product_id":"b"}]}"#.utf8))
        #expect(request.generateOffers.map { $0.problem?.message ?? "" } == [
            "generate_offers[0].offer_id must be a string; got a number that is not a 64-bit integer (1e+30)",
            "generate_offers[1].offer_id must be a string; got a number written with a fraction or an exponent (2.5)",
        ])
    }

    /// Member names come from the body, and an error message quoted them
    /// whole: a 60,000-character unknown name came back twice, in
    /// `message` and in `field`. A message quotes 200 characters (Unicode
    /// scalars: one combining-mark Character is as long as the body);
    /// `field` keeps the whole name or path, to say which member it is.
    @Test("a message quotes at most 200 characters of a member name or path from the body; field holds it whole", arguments: [
        String(repeating: "x", count: 60_000),
        "e" + String(repeating: "\u{301}", count: 30_000),
    ])
    func longNamesInMessages(long: String) throws {
        let quoted = String(String.UnicodeScalarView(long.unicodeScalars.prefix(200))) + "… (\(long.unicodeScalars.count - 200) more characters)"
        func refused(_ text: String, allowed: Set<String> = ["a"]) -> APIError? {
            #expect(throws: APIError.self) { _ = try FieldReader(json: Array(text.utf8), allowed: allowed) }
        }
        let unknown = refused("{\"\(long)\":1}")
        #expect(unknown?.code == .unknownField && unknown?.field == long)
        #expect(unknown?.message.hasPrefix("\(quoted) is not a field of this request") == true)
        // An API audit: a member named "" gave a message that began " is not a field".
        let empty = refused(#"{"":1}"#)
        #expect(empty?.code == .unknownField && empty?.field == "" && empty?.message.hasPrefix(#""" is not a field of this request"#) == true, "\(String(describing: empty))")
        let entry = #expect(throws: APIError.self) { try OffersRequest(body: Array("{\"bundle_id\":\"a\",\"generate_offers\":[{\"\(long)\":1}]}".utf8)) }
        #expect(entry?.code == .unknownField && entry?.field == "generate_offers[0].\(long)")
        #expect(entry?.message.hasPrefix("generate_offers[0].\(quoted) is not a field of generate_offers[0]") == true)
        // A path writes a name that is not plain (the combining marks) as a JSON string in brackets.
        let member = long.utf8.allSatisfy { $0 == UInt8(ascii: "x") } ? "a." + long : "a[\"" + long + "\"]"
        let repeated = refused("{\"a\":{\"\(long)\":1,\"\(long)\":2}}")
        #expect(repeated?.code == .invalidJSON && repeated?.field == member)
        let path = String(String.UnicodeScalarView(member.unicodeScalars.prefix(200))) + "… (\(member.unicodeScalars.count - 200) more characters)"
        #expect(repeated?.message.hasPrefix("the member \"\(quoted)\" appears more than once in one object (\(path));") == true)
        for problem in [refused("{\"a\":{\"\(long)\":99999999999999999999}}"), refused("{\"a\":{\"\(long)\":1e999}}"), repeated] {
            #expect(problem?.field == member)
            #expect((problem?.message.unicodeScalars.count ?? .max) < 700, "\(problem?.message.unicodeScalars.count ?? 0) scalars")
        }
    }

    /// A fuzzing round found a body shape whose check grew faster than its
    /// size: many numbers under objects nested 30 deep behind long member
    /// names, for each of which a path of every step was hashed twice. The
    /// reader records a path only for the first problem it finds; this
    /// checks the answers for such bodies, and docs/BENCHMARKS.md has the
    /// timings (speed is not asserted in unit tests).
    @Test("deeply nested bodies with long names and many numbers get the answer their first problem calls for")
    func hostileShape() throws {
        let name = String(repeating: "n", count: 1_000)
        func body(_ leaf: String) -> [UInt8] {
            Array(("{\"request\":" + String(repeating: "{\"\(name)\":", count: 29) + leaf + String(repeating: "}", count: 29) + "}").utf8)
        }
        let numbers = "[" + Array(repeating: "1", count: 9_000).joined(separator: ",") + ",2.5]"
        var reader = try FieldReader(json: body(numbers), allowed: ["request"])
        _ = try reader.object("request")
        let fraction = #expect(throws: APIError.self) { try AdvancedCommerceSigningRequest(body: body(numbers).replacing(Array("\"request\"".utf8), with: Array("\"bundle_id\":\"a\",\"request\"".utf8))) }
        #expect(fraction?.code == .invalidField)
        #expect(fraction?.field == "request" + String(repeating: ".\(name)", count: 29) + "[9000]")
        let beyond = #expect(throws: APIError.self) { try FieldReader(json: body("[" + Array(repeating: "1e999", count: 9_000).joined(separator: ",") + "]"), allowed: ["request"]) }
        #expect(beyond?.code == .invalidField)
        #expect(beyond?.field == "request" + String(repeating: ".\(name)", count: 29) + "[0]")
    }
}
