import Foundation
import HSMSigner
@testable import SignerIPC
import Testing

/// Request bodies that name a member twice in one object are refused
/// (`invalid_json`, the name as `field`): Foundation's parser would keep the
/// last value and the daemon would sign it without a word.
@Suite("Repeated member names in request bodies")
struct RepeatedMemberTests {
    static let allowed: Set<String> = ["bundle_id", "product_id", "offer_id", "app_account_token", "generate_offers", "request"]

    @Test("found in the top object, in nested objects, and through escapes; the field is its path", arguments: [
        (#"{"bundle_id":"a","offer_id":"x","offer_id":"y"}"#, "offer_id", "offer_id"),
        (#"{"offer_id":"x", "bundle_id":"a" ,"offer_id" : "y"}"#, "offer_id", "offer_id"),
        (#"{"generate_offers":[{"offer_id":"x","product_id":"p","offer_id":"y"}]}"#, "offer_id", "generate_offers[0].offer_id"),
        (#"{"generate_offers":[{"offer_id":"x"}, [1, [2, 3]], {"offer_id":"y","product_id":"p","product_id":"q"}]}"#, "product_id", "generate_offers[2].product_id"),
        (#"{"request":{"a":{"b":1,"b":2}}}"#, "b", "request.a.b"),
        (#"{"request":{"list":[{"c":1},{"c":1,"c":2}]}}"#, "c", "request.list[1].c"),
        (#"{"offer_id":"x","\u006fffer_id":"y"}"#, "offer_id", "offer_id"),
        (#"{"bundle_id":"a","bundle_id":"a"}"#, "bundle_id", "bundle_id"),
        // A name that is not plain is written as a JSON string in brackets,
        // so it cannot be read as a path of its own (found by an attack run).
        (#"{"request":{"a":{"b":1},"a.b":1,"a.b":2}}"#, "a.b", #"request["a.b"]"#),
        (#"{"request":{"x":[{"":1,"":2}]}}"#, "", #"request.x[0][""]"#),
        (#"{"request":{"q\"":{"k":1,"k":2}}}"#, "k", #"request["q\""].k"#),
    ])
    func repeated(body: String, name: String, path: String) throws {
        let repeated = try JSONReader.read(Array(body.utf8), exactNumbers: true).repeated
        #expect(repeated?.name == name && repeated?.path == path, "\(String(describing: repeated))")
        do {
            _ = try FieldReader(json: Array(body.utf8), allowed: Self.allowed)
            Issue.record("accepted \(body)")
        } catch {
            #expect(error.code == .invalidJSON)
            #expect(error.field == path)
            #expect(error.message.contains("\"\(name)\" appears more than once"))
        }
    }

    /// An attack round sent an Advanced Commerce `request` with "é" once
    /// precomposed and once as e + U+0301: refused as a repeat (Swift's
    /// `String` compares canonically), with a message that said the same
    /// name was given twice, which its bytes are not.
    @Test("names that differ in bytes but are canonically equivalent are refused, the message giving both spellings' code points")
    func canonicallyEquivalent() throws {
        for body in [#"{"request":{"caf\u00e9":1,"cafe\u0301":2}}"#, "{\"request\":{\"caf\u{E9}\":1,\"cafe\u{301}\":2}}"] {
            let repeated = try #require(try JSONReader.read(Array(body.utf8), exactNumbers: true).repeated, "\(body)")
            #expect(repeated.firstSpelling.map { Array($0.unicodeScalars) } == ["c", "a", "f", "\u{E9}"], "\(repeated)")
            #expect(Array(repeated.name.unicodeScalars) == ["c", "a", "f", "e", "\u{301}"], "\(repeated)")
            let error = #expect(throws: APIError.self) { _ = try FieldReader(json: Array(body.utf8), allowed: Self.allowed) }
            #expect(error?.code == .invalidJSON, "\(String(describing: error))")
            #expect(error?.message.contains("spelled U+63 U+61 U+66 U+E9 and U+63 U+61 U+66 U+65 U+301: one name in Unicode canonical equivalence") == true, "\(error?.message ?? "")")
        }
        // Byte-equal repeats keep the plain message.
        let plain = try #require(try JSONReader.read(Array(#"{"a":1,"a":2}"#.utf8), exactNumbers: true).repeated)
        #expect(plain.firstSpelling == nil)
    }

    @Test("not found where names differ, sit in sibling objects, or only look like names", arguments: [
        #"{"bundle_id":"a","product_id":"b","offer_id":"c"}"#,
        #"{"generate_offers":[{"offer_id":"x"},{"offer_id":"y"}]}"#,
        #"{"bundle_id":"offer_id","offer_id":"bundle_id"}"#,
        #"{"bundle_id":"a\",\"bundle_id\":\"b","product_id":"{\"x\":1,\"x\":2}"}"#,
        #"{"request":["offer_id","offer_id"],"offer_id":"x"}"#,
        #"{"a":{"x":1},"b":{"x":1}}"#,
    ])
    func notRepeated(body: String) throws {
        #expect(try JSONReader.read(Array(body.utf8), exactNumbers: true).repeated == nil)
    }

    @Test("text that ends inside a repeated member is refused as JSON, not read up to the repeat")
    func malformed() {
        for body in [#"{"a"#, #"{"a\"#, "}}]]", #"{"a":"#, #"[{"a":1,"a"#, "\"", #"{"a":1,"a"#] {
            let error = #expect(throws: APIError.self) { _ = try FieldReader(json: Array(body.utf8), allowed: ["a"]) }
            #expect(error?.code == .invalidJSON && error?.message.contains("not valid JSON") == true, "\(body): \(error?.message ?? "accepted")")
        }
    }

    @Test("the count of names in the text matches the parsed members exactly when no name repeats", arguments: [
        (#"{"bundle_id":"a","product_id":"b","offer_id":"c"}"#, 3),
        (#"{"generate_offers":[{"offer_id":"x"},{"offer_id":"y","product_id":"p"}]}"#, 4),
        (#"{"bundle_id":"a\",\"bundle_id\":\"b","request":{"x":[1,{"y":2}]}}"#, 4),
    ])
    func nameCount(body: String, count: Int) throws {
        #expect(JSONText.structure(Array(body.utf8)).memberNames == count)
        let parsed = try JSONValue(foundation: JSONSerialization.jsonObject(with: Data(body.utf8)), path: "")
        #expect(parsed.memberCount == count)
    }

    /// Foundation's parser also reads UTF-16 and UTF-32; a repeated name
    /// written with an escape in such a body got past the byte scan and the
    /// last value was signed.
    @Test("a body that is not UTF-8 is refused before parsing, repeated names or not", arguments: [
        String.Encoding.utf16, .utf16LittleEndian, .utf16BigEndian, .utf32, .utf32LittleEndian, .utf32BigEndian,
    ])
    func notUTF8(encoding: String.Encoding) throws {
        for text in [#"{"bundle_id":"a","offer_id":"w","offer\u005fid":"EVIL"}"#, #"{"bundle_id":"a","offer_id":"w"}"#] {
            let body = try #require(text.data(using: encoding))
            #expect(throws: APIError.self) { _ = try FieldReader(json: Array(body), allowed: Self.allowed) }
            do {
                _ = try FieldReader(json: Array(body), allowed: Self.allowed)
            } catch {
                #expect(error.code == .invalidJSON)
                #expect(error.message.contains("not UTF-8"), "\(error.message)")
            }
        }
        // A UTF-8 byte-order mark is refused too; plain UTF-8 is read.
        let marked = #expect(throws: APIError.self) { _ = try FieldReader(json: [0xEF, 0xBB, 0xBF] + Array(#"{"bundle_id":"a"}"#.utf8), allowed: Self.allowed) }
        #expect(marked?.code == .invalidJSON)
        var reader = try FieldReader(json: Array(#"{"bundle_id":"ä"}"#.utf8), allowed: Self.allowed)
        #expect(try reader.string("bundle_id") == "ä")
    }

    @Test("integers beyond Int64 and numbers only a decimal holds are refused, naming where they sit", arguments: [
        (#"{"request":{"p":18446744073709551615}}"#, "request.p"),
        (#"{"request":{"p":9223372036854775808}}"#, "request.p"),
        (#"{"request":{"a":[1,{"p":-9223372036854775809}]}}"#, "request.a[1].p"),
        (#"{"request":{"p":12345678901234567890123}}"#, "request.p"),
        // Too long for NSDecimalNumber as well: Foundation gives a Double, once described as "written with a fraction or an exponent (1e+166)".
        ("{\"request\":{\"p\":1" + String(repeating: "0", count: 166) + "}}", "request.p"),
        ("{\"request\":{\"p\":-9" + String(repeating: "9", count: 300) + "}}", "request.p"),
    ])
    func inexactNumbers(body: String, field: String) {
        do {
            _ = try FieldReader(json: Array(body.utf8), allowed: Self.allowed)
            Issue.record("accepted \(body)")
        } catch {
            #expect(error.code == .invalidField)
            #expect(error.field == field)
            #expect(error.message.contains("beyond the numbers signerd signs exactly"), "\(error.message)")
        }
    }

    /// `/v1/offers` reads its numbers inexactly (none is signed), yet an
    /// integer of 166 to 309 digits, which Foundation hands over as a
    /// Double, was refused as if it were signed: a `where` clause meant for
    /// both number types bound only one (a fuzzing round).
    @Test("a request read inexactly keeps integers of 166 to 309 digits as numbers instead of refusing them", arguments: [166, 200, 309])
    func longIntegersReadInexactly(digits: Int) throws {
        let body = "{\"request\":{\"p\":" + String(repeating: "1", count: digits) + "}}"
        var reader = try FieldReader(json: Array(body.utf8), allowed: Self.allowed, exactNumbers: false)
        guard case .number(let value)? = try reader.object("request")["p"] else {
            Issue.record("not kept as a number")
            return
        }
        #expect(value > 1e165)
        #expect(throws: APIError.self) { _ = try FieldReader(json: Array(body.utf8), allowed: Self.allowed) }
    }

    /// Foundation takes 512 levels, and the work per value after it grew
    /// with the depth: a 64 KB body 500 deep took 3.5 s (a fuzzing round).
    @Test("arrays and objects nested up to 32 deep are read; deeper is invalid_json naming the limit, before the parser")
    func nestingLimit() throws {
        func nested(_ levels: Int) -> [UInt8] {
            // The body's own object is the first level.
            Array(("{\"request\":" + String(repeating: "[", count: levels - 1) + "1" + String(repeating: "]", count: levels - 1) + "}").utf8)
        }
        var reader = try FieldReader(json: nested(32), allowed: Self.allowed)
        #expect(try reader.array("request").count == 1)
        for levels in [33, 500, 100_000] {
            let error = #expect(throws: APIError.self) { _ = try FieldReader(json: nested(levels), allowed: Self.allowed) }
            #expect(error?.code == .invalidJSON)
            #expect(error?.message.contains("nested more than 32 deep") == true, "\(error?.message ?? "")")
        }
        let objects = Array((String(repeating: "{\"a\":", count: 33) + "1" + String(repeating: "}", count: 33)).utf8)
        #expect(throws: APIError.self) { _ = try FieldReader(json: objects, allowed: ["a"]) }
    }

    /// A field with its own range says that range for a number beyond what
    /// signerd reads, as it does for one in the 64-bit range outside it.
    @Test("ttl_seconds and timestamp beyond the 64-bit range are answered with the field's own range", arguments: [
        ("ttl", #"{"bundle_id":"a","ttl_seconds":99999999999999999999}"#, "ttl_seconds", "ttl_seconds must be 1 to 3600 seconds (Apple refuses tokens that live longer than an hour); got 99999999999999999999"),
        ("ttl", #"{"bundle_id":"a","ttl_seconds":-9223372036854775809}"#, "ttl_seconds", "ttl_seconds must be 1 to 3600 seconds (Apple refuses tokens that live longer than an hour); got -9223372036854775809"),
        ("ttl", #"{"bundle_id":"a","ttl_seconds":1e400}"#, "ttl_seconds", "ttl_seconds must be 1 to 3600 seconds (Apple refuses tokens that live longer than an hour); got 1e400"),
        ("offer", #"{"bundle_id":"a","product_id":"p","offer_id":"o","timestamp":17960912803270000000000}"#, "timestamp",
         "timestamp must be UNIX time in milliseconds (13 digits), within the last 24 hours and at most 5 minutes ahead; got 17960912803270000000000"),
        ("offer", "{\"bundle_id\":\"a\",\"product_id\":\"p\",\"offer_id\":\"o\",\"timestamp\":1" + String(repeating: "0", count: 170) + "}", "timestamp",
         "timestamp must be UNIX time in milliseconds (13 digits), within the last 24 hours and at most 5 minutes ahead; got an integer of 171 digits"),
    ])
    func fieldRangesBeyondInt64(kind: String, body: String, field: String, message: String) {
        do {
            if kind == "ttl" {
                _ = try ServerAPITokenRequest(body: Array(body.utf8))
            } else {
                _ = try PromotionalOfferRequest(body: Array(body.utf8))
            }
            Issue.record("accepted \(body)")
        } catch {
            #expect(error.code == .invalidField)
            #expect(error.field == field)
            #expect(error.message == message)
        }
    }

    @Test("a number beyond Int64 in a field with no range of its own still gets the 64-bit range, and other errors are kept")
    func otherNumbersKeepTheirMessage() {
        let cases: [(String, APIError.Code, String?, String)] = [
            (#"{"bundle_id":99999999999999999999,"product_id":"p","offer_id":"o"}"#, .invalidField, "bundle_id", "beyond the numbers signerd signs exactly"),
            (#"{"bundle_id":"a","ttl_seconds":99999999999999999999,"ttl":1}"#, .unknownField, "ttl", "ttl"),
        ]
        for (body, code, field, fragment) in cases {
            do {
                if body.contains("ttl_seconds") {
                    _ = try ServerAPITokenRequest(body: Array(body.utf8))
                } else {
                    _ = try PromotionalOfferRequest(body: Array(body.utf8))
                }
                Issue.record("accepted \(body)")
            } catch {
                #expect(error.code == code, "\(error.message)")
                #expect(error.field == field, "\(error.message)")
                #expect(error.message.contains(fragment), "\(error.message)")
            }
        }
    }

    /// Foundation's parser refuses a number no Double holds, where RFC 8259
    /// sets no range; the member that holds it is named all the same.
    @Test("numbers no Double holds are refused as invalid_field naming where they sit, not as invalid JSON; other problems keep their own error", arguments: [
        (#"{"product_id":1e309}"#, APIError.Code.invalidField, "product_id", "1e309"),
        (#"{"request":{"a":[1,{"p":-1E400}]},"product_id":1}"#, .invalidField, "request.a[1].p", "-1E400"),
        (#"{"product_id":1e309,"request":{"p":2e400}}"#, .invalidField, "product_id", "1e309"),
        ("{\"request\":{\"p\":" + String(repeating: "9", count: 400) + "}}", .invalidField, "request.p", String(repeating: "9", count: 200) + "… (200 more characters)"),
        // Not JSON for another reason as well: that reason is given.
        (#"{"product_id":1e309,"bundle_id":tru}"#, .invalidJSON, nil, nil),
        (#"{"product_id":1e309,}"#, .invalidJSON, nil, nil),
        // Malformed numbers are not JSON, whatever Double(String) makes of them.
        (#"{"product_id":1e}"#, .invalidJSON, nil, nil),
        (#"{"product_id":-}"#, .invalidJSON, nil, nil),
        (#"{"product_id":1e+}"#, .invalidJSON, nil, nil),
        (#"{"product_id":--1}"#, .invalidJSON, nil, nil),
        (#"{"product_id":01e999}"#, .invalidJSON, nil, nil),
        (#"{"product_id":1.e999}"#, .invalidJSON, nil, nil),
        (#"{"product_id":-.5e999}"#, .invalidJSON, nil, nil),
        // Deeply nested: refused for its depth, quickly (a path per number cost the depth each).
        (#"{"product_id":"# + String(repeating: "[", count: 16_000) + Array(repeating: "1e999", count: 5_000).joined(separator: ",") + String(repeating: "]", count: 16_000) + "}", .invalidJSON, nil, nil),
        // An unknown member, a body that is not an object, a repeated member: the error they get without the number.
        (#"{"product_id":1e309,"productId":"p"}"#, .unknownField, "productId", nil),
        (#"[1e309]"#, .invalidJSON, nil, nil),
        // A body that is no object is said first, before a number in it beyond Int64.
        (#"[9223372036854775808]"#, .invalidJSON, nil, nil),
        ("-9223372036854775809", .invalidJSON, nil, nil),
        (#"1e309"#, .invalidJSON, nil, nil),
        (#"{"product_id":1,"product_id":1e309}"#, .invalidJSON, "product_id", nil),
    ] as [(String, APIError.Code, String?, String?)])
    func numbersBeyondDouble(body: String, code: APIError.Code, field: String?, text: String?) {
        do {
            _ = try FieldReader(json: Array(body.utf8), allowed: Self.allowed)
            Issue.record("accepted \(body)")
        } catch {
            #expect(error.code == code, "\(error.message)")
            #expect(error.field == field, "\(error.message)")
            if let field, let text {
                #expect(error.message.hasPrefix("\(field) is \(text), beyond any number signerd reads (a JSON number must fit a 64-bit double"), "\(error.message)")
            }
        }
    }

    @Test("the ends of Int64 and ordinary numbers are kept exactly")
    func exactNumbers() throws {
        let body = #"{"request":{"max":9223372036854775807,"min":-9223372036854775808,"half":1.5,"zero":0}}"#
        var reader = try FieldReader(json: Array(body.utf8), allowed: Self.allowed)
        let request = try reader.object("request")
        #expect(request["max"] == .integer(Int64.max))
        #expect(request["min"] == .integer(Int64.min))
        #expect(request["half"] == .number(1.5))
        #expect(request["zero"] == .integer(0))
    }
}

/// A U+FEFF sent as raw UTF-8 at the start of a string is kept (Foundation's
/// parser would drop it as a byte-order mark), and nothing that was not JSON
/// becomes JSON on the way.
@Suite("U+FEFF at the start of a string")
struct LeadingByteOrderMarkTests {
    static let mark = "\u{FEFF}"

    func object(_ body: String) throws -> [String: JSONValue] {
        _ = try FieldReader(json: Array(body.utf8), allowed: ["request"])
        guard case .object(let members)? = try JSONValue(foundation: JSONText.parse(Array(body.utf8)).value, path: "") as JSONValue? else {
            throw APIError(.invalidJSON, "not an object")
        }
        return members
    }

    @Test("kept at the start of a value, after an escaped quote or another escape, and twice in a row")
    func kept() throws {
        let members = try object(#"{"request":{"a":"\#(Self.mark)x","b":"\"\#(Self.mark)y","c":"\#(Self.mark)\#(Self.mark)z","d":"\n\#(Self.mark)w","e":"\ufeff\#(Self.mark)v"}}"#)
        #expect(members["request"] == .object(["a": .string(Self.mark + "x"), "b": .string("\"" + Self.mark + "y"), "c": .string(Self.mark + Self.mark + "z"),
                                               "d": .string("\n" + Self.mark + "w"), "e": .string(Self.mark + Self.mark + "v")]))
    }

    @Test("a member name with the mark is another name, and the same name spelled raw and escaped is a repeat")
    func names() throws {
        let other = #expect(throws: APIError.self) { try FieldReader(json: Array(#"{"\#(Self.mark)request":{}}"#.utf8), allowed: ["request"]) }
        #expect(other?.code == .unknownField && other?.field == "\(Self.mark)request", "\(String(describing: other))")
        do {
            _ = try FieldReader(json: Array(#"{"request":{"\#(Self.mark)k":1,"\ufeffk":2}}"#.utf8), allowed: ["request"])
            Issue.record("a repeated name was accepted")
        } catch {
            #expect(error.code == .invalidJSON)
            // Not a plain name: written in brackets, so the mark shows where it is.
            #expect(error.field == "request[\"\(Self.mark)k\"]")
        }
    }

    @Test("still refused where the mark is not JSON: after a backslash, outside strings")
    func stillInvalid() {
        for body in [#"{"request":{"a":"\\#(Self.mark)"}}"#, #"{"request":{"a":"x"\#(Self.mark)}}"#, #"{"request":\#(Self.mark){}}"#] {
            let error = #expect(throws: APIError.self, "\(body)") { try FieldReader(json: Array(body.utf8), allowed: ["request"]) }
            #expect(error?.code == .invalidJSON, "\(body)")
        }
    }
}
