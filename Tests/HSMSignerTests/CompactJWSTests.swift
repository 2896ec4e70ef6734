import Foundation
@testable import HSMSigner
import TestSupport
import Testing

@Suite("Compact JWS (ES256)")
struct CompactJWSTests {
    @Test("header and claims serialize deterministically, members sorted")
    func deterministic() {
        #expect(CompactJWS.header(keyID: "ABC123DEFG") == #"{"alg":"ES256","kid":"ABC123DEFG","typ":"JWT"}"#)
        let claims: [String: ClaimValue] = ["iss": .string("i"), "iat": .integer(1_790_800_914), "allowIntroductoryOffer": .bool(false), "bid": .string("com.exämple\"app")]
        #expect(CompactJWS.claimsJSON(claims) == #"{"allowIntroductoryOffer":false,"bid":"com.exämple\"app","iat":1790800914,"iss":"i"}"#)
        // RFC 7515 §7.1: BASE64URL(header) "." BASE64URL(payload), from the exact texts above.
        #expect(CompactJWS.signingInput(keyID: "K", claims: claims)
                == Base64URL.encode(Array(#"{"alg":"ES256","kid":"K","typ":"JWT"}"#.utf8)) + "." + Base64URL.encode(Array(#"{"allowIntroductoryOffer":false,"bid":"com.exämple\"app","iat":1790800914,"iss":"i"}"#.utf8)))
    }

    @Test("base64url: no padding, URL alphabet, round trip; standard Base64 refused", arguments: 0..<40)
    func base64url(length: Int) throws {
        let bytes = (0..<length).map { UInt8(truncatingIfNeeded: $0 * 37 + 250) }
        let text = Base64URL.encode(bytes)
        #expect(!text.contains("=") && !text.contains("+") && !text.contains("/"))
        #expect(Base64URL.decode(text) == bytes)
        let standard = Data(bytes).base64EncodedString()
        if standard.contains("=") || standard.contains("+") || standard.contains("/") {
            #expect(Base64URL.decode(standard) == nil)
        }
    }

    @Test("base64url decoding is strict: non-zero unused bits and 4n+1 lengths refused", arguments: 1..<40)
    func base64urlCanonical(length: Int) throws {
        let bytes = (0..<length).map { UInt8(truncatingIfNeeded: $0 * 53 + 7) }
        let text = Base64URL.encode(bytes)
        let alphabet = Array("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")
        let unusedBits = length % 3 == 1 ? 0x0f : length % 3 == 2 ? 0x03 : 0
        let last = try #require(alphabet.firstIndex(of: text.last!))
        // Each last character that differs only in the unused bits would decode to the same bytes if they were ignored.
        for bits in 1..<(unusedBits + 1) {
            let sibling = String(text.dropLast()) + String(alphabet[last | bits])
            #expect(Base64URL.decode(sibling) == nil, "\(sibling)")
        }
        #expect(Base64URL.decode(String(repeating: "A", count: 4 * (length / 4) + 1)) == nil, "4n + 1 characters encode no whole bytes")
    }

    @Test("a JWS part that is not canonical base64url is malformed, and the part is named")
    func nonCanonicalPartNamed() throws {
        let header = Base64URL.encode(Array(#"{"alg":"ES256","kid":"K","typ":"JWT"}"#.utf8))
        let claims = Base64URL.encode(Array(#"{"iss":"x"}"#.utf8))
        let signature = Base64URL.encode([UInt8](repeating: 0x11, count: 64))
        // 2 characters left over carry 4 unused bits, 3 carry 2: Q = 010000 → R = 010001, 0 = 110100 → 1 = 110101.
        #expect(signature.last == "Q" && header.last == "Q" && claims.last == "0")
        let cases: [(String, String)] = [
            ("\(header).\(claims).\(signature.dropLast())R", "the signature (part 3)"),
            ("\(header.dropLast())R.\(claims).\(signature)", "the header (part 1)"),
            ("\(header).\(claims.dropLast())1.\(signature)", "the claims (part 2)"),
        ]
        for (token, part) in cases {
            let error = #expect(throws: JWSError.self) { try CompactJWS.decode(token) }
            #expect(error?.code == "jws_base64url")
            #expect(error?.message.hasPrefix(part) == true, "\(error?.message ?? "no error")")
        }
    }

    @Test("decode names malformed tokens, other algorithms and DER signatures")
    func decodeErrors() throws {
        let header = Base64URL.encode(Array(#"{"alg":"ES256","kid":"K","typ":"JWT"}"#.utf8))
        let claims = Base64URL.encode(Array(#"{"iss":"x"}"#.utf8))
        let raw = [UInt8](repeating: 0x11, count: 64)
        #expect(try CompactJWS.decode("\(header).\(claims).\(Base64URL.encode(raw))").keyID == "K")
        let cases: [(String, String)] = [
            ("a.b", "jws_format"),
            ("\(header).\(claims).a+b=", "jws_base64url"),
            ("\(Base64URL.encode(Array(#"{"alg":"HS256"}"#.utf8))).\(claims).\(Base64URL.encode(raw))", "jws_alg"),
            ("\(Base64URL.encode(Array("[]".utf8))).\(claims).\(Base64URL.encode(raw))", "jws_json"),
            ("\(header).\(claims).\(Base64URL.encode(try ECDSASignature.der(fromRaw: raw, curve: .p256)))", "jws_signature_der"),
            ("\(header).\(claims).\(Base64URL.encode(Array(raw.prefix(63))))", "jws_signature_length"),
        ]
        for (token, code) in cases {
            let error = #expect(throws: JWSError.self) { try CompactJWS.decode(token) }
            #expect(error?.code == code, "\(token)")
        }
        let short = #expect(throws: JWSError.self) { try CompactJWS.assemble(signingInput: "a.b", rawSignature: Array(raw.prefix(63))) }
        #expect(short?.code == "jws_signature_length")
    }

    @Test("decode takes only UTF-8 JSON: UTF-16, a byte-order mark or a trailing comma is jws_json, a comma in a string is not")
    func decodeStrictJSON() throws {
        let signature = Base64URL.encode([UInt8](repeating: 0x11, count: 64))
        let header = Array(#"{"alg":"ES256","kid":"K","typ":"JWT"}"#.utf8)
        let claims = Array(#"{"iss":"x"}"#.utf8)
        func token(_ header: [UInt8], _ claims: [UInt8]) -> String {
            "\(Base64URL.encode(header)).\(Base64URL.encode(claims)).\(signature)"
        }
        // Foundation's parser reads each of these; signctl verify jws --json printed them as is, which is not JSON.
        let refused: [(String, String)] = [
            ("trailing comma in the header", token(Array(#"{"alg":"ES256","kid":"K",}"#.utf8), claims)),
            ("trailing comma in a claim's array", token(header, Array(#"{"a":[1, ] }"#.utf8))),
            ("UTF-16 header", token(Array(#"{"alg":"ES256"}"#.utf16.flatMap { [UInt8($0 & 0xff), UInt8($0 >> 8)] }), claims)),
            ("byte-order mark before the claims", token(header, [0xEF, 0xBB, 0xBF] + claims)),
        ]
        for (name, text) in refused {
            let error = #expect(throws: JWSError.self, "\(name)") { try CompactJWS.decode(text) }
            #expect(error?.code == "jws_json", "\(name)")
        }
        let commaInString = try CompactJWS.decode(token(header, Array(#"{"a":",}","b":"\\\",]"}"#.utf8)))
        #expect(commaInString.claims == #"{"a":",}","b":"\\\",]"}"#)
    }

    @Test("a JWS signed through SoftHSM verifies; a changed claim does not")
    func signThroughToken() throws {
        let token = try SoftHSMFixture.shared.makeToken("jws")
        let hsm = try TokenTests.open(token)
        defer { hsm.close() }
        let files = try TestKeyFiles.make()
        _ = try hsm.importKey(ECPrivateKeyMaterial(contentsOf: files.pkcs8Apple), keyID: "JWS0000001", replace: false)
        let input = CompactJWS.signingInput(keyID: "JWS0000001", claims: ["aud": .string("promotional-offer"), "iat": .integer(1)])
        let signature = try hsm.sign(digest: SHA256.hash(Array(input.utf8)), keyID: "JWS0000001")
        let jws = try CompactJWS.assemble(signingInput: input, rawSignature: signature.raw)
        let publicKey = try ECPublicKey(pem: files.publicKeyPEM)
        #expect(try CompactJWS.verify(jws, publicKey: publicKey) != nil)
        var parts = jws.split(separator: ".").map(String.init)
        parts[1] = Base64URL.encode(Array(#"{"aud":"promotional-offer","iat":2}"#.utf8))
        #expect(try CompactJWS.verify(parts.joined(separator: "."), publicKey: publicKey) == nil)
    }
}
