import SignerIPC
import Testing

@Suite("Command-line arguments: UTF-8")
struct ArgumentEncodingTests {
    /// `--product-id $'p\xff'` reached the payload as "p\u{FFFD}" and was signed.
    @Test("a word that is not valid UTF-8 is refused, naming the option", arguments: [
        ([Array("--product-id".utf8), [0x70, 0xff]], "the argument after --product-id is not valid UTF-8"),
        ([Array("--product-id=p".utf8) + [0xc3]], "the value of --product-id is not valid UTF-8"),
        ([Array("keys".utf8), Array("export-public".utf8), [0xed, 0xa0, 0x80]], "argument 3 is not valid UTF-8"),
    ])
    func refused(_ words: [[UInt8]], _ expected: String) throws {
        let error = #expect(throws: UsageError.self) { try Arguments.checkUTF8(words) }
        #expect(error?.message == expected)
    }

    @Test("UTF-8 words pass, non-ASCII included")
    func accepted() throws {
        try Arguments.checkUTF8([Array("--offer-id".utf8), Array("ä€😀".utf8), []])
    }
}
