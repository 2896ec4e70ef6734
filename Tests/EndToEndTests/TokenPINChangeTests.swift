import Foundation
import TestSupport
import Testing

/// The PIN-change runbook had no command for the token itself; operators
/// reached for OpenSC's `pkcs11-tool`, PINs on its command line included.
@Suite("signctl token change-pin")
struct TokenPINChangeTests {
    @Test("changes the user PIN with C_SetPIN: the old PIN is refused after, the new one signs; a PIN the token cannot take, or the same PIN (65), changes nothing")
    func changePIN() throws {
        let daemon = try DaemonHarness()
        let pinFile = try CheckConfigTests().pinPath(daemon)
        let oldPIN = try String(contentsOfFile: pinFile, encoding: .utf8)
        let newPIN = (0..<8).map { _ in String(format: "%02x", UInt8.random(in: 0...255)) }.joined()
        let newFile = daemon.directory + "/new.pin"
        let environment = ["SOFTHSM2_CONF": daemon.softHSMConf]

        try writeSecretFile(newFile, "123\n")
        let tooShort = runSignctl(["--config", daemon.configPath, "token", "change-pin", "--new-pin-file", newFile], environment: environment)
        // Bad input (65): the token refused nothing; scripts read 77 as "the current PIN is wrong".
        #expect(tooShort.status == 65, "\(tooShort.stderr)")
        #expect(tooShort.stderr.contains("shorter") && tooShort.stderr.contains("nothing was changed"), "\(tooShort.stderr)")
        #expect(runSignctl(["--config", daemon.configPath, "keys", "list"], environment: environment).status == 0, "the old PIN still works")

        try writeSecretFile(newFile, oldPIN)
        let same = runSignctl(["--config", daemon.configPath, "token", "change-pin", "--new-pin-file", newFile], environment: environment)
        // Bad input (65), not a PIN the token refused (77, "signctl does not retry a refused PIN"): nothing reached the token.
        #expect(same.status == 65, "\(same.stderr)")
        #expect(same.stderr.hasPrefix("error: the new PIN (--new-pin-file \(newFile)) is the same as the current one, from the PIN file \(pinFile)"), "\(same.stderr)")
        #expect(same.stderr.contains("nothing was sent to the token") && !same.stderr.contains("pin_rejected") && !same.stderr.contains("retry"), "\(same.stderr)")
        #expect(!same.stdout.contains("changed the user PIN"), "\(same.stdout)")

        try writeSecretFile(newFile, newPIN + "\n")
        let changed = runSignctl(["--config", daemon.configPath, "token", "change-pin", "--new-pin-file", newFile], environment: environment)
        #expect(changed.status == 0, "\(changed.stderr)")
        #expect(changed.stdout.contains("changed the user PIN of token"), "\(changed.stdout)")
        // With the shipped unit (LoadCredential=) a reload reads systemd's old copy of the PIN: the next step is a restart.
        #expect(changed.stdout.contains("systemctl restart signerd"), "\(changed.stdout)")
        for output in [tooShort.stdout, tooShort.stderr, same.stdout, same.stderr, changed.stdout, changed.stderr] {
            #expect(!output.contains(newPIN) && !output.contains(oldPIN.trimmingCharacters(in: .whitespacesAndNewlines)), "no PIN in the output")
        }
        let refused = runSignctl(["--config", daemon.configPath, "keys", "list"], environment: environment)
        #expect(refused.status == 77, "the old PIN is refused now: \(refused.stderr)")

        try writeSecretFile(pinFile, newPIN + "\n")
        try daemon.start()
        defer { daemon.stop() }
        let publicKey = try #require(daemon.keys["ABC123DEFG"]).publicKeyPEM
        #expect(try signAndVerify(daemon.client(), keyID: "ABC123DEFG", publicKeyPEM: publicKey), "signerd logs in with the new PIN and signs")

        // Back to the old PIN, as a script would, reading --json.
        try writeSecretFile(newFile, oldPIN)
        let back = runSignctl(["--config", daemon.configPath, "token", "change-pin", "--new-pin-file", newFile, "--json"], environment: environment)
        #expect(back.status == 0, "\(back.stderr)")
        let entry = try #require(try? JSONSerialization.jsonObject(with: Data(back.stdout.utf8)) as? [String: Any], "\(back.stdout)")
        #expect(entry["pin_changed"] as? Bool == true && (entry["token_label"] as? String)?.isEmpty == false, "\(entry)")
        #expect(!back.stdout.contains(newPIN) && !back.stdout.contains(oldPIN.trimmingCharacters(in: .whitespacesAndNewlines)), "no PIN in the output")
        try writeSecretFile(pinFile, oldPIN)
        #expect(runSignctl(["--config", daemon.configPath, "keys", "list"], environment: environment).status == 0, "the old PIN logs in again")
    }

    /// Under a small file size limit the login itself cut SoftHSM's token
    /// file short, C_SetPIN answered CKR_OK, and signctl said "changed the
    /// user PIN" about a token that was gone.
    @Test("under a file size limit smaller than the token file, change-pin refuses before it logs in (78), and the token survives")
    func notStored() throws {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.initializeToken(label: "pin-not-stored")
        let config = try hsm.config(label: "pin-not-stored", pinPath: pin)
        let newFile = try hsm.pinFile("new-pin", "0123456789abcdef")
        // SIGXFSZ ignored: writes past 100 bytes fail with EFBIG, as on a full disk.
        let run = runProgram("/bin/sh", ["-c", "trap '' XFSZ; exec \"$@\"", "sh", "/usr/bin/prlimit", "--fsize=100",
                                         Binaries.signctl, "--config", config, "token", "change-pin", "--new-pin-file", newFile], environment: hsm.environment)
        // The login rewrites SoftHSM's token file (320 bytes) first: cut at
        // 100 bytes it would be gone before C_SetPIN. signctl looks first.
        #expect(run.status == 78, "\(run.stdout) \(run.stderr)")
        #expect(run.stderr.contains("file_size_limit: the file size limit (ulimit -f, LimitFSIZE=) is 100 bytes, smaller than SoftHSM's token file"), "\(run.stderr)")
        #expect(runSignctl(["--config", config, "keys", "list"], environment: hsm.environment).status == 0, "the token survives, the old PIN logs in")
        #expect(!run.stdout.contains("changed the user PIN"), "\(run.stdout)")
        #expect(!run.stdout.contains("0123456789abcdef") && !run.stderr.contains("0123456789abcdef"), "no PIN in the output")
    }
}
