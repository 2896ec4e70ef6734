import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

/// How a JSON number is written decides how signerd takes it: an integer
/// written without a fraction or exponent is signed exactly; any other is
/// refused wherever an integer is required. Foundation's parser returns
/// `NSDecimalNumber` for some spellings of either (`1.796013077037E+12`,
/// `-9.223372036854775808E+18`, `-1234567890123456789`), so the type it
/// returns could not tell them apart: `1.796013077037E+12` got the
/// message for an integer out of range, `-9.223372036854775808E+18` in an
/// Advanced Commerce request was signed as an integer, and negative
/// 19-digit integers within Int64 were refused.
@Suite("Number spellings", .serialized)
struct NumberSpellingTests {
    /// Numbers written with a fraction, an exponent or both: e, E, e+, E+,
    /// e-, E-, negative, at and beyond the Int64 edges.
    static let fractional = [
        "1.796013077037E+12", "1.796013077037e+12", "1.796013077037E12", "1796013077037E0", "1796013077037e0",
        "1796013077037E+0", "1796013077037e-0", "17960130770370E-1", "17960130770370e-1", "1796013077037.0",
        "1e12", "1E12", "3E+2", "3e+2", "1.5", "-1.5E-3", "-15e-1", "0E0", "-0.0",
        "-9.223372036854775808E+18", "-9.223372036854775808e+18", "-9223372036854775808E0", "-9223372036854775808.0",
        "9.223372036854775807E+18", "9223372036854775807e0", "9223372036854775807.0", "9.223372036854775808E18",
        "-9.223372036854775809E18", "1.8446744073709551615E19", "12345678901234567890.5",
    ]

    /// Integers written plainly, at the Int64 edges and around 19 digits,
    /// with the compact text signerd signs for them.
    static let integers: [(text: String, signed: String)] = [
        ("9223372036854775807", "9223372036854775807"), ("-9223372036854775808", "-9223372036854775808"),
        ("-9223372036854775807", "-9223372036854775807"), ("-1234567890123456789", "-1234567890123456789"),
        ("-1000000000000000000", "-1000000000000000000"), ("-999999999999999999", "-999999999999999999"),
        ("1796013077037", "1796013077037"), ("0", "0"), ("-0", "0"),
    ]

    static func post(_ daemon: InProcessDaemon, _ path: String, _ text: String) throws -> ClientResponse {
        let client = SignerClient(socketPath: daemon.socketPath)
        defer { client.close() }
        return try client.send("POST", path, body: Array(text.utf8))
    }

    @Test("a number with a fraction or exponent is refused as such: as a timestamp and anywhere in an Advanced Commerce request",
          arguments: fractional)
    func fractionOrExponent(_ number: String) throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let offer = try Self.post(daemon, "/v1/sign/promotional-offer",
                                  #"{"bundle_id":"\#(daemon.bundleID)","product_id":"p","offer_id":"o","timestamp":\#(number)}"#)
        #expect(offer.status == 400 && offer.error?.code == "invalid_field" && offer.error?.field == "timestamp")
        #expect(offer.error?.message.contains("must be an integer JSON number (UNIX time in milliseconds); got a number written with a fraction or an exponent") == true,
                "\(offer.error?.message ?? String(decoding: offer.body, as: UTF8.self))")
        // It quoted the parsed double, "(1796013077037.0)", which was never sent (an integrator audit).
        #expect(offer.error?.message.hasSuffix("got a number written with a fraction or an exponent (\(number))") == true, "\(offer.error?.message ?? "")")
        for (request, field) in [(#"{"n":\#(number)}"#, "request.n"), (#"{"items":[{"price":1},{"price":\#(number)}]}"#, "request.items[1].price")] {
            let commerce = try Self.post(daemon, "/v1/sign/advanced-commerce-request", #"{"bundle_id":"\#(daemon.bundleID)","request":\#(request)}"#)
            #expect(commerce.status == 400 && commerce.error?.code == "invalid_field" && commerce.error?.field == field,
                    "\(String(decoding: commerce.body, as: UTF8.self))")
            #expect(commerce.error?.message.contains("has a fraction or exponent") == true, "\(commerce.error?.message ?? "")")
        }
    }

    @Test("an integer from -2^63 to 2^63 - 1 written plainly is signed exactly in an Advanced Commerce request", arguments: integers)
    func plainInteger(_ number: (text: String, signed: String)) throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        // A fraction elsewhere in the body does not change how this one is read.
        for extra in ["", #","x":"1.5E+3""#] {
            let response = try Self.post(daemon, "/v1/sign/advanced-commerce-request",
                                         #"{"bundle_id":"\#(daemon.bundleID)","request":{"n":\#(number.text)\#(extra)}}"#)
            #expect(response.status == 200, "\(String(decoding: response.body, as: UTF8.self))")
            let token = try response.decode(JWSResponse.self).jws
            let jws = try #require(try CompactJWS.verify(token, publicKey: daemon.publicKey))
            let claims = try #require(try JSONSerialization.jsonObject(with: Data(jws.claims.utf8)) as? [String: Any])
            let encoded = try #require(claims["request"] as? String)
            let request = try #require(Data(base64Encoded: encoded))
            #expect(String(decoding: request, as: UTF8.self) == #"{"n":\#(number.signed)\#(extra)}"#)
        }
    }

    @Test("an integer and a fraction of the same value in one request: each is read by its own spelling")
    func sameValueTwoSpellings() throws {
        let daemon = try InProcessDaemon()
        defer { daemon.stop() }
        let response = try Self.post(daemon, "/v1/sign/advanced-commerce-request",
                                     #"{"bundle_id":"\#(daemon.bundleID)","request":{"a":-9223372036854775808,"b":[-9223372036854775808,-9.223372036854775808E+18]}}"#)
        #expect(response.status == 400 && response.error?.code == "invalid_field" && response.error?.field == "request.b[1]", "\(String(decoding: response.body, as: UTF8.self))")
    }
}
