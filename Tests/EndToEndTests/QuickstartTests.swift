import Foundation
import TestSupport
import Testing

/// scripts/quickstart.sh, run end to end on the built debug binaries: a copy
/// of the script beside the real softhsm-setup.sh, with install-deps.sh and
/// `swift` (the release build) stubbed out, since those take minutes.
@Suite("scripts/quickstart.sh")
struct QuickstartTests {
    /// With SIGNERD_DEMO_DIR set the script still said "delete .demo to start afresh".
    @Test("with SIGNERD_DEMO_DIR it signs, verifies, and names that directory, not .demo, to start afresh")
    func demoDirectoryNamed() throws {
        let (result, demo) = try Self.run()
        #expect(result.status == 0, "\(result.stdout)\n\(result.stderr)")
        #expect(result.stdout.contains("Verified OK"), "\(result.stdout)")
        #expect(result.stdout.contains("delete \(demo) to start afresh"), "\(result.stdout)")
        #expect(!result.stdout.contains("delete .demo"), "\(result.stdout)")
        #expect(try Self.issuerID(in: demo) == "00000000-0000-4000-8000-000000000000", "the demo key gets a placeholder issuer ID")
    }

    /// With the user's own key and no ISSUER_ID, the configuration got a
    /// made-up issuer ID: every JWS kind answered 200 with an `iss` Apple
    /// refuses, and nothing said so (an integrator audit).
    @Test("with your own key and no ISSUER_ID, no issuer ID is made up and a note says the JWS kinds need one; ISSUER_ID is written as given")
    func ownKeyIssuer() throws {
        let keys = try TestKeyFiles.make()
        let keyFile = TemporaryDirectory.make(prefix: "signerd-quickstart-key") + "/SubscriptionKey_QUICK00001.p8"
        try FileManager.default.copyItem(atPath: keys.pkcs8Apple, toPath: keyFile)
        let (without, demo) = try Self.run([keyFile])
        #expect(without.status == 0, "\(without.stdout)\n\(without.stderr)")
        #expect(without.stdout.contains("Verified OK"), "\(without.stdout)")
        #expect(try Self.issuerID(in: demo) == nil, "an issuer ID was made up for a real key")
        #expect(without.stdout.contains("note: no ISSUER_ID given: the JWS kinds answer 400"), "\(without.stdout)")
        let issuer = "57246542-96fe-1a63-e053-0824d011072a"
        let (with, again) = try Self.run([keyFile], environment: ["ISSUER_ID": issuer])
        #expect(with.status == 0, "\(with.stdout)\n\(with.stderr)")
        #expect(try Self.issuerID(in: again) == issuer)
        #expect(!with.stdout.contains("note: no ISSUER_ID"), "\(with.stdout)")
    }

    /// The script read the key ID from the file name with a regex of its
    /// own, which refused `SubscriptionKey_<ID> (1).p8` (a browser's second
    /// copy) and `.P8`, names `signctl keys import` takes.
    @Test("the key ID is signctl's reading of the file name: a browser's (1) copy and .P8 sign end to end; a name without one is 64 with a KEY_ID hint, and KEY_ID then works")
    func keyIDFromSignctl() throws {
        let keys = try TestKeyFiles.make()
        let directory = TemporaryDirectory.make(prefix: "signerd-quickstart-key")
        for (name, keyID) in [("SubscriptionKey_QUICK00002 (1).p8", "QUICK00002"), ("AuthKey_QUICK00003.P8", "QUICK00003")] {
            let keyFile = directory + "/" + name
            try FileManager.default.copyItem(atPath: keys.pkcs8Apple, toPath: keyFile)
            let (result, demo) = try Self.run([keyFile])
            #expect(result.status == 0, "\(name): \(result.stdout)\n\(result.stderr)")
            #expect(result.stdout.contains("Verified OK"), "\(name): \(result.stdout)")
            #expect(result.stdout.contains("imported \(keyID) into token "), "\(name): \(result.stdout)")
            #expect(try Self.keyID(in: demo) == keyID, "\(name)")
            #expect(!FileManager.default.fileExists(atPath: demo + "/signctl-import.json"), "the import's configuration is left behind")
        }
        let unnamed = directory + "/my-key.p8"
        try FileManager.default.copyItem(atPath: keys.pkcs8Apple, toPath: unnamed)
        let (refused, _) = try Self.run([unnamed])
        #expect(refused.status == 64, "\(refused.stdout)\n\(refused.stderr)")
        #expect(refused.stderr.contains("error: cannot tell the key ID from the file name"), "\(refused.stderr)")
        #expect(refused.stderr.contains("hint: set KEY_ID=XXXXXXXXXX"), "\(refused.stderr)")
        let (given, demo) = try Self.run([unnamed], environment: ["KEY_ID": "QUICK00004"])
        #expect(given.status == 0 && given.stdout.contains("Verified OK"), "\(given.stdout)\n\(given.stderr)")
        #expect(try Self.keyID(in: demo) == "QUICK00004")
    }

