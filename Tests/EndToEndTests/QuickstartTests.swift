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
        let result = runProgram("/bin/bash", [scripts + "/quickstart.sh"], environment: ["SIGNERD_DEMO_DIR": demo, "PATH": path])
        #expect(result.status == 0, "\(result.stdout)\n\(result.stderr)")
        #expect(result.stdout.contains("Verified OK"), "\(result.stdout)")
        #expect(result.stdout.contains("delete \(demo) to start afresh"), "\(result.stdout)")
        #expect(!result.stdout.contains("delete .demo"), "\(result.stdout)")
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
