import Foundation
import SignerIPC
import Testing

/// Response shapes the contract fixes member by member.
@Suite("wire format")
struct WireFormatTests {
    @Test("GET /v1/keys: issuer_id and public_key_pem are present as null when unknown")
    func keysNullMembers() throws {
        let key = KeysResponse.Key(keyID: "ABC123DEFG", issuerID: nil, bundleIDs: ["com.example.app"], curve: "P-256", publicKeyPEM: nil, tokenLabel: "signer")
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.sortedKeys]
        let text = String(decoding: try encoder.encode(KeysResponse(keys: [key])), as: UTF8.self)
        #expect(text.contains(#""issuer_id":null"#), "\(text)")
        #expect(text.contains(#""public_key_pem":null"#), "\(text)")
        // And it reads back.
        let decoded = try JSONDecoder().decode(KeysResponse.self, from: Data(text.utf8))
        #expect(decoded.keys == [key])
    }
}