    /// Runs a copy of quickstart.sh (beside the real softhsm-setup.sh) in a
    /// new demo directory, with install-deps.sh and the release build stubbed out.
    static func run(_ arguments: [String] = [], environment: [String: String] = [:]) throws -> (result: (status: Int32, stdout: String, stderr: String), demo: String) {
        let root = TemporaryDirectory.make(prefix: "signerd-quickstart")
        let scripts = root + "/scripts"
        let stubs = root + "/stubs"
        for directory in [scripts, stubs] {
            try FileManager.default.createDirectory(atPath: directory, withIntermediateDirectories: true)
        }
        for script in ["quickstart.sh", "softhsm-setup.sh"] {
            try FileManager.default.copyItem(atPath: Binaries.root + "/scripts/" + script, toPath: scripts + "/" + script)
        }
        let stubbed = [
            scripts + "/install-deps.sh": "#!/bin/sh\nexit 0\n",
            // `swift build -c release --show-bin-path` answers with the binaries the tests use; a build does nothing.
            stubs + "/swift": "#!/bin/sh\ncase \"$*\" in *--show-bin-path*) echo '\(Binaries.directory)' ;; esac\nexit 0\n",
        ]
        for (path, text) in stubbed {
            try text.write(toFile: path, atomically: false, encoding: .utf8)
            chmod(path, 0o755)
        }
        let demo = root + "/my-demo"
        let path = stubs + ":" + (ProcessInfo.processInfo.environment["PATH"] ?? "/usr/bin:/bin")
        let result = runProgram("/bin/bash", [scripts + "/quickstart.sh"] + arguments,
                                environment: environment.merging(["SIGNERD_DEMO_DIR": demo, "PATH": path]) { $1 })
        return (result, demo)
    }

    /// The `key_id` of the one key in the configuration the script wrote.
    static func keyID(in demo: String) throws -> String? {
        let data = try Data(contentsOf: URL(fileURLWithPath: demo + "/signerd.json"))
        let object = try #require(try JSONSerialization.jsonObject(with: data) as? [String: Any])
        return ((object["keys"] as? [[String: Any]])?.first)?["key_id"] as? String
    }

    /// The top-level `issuer_id` of the configuration the script wrote.
    static func issuerID(in demo: String) throws -> String? {
        let data = try Data(contentsOf: URL(fileURLWithPath: demo + "/signerd.json"))
        let object = try #require(try JSONSerialization.jsonObject(with: data) as? [String: Any])
        return object["issuer_id"] as? String
    }
}

@Suite("scripts/softhsm-setup.sh")
struct SoftHSMSetupTests {
    /// With token.object cut short (emptied by a process ended mid-write),
    /// SoftHSM counts the token as a free slot: running the script again
    /// made a new, empty token with the same label beside it, and keys list
    /// said "no keys" instead of showing the damage.
    @Test("run again over a token whose token.object is empty, it refuses (65) naming the directory, and makes no new token")
    func damagedTokenRefused() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-setup")
        let setup = Binaries.root + "/scripts/softhsm-setup.sh"
        let first = runProgram("/usr/bin/env", ["SIGNCTL=\(Binaries.signctl)", setup, directory])
        try #require(first.status == 0, "\(first.stderr)")
        #expect(runProgram("/usr/bin/env", ["SIGNCTL=\(Binaries.signctl)", setup, directory]).status == 0, "run again on a sound token: nothing changes")
        let tokens = try softHSMTokenDirectories(directory + "/tokens")
        try #require(tokens.count == 1, "\(tokens)")
        try Data().write(to: URL(fileURLWithPath: directory + "/tokens/" + tokens[0] + "/token.object"))
        let again = runProgram("/usr/bin/env", ["SIGNCTL=\(Binaries.signctl)", setup, directory])
        #expect(again.status == 65, "\(again.stdout) \(again.stderr)")
        #expect(again.stderr.contains("tokens/\(tokens[0]) holds a SoftHSM token whose token.object is empty or missing"), "\(again.stderr)")
        #expect(try softHSMTokenDirectories(directory + "/tokens").count == 1, "no second token")
        // Cut short but not empty (200 of its 320 bytes): SoftHSM reads no token there either.
        try Data(repeating: 0x41, count: 200).write(to: URL(fileURLWithPath: directory + "/tokens/" + tokens[0] + "/token.object"))
        let cut = runProgram("/usr/bin/env", ["SIGNCTL=\(Binaries.signctl)", setup, directory])
        #expect(cut.status == 65, "\(cut.stdout) \(cut.stderr)")
        #expect(cut.stderr.contains("holds 1 token directories, but SoftHSM reads only 0 tokens there"), "\(cut.stderr)")
        #expect(try softHSMTokenDirectories(directory + "/tokens").count == 1, "no second token")
    }
}
