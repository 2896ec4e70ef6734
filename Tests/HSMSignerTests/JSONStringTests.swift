import Foundation
import HSMSigner
import TestSupport
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

    /// Log lines carry callers' text (audit_log's product and offer IDs):
    /// a bidirectional control shown raw by a log viewer reorders the rest
    /// of the line and a zero-width one makes two IDs look alike, so log
    /// lines escape format characters (Cf) and the C1 controls; the public
    /// form, used for responses and signed JSON, keeps them.
    @Test("log lines escape C1 controls and format characters (bidi controls, zero-width, BOM, tags) as \\uXXXX and read back the same text; responses keep them")
    func logLinesEscapeInvisible() throws {
        let text = "a\u{202E}b\u{85}c\u{61C}d\u{2066}e\u{200F}f\u{9F}g\u{2069}h \u{202A}\u{2063}é中 pro\u{200B}\u{FEFF}\u{AD}\u{E0041}😀\u{7F}"
        let lines = LineCollector()
        Logger(minimumLevel: .trace) { lines.append($0) }.info("m", ["v": .string(text)])
        let line = try #require(lines.lines.first)
        #expect(line.contains(#""v":"a\u202eb\u0085c\u061cd\u2066e\u200ff\u009fg\u2069h \u202a\u2063é中 pro\u200b\ufeff\u00ad\udb40\udc41😀\u007f""#), "\(line)")
        let decoded = try #require(try JSONSerialization.jsonObject(with: Data(line.utf8)) as? [String: Any])
        #expect(decoded["v"] as? String == text)
        var response = ""
        Logger.appendJSONString(text, to: &response)
        #expect(response == "\"" + text + "\"")
    }

    @Test("escapes have the short forms where JSON has them, lowercase \\uXXXX otherwise")
    func escapeForms() {
        var bytes: [UInt8] = []
        Logger.appendJSONString("a\"b\\c\nd\re\tf\u{1}g\u{1F}h\u{2028}", to: &bytes)
        #expect(String(decoding: bytes, as: UTF8.self) == #""a\"b\\c\nd\re\tf\u0001g\u001fh\u2028""#)
    }
}

