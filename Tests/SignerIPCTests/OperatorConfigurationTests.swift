import Foundation
import HSMSigner
import SignerIPC
import Testing

/// What `signerd --check-config` and `signctl` refuse in `token_uri`.
@Suite("Configuration: token_uri checks for operators")
struct OperatorConfigurationTests {
    @Test("--check-config refuses a pin-source that is not file:/absolute/path, without echoing it")
    func pinSourceNotAFile() throws {
        let json = #"{"token_uri": "pkcs11:token=signer?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=50a0392f0c82a225fa64f846cbd2e48a"}"#
        let error = #expect(throws: ConfigurationError.self) { try SignerConfiguration.parse(Array(json.utf8)) }
        #expect(error?.message.hasPrefix("token_uri") == true, "\(error?.message ?? "no error")")
        #expect(error?.message.contains("file:/absolute/path") == true, "\(error?.message ?? "no error")")
        #expect(error?.message.contains("50a0392f0c82a225fa64f846cbd2e48a") == false, "\(error?.message ?? "")")
    }
}
