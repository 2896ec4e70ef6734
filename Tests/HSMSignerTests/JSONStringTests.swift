import Foundation
import HSMSigner
import Testing

@Suite("JSON string literals (responses, JWS headers and claims, log lines)")
struct JSONStringTests {
    /// Every control character, the two characters JSON escapes, DEL,
    /// the JavaScript line breaks and their neighbours, and multi-byte text.
    static let texts: [String] = [
        "",
        "plain",
        String((0..<0x20).map { Character(Unicode.Scalar(UInt8($0))) }),
        "quote \" and backslash \\ and slash /",
        "DEL \u{7F} stays",
        "line\u{2028}para\u{2029}end",
        "not breaks: \u{2027}\u{202A}\u{2063}",
        "é 😀 \u{FEFF} 中文",
        "\u{2028}",
        "trailing \u{E2}",  // U+00E2, whose UTF-8 is C3 A2: no escape
    ]

    @Test("bytes and String forms agree, and JSONSerialization reads back the same text", arguments: texts)
    func roundTrip(text: String) throws {
        var bytes: [UInt8] = []
        Logger.appendJSONString(text, to: &bytes)
        var string = ""
        Logger.appendJSONString(text, to: &string)
        #expect(Array(string.utf8) == bytes)
        let decoded = try JSONSerialization.jsonObject(with: Data(bytes), options: .fragmentsAllowed) as? String
        #expect(decoded == text)
        // No raw control character and no raw U+2028/U+2029 is written.
        #expect(!bytes.contains { $0 < 0x20 })
        #expect(!String(decoding: bytes, as: UTF8.self).unicodeScalars.contains { $0.value == 0x2028 || $0.value == 0x2029 })
    }

    @Test("escapes have the short forms where JSON has them, lowercase \\uXXXX otherwise")
    func escapeForms() {
        var bytes: [UInt8] = []
        Logger.appendJSONString("a\"b\\c\nd\re\tf\u{1}g\u{1F}h\u{2028}", to: &bytes)
        #expect(String(decoding: bytes, as: UTF8.self) == #""a\"b\\c\nd\re\tf\u0001g\u001fh\u2028""#)
    }
}
