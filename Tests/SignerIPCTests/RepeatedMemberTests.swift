import Foundation
@testable import SignerIPC
import Testing

/// Request bodies that name a member twice in one object are refused
/// (`invalid_json`, the name as `field`): Foundation's parser would keep the
/// last value and the daemon would sign it without a word.
@Suite("Repeated member names in request bodies")
struct RepeatedMemberTests {
    static let allowed: Set<String> = ["bundle_id", "product_id", "offer_id", "app_account_token", "generate_offers", "request"]

    @Test("found in the top object, in nested objects, and through escapes", arguments: [
        (#"{"bundle_id":"a","offer_id":"x","offer_id":"y"}"#, "offer_id"),
        (#"{"offer_id":"x", "bundle_id":"a" ,"offer_id" : "y"}"#, "offer_id"),
        (#"{"generate_offers":[{"offer_id":"x","product_id":"p","offer_id":"y"}]}"#, "offer_id"),
        (#"{"request":{"a":{"b":1,"b":2}}}"#, "b"),
        (#"{"offer_id":"x","\u006fffer_id":"y"}"#, "offer_id"),
        (#"{"bundle_id":"a","bundle_id":"a"}"#, "bundle_id"),
    ])
    func repeated(body: String, name: String) {
        #expect(FieldReader.repeatedMemberName(in: Array(body.utf8)) == name)
        do {
            _ = try FieldReader(json: Array(body.utf8), allowed: Self.allowed)
            Issue.record("accepted \(body)")
        } catch {
            #expect(error.code == .invalidJSON)
            #expect(error.field == name)
            #expect(error.message.contains("\"\(name)\" appears more than once"))
        }
    }

    @Test("not found where names differ, sit in sibling objects, or only look like names", arguments: [
        #"{"bundle_id":"a","product_id":"b","offer_id":"c"}"#,
        #"{"generate_offers":[{"offer_id":"x"},{"offer_id":"y"}]}"#,
        #"{"bundle_id":"offer_id","offer_id":"bundle_id"}"#,
        #"{"bundle_id":"a\",\"bundle_id\":\"b","product_id":"{\"x\":1,\"x\":2}"}"#,
        #"{"request":["offer_id","offer_id"],"offer_id":"x"}"#,
        #"{"a":{"x":1},"b":{"x":1}}"#,
    ])
    func notRepeated(body: String) {
        #expect(FieldReader.repeatedMemberName(in: Array(body.utf8)) == nil)
    }

    @Test("stays in bounds on input the parser would refuse")
    func malformed() {
        for body in [#"{"a"#, #"{"a\"#, "}}]]", #"{"a":"#, #"[{"a":1,"a"#, "\""] {
            _ = FieldReader.repeatedMemberName(in: Array(body.utf8))
        }
        #expect(FieldReader.repeatedMemberName(in: Array(#"{"a":1,"a"#.utf8)) == "a")
    }
}
