import Foundation
@testable import HSMSigner
import SignerIPC
import TestSupport
import Synchronization
import Testing

/// Runs the built signctl with `environment` added, never throwing.
/// - Returns: the exit status, stdout and stderr.
func runSignctl(_ arguments: [String], environment extra: [String: String] = [:]) -> (status: Int32, stdout: String, stderr: String) {
    runProgram(Binaries.signctl, arguments, environment: extra)
}

/// The token directories in SoftHSM's `tokens` directory: not signctl's
/// lock file (``SoftHSMFiles/lockFileName``), which SoftHSM ignores too.
func softHSMTokenDirectories(_ tokens: String) throws -> [String] {
    try FileManager.default.contentsOfDirectory(atPath: tokens).filter { $0 != SoftHSMFiles.lockFileName }.sorted()
}

/// Runs `executable` with `environment` added to this process's, never throwing.
/// - Returns: the exit status, stdout and stderr.
func runProgram(_ executable: String, _ arguments: [String], environment extra: [String: String] = [:]) -> (status: Int32, stdout: String, stderr: String) {
    let result = runProgram(executable, arguments, environment: extra, killAfter: nil)
    return (result.status, result.stdout, result.stderr)
}

/// Runs `executable` as `runProgram(_:_:environment:)` does, and kills it
/// (SIGKILL) should it still run `seconds` after its start, so that a hung
/// program fails its test instead of hanging the suite.
/// - Parameter seconds: the bound; nil for none.
/// - Returns: the exit status (the signal's number when a signal ended it),
///   stdout, stderr, and whether the bound was reached and the program killed.
func runProgram(_ executable: String, _ arguments: [String], environment extra: [String: String] = [:],
                killAfter seconds: Double?) -> (status: Int32, stdout: String, stderr: String, timedOut: Bool) {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: executable)
    process.arguments = arguments
    process.environment = ProcessInfo.processInfo.environment.merging(extra) { _, new in new }
    let output = Pipe()
    let errors = Pipe()
    process.standardOutput = output
    process.standardError = errors
    do { try process.run() } catch { return (-1, "", "\(error)", false) }
    let watch = ProgramWatch(pid: process.processIdentifier)
    if let seconds {
        DispatchQueue.global().asyncAfter(deadline: .now() + seconds) { watch.killUnlessFinished() }
    }
    let out = output.fileHandleForReading.readDataToEndOfFile()
    let err = errors.fileHandleForReading.readDataToEndOfFile()
    process.waitUntilExit()
    let timedOut = watch.finish()
    return (process.terminationStatus, String(decoding: out, as: UTF8.self), String(decoding: err, as: UTF8.self), timedOut)
}

/// The state `runProgram(_:_:environment:killAfter:)` shares with its timer:
/// whether the program ended (its pid is then not signalled, as it may be
/// another process's by then) and whether the timer killed it.
private final class ProgramWatch: Sendable {
    private let pid: pid_t
    private let state = Mutex((finished: false, killed: false))

    init(pid: pid_t) { self.pid = pid }

    /// The timer's side: SIGKILL to a program not yet seen to end.
    func killUnlessFinished() {
        state.withLock { state in
            guard !state.finished else { return }
            kill(pid, SIGKILL)
            state.killed = true
        }
    }

    /// The runner's side, once the program has ended; returns whether the timer killed it.
    func finish() -> Bool {
        state.withLock { state in
            state.finished = true
            return state.killed
        }
    }
}

/// A SoftHSM token directory of its own, with one free slot, for `signctl token init`.
struct FreeSoftHSM {
    let directory: String
    let environment: [String: String]
    let modulePath = ProcessInfo.processInfo.environment["SIGNERD_TEST_SOFTHSM_MODULE"] ?? "/usr/lib/softhsm/libsofthsm2.so"

    init() throws {
        directory = TemporaryDirectory.make(prefix: "signerd-init")
        try FileManager.default.createDirectory(atPath: directory + "/tokens", withIntermediateDirectories: true)
        try "directories.tokendir = \(directory)/tokens\nobjectstore.backend = file\nlog.level = ERROR\n"
            .write(toFile: directory + "/softhsm2.conf", atomically: false, encoding: .utf8)
        environment = ["SOFTHSM2_CONF": directory + "/softhsm2.conf"]
    }

    /// Writes a 0600 PIN file and returns its path.
    func pinFile(_ name: String, _ pin: String) throws -> String {
        try writeSecretFile(directory + "/" + name, pin)
        return directory + "/" + name
    }

    /// Runs `signctl token init` for a token `label` (SO PIN 12345678) and
    /// returns the path of its user PIN's file (87654321).
    func initializeToken(label: String) throws -> String {
        let soPIN = try pinFile("so-pin", "12345678")
        let pin = try pinFile("pin", "87654321")
        let initialized = runSignctl(["token", "init", "--label", label, "--pin-file", pin, "--so-pin-file", soPIN, "--module", modulePath], environment: environment)
        try #require(initialized.status == 0, "\(initialized.stderr)")
        return pin
    }

    /// A configuration file whose token_uri names `label` with the PIN in `pinPath`.
    /// The socket goes in `socketDirectory` (this directory unless given),
    /// so that signerd, which checks the socket path before it opens the
    /// token, gets as far as the token.
    func config(label: String, pinPath: String, socketDirectory: String? = nil) throws -> String {
        let path = directory + "/signerd.json"
        try #"{"token_uri": "pkcs11:token=\#(label)?module-path=\#(modulePath)&pin-source=file:\#(pinPath)", "socket_path": "\#(socketDirectory ?? directory)/signerd.sock"}"#
            .write(toFile: path, atomically: false, encoding: .utf8)
        return path
    }
}

/// `signctl`, `signctl keys` and `signctl sign` printed their usage on
/// stdout and exited 64: a usage error with nothing on stderr, against the
/// CLI convention (`error: …` and a hint on stderr, exit 64).
@Suite("signctl usage errors")
struct SignctlUsageTests {
    @Test("a missing command is a usage error on stderr: error line, hint, exit 64, nothing on stdout", arguments: [
        ([], "error: no command given", "hint: run signctl --help"),
        (["keys"], "error: signctl keys needs a command: import, list, export-public, delete", "hint: run signctl keys --help"),
        (["token"], "error: signctl token needs a command: init, change-pin", "hint: run signctl token --help"),
        (["sign"], "error: signctl sign needs a command: promotional-offer,", "hint: run signctl sign --help"),
        (["verify"], "error: signctl verify needs a command: promotional-offer, jws", "hint: run signctl verify --help"),
        (["keys", "rotate"], "error: unknown command keys rotate", "hint: signctl keys commands: import, list, export-public, delete"),
        // A CLI audit: an option where the command goes was "unknown command keys --yes".
        (["keys", "--yes", "delete"], "error: signctl keys needs a command before its options (--yes): import, list,", "hint: run signctl keys --help"),
        // It said "unknown command --bogus".
        (["--bogus", "keys", "list"], "error: unknown option --bogus before the command", "hint: before the command: --config FILE, --json, --final-try"),
    ])
    func missingCommand(arguments: [String], error: String, hint: String) {
        let run = runSignctl(arguments)
        #expect(run.status == 64)
        #expect(run.stdout.isEmpty, "\(run.stdout)")
        #expect(run.stderr.hasPrefix(error), "\(run.stderr)")
        #expect(run.stderr.contains("\n" + hint), "\(run.stderr)")
    }

    /// A CLI audit: `signctl --json` was "unknown option --json before the
    /// command", and `signctl --json keys` or `signctl keys --json list`
    /// "unknown command keys --json", where plain `signctl` and `signctl
    /// keys` name what is missing.
    @Test("--json with a missing command: the same error as without it, on stderr and as JSON on stdout", arguments: [
        (["--json"], "no command given"),
        (["--json", "keys"], "signctl keys needs a command before its options (--json): import, list, export-public, delete"),
        (["keys", "--json", "list"], "signctl keys needs a command before its options (--json): import, list, export-public, delete"),
        (["--json", "verify"], "signctl verify needs a command before its options (--json): promotional-offer, jws"),
    ])
    func missingCommandJSON(arguments: [String], message: String) throws {
        let run = runSignctl(arguments)
        #expect(run.status == 64)
        #expect(run.stderr.hasPrefix("error: \(message)\n"), "\(run.stderr)")
        let object = try #require(try JSONSerialization.jsonObject(with: Data(run.stdout.utf8)) as? [String: Any])
        let error = try #require(object["error"] as? [String: Any])
        #expect(error["message"] as? String == message && error["code"] as? String == "usage", "\(run.stdout)")
    }

    /// The last --config won, so `keys delete` could reach another token than the one meant.
    @Test("--config given twice, in any form and place, is a usage error naming both", arguments: [
        ["--config", "/tmp/a.json", "health", "--config", "/tmp/b.json"],
        ["--config=/tmp/a.json", "keys", "delete", "ABC123DEFG", "--config", "/tmp/b.json"],
        ["health", "--config", "/tmp/a.json", "--config=/tmp/b.json"],
    ])
    func configTwice(arguments: [String]) {
        let run = runSignctl(arguments)
        #expect(run.status == 64)
        #expect(run.stderr.hasPrefix("error: --config is given twice (/tmp/a.json and /tmp/b.json)"), "\(run.stderr)")
        #expect(run.stderr.contains("\nhint: "), "\(run.stderr)")
    }

    @Test("--help is not an error: usage on stdout, exit 0", arguments: [["--help"], ["-h"], ["keys", "--help"], ["sign", "-h"]])
    func help(arguments: [String]) {
        let run = runSignctl(arguments)
        #expect(run.status == 0)
        #expect(run.stdout.hasPrefix("usage:"), "\(run.stdout)")
        #expect(run.stderr.isEmpty, "\(run.stderr)")
    }
}

@Suite("signctl token init: PIN length and half-initialized tokens", .serialized)
struct SignctlTokenInitTests {
    /// An empty or 40-byte --label was exit 78 "invalid_uri", though no URI is involved.
    @Test("a --label outside 1 to 32 bytes is a usage error (64) with a hint; the token stays free", arguments: ["", String(repeating: "l", count: 33), String(repeating: "é", count: 17)])
    func labelLength(_ label: String) throws {
        let hsm = try FreeSoftHSM()
        let soPIN = try hsm.pinFile("so-pin", "12345678")
        let pin = try hsm.pinFile("pin", "87654321")
        let refused = runSignctl(["token", "init", "--label", label, "--pin-file", pin, "--so-pin-file", soPIN, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(refused.status == 64, "\(refused.stderr)")
        #expect(refused.stderr.hasPrefix("error: --label is \(label.utf8.count) bytes; a token label is 1 to 32 bytes"), "\(refused.stderr)")
        #expect(refused.stderr.contains("\nhint: "), "\(refused.stderr)")
        let made = runSignctl(["token", "init", "--label", String(repeating: "l", count: 32), "--pin-file", pin, "--so-pin-file", soPIN, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(made.status == 0, "32 bytes is a label: \(made.stderr)")
    }

    /// C_InitPIN refused a 3-byte PIN after C_InitToken had run, leaving a
    /// token without a user PIN that a second run called "already initialized".
    @Test("a user PIN shorter than ulMinPinLen is refused before C_InitToken; the token stays free")
    func shortPINRefusedFirst() throws {
        let hsm = try FreeSoftHSM()
        let soPIN = try hsm.pinFile("so-pin", "12345678")
        let short = try hsm.pinFile("short-pin", "123")
        let refused = runSignctl(["token", "init", "--label", "short", "--pin-file", short, "--so-pin-file", soPIN, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(refused.status == 65, "\(refused.stderr)")
        #expect(refused.stderr.contains("the user PIN (--pin-file) is shorter than token short takes: 4 to 255 bytes"), "\(refused.stderr)")
        #expect(refused.stderr.contains("nothing was changed"))
        #expect(refused.stderr.contains("error: pin_invalid: ") && !refused.stderr.contains("pin_rejected"), "the token refused no login: \(refused.stderr)")
        #expect(!refused.stderr.contains("123\n") && !refused.stderr.contains(" 123"), "the PIN is never shown")
        let good = try hsm.pinFile("pin", "87654321")
        let done = runSignctl(["token", "init", "--label", "short", "--pin-file", good, "--so-pin-file", soPIN, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(done.status == 0, "\(done.stderr)")
        #expect(done.stdout.hasPrefix("initialized token short"), "the token was still free: \(done.stdout)")
        let list = runSignctl(["--config", try hsm.config(label: "short", pinPath: good), "keys", "list"], environment: hsm.environment)
        #expect(list.status == 0, "\(list.stderr)")
        #expect(list.stdout.contains("no keys on token short"))
    }

    /// A CLI audit: `signctl --json token init` was "unknown option --json",
    /// though the serial it prints is what a provisioning script wants.
    @Test("token init --json: the label, the serial and the outcome, initialized then already_initialized")
    func initJSON() throws {
        let hsm = try FreeSoftHSM()
        let soPIN = try hsm.pinFile("so-pin", "12345678")
        let pin = try hsm.pinFile("pin", "87654321")
        var serials: [String] = []
        for expected in ["initialized", "already_initialized"] {
            let run = runSignctl(["--json", "token", "init", "--label", "json", "--pin-file", pin, "--so-pin-file", soPIN, "--module", hsm.modulePath], environment: hsm.environment)
            #expect(run.status == 0, "\(run.stderr)")
            let object = try #require(try JSONSerialization.jsonObject(with: Data(run.stdout.utf8)) as? [String: String], "\(run.stdout)")
            #expect(object["token_label"] == "json" && object["outcome"] == expected && object["serial"]?.isEmpty == false, "\(run.stdout)")
            serials.append(object["serial"] ?? "")
        }
        #expect(serials[0] == serials[1])
    }

    @Test("the same PIN file for the user and the SO PIN initializes the token with a warning on stderr")
    func samePINs() throws {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.pinFile("both-pin", "12345678")
        let done = runSignctl(["token", "init", "--label", "same", "--pin-file", pin, "--so-pin-file", pin, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(done.status == 0, "\(done.stderr)")
        #expect(done.stdout.hasPrefix("initialized token same"), "\(done.stdout)")
        #expect(withoutRootTokenWarning(done.stderr).hasPrefix("warning: the user PIN (--pin-file \(pin)) and the SO PIN (--so-pin-file \(pin)) are the same: "), "\(done.stderr)")
        #expect(!done.stderr.contains("12345678"), "the PIN is never shown")
        let other = try hsm.pinFile("so-pin", "87654321")
        let apart = runSignctl(["token", "init", "--label", "apart", "--pin-file", pin, "--so-pin-file", other, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(apart.status == 0 && withoutRootTokenWarning(apart.stderr).isEmpty, "\(apart.stderr)")
    }

    /// `stderr` less the warning `token init` gives as root on a host with a
    /// `signerd` user (tested in `tokenInitAsRootWarns`).
    func withoutRootTokenWarning(_ stderr: String) -> String {
        stderr.split(separator: "\n", omittingEmptySubsequences: false)
            .filter { !($0.hasPrefix("warning: token ") && $0.contains(" was made as root, in ")) }.joined(separator: "\n")
    }

    @Test("a token without a user PIN: keys list exits 78 with a hint, and token init sets the user PIN")
    func halfInitialized() throws {
        // C_InitToken alone, in this process through HSMSigner's function table, as the old
        // signctl left a token after C_InitPIN failed. signctl inherits this process's SOFTHSM2_CONF.
        let (token, config) = try tokenConfig("half", userPIN: false)
        let list = runSignctl(["--config", config, "keys", "list"])
        #expect(list.status == 78, "\(list.stderr)")
        #expect(list.stderr.contains("CKR_USER_PIN_NOT_INITIALIZED"), "\(list.stderr)")
        #expect(list.stderr.contains("hint: the token has no user PIN"), "\(list.stderr)")
        let repaired = runSignctl(["token", "init", "--label", token.label, "--pin-file", token.pinPath, "--so-pin-file", token.soPINPath, "--module", token.modulePath])
        #expect(repaired.status == 0, "\(repaired.stderr)")
        #expect(repaired.stdout.contains("without a user PIN") && repaired.stdout.contains("set the user PIN"), "\(repaired.stdout)")
        let after = runSignctl(["--config", config, "keys", "list"])
        #expect(after.status == 0, "\(after.stderr)")
        #expect(after.stdout.contains("no keys on token \(token.label)"))
    }
}

/// A fresh token of the shared SoftHSM fixture (this process's
/// SOFTHSM2_CONF, which signctl inherits) and a configuration naming it;
/// `userPIN: false` leaves the token without a user PIN.
func tokenConfig(_ prefix: String, userPIN: Bool = true) throws -> (token: SoftHSMFixture.Token, configPath: String) {
    let token = try SoftHSMFixture.shared.makeToken(prefix, userPIN: userPIN)
    let path = TemporaryDirectory.make(prefix: "signerd-ops") + "/signerd.json"
    try #"{"token_uri": "\#(token.uri)"}"#.write(toFile: path, atomically: false, encoding: .utf8)
    return (token, path)
}

/// `token` opened in this process, without logs, to look at (or change)
/// what signctl left on it from the outside.
func inProcessToken(_ token: SoftHSMFixture.Token) throws -> HSMToken {
    var options = TokenOptions()
    options.logger = .disabled
    return try HSMToken(uri: PKCS11URI(token.uri), options: options)
}

@Suite("signctl keys import: the key ID in Apple's file name")
struct SignctlKeyIDTests {
    /// `--key-id ABC123DEFG AuthKey_ZZZ999YYYX.p8` imported under the wrong ID.
    @Test("a --key-id unlike the file name's is refused (64) unless --force-key-id; without --key-id the name's is used")
    func keyIDFromName() throws {
        let (_, config) = try tokenConfig("keyid")
        let files = try TestKeyFiles.make()
        let named = files.directory + "/AuthKey_ZZZ999YYYX.p8"
        try FileManager.default.copyItem(atPath: files.pkcs8Apple, toPath: named)
        let refused = runSignctl(["--config", config, "keys", "import", "--key-id", "ABC123DEFG", named])
        #expect(refused.status == 64, "\(refused.stderr)")
        #expect(refused.stderr.contains("--key-id ABC123DEFG differs from the key ID ZZZ999YYYX in the file name"), "\(refused.stderr)")
        #expect(refused.stderr.contains("--force-key-id"))
        // A CLI audit: --force-key-id alone was accepted, and meant nothing.
        let alone = runSignctl(["--config", config, "keys", "import", "--force-key-id", named])
        #expect(alone.status == 64 && alone.stderr.hasPrefix("error: --force-key-id needs --key-id"), "\(alone.stderr)")
        let forced = runSignctl(["--config", config, "keys", "import", "--key-id", "ABC123DEFG", "--force-key-id", named])
        #expect(forced.status == 0, "\(forced.stderr)")
        #expect(forced.stdout.hasPrefix("imported ABC123DEFG"))
        // One key, one key ID: remove the forced import before the name's.
        #expect(runSignctl(["--config", config, "keys", "delete", "ABC123DEFG", "--yes"]).status == 0)
        let fromName = runSignctl(["--config", config, "keys", "import", named])
        #expect(fromName.status == 0, "\(fromName.stderr)")
        #expect(fromName.stdout.hasPrefix("imported ZZZ999YYYX"))
        let same = runSignctl(["--config", config, "keys", "import", "--key-id", "ZZZ999YYYX", "--replace", named])
        #expect(same.status == 0, "\(same.stderr)")
        // A CLI audit: this said "(replaced the old key)", though the key is the one the token held.
        #expect(same.stdout.hasPrefix("imported ZZZ999YYYX into token keyid") && same.stdout.contains("(it already held this key; its objects were written again)"), "\(same.stdout)")
    }
}

@Suite("signctl keys import: one key, one key ID")
struct SignctlDuplicateKeyTests {
    /// The same private key imported under a second key ID went through without a word.
    @Test("a key already on the token under another key ID is refused (65) naming it; --replace of its own ID works; --allow-duplicate-key imports it")
    func duplicateKey() throws {
        let (_, config) = try tokenConfig("dupkey")
        let files = try TestKeyFiles.make()
        let other = try TestKeyFiles.make()
        func importing(_ arguments: [String]) -> (status: Int32, stdout: String, stderr: String) {
            runSignctl(["--config", config, "keys", "import"] + arguments)
        }
        func keyIDs() throws -> [String] {
            let list = runSignctl(["--config", config, "keys", "list", "--json"])
            let entries = try #require(try JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [[String: Any]], "\(list.stderr)")
            return entries.compactMap { $0["key_id"] as? String }
        }
        #expect(importing(["--key-id", "DUPKEY0001", files.sec1]).status == 0)
        // The same key in another form (PKCS#8 without the public key): the public point is what is compared.
        let refused = importing(["--key-id", "DUPKEY0002", files.pkcs8NoPublicKey])
        #expect(refused.status == 65, "\(refused.stderr)")
        #expect(refused.stderr.contains("error: key_duplicate: this key is already on token"), "\(refused.stderr)")
        #expect(refused.stderr.contains("as key ID DUPKEY0001 ") && refused.stderr.contains("nothing was changed"), "\(refused.stderr)")
        #expect(refused.stderr.contains("hint: ") && refused.stderr.contains("--allow-duplicate-key"), "\(refused.stderr)")
        #expect(try keyIDs() == ["DUPKEY0001"], "nothing was created for DUPKEY0002")

        let replaced = importing(["--key-id", "DUPKEY0001", "--replace", "--json", files.sec1])
        #expect(replaced.status == 0, "\(replaced.stderr)")
        let entry = try #require(try JSONSerialization.jsonObject(with: Data(replaced.stdout.utf8)) as? [String: Any], "\(replaced.stdout)")
        #expect(entry["replaced"] as? Bool == true)
        #expect(replaced.stderr.isEmpty, "\(replaced.stderr)")

        let allowed = importing(["--key-id", "DUPKEY0002", "--allow-duplicate-key", files.sec1])
        #expect(allowed.status == 0, "\(allowed.stderr)")
        #expect(allowed.stdout.hasPrefix("imported DUPKEY0002"), "\(allowed.stdout)")
        #expect(allowed.stderr.contains("note: the same key is also on token") && allowed.stderr.contains("as key ID DUPKEY0001 (--allow-duplicate-key)"), "\(allowed.stderr)")
        #expect(try keyIDs() == ["DUPKEY0001", "DUPKEY0002"])

        // --replace of a third key ID with this key is still a duplicate, and that key stays.
        #expect(importing(["--key-id", "DUPKEY0003", other.sec1]).status == 0)
        let onto = importing(["--key-id", "DUPKEY0003", "--replace", files.sec1])
        #expect(onto.status == 65, "\(onto.stderr)")
        #expect(onto.stderr.contains("as key ID DUPKEY0001, DUPKEY0002 "), "\(onto.stderr)")
        #expect(runSignctl(["--config", config, "keys", "export-public", "DUPKEY0003"]).stdout == other.publicKeyPEM)
    }
}

@Suite("signctl: small things an operator meets")
struct SignctlCosmeticsTests {
    @Test("bench states its --duration bound, checks --key-id with --direct, refuses --endpoint with --direct", arguments: [
        (["bench", "--duration", "1e9"], "--duration must be seconds, more than 0 and at most 86400 (one day); got 1e9"),
        (["bench", "--duration", "100000"], "at most 86400"),
        (["bench", "--direct", "--key-id", "bad"], "--key-id must be 10 characters A-Z0-9"),
        (["bench", "--direct", "--endpoint", "promotional-offer"], "--endpoint does not apply to --direct"),
        // Swift's Double(_:) reads hexadecimal and exponents; 0x10 ran for 16 s and 1e-9 completed nothing, exit 0.
        (["bench", "--duration", "0x10"], "--duration must be seconds, more than 0 and at most 86400 (one day); got 0x10"),
        (["bench", "--duration", "1e-9"], "got 1e-9"),
        // A batch names no key: --key-id was accepted and ignored.
        (["bench", "--endpoint", "offers", "--key-id", "ABC123DEFG"], "--key-id does not apply to --endpoint offers"),
        // /healthz carries no signature: --verify was accepted and reported "verified": true.
        (["bench", "--endpoint", "healthz", "--verify"], "--verify does not apply to --endpoint healthz"),
    ])
    func benchUsage(_ arguments: [String], _ expected: String) throws {
        // No configuration exists: each must be refused before it is read.
        let result = runSignctl(["--config", "/nonexistent/signerd.json"] + arguments)
        #expect(result.status == 64, "\(result.stderr)")
        #expect(result.stderr.contains(expected), "\(result.stderr)")
    }

    @Test("a --json behind -- is a positional: refused, and no JSON error object on stdout")
    func jsonAfterSeparator() throws {
        let result = runSignctl(["--config", "/nonexistent/signerd.json", "bench", "--requests", "5", "--", "--json"])
        #expect(result.status == 64, "\(result.stderr)")
        #expect(result.stderr.contains("unexpected argument --json"), "\(result.stderr)")
        #expect(result.stdout.isEmpty, "\(result.stdout)")
    }

    @Test("bench checks its descriptor limit first: refused (64) naming both limits when the hard limit is too low")
    func benchDescriptorLimit() throws {
        // 500 connections under a hard limit of 128: before, each connection
        // that got EMFILE was counted as the daemon's `socket` error (exit 69).
        let result = runProgram("/usr/bin/prlimit", ["--nofile=128:128", Binaries.signctl, "--config", "/nonexistent/signerd.json", "bench", "--concurrency", "500"])
        #expect(result.status == 64, "\(result.stderr)")
        #expect(result.stderr.contains("--concurrency 500 needs about 564 open descriptors in signctl, and this process may open 128 (hard limit 128)"), "\(result.stderr)")
    }

    /// Four imports at once: one succeeded, the others failed with
    /// CKR_OBJECT_HANDLE_INVALID or "token not found … restore the copy of
    /// its token directory"; a parallel keys list failed C_Login with
    /// CKR_GENERAL_ERROR. SoftHSM rewrites its token files at C_Login and at
    /// every write, so signctl commands on the same SoftHSM tokens now run
    /// one at a time.
    @Test("signctl commands run at once on one SoftHSM token all succeed: four imports --replace of one key ID, then six keys list; one key is left")
    func concurrentCommands() throws {
        let (_, config) = try tokenConfig("concurrent")
        let files = try (0..<4).map { _ in try TestKeyFiles.make() }
        let imports = Mutex<[(Int32, String)]>([])
        DispatchQueue.concurrentPerform(iterations: files.count) { index in
            let run = runSignctl(["--config", config, "keys", "import", "--replace", "--key-id", "RACEKEY001", "--force-key-id", files[index].pkcs8Apple])
            imports.withLock { $0.append((run.status, run.stderr)) }
        }
        for (status, stderr) in imports.withLock({ $0 }) {
            #expect(status == 0, "\(stderr)")
        }
        let lists = Mutex<[(Int32, String)]>([])
        DispatchQueue.concurrentPerform(iterations: 6) { _ in
            let run = runSignctl(["--config", config, "keys", "list", "--json"])
            lists.withLock { $0.append((run.status, run.stderr + run.stdout)) }
        }
        for (status, output) in lists.withLock({ $0 }) {
            #expect(status == 0, "\(output)")
        }
        let listed = runSignctl(["--config", config, "keys", "list", "--json"])
        let keys = try #require(try? JSONSerialization.jsonObject(with: Data(listed.stdout.utf8)) as? [[String: Any]], "\(listed.stdout)")
        #expect(keys.count == 1 && keys.first?["key_id"] as? String == "RACEKEY001", "\(listed.stdout)")
    }

    /// Takes signctl's SoftHSM token lock of the test tokens from this
    /// process, as another signctl would; closing the descriptor frees it.
    static func holdTokenLock() throws -> (directory: String, descriptor: Int32) {
        let directory = try #require(SoftHSMFiles.tokenDirectory(module: "/usr/lib/softhsm/libsofthsm2.so"))
        let descriptor = open(directory + "/" + SoftHSMFiles.lockFileName, O_RDWR | O_CREAT | O_CLOEXEC, 0o600)
        try #require(descriptor >= 0 && flock(descriptor, LOCK_EX) == 0)
        return (directory, descriptor)
    }

    @Test("a signctl that finds the SoftHSM token lock held says who holds it, waits, and goes on once it is free")
    func waitsForTheLock() throws {
        let (_, config) = try tokenConfig("lock-wait")
        let (directory, holder) = try Self.holdTokenLock()
        let released = Thread { usleep(1_500_000); close(holder) }
        released.start()
        let listed = runSignctl(["--config", config, "keys", "list"])
        #expect(listed.status == 0, "\(listed.stderr)")
        #expect(listed.stderr.hasPrefix("waiting: another process (PID \(getpid())"), "\(listed.stderr)")
        #expect(listed.stderr.contains("holds the lock on the SoftHSM tokens in \(directory)"), "\(listed.stderr)")
    }

    /// Ctrl-C while waiting for the lock was held like one during a write:
    /// signctl waited for the lock, then imported, then died.
    @Test("Ctrl-C while signctl waits for the SoftHSM token lock stops it at once, having changed nothing")
    func interruptedWhileWaiting() throws {
        let (token, config) = try tokenConfig("lock-interrupt")
        let holder = try Self.holdTokenLock().descriptor
        defer { close(holder) }
        let files = try TestKeyFiles.make()
        let started = MonotonicClock.now()
        let (_, stderr) = try SignctlInterruptTests.interrupted(["--config", config, "keys", "import", "--key-id", "INTR000001", "--force-key-id", files.pkcs8Apple], after: 0.7)
        let seconds = Double(MonotonicClock.now() - started) / 1e9
        #expect(seconds < 5, "stopped \(seconds) s after it started, with the lock still held")
        #expect(stderr.contains("stopped while waiting for the lock on the SoftHSM tokens") && stderr.contains("nothing was changed"), "\(stderr)")
        // It said "writing to the token: stopping once the write is done" while nothing was being written.
        #expect(stderr.hasPrefix("waiting: another process") && stderr.contains("\nstopping: nothing was written yet\n") && !stderr.contains("writing to the token"), "\(stderr)")
        // Nor "now that the command has run to its end": it was stopped before it began.
        #expect(!stderr.contains("run to its end"), "\(stderr)")
        let hsm = try inProcessToken(token)  // signerd's own code takes no lock
        defer { hsm.close() }
        #expect(throws: HSMError.self, "the key was imported") { try hsm.publicKey(keyID: "INTR000001") }
    }

    /// A key file with a certificate or other text before the key imported without a word.
    @Test("keys import of a file with text before the key imports it and warns on stderr; a plain file gets no warning")
    func importWarnsOfOtherText() throws {
        let (_, config) = try tokenConfig("other-text")
        let files = try TestKeyFiles.make()
        let mixed = TemporaryDirectory.make(prefix: "signerd-ops") + "/AuthKey_OTHERTEXT1.p8"
        try writeSecretFile(mixed, files.publicKeyPEM + (try String(contentsOfFile: files.pkcs8Apple, encoding: .utf8)))
        let warned = runSignctl(["--config", config, "keys", "import", mixed])
        #expect(warned.status == 0, "\(warned.stderr)")
        #expect(warned.stderr.hasPrefix("warning: \(mixed) holds more than the private key"), "\(warned.stderr)")
        #expect(warned.stderr.contains("key ID OTHERTEXT1"), "\(warned.stderr)")
        let plain = runSignctl(["--config", config, "keys", "import", "--replace", "--key-id", "OTHERTEXT1", files.pkcs8Apple, "--force-key-id"])
        #expect(plain.status == 0 && !plain.stderr.contains("warning:"), "\(plain.stderr)")
    }

    /// A .p8 with a public key (or anything) after its END line imported,
    /// OpenSSL ignoring what follows the key.
    @Test("keys import of a file with data after its END line is refused (65, --json too) before the token is touched")
    func importRefusesTrailingData() throws {
        let (_, config) = try tokenConfig("trailing")
        let files = try TestKeyFiles.make()
        let appended = TemporaryDirectory.make(prefix: "signerd-ops") + "/AuthKey_TRAILING01.p8"
        try writeSecretFile(appended, try String(contentsOfFile: files.pkcs8Apple, encoding: .utf8) + files.publicKeyPEM)
        let refused = runSignctl(["--config", config, "keys", "import", appended])
        #expect(refused.status == 65, "\(refused.stderr)")
        #expect(refused.stderr.hasPrefix("error: key_file_invalid: the key file goes on after its -----END PRIVATE KEY----- line: a -----BEGIN PUBLIC KEY----- block ("), "\(refused.stderr)")
        #expect(refused.stdout.isEmpty, "\(refused.stdout)")
        let json = runSignctl(["--config", config, "keys", "import", "--json", appended])
        #expect(json.status == 65, "\(json.stderr)")
        let failure = try #require(try JSONSerialization.jsonObject(with: Data(json.stdout.utf8)) as? [String: [String: Any]], "\(json.stdout)")
        #expect(failure["error"]?["code"] as? String == "key_file_invalid" && failure["error"]?["exit_code"] as? Int == 65, "\(json.stdout)")
        // Read before any configuration or token: a configuration that does not exist is never reached (78).
        let unreached = runSignctl(["--config", "/nonexistent/signerd.json", "keys", "import", appended])
        #expect(unreached.status == 65, "\(unreached.stderr)")
        let list = runSignctl(["--config", config, "keys", "list", "--json"])
        let entries = try #require(try JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [Any], "\(list.stdout) \(list.stderr)")
        #expect(entries.isEmpty, "nothing was imported: \(list.stdout)")
    }

    @Test("keys import --json says replaced as a boolean; keys delete counts objects in words")
    func importJSONAndDelete() throws {
        let (_, config) = try tokenConfig("cosmetic")
        let files = try TestKeyFiles.make()
        for (replace, expected) in [(false, false), (true, true)] {
            let result = runSignctl(["--config", config, "keys", "import", "--key-id", "COSMETIC01", "--json"] + (replace ? ["--replace"] : []) + [files.pkcs8OpenSSL])
            #expect(result.status == 0, "\(result.stderr)")
            let object = try #require(try JSONSerialization.jsonObject(with: Data(result.stdout.utf8)) as? [String: Any])
            #expect(object["replaced"] as? Bool == expected, "\(result.stdout)")
            #expect(!result.stdout.contains("\"true\"") && !result.stdout.contains("\"false\""))
        }
        let deleted = runSignctl(["--config", config, "keys", "delete", "COSMETIC01", "--yes"])
        #expect(deleted.stdout.contains("(2 objects)"), "\(deleted.stdout)")
        #expect(!deleted.stderr.contains("key_still_configured"), "COSMETIC01 is not in keys[]: \(deleted.stderr)")
    }

    @Test("a signctl argument that is not valid UTF-8 is refused (64), naming the option")
    func notUTF8() throws {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: "/bin/bash")
        // bash's printf makes the raw byte 0xFF, which Process's [String] cannot carry.
        process.arguments = ["-c", #"exec "$0" --config /nonexistent/signerd.json sign promotional-offer --bundle-id a --product-id "$(printf 'p\377')" --offer-id o"#, Binaries.signctl]
        let errors = Pipe()
        process.standardError = errors
        process.standardOutput = FileHandle.nullDevice
        try process.run()
        let stderr = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        #expect(process.terminationStatus == 64, "\(stderr)")
        #expect(stderr.contains("error: the argument after --product-id is not valid UTF-8"), "\(stderr)")
    }

    /// `signctl --help` left `--json` out of `keys import`, which takes it.
    @Test("every command that takes --json lists it in signctl --help and in its own --help; no other command lists it", arguments: [
        ["token", "init"], ["token", "change-pin"], ["keys", "import"], ["keys", "list"], ["keys", "export-public"], ["keys", "delete"],
        ["health"], ["sign", "promotional-offer"], ["sign", "promotional-offer-v2"], ["sign", "introductory-offer-eligibility"],
        ["sign", "advanced-commerce-request"], ["sign", "server-api-token"], ["bench"], ["verify", "promotional-offer"], ["verify", "jws"],
    ])
    func jsonListed(_ command: [String]) throws {
        // A command that does not take --json refuses it (64) before it looks at --help.
        let own = runSignctl(["--config", "/nonexistent/signerd.json"] + command + ["--json", "--help"])
        let takesJSON = own.status == 0
        #expect(takesJSON || own.status == 64, "\(command): \(own.stderr)")
        if takesJSON { #expect(own.stdout.contains("--json"), "\(command) --help: \(own.stdout)") }
        // The entries of signctl --help for the command: its first line and the lines indented under it.
        let usage = runSignctl(["--help"]).stdout.split(separator: "\n", omittingEmptySubsequences: false)
        var entries: [String] = []
        var inside = false
        for line in usage {
            if line.hasPrefix("  " + command.joined(separator: " ") + " ") {
                entries.append(String(line))
                inside = true
            } else if inside && line.hasPrefix("    ") {
                entries[entries.count - 1] += "\n" + line
            } else {
                inside = false
            }
        }
        try #require(!entries.isEmpty, "\(command) is not in signctl --help")
        for entry in entries {
            #expect(entry.contains("[--json]") == takesJSON, "\(command) takes --json: \(takesJSON); signctl --help says: \(entry)")
        }
    }
}

@Suite("signctl keys: a public key object without its private key")
struct SignctlPublicKeyOnlyTests {
    /// Such an object blocked `keys import` ("pass --replace") yet was not in `keys list`.
    @Test("keys list shows it, import names it and how to remove it, delete removes it (1 object)")
    func publicKeyOnly() throws {
        let (token, config) = try tokenConfig("orphan")
        let files = try TestKeyFiles.make()
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "ORPHAN0001", files.sec1]).status == 0)
        // Destroy only the private key object, in this process (the same SoftHSM token directory signctl uses).
        let hsm = try inProcessToken(token)
        defer { hsm.close() }
        let destroyed = try hsm.withReadWriteSession { (session) throws(HSMError) -> Int in
            let handles = try hsm.find(session, [Attribute(P11.classAttribute, ulong: P11.privateKeyClass), Attribute(P11.id, Array("ORPHAN0001".utf8))])
            return handles.filter { hsm.functions.destroyObject(session, object: $0) == .ok }.count
        }
        try #require(destroyed == 1)
        let list = runSignctl(["--config", config, "keys", "list"])
        #expect(list.status == 0, "\(list.stderr)")
        #expect(list.stdout.contains("ORPHAN0001  public key only, no private key"), "\(list.stdout)")
        let json = runSignctl(["--config", config, "keys", "list", "--json"])
        let entries = try #require(try JSONSerialization.jsonObject(with: Data(json.stdout.utf8)) as? [[String: Any]])
        #expect(entries.count == 1)
        #expect(entries.first?["key_id"] as? String == "ORPHAN0001")
        #expect(entries.first?["private_key_object"] as? Bool == false)
        // Its public key can still be exported, with a note on stderr.
        let exported = runSignctl(["--config", config, "keys", "export-public", "ORPHAN0001"])
        #expect(exported.status == 0, "\(exported.stderr)")
        #expect(exported.stdout == files.publicKeyPEM)
        #expect(exported.stderr.contains("only a public key object"), "\(exported.stderr)")
        let exportedJSON = runSignctl(["--config", config, "keys", "export-public", "ORPHAN0001", "--json"])
        let exportEntry = try #require(try? JSONSerialization.jsonObject(with: Data(exportedJSON.stdout.utf8)) as? [String: Any], "\(exportedJSON.stdout) \(exportedJSON.stderr)")
        #expect(exportEntry["key_id"] as? String == "ORPHAN0001" && exportEntry["public_key_pem"] as? String == files.publicKeyPEM)
        #expect(exportEntry["fingerprint"] as? String == (try ECPublicKey(pem: files.publicKeyPEM)).fingerprint)
        let absent = runSignctl(["--config", config, "keys", "export-public", "NOSUCHKEY1"])
        #expect(absent.status == 65 && absent.stderr.contains("key_not_found"), "\(absent.stderr)")
        let refused = runSignctl(["--config", config, "keys", "import", "--key-id", "ORPHAN0001", files.sec1])
        #expect(refused.status == 65)
        #expect(refused.stderr.contains("only a public key object with key ID ORPHAN0001"), "\(refused.stderr)")
        #expect(refused.stderr.contains("signctl keys delete ORPHAN0001 --yes"), "\(refused.stderr)")
        let deleted = runSignctl(["--config", config, "keys", "delete", "ORPHAN0001", "--yes"])
        #expect(deleted.stdout.contains("(1 object)"), "\(deleted.stdout)")
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "ORPHAN0001", files.sec1]).status == 0)
        // A rotation script reads what was deleted: the private and the public key object.
        let deletedJSON = runSignctl(["--config", config, "keys", "delete", "ORPHAN0001", "--yes", "--json"])
        let deletion = try #require(try? JSONSerialization.jsonObject(with: Data(deletedJSON.stdout.utf8)) as? [String: Any], "\(deletedJSON.stdout) \(deletedJSON.stderr)")
        #expect(deletion["key_id"] as? String == "ORPHAN0001" && deletion["objects_deleted"] as? Int == 2, "\(deletion)")
        #expect((deletion["token_label"] as? String)?.isEmpty == false, "\(deletion)")
    }
}

@Suite("signctl keys: another application's key labelled with a key ID")
struct SignctlLabelNamesakeTests {
    /// pkcs11-tool --keypairgen --id 01 --label NAMESAKE01: keys delete
    /// NAMESAKE01 destroyed it, and keys import called it key_exists.
    @Test("keys list shows the label column, import is key_id_conflict naming it, delete leaves it (65 both)")
    func labelNamesake() throws {
        let (token, config) = try tokenConfig("namesake")
        let files = try TestKeyFiles.make()
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "ABC123DEFG", files.sec1]).status == 0)
        let theirs = try ECPrivateKeyMaterial(contentsOf: try TestKeyFiles.make().pkcs8Apple)
        let hsm = try inProcessToken(token)
        try hsm.withReadWriteSession { (session) throws(HSMError) in
            let common = [Attribute(P11.keyType, ulong: P11.ecKeyType), Attribute(P11.token, bool: true), Attribute(P11.label, Array("NAMESAKE01".utf8)),
                          Attribute(P11.id, [0x01]), Attribute(P11.ecParams, ECCurve.p256.parametersDER)]
            for template in [[Attribute(P11.classAttribute, ulong: P11.publicKeyClass), Attribute(P11.ecPoint, HSMToken.wrappedECPoint(theirs.publicKey.uncompressedPoint))],
                             [Attribute(P11.classAttribute, ulong: P11.privateKeyClass), Attribute(P11.private, bool: true), Attribute(P11.value, secret: theirs.scalar)]] {
                #expect(hsm.functions.createObject(session, template: template + common).0 == .ok)
            }
        }
        hsm.close()
        let list = runSignctl(["--config", config, "keys", "list"])
        #expect(list.status == 0, "\(list.stderr)")
        let lines = list.stdout.split(separator: "\n")
        #expect(lines.first?.hasSuffix("SHA-256 FINGERPRINT" + String(repeating: " ", count: 47) + "LABEL") == true, "\(list.stdout)")
        #expect(lines.contains { $0.hasPrefix("0x01") && $0.hasSuffix("  " + theirs.publicKey.fingerprint + "  NAMESAKE01") }, "\(list.stdout)")
        #expect(lines.contains { $0.hasPrefix("ABC123DEFG") && $0.hasSuffix("  ABC123DEFG") }, "\(list.stdout)")
        let imported = runSignctl(["--config", config, "keys", "import", "--replace", "--key-id", "NAMESAKE01", files.pkcs8OpenSSL])
        #expect(imported.status == 65 && imported.stderr.contains("error: key_id_conflict: key ID NAMESAKE01 is already carried by an EC private key object labelled NAMESAKE01 with CKA_ID 0x01"), "\(imported.stderr)")
        let deleted = runSignctl(["--config", config, "keys", "delete", "NAMESAKE01", "--yes"])
        #expect(deleted.status == 65 && deleted.stderr.contains("error: key_not_found: ") && deleted.stderr.contains("signctl leaves alone"), "\(deleted.stderr)")
        #expect(runSignctl(["--config", config, "keys", "list"]).stdout.contains("NAMESAKE01"), "still there")
    }
}

@Suite("signctl keys: a key object labelled with a key ID that has no CKA_ID")
struct SignctlLabelOnlyTests {
    /// pkcs11-tool --write-object (or --keypairgen) without --id: an EC key
    /// labelled NOIDKEY001 with an empty CKA_ID stopped keys import
    /// NOIDKEY001, yet keys delete and delete --incomplete left it without
    /// a word, and keys list did not show a public one at all: the
    /// operator had nothing telling them what blocks the key ID.
    @Test("keys list names it on stderr; import is key_id_conflict naming it; delete and delete --incomplete leave it and say so; it is never destroyed")
    func labelOnly() throws {
        let (token, config) = try tokenConfig("label-only")
        let files = try TestKeyFiles.make()
        let theirs = try ECPrivateKeyMaterial(contentsOf: try TestKeyFiles.make().pkcs8Apple)
        let hsm = try inProcessToken(token)
        defer { hsm.close() }
        // As another tool makes them: a label, no CKA_ID at all.
        func addWithoutID(_ label: String, privateKey: Bool) throws {
            try hsm.withReadWriteSession { (session) throws(HSMError) in
                let common = [Attribute(P11.keyType, ulong: P11.ecKeyType), Attribute(P11.token, bool: true),
                              Attribute(P11.label, Array(label.utf8)), Attribute(P11.ecParams, ECCurve.p256.parametersDER)]
                let template = privateKey
                    ? [Attribute(P11.classAttribute, ulong: P11.privateKeyClass), Attribute(P11.private, bool: true), Attribute(P11.sign, bool: true), Attribute(P11.value, secret: theirs.scalar)]
                    : [Attribute(P11.classAttribute, ulong: P11.publicKeyClass), Attribute(P11.ecPoint, HSMToken.wrappedECPoint(theirs.publicKey.uncompressedPoint))]
                #expect(hsm.functions.createObject(session, template: template + common).0 == .ok)
            }
        }
        func labelled(_ label: String) throws -> Int {
            try hsm.withSession { (session) throws(HSMError) -> Int in try hsm.find(session, [Attribute(P11.label, Array(label.utf8))]).count }
        }
        try addWithoutID("NOIDKEY001", privateKey: true)
        try addWithoutID("NOIDKEY002", privateKey: false)
        let privateOne = "an EC private key object labelled NOIDKEY001 with no CKA_ID"
        let publicOne = "an EC public key object labelled NOIDKEY002 with no CKA_ID"

        let list = runSignctl(["--config", config, "keys", "list", "--json"])
        #expect(list.status == 0, "\(list.stderr)")
        #expect(list.stderr.contains("note: token \(token.label) holds key objects with no CKA_ID labelled with a key ID: \(privateOne); \(publicOne), which signctl did not make"), "\(list.stderr)")
        #expect(list.stderr.contains("they stop keys import of NOIDKEY001, NOIDKEY002 (key_id_conflict)"), "\(list.stderr)")
        #expect(list.stderr.contains("\nhint: signctl leaves them alone") && list.stderr.contains("pkcs11-tool --list-objects"), "\(list.stderr)")
        let entries = try #require(try JSONSerialization.jsonObject(with: Data(list.stdout.utf8)) as? [[String: Any]], "--json stays a list: \(list.stdout)")
        // An empty CKA_ID pairs the private key with no public key object (NOIDKEY002's has no ID either).
        #expect(entries.count == 1 && entries.first?["label"] as? String == "NOIDKEY001" && entries.first?["public_key_object"] as? Bool == false, "\(entries)")

        for replace in [[], ["--replace"]] {
            let imported = runSignctl(["--config", config, "keys", "import", "--key-id", "NOIDKEY001", "--allow-duplicate-key"] + replace + [files.sec1])
            #expect(imported.status == 65 && imported.stderr.hasPrefix("error: key_id_conflict: key ID NOIDKEY001 is already carried by \(privateOne)"), "\(replace): \(imported.stderr)")
        }
        let notFound = runSignctl(["--config", config, "keys", "delete", "NOIDKEY001", "--yes"])
        #expect(notFound.status == 65 && notFound.stderr.contains("error: key_not_found: ") && notFound.stderr.contains("signctl leaves alone \(privateOne)"), "\(notFound.stderr)")

        let incomplete = runSignctl(["--config", config, "keys", "delete", "--incomplete", "--yes"])
        #expect(incomplete.status == 0 && incomplete.stdout.contains("no incomplete key objects"), "\(incomplete.stdout) \(incomplete.stderr)")
        #expect(incomplete.stderr.hasPrefix("note: left alone on token \(token.label), not incomplete (a label, no CKA_ID): \(privateOne); \(publicOne)"), "\(incomplete.stderr)")

        // signctl's own key under the ID first, a namesake without an ID added afterwards: delete takes signctl's objects and says what stays.
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "NOIDKEY003", files.sec1]).status == 0)
        try addWithoutID("NOIDKEY003", privateKey: true)
        let deleted = runSignctl(["--config", config, "keys", "delete", "NOIDKEY003", "--yes"])
        #expect(deleted.status == 0 && deleted.stdout.contains("deleted NOIDKEY003 from token \(token.label) (2 objects)"), "\(deleted.stdout) \(deleted.stderr)")
        #expect(deleted.stderr.hasPrefix("note: left alone on token \(token.label): an EC private key object labelled NOIDKEY003 with no CKA_ID, which signctl did not make"), "\(deleted.stderr)")
        #expect(deleted.stderr.contains("it stops keys import of NOIDKEY003 (key_id_conflict)"), "\(deleted.stderr)")

        #expect(try labelled("NOIDKEY001") == 1 && labelled("NOIDKEY002") == 1 && labelled("NOIDKEY003") == 1, "a namesake was destroyed")
        // A complete key, not a namesake: no note.
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "NOIDKEY004", files.sec1]).status == 0)
        let plain = runSignctl(["--config", config, "keys", "delete", "NOIDKEY004", "--yes"])
        #expect(plain.status == 0 && !plain.stderr.contains("note:"), "\(plain.stderr)")
    }
}

@Suite("signctl keys delete: key_still_configured follows the running signerd")
struct SignctlStillConfiguredTests {
    /// The warning read keys[] of signctl's own signctl.json, not the
    /// daemon's configuration: a stale file warned about a key signerd did
    /// not serve and said nothing about one it did.
    @Test("with signerd answering, its GET /v1/keys decides (no false alarm, no miss); with none answering, signctl's file does and the warning says so")
    func followsTheDaemon() throws {
        let daemon = try DaemonHarness(keyIDs: ["ABC123DEFG", "XYZ987WVUT", "STALEONLY1", "STALEONLY2"])
        try daemon.writeConfig(keys: ["ABC123DEFG", "XYZ987WVUT"])
        try daemon.start()
        defer { daemon.stop() }
        // signctl's own file, out of date: the same token and socket, other keys.
        let stale = daemon.directory + "/signctl.json"
        try JSONSerialization.data(withJSONObject: [
            "token_uri": daemon.tokenURI, "socket_path": daemon.socketPath,
            "keys": ["STALEONLY1", "STALEONLY2"].map { ["key_id": $0, "bundle_ids": ["com.example.app"]] },
        ], options: [.withoutEscapingSlashes]).write(to: URL(fileURLWithPath: stale))
        func delete(_ keyID: String) -> (status: Int32, stdout: String, stderr: String) {
            runProgram(Binaries.signctl, ["--config", stale, "keys", "delete", keyID, "--yes", "--json"], environment: ["SOFTHSM2_CONF": daemon.softHSMConf])
        }
        // With --json the warning's code is in the output too (a CLI audit found it only on stderr).
        func warnings(_ run: (status: Int32, stdout: String, stderr: String)) -> [String]? {
            (try? JSONSerialization.jsonObject(with: Data(run.stdout.utf8)) as? [String: Any])?["warnings"] as? [String]
        }
        let notServed = delete("STALEONLY1")
        #expect(notServed.status == 0, "\(notServed.stderr)")
        #expect(!notServed.stderr.contains("key_still_configured"), "signerd does not serve STALEONLY1: \(notServed.stderr)")
        #expect(warnings(notServed) == [], "\(notServed.stdout)")
        let served = delete("XYZ987WVUT")
        #expect(served.status == 0, "\(served.stderr)")
        #expect(served.stderr.contains("warning: key_still_configured: XYZ987WVUT is in keys[] of the running signerd (GET /v1/keys on \(daemon.socketPath)); it marks the token down"),
                "\(served.stderr)")
        #expect(warnings(served) == ["key_still_configured"], "\(served.stdout)")
        #expect(daemon.stop() == 0)
        let unanswered = delete("STALEONLY2")
        #expect(unanswered.status == 0, "\(unanswered.stderr)")
        #expect(unanswered.stderr.hasPrefix("warning: key_still_configured: STALEONLY2 is in keys[] of \(stale), signctl's configuration, read because signerd did not answer GET /v1/keys on \(daemon.socketPath) ("),
                "\(unanswered.stderr)")
        #expect(warnings(unanswered) == ["key_still_configured"], "\(unanswered.stdout)")
    }
}

@Suite("signctl keys list: a replacement that stopped half-way")
struct SignctlHalfReplacedTests {
    /// The old and the new objects both under one key ID: signerd answered
    /// 500 key_invalid and said why, while keys list showed the key with
    /// "PUBLIC no" and no word on it.
    @Test("keys list warns key_invalid in signerd's words with the --replace advice; import --replace clears it")
    func halfReplaced() throws {
        let (token, config) = try tokenConfig("half-replaced")
        let (old, new) = (try TestKeyFiles.make(), try TestKeyFiles.make())
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "HALFREPL01", old.sec1]).status == 0)
        // The new key's objects written beside the old ones, as a --replace stopped before it removed them.
        let hsm = try inProcessToken(token)
        _ = try hsm.importKey(ECPrivateKeyMaterial(contentsOf: new.sec1), keyID: "HALFREPL01", replace: true, extractable: false, removingOld: false)
        hsm.close()
        let listed = runSignctl(["--config", config, "keys", "list"])
        #expect(listed.status == 0, "\(listed.stderr)")
        #expect(listed.stderr.contains("warning: key_invalid: 2 private keys carry key ID HALFREPL01"), "\(listed.stderr)")
        #expect(listed.stderr.contains("signctl keys import --replace"), "\(listed.stderr)")
        #expect(runSignctl(["--config", config, "keys", "import", "--replace", "--key-id", "HALFREPL01", new.sec1]).status == 0)
        let after = runSignctl(["--config", config, "keys", "list"])
        #expect(!after.stderr.contains("key_invalid"), "\(after.stderr)")
        #expect(after.stdout.contains("HALFREPL01  P-256  yes"), "\(after.stdout)")
    }
}

@Suite("signctl keys: key objects a write left incomplete")
struct SignctlIncompleteObjectTests {
    /// A process ended inside C_CreateObject (a second Ctrl-C, SIGKILL)
    /// left SoftHSM objects with no CKA_ID, CKA_LABEL or CKA_EC_PARAMS:
    /// `keys list` showed a private one as a row with no key ID and curve
    /// "?", and nothing in signctl could remove them. A child process (an
    /// exit test) imports through HSMToken, as signctl does, under a hard
    /// file size limit with SIGXFSZ at its default action: it is ended at
    /// the write that crosses the limit, the same real SoftHSM state
    /// without a race. (signctl itself ignores SIGXFSZ, so that a write
    /// past a limit fails and is reported instead.)
    @Test("an import ended mid-write by SIGXFSZ leaves incomplete objects: keys list counts them on stderr, delete --incomplete --yes removes only them")
    func incompleteObjects() async throws {
        let (token, config) = try tokenConfig("incomplete")
        let files = try TestKeyFiles.make()
        // A complete key that must survive the clean-up.
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "KEEPME0001", files.sec1]).status == 0)
        let hsm = try inProcessToken(token)
        defer { hsm.close() }
        // Limits between SoftHSM's token file (320 bytes, rewritten at the
        // login) and its object files (600 to 800 bytes): each import dies
        // writing an object, and one of them between an object's first
        // write and its attributes (500 bytes with SoftHSM 2.6.1).
        setenv("SIGNERD_TEST_CUT_URI", token.uri, 1)
        setenv("SIGNERD_TEST_CUT_KEY", files.sec1, 1)
        var limit: Int?
        for size in stride(from: 400, through: 760, by: 20) {
            setenv("SIGNERD_TEST_CUT_SIZE", String(size), 1)
            await #expect(processExitsWith: .signal(SIGXFSZ)) {
                let environment = ProcessInfo.processInfo.environment
                let bytes = rlim_t(environment["SIGNERD_TEST_CUT_SIZE"] ?? "") ?? 0
                var cap = rlimit(rlim_cur: bytes, rlim_max: bytes)
                setrlimit(Int32(RLIMIT_FSIZE.rawValue), &cap)
                // Default action, and not blocked (the child inherits the runner's mask).
                signal(SIGXFSZ, SIG_DFL)
                var unblock = sigset_t()
                sigemptyset(&unblock)
                sigaddset(&unblock, SIGXFSZ)
                pthread_sigmask(SIG_UNBLOCK, &unblock, nil)
                var options = TokenOptions()
                options.logger = .disabled
                let child = try HSMToken(uri: PKCS11URI(environment["SIGNERD_TEST_CUT_URI"] ?? ""), options: options)
                _ = try child.importKey(ECPrivateKeyMaterial(contentsOf: environment["SIGNERD_TEST_CUT_KEY"] ?? ""), keyID: "CUTOFF0001", replace: false, allowDuplicateKey: true)
            }
            if try hsm.incompleteKeyObjectCount() > 0 {
                limit = size
                break
            }
            _ = runSignctl(["--config", config, "keys", "delete", "CUTOFF0001", "--yes"])
        }
        let found = try #require(limit, "no file size limit from 400 to 760 bytes left an incomplete key object")
        let count = try hsm.incompleteKeyObjectCount()
        let list = runSignctl(["--config", config, "keys", "list"])
        #expect(list.status == 0, "\(list.stderr)")
        #expect(list.stderr.contains("holds \(count) incomplete key object"), "limit \(found): \(list.stderr)")
        #expect(list.stderr.contains("signctl keys delete --incomplete --yes"), "\(list.stderr)")
        #expect(!list.stdout.contains("?"), "an incomplete object is not listed as a key: \(list.stdout)")
        #expect(list.stdout.contains("KEEPME0001"), "\(list.stdout)")
        let json = runSignctl(["--config", config, "keys", "list", "--json"])
        let entries = try #require(try JSONSerialization.jsonObject(with: Data(json.stdout.utf8)) as? [[String: Any]], "\(json.stdout)")
        #expect(entries.allSatisfy { !($0["key_id"] as? String ?? "").isEmpty }, "\(entries)")
        let unconfirmed = runSignctl(["--config", config, "keys", "delete", "--incomplete"])
        #expect(unconfirmed.status == 64 && unconfirmed.stderr.contains("--yes"), "\(unconfirmed.stderr)")
        #expect(try hsm.incompleteKeyObjectCount() == count)
        let deleted = runSignctl(["--config", config, "keys", "delete", "--incomplete", "--yes"])
        #expect(deleted.status == 0, "\(deleted.stderr)")
        #expect(deleted.stdout.contains("deleted \(count) incomplete key object"), "\(deleted.stdout)")
        #expect(try hsm.incompleteKeyObjectCount() == 0)
        let after = runSignctl(["--config", config, "keys", "list"])
        #expect(!after.stderr.contains("incomplete"), "\(after.stderr)")
        #expect(after.stdout.contains("KEEPME0001"), "the complete key stays: \(after.stdout)")
        let again = runSignctl(["--config", config, "keys", "delete", "--incomplete", "--yes"])
        #expect(again.status == 0 && again.stdout.contains("no incomplete key objects"), "\(again.stdout)")
        // The key ID the cut-off import used can be imported now.
        _ = runSignctl(["--config", config, "keys", "delete", "CUTOFF0001", "--yes"])
        let imported = runSignctl(["--config", config, "keys", "import", "--key-id", "CUTOFF0001", "--allow-duplicate-key", files.sec1])
        #expect(imported.status == 0, "\(imported.stderr)")
    }
}

@Suite("signctl keys import: a key the token could not store")
struct SignctlImportNotStoredTests {
    /// SoftHSM keeps objects it cannot write in the importing process's
    /// memory and answers CKR_OK: the self-test passed, signctl said
    /// "imported … the .p8 file is no longer needed", and the key was
    /// missing or cut short for signerd and after a restart. A file size
    /// limit with SIGXFSZ ignored makes SoftHSM's writes fail with EFBIG,
    /// as a full disk makes them fail with ENOSPC.
    @Test("with writes failing (EFBIG), every import either is stored or fails with key_not_stored (69) saying to keep the .p8; never 'imported' for a key not stored")
    func notStored() throws {
        let (_, config) = try tokenConfig("not-stored")
        let files = try TestKeyFiles.make()
        let fingerprint = try Self.fingerprint(files)
        var refusals = 0
        for size in stride(from: 400, through: 1000, by: 40) {
            let run = runProgram("/bin/sh", ["-c", "trap '' XFSZ; exec \"$@\"", "sh", "/usr/bin/prlimit", "--fsize=\(size)",
                                            Binaries.signctl, "--config", config, "keys", "import", "--key-id", "NOTSTORED1", files.sec1])
            // What another process finds on the token now.
            let listed = runSignctl(["--config", config, "keys", "list", "--json"])
            let entries = try #require(try JSONSerialization.jsonObject(with: Data(listed.stdout.utf8)) as? [[String: Any]], "\(listed.stderr)")
            let stored = entries.contains { $0["key_id"] as? String == "NOTSTORED1" && $0["private_key_object"] as? Bool == true && $0["fingerprint"] as? String == fingerprint }
            if run.status == 0 {
                #expect(stored, "limit \(size): signctl said \(run.stdout) yet the token holds \(entries)")
            } else if run.stderr.contains("key_not_stored") {
                refusals += 1
                #expect(run.status == 69, "limit \(size): \(run.stderr)")
                #expect(run.stderr.contains("keep the .p8 file") && run.stderr.contains("--replace"), "\(run.stderr)")
                #expect(!run.stdout.contains("imported"), "\(run.stdout)")
            }
            _ = runSignctl(["--config", config, "keys", "delete", "NOTSTORED1", "--yes"])
            _ = runSignctl(["--config", config, "keys", "delete", "--incomplete", "--yes"])
        }
        #expect(refusals > 0, "no file size limit from 400 to 1000 bytes made an import fail to store")
        let imported = runSignctl(["--config", config, "keys", "import", "--key-id", "NOTSTORED1", files.sec1])
        #expect(imported.status == 0 && imported.stdout.contains("imported NOTSTORED1"), "\(imported.stderr)")
    }

    /// SHA-256 of the DER SubjectPublicKeyInfo, as keys list shows it.
    static func fingerprint(_ files: TestKeyFiles) throws -> String {
        let spki = try #require(Data(base64Encoded: files.publicKeyPEM.split(separator: "\n").filter { !$0.hasPrefix("-----") }.joined()))
        return SHA256.hash(Array(spki)).hexString
    }

    /// The old objects were removed once the new ones passed their
    /// self-test in memory, before the read-back: a --replace that could
    /// not be stored left the key ID with a private key cut short (500
    /// key_invalid from signerd) or a public key only.
    @Test("with writes failing (EFBIG), a --replace either stores the new key or keeps the old one whole, signing and with no leftovers")
    func replaceNotStoredKeepsOldKey() throws {
        let (_, config) = try tokenConfig("replace-not-stored")
        let (old, new) = (try TestKeyFiles.make(), try TestKeyFiles.make())
        let (oldPrint, newPrint) = (try Self.fingerprint(old), try Self.fingerprint(new))
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "REPLACE001", old.sec1]).status == 0)
        var kept = 0
        for size in stride(from: 400, through: 1000, by: 40) {
            let run = runProgram("/bin/sh", ["-c", "trap '' XFSZ; exec \"$@\"", "sh", "/usr/bin/prlimit", "--fsize=\(size)",
                                            Binaries.signctl, "--config", config, "keys", "import", "--replace", "--key-id", "REPLACE001", new.sec1])
            let listed = runSignctl(["--config", config, "keys", "list", "--json"])
            let entries = try #require(try JSONSerialization.jsonObject(with: Data(listed.stdout.utf8)) as? [[String: Any]], "\(listed.stderr)")
            #expect(entries.count == 1 && entries.first?["private_key_object"] as? Bool == true, "limit \(size): \(entries)")
            #expect(!listed.stderr.contains("incomplete"), "limit \(size): \(listed.stderr)")
            let holds = entries.first?["fingerprint"] as? String
            if run.status == 0 {
                #expect(holds == newPrint, "limit \(size): signctl said \(run.stdout)")
                #expect(runSignctl(["--config", config, "keys", "import", "--replace", "--key-id", "REPLACE001", old.sec1]).status == 0)
                continue
            }
            if run.stderr.contains("key_not_stored") {
                kept += 1
                #expect(run.stderr.contains("the key REPLACE001 had before is kept"), "\(run.stderr)")
            }
            #expect(holds == oldPrint, "limit \(size): \(run.stderr)")
            // It signs, read from storage by another process.
            let signs = runSignctl(["--config", config, "bench", "--direct", "--concurrency", "1", "--requests", "3", "--key-id", "REPLACE001", "--verify"])
            #expect(signs.status == 0, "limit \(size): \(signs.stdout) \(signs.stderr)")
        }
        #expect(kept > 0, "no file size limit from 400 to 1000 bytes made a --replace fail to store")
    }
}

@Suite("signctl and a file size limit (ulimit -f)")
struct SignctlFileSizeLimitTests {
    /// SoftHSM rewrites its token file at C_Login: with a small soft limit,
    /// even `keys list` cut it short and the token was gone, while signctl
    /// exited 0. signctl now lifts the soft limit to the hard one, and warns
    /// when the hard one is finite.
    @Test("a soft ulimit -f 0 is lifted (the token survives keys list and import); a hard limit is warned about")
    func fileSizeLimit() throws {
        let (_, config) = try tokenConfig("fsize")
        let files = try TestKeyFiles.make()
        for command in [["keys", "list"], ["keys", "import", "--key-id", "FSIZE00001", files.sec1], ["keys", "list"]] {
            let run = runProgram("/bin/sh", ["-c", "ulimit -S -f 0; exec \"$@\"", "sh", Binaries.signctl, "--config", config] + command)
            #expect(run.status == 0, "\(command): \(run.stderr)")
            #expect(!run.stderr.contains("file_size_limit"), "\(run.stderr)")
        }
        let listed = runSignctl(["--config", config, "keys", "list"])
        #expect(listed.status == 0 && listed.stdout.contains("FSIZE00001"), "the token survived: \(listed.stdout) \(listed.stderr)")
        let hard = runProgram("/usr/bin/prlimit", ["--fsize=1048576", Binaries.signctl, "--config", config, "keys", "list"])
        #expect(hard.status == 0, "\(hard.stderr)")
        #expect(hard.stderr.contains("warning: file_size_limit: the file size limit (ulimit -f, LimitFSIZE=) is 1048576 bytes"), "\(hard.stderr)")
    }
}

@Suite("signctl under Ctrl-C: it says what it did, and the token survives", .serialized)
struct SignctlInterruptTests {
    /// Runs signctl with `arguments`, sends SIGINT after `delay` seconds.
    /// - Returns: its stdout and stderr.
    static func interrupted(_ arguments: [String], after delay: Double, environment: [String: String] = [:]) throws -> (stdout: String, stderr: String) {
        let process = Process()
        // SIGINT's default action back: the test runner ignores it, and an
        // ignored signal stays ignored across exec (signctl would never see it).
        process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
        process.arguments = ["--default-signal=SIGINT", Binaries.signctl] + arguments
        process.environment = ProcessInfo.processInfo.environment.merging(environment) { _, new in new }
        let output = Pipe()
        let errors = Pipe()
        process.standardOutput = output
        process.standardError = errors
        try process.run()
        usleep(useconds_t(delay * 1_000_000))
        process.interrupt()
        let out = output.fileHandleForReading.readDataToEndOfFile()
        let err = errors.fileHandleForReading.readDataToEndOfFile()
        process.waitUntilExit()
        return (String(decoding: out, as: UTF8.self), String(decoding: err, as: UTF8.self))
    }

    /// The import and the PIN change released their hold of SIGINT before
    /// saying what they did: an import or a PIN change that had happened
    /// was reported by nothing (16 in 100 interrupted PIN changes), and the
    /// read-back after the write logged in again outside the hold, which
    /// can leave SoftHSM's token file empty (2 in 100). Now the whole
    /// command, its answer included, runs under the hold.
    @Test("interrupted at random points, an import says 'imported' exactly when the key is on the token, and the token always survives")
    func importInterrupted() throws {
        let (_, config) = try tokenConfig("interrupt-import")
        let files = try TestKeyFiles.make()
        for round in 0..<30 {
            let run = try Self.interrupted(["--config", config, "keys", "import", "--key-id", "INTRPT0001", files.sec1], after: Double(round % 15) * 0.006)
            let listed = runSignctl(["--config", config, "keys", "list", "--json"])
            try #require(listed.status == 0, "round \(round): the token did not survive: \(listed.stderr)")
            let entries = try #require(try JSONSerialization.jsonObject(with: Data(listed.stdout.utf8)) as? [[String: Any]])
            let onToken = entries.contains { $0["key_id"] as? String == "INTRPT0001" && $0["private_key_object"] as? Bool == true }
            #expect(onToken == run.stdout.contains("imported INTRPT0001"), "round \(round): on the token \(onToken), signctl said: \(run.stdout) \(run.stderr)")
            // Held, the signal still ends signctl: its exit status says interrupted even after "imported".
            if run.stderr.contains("writing to the token: stopping once the write is done") {
                #expect(run.stderr.contains("stopping for SIGINT now that the command has run to its end: what it printed above is what it did (the exit status is the signal's, 130 in a shell)"),
                        "round \(round): \(run.stderr)")
            }
            _ = runSignctl(["--config", config, "keys", "delete", "INTRPT0001", "--yes"])
            _ = runSignctl(["--config", config, "keys", "delete", "--incomplete", "--yes"])
        }
    }
}

@Suite("signctl: errors that say what to do about them")
struct SignctlHintTests {
    /// An attack round found an argument's escape bytes echoed raw to
    /// stderr, where a terminal acts on them (colours, a moved cursor, a
    /// retitled window).
    @Test("an argument's control characters are shown as escapes on stderr, not sent to the terminal; --json keeps them as JSON escapes")
    func controlCharactersInArguments() throws {
        let unknown = runSignctl(["bad\u{1B}]0;owned\u{07}\u{1B}[31m\rcommand"])
        #expect(unknown.status == 64, "\(unknown.stderr)")
        #expect(!unknown.stderr.unicodeScalars.contains { $0.value < 0x20 && $0 != "\n" }, "\(unknown.stderr.debugDescription)")
        #expect(unknown.stderr.contains(#"bad\u001B]0;owned\u0007\u001B[31m\u000Dcommand"#), "\(unknown.stderr.debugDescription)")
        let json = runSignctl(["verify", "jws", "x\u{1B}[2J", "--public-key", "/nonexistent/\u{1B}[2J.pem", "--json"])
        #expect(json.status == 65, "\(json.stderr)")
        #expect(!json.stderr.contains("\u{1B}") && json.stderr.contains(#"/nonexistent/\u001B[2J.pem"#), "\(json.stderr.debugDescription)")
        let object = try #require(try JSONSerialization.jsonObject(with: Data(json.stdout.utf8)) as? [String: [String: Any]], "\(json.stdout)")
        #expect((object["error"]?["message"] as? String)?.contains("/nonexistent/\u{1B}[2J.pem") == true, "\(json.stdout)")
    }

    /// `--json` shaped only successful output: a script reading stdout got
    /// nothing when the command failed.
    @Test("with --json a failure is also one JSON object on stdout: code, message, hint, exit_code; stderr keeps the words")
    func jsonFailures() throws {
        let (_, config) = try tokenConfig("json-failure")
        let missing = runSignctl(["--config", config, "keys", "import", "--json", "--key-id", "ABC123DEFG", "/nonexistent/AuthKey_ABC123DEFG.p8"])
        #expect(missing.status == 65, "\(missing.stderr)")
        #expect(missing.stderr.hasPrefix("error: "), "\(missing.stderr)")
        let object = try #require(try JSONSerialization.jsonObject(with: Data(missing.stdout.utf8)) as? [String: Any], "\(missing.stdout)")
        let error = try #require(object["error"] as? [String: Any], "\(missing.stdout)")
        #expect(error["exit_code"] as? Int == 65)
        #expect((error["message"] as? String).map { missing.stderr.contains($0) } == true, "\(missing.stdout)")
        #expect(error["code"] as? String == "key_file_unreadable", "\(missing.stdout)")
        // A usage error too (64), and nothing on stdout without --json.
        let usage = runSignctl(["--config", config, "keys", "list", "--json", "--no-such-flag"])
        #expect(usage.status == 64)
        let usageObject = try #require(try JSONSerialization.jsonObject(with: Data(usage.stdout.utf8)) as? [String: [String: Any]], "\(usage.stdout)")
        #expect(usageObject["error"]?["exit_code"] as? Int == 64)
        #expect(usageObject["error"]?["code"] as? String == "usage", "\(usage.stdout)")
        #expect(runSignctl(["--config", config, "keys", "list", "--no-such-flag"]).stdout.isEmpty)
        // Before the command, as --config and --final-try may be: it was "unknown command --json" (64).
        let listed = runSignctl(["--json", "--config", config, "keys", "list"])
        #expect(listed.status == 0, "\(listed.stderr)")
        #expect(try JSONSerialization.jsonObject(with: Data(listed.stdout.utf8)) is [[String: Any]], "\(listed.stdout)")
        let early = runSignctl(["--json", "--config", config, "keys", "import", "--key-id", "ABSENT0001", "--", "/nonexistent/absent.p8"])
        #expect(early.status == 65, "\(early.stderr)")
        let earlyObject = try #require(try JSONSerialization.jsonObject(with: Data(early.stdout.utf8)) as? [String: [String: Any]], "\(early.stdout)")
        #expect(earlyObject["error"]?["code"] as? String == "key_file_unreadable")
        // Failures signctl finds itself carry a code too: a script had
        // {"error": {"message": …}} with no code for a daemon not running
        // and for a malformed JWS.
        let unreachable = runSignctl(["--config", config, "health", "--json"])
        #expect(unreachable.status == 69, "\(unreachable.stderr)")
        let unreachableObject = try #require(try JSONSerialization.jsonObject(with: Data(unreachable.stdout.utf8)) as? [String: [String: Any]], "\(unreachable.stdout)")
        #expect(unreachableObject["error"]?["code"] as? String == "daemon_unreachable", "\(unreachable.stdout)")
        let pem = TemporaryDirectory.make(prefix: "signerd-json-failure") + "/example.pem"
        try DocsExamplesTests.publicKeyPEM().write(toFile: pem, atomically: false, encoding: .utf8)
        let malformed = runSignctl(["verify", "jws", "not-a-jws", "--public-key", pem, "--json"])
        #expect(malformed.status == 65, "\(malformed.stderr)")
        let malformedObject = try #require(try JSONSerialization.jsonObject(with: Data(malformed.stdout.utf8)) as? [String: [String: Any]], "\(malformed.stdout)")
        #expect(malformedObject["error"]?["code"] as? String == "jws_format", "\(malformed.stdout)")
        // Put at the end, it became the value of an option left without one.
        let unfinished = runSignctl(["--json", "verify", "jws", "e30.e30.AA", "--public-key"])
        #expect(unfinished.status == 64 && unfinished.stderr.contains("--public-key needs a value"), "\(unfinished.stderr)")
    }

    /// SoftHSM sets CKF_USER_PIN_COUNT_LOW after a refused login: signctl
    /// printed the token's warning as a JSON log line in its plain stderr.
    @Test("after a wrong PIN, the next signctl run warns pin_count_low in signctl's own words, not a JSON line; --final-try is a global option")
    func countLowWarningPlain() throws {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.initializeToken(label: "counted")
        let wrongConfig = TemporaryDirectory.make(prefix: "signerd-wrong") + "/signerd.json"
        try #"{"token_uri": "pkcs11:token=counted?module-path=\#(hsm.modulePath)&pin-source=file:\#(try hsm.pinFile("wrong-pin", "00000000"))"}"#
            .write(toFile: wrongConfig, atomically: false, encoding: .utf8)
        #expect(runSignctl(["--config", wrongConfig, "keys", "list"], environment: hsm.environment).status == 77)
        let config = try hsm.config(label: "counted", pinPath: pin)
        let list = runSignctl(["--final-try", "--config", config, "keys", "list"], environment: hsm.environment)
        #expect(list.status == 0, "\(list.stderr)")
        #expect(list.stderr.hasPrefix("warning: pin_count_low: final_try=false token.label=counted\nhint: the token has refused a user PIN"), "\(list.stderr)")
        #expect(!list.stderr.contains("{"), "no JSON log line: \(list.stderr)")
    }

    /// Root's `keys import` on a token directory signerd's user owns made
    /// object files only root could read: signerd reported the key
    /// missing, and root's `--replace` later removed signerd's own copy.
    @Test("as root, token init, import, delete and change-pin refuse SoftHSM token directories another uid owns (77, naming runuser); keys list still reads them",
          .enabled(if: geteuid() == 0, "the check is for root"))
    func rootOnOthersSoftHSMToken() throws {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.initializeToken(label: "owned")
        let config = try hsm.config(label: "owned", pinPath: pin)
        let files = try TestKeyFiles.make()
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "OWNED00001", files.sec1], environment: hsm.environment).status == 0, "root's own token directory")
        let tokens = hsm.directory + "/tokens"
        for path in [tokens] + (try FileManager.default.subpathsOfDirectory(atPath: tokens)).map({ tokens + "/" + $0 }) {
            #expect(chown(path, 65534, 65534) == 0, "\(path)")
        }
        let newPIN = try hsm.pinFile("new-pin", "11223344")
        let soPIN = try hsm.pinFile("so-pin", "12345678")
        for command in [["keys", "import", "--key-id", "OWNED00002", files.sec1], ["keys", "delete", "OWNED00001", "--yes"], ["token", "change-pin", "--new-pin-file", newPIN],
                        ["token", "init", "--label", "rootmade", "--pin-file", newPIN, "--so-pin-file", soPIN, "--module", hsm.modulePath]] {
            let refused = runSignctl(["--config", config] + command, environment: hsm.environment)
            #expect(refused.status == 77, "\(command): \(refused.stderr)")
            #expect(refused.stderr.contains("signctl runs as root, but SoftHSM's token directory \(tokens)") && refused.stderr.contains("belongs to uid 65534"), "\(command): \(refused.stderr)")
            #expect(refused.stderr.contains("hint: run signctl as the user signerd runs as: runuser -u nobody -- "), "\(command): \(refused.stderr)")
        }
        let list = runSignctl(["--config", config, "keys", "list"], environment: hsm.environment)
        #expect(list.status == 0 && list.stdout.contains("OWNED00001") && !list.stdout.contains("OWNED00002"), "\(list.stdout)\(list.stderr)")
        #expect(try softHSMTokenDirectories(tokens).count == 1, "token init made no token as root")
    }

    /// An operations audit moved the token directory away and ran
    /// `signctl keys list` as root: the hint said root could not read the
    /// directory ("unknown owner") and to run as root. It does not exist.
    @Test("a SoftHSM token directory that does not exist is named as missing, not as unreadable, by signctl and signerd (69)")
    func tokenDirectoryMissing() throws {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.initializeToken(label: "gone")
        let config = try hsm.config(label: "gone", pinPath: pin)
        try FileManager.default.moveItem(atPath: hsm.directory + "/tokens", toPath: hsm.directory + "/tokens.away")
        let expected = "SoftHSM's token directory \(hsm.directory)/tokens (directories.tokendir in \(hsm.directory)/softhsm2.conf) does not exist"
        let list = runSignctl(["--config", config, "keys", "list"], environment: hsm.environment)
        #expect(list.status == 69, "\(list.stderr)")
        #expect(list.stderr.contains(expected) && !list.stderr.contains("cannot read"), "\(list.stderr)")
        let start = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", config], environment: hsm.environment)
        #expect(start.status == 69, "\(start.stderr)")
        let failed = start.stderr.split(separator: "\n").first { $0.contains("\"token_open_failed\"") }
        #expect(failed?.contains(expected) == true, "\(start.stderr)")
    }

    /// A token's own directory moved away (the token directory still there):
    /// signerd exited 69 with no hint, where signctl names SOFTHSM2_CONF.
    @Test("a token whose directory was moved away: signerd's token_open_failed says which SoftHSM configuration and directory it looked in (69)")
    func tokenMissingFromDirectory() throws {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.initializeToken(label: "moved")
        let config = try hsm.config(label: "moved", pinPath: pin)
        let tokenDirectory = try #require(try softHSMTokenDirectories(hsm.directory + "/tokens").first)
        try FileManager.default.moveItem(atPath: hsm.directory + "/tokens/" + tokenDirectory, toPath: hsm.directory + "/moved.away")
        let start = runProgram("/usr/bin/timeout", ["10", Binaries.signerd, "--config", config], environment: hsm.environment)
        #expect(start.status == 69, "\(start.stderr)")
        let failed = start.stderr.split(separator: "\n").first { $0.contains("\"token_open_failed\"") }
        #expect(failed?.contains("\"hint\":\"check token= in token_uri; SoftHSM looked in \(hsm.directory)/tokens (directories.tokendir in \(hsm.directory)/softhsm2.conf, from SOFTHSM2_CONF)") == true, "\(start.stderr)")
    }

    /// A token made as root whose configuration, SoftHSM configuration and
    /// PIN file the user nobody (65534) may read, and the `setpriv`
    /// arguments that run a command as nobody with that SoftHSM configuration.
    static func tokenForNobody(label: String) throws -> (hsm: FreeSoftHSM, pin: String, config: String, asNobody: [String]) {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.initializeToken(label: label)
        // nobody's own directory for the socket, so that signerd run as nobody gets past the socket check to the token.
        let run = hsm.directory + "/run"
        try FileManager.default.createDirectory(atPath: run, withIntermediateDirectories: false)
        #expect(chown(run, 65534, 65534) == 0 && chmod(run, 0o755) == 0)
        let config = try hsm.config(label: label, pinPath: pin, socketDirectory: run)
        #expect(chmod(hsm.directory, 0o755) == 0)
        #expect(chmod(config, 0o644) == 0 && chmod(hsm.directory + "/softhsm2.conf", 0o644) == 0 && chown(pin, 65534, 65534) == 0)
        return (hsm, pin, config, ["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/env", "SOFTHSM2_CONF=\(hsm.directory)/softhsm2.conf"])
    }

    /// `token init` as root makes files only root can read; SoftHSM run as
    /// signerd's user then shows the token as uninitialized, and the error
    /// spoke of a token.object cut short.
    @Test("a token only root can read: signctl keys list and signerd, run as another user, name its directory and owner (69)",
          .enabled(if: geteuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv"), "needs root and setpriv (util-linux) to run as another user"))
    func tokenOnlyRootCanRead() throws {
        let (hsm, pin, config, asNobody) = try Self.tokenForNobody(label: "rootonly")
        // The user nobody may reach every file but root's token itself.
        #expect(chmod(hsm.directory + "/tokens", 0o755) == 0)
        let tokenDirectory = try #require(try softHSMTokenDirectories(hsm.directory + "/tokens").first)
        let expected = "cannot be read by this user (nobody), and SoftHSM shows it as uninitialized: \(hsm.directory)/tokens/\(tokenDirectory) (owner root"
        let list = runProgram("/usr/bin/setpriv", asNobody + [Binaries.signctl, "--config", config, "keys", "list"])
        #expect(list.status == 69, "\(list.stderr)")
        #expect(list.stderr.contains("error: token_not_found: ") && list.stderr.contains("hint: 1 token in SoftHSM's token directory " + expected), "\(list.stderr)")
        let start = runProgram("/usr/bin/setpriv", asNobody + ["/usr/bin/timeout", "10", Binaries.signerd, "--config", config])
        #expect(start.status == 69, "\(start.stderr)")
        let failed = start.stderr.split(separator: "\n").first { $0.contains("\"token_open_failed\"") }
        #expect(failed?.contains(expected) == true && failed?.contains("runuser -u signerd -- signctl token init") == true, "\(start.stderr)")
        // A token directory nobody may not read fails SoftHSM's C_Initialize: the same diagnosis.
        #expect(chmod(hsm.directory + "/tokens", 0o700) == 0)
        let closed = runProgram("/usr/bin/setpriv", asNobody + [Binaries.signctl, "--config", config, "keys", "list"])
        #expect(closed.status == 69 && closed.stderr.contains("C_Initialize"), "\(closed.stderr)")
        #expect(closed.stderr.contains("hint: this user (nobody) cannot read SoftHSM's token directory \(hsm.directory)/tokens (owner root, mode 700)"), "\(closed.stderr)")
        let closedStart = runProgram("/usr/bin/setpriv", asNobody + ["/usr/bin/timeout", "10", Binaries.signerd, "--config", config])
        #expect(closedStart.status == 69 && closedStart.stderr.contains("cannot read SoftHSM's token directory"), "\(closedStart.stderr)")
        #expect(chmod(hsm.directory + "/tokens", 0o755) == 0)
        // Root reads it (with the PIN file root's again): no such hint.
        #expect(chown(pin, 0, 0) == 0)
        let asRoot = runSignctl(["--config", config, "keys", "list"], environment: hsm.environment)
        #expect(asRoot.status == 0 && !asRoot.stderr.contains("cannot be read"), "\(asRoot.stderr)")
    }

    /// A token its own user shut with chmod 000 got the hint "run as that
    /// user", naming the user it already ran as (an attack round).
    @Test("a token, or the token directory, that its own user may not read (mode 000): the hint says to give the owner access back, not to run as the owner (69)",
          .enabled(if: geteuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv"), "needs root and setpriv (util-linux) to run as another user"))
    func tokenShutToItsOwner() throws {
        let (hsm, _, config, asNobody) = try Self.tokenForNobody(label: "shut")
        #expect(runProgram("/bin/chown", ["-R", "65534:65534", hsm.directory + "/tokens"]).status == 0)
        let tokenDirectory = hsm.directory + "/tokens/" + (try #require(try softHSMTokenDirectories(hsm.directory + "/tokens").first))
        #expect(chmod(tokenDirectory, 0) == 0)
        let list = runProgram("/usr/bin/setpriv", asNobody + [Binaries.signctl, "--config", config, "keys", "list"])
        #expect(list.status == 69, "\(list.stderr)")
        #expect(list.stderr.contains("\(tokenDirectory) (owner nobody, mode 0). They belong to this user, but their mode does not let their owner read them")
                && list.stderr.contains("chmod u+rwx") && !list.stderr.contains("run as that user"), "\(list.stderr)")
        #expect(chmod(tokenDirectory, 0o700) == 0 && chmod(hsm.directory + "/tokens", 0) == 0)
        let closed = runProgram("/usr/bin/setpriv", asNobody + [Binaries.signctl, "--config", config, "keys", "list"])
        #expect(closed.status == 69, "\(closed.stderr)")
        #expect(closed.stderr.contains("hint: this user (nobody) owns SoftHSM's token directory \(hsm.directory)/tokens (owner nobody, mode 0) but its mode does not let its owner read it")
                && closed.stderr.contains("chmod u+rwx \(hsm.directory)/tokens"), "\(closed.stderr)")
        #expect(chmod(hsm.directory + "/tokens", 0o700) == 0)
        let opened = runProgram("/usr/bin/setpriv", asNobody + [Binaries.signctl, "--config", config, "keys", "list"])
        #expect(opened.status == 0, "access given back, the token opens: \(opened.stderr)")
    }

    /// The first version of the hint told anyone who could not read a token
    /// to delete it, which for signerd's own token would destroy the key.
    @Test("a token another user made: the hint says to run as that user, and never to delete it",
          .enabled(if: geteuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv"), "needs root and setpriv (util-linux) to run as other users"))
    func tokenOfAnotherUser() throws {
        let hsm = try FreeSoftHSM()
        #expect(chmod(hsm.directory, 0o755) == 0 && chmod(hsm.directory + "/softhsm2.conf", 0o644) == 0 && chown(hsm.directory + "/tokens", 65534, 65534) == 0)
        // PIN files each user may use: its own, mode 0600.
        func pinFiles(_ uid: uid_t) throws -> (so: String, user: String) {
            let so = try hsm.pinFile("so-pin-\(uid)", "12345678")
            let user = try hsm.pinFile("pin-\(uid)", "87654321")
            #expect(chown(so, uid, uid) == 0 && chown(user, uid, uid) == 0)
            return (so, user)
        }
        let (nobodySO, nobodyPIN) = try pinFiles(65534)
        let environment = "SOFTHSM2_CONF=\(hsm.directory)/softhsm2.conf"
        let made = runProgram("/usr/bin/setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/env", environment,
                                                   Binaries.signctl, "token", "init", "--label", "nobodys", "--pin-file", nobodyPIN, "--so-pin-file", nobodySO, "--module", hsm.modulePath])
        try #require(made.status == 0, "\(made.stderr)")
        #expect(chmod(hsm.directory + "/tokens", 0o755) == 0)
        let (_, otherPIN) = try pinFiles(65533)
        let config = try hsm.config(label: "nobodys", pinPath: otherPIN)
        #expect(chmod(config, 0o644) == 0)
        let other = runProgram("/usr/bin/setpriv", ["--reuid=65533", "--regid=65533", "--clear-groups", "/usr/bin/env", environment, Binaries.signctl, "--config", config, "keys", "list"])
        #expect(other.status == 69, "\(other.stderr)")
        #expect(other.stderr.contains("(owner nobody, mode 700)") && other.stderr.contains("run as that user (runuser -u nobody -- …)"), "\(other.stderr)")
        #expect(!other.stderr.contains("delete it"), "\(other.stderr)")
        // Root, re-running token init for the token that exists, changes nothing and is not refused.
        let (rootSO, rootPIN) = try pinFiles(0)
        let again = runSignctl(["token", "init", "--label", "nobodys", "--pin-file", rootPIN, "--so-pin-file", rootSO, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(again.status == 0 && again.stdout.hasPrefix("token nobodys already initialized"), "\(again.stdout)\(again.stderr)")
        // A new token there is refused, naming the owner to run as.
        let new = runSignctl(["token", "init", "--label", "another", "--pin-file", rootPIN, "--so-pin-file", rootSO, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(new.status == 77 && new.stderr.contains("hint: run signctl as the user signerd runs as: runuser -u nobody -- signctl token init …"), "\(new.stderr)")
    }

    /// `signctl keys list` run as uid 65534 with a configuration file made
    /// by root, its directory and the file given these modes.
    static func keysListAsNobody(directoryMode: mode_t, fileMode: mode_t) throws -> (path: String, status: Int32, stderr: String) {
        let directory = TemporaryDirectory.make(prefix: "signerd-config-mode")
        let path = directory + "/signerd.json"
        try #"{"token_uri": "pkcs11:token=x?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/nonexistent"}"#.write(toFile: path, atomically: false, encoding: .utf8)
        #expect(chmod(path, fileMode) == 0 && chmod(directory, directoryMode) == 0)
        let refused = runProgram("/usr/bin/setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", Binaries.signctl, "--config", path, "keys", "list"])
        return (path, refused.status, refused.stderr)
    }

    @Test("a configuration file this user may not read gets a hint naming its owner and mode",
          .enabled(if: geteuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv"), "needs root and setpriv (util-linux) to run as another user"))
    func configUnreadable() throws {
        let refused = try Self.keysListAsNobody(directoryMode: 0o755, fileMode: 0o600)
        #expect(refused.status == 78, "\(refused.stderr)")
        #expect(refused.stderr.contains("hint: this user (uid 65534) may not read \(refused.path) (owner uid 0, mode 600)"), "\(refused.stderr)")
    }

    /// The hint said "no file at …" for a file that was there, behind a directory closed to the user.
    @Test("a configuration file in a directory this user may not search gets a hint about the directory, not 'no file'",
          .enabled(if: geteuid() == 0 && FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv"), "needs root and setpriv (util-linux) to run as another user"))
    func configDirectoryClosed() throws {
        let refused = try Self.keysListAsNobody(directoryMode: 0o700, fileMode: 0o644)
        #expect(refused.status == 78, "\(refused.stderr)")
        #expect(refused.stderr.contains("hint: this user (uid 65534) may not search a directory on the path to \(refused.path)"), "\(refused.stderr)")
        #expect(!refused.stderr.contains("no file at"), "\(refused.stderr)")
    }

    @Test("token init as root warns that the token is root's alone when a signerd user exists",
          .enabled(if: geteuid() == 0 && getpwnam("signerd") != nil, "needs root and a user named signerd (docs/OPERATIONS.md's systemd-sysusers step) on this host"))
    func tokenInitAsRootWarns() throws {
        let hsm = try FreeSoftHSM()
        let soPIN = try hsm.pinFile("so-pin", "12345678")
        let pin = try hsm.pinFile("pin", "87654321")
        let made = runSignctl(["token", "init", "--label", "warned", "--pin-file", pin, "--so-pin-file", soPIN, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(made.status == 0, "\(made.stderr)")
        #expect(made.stderr.hasPrefix("warning: token warned was made as root, in \(hsm.directory)/tokens: SoftHSM wrote its files for root alone"), "\(made.stderr)")
        #expect(made.stderr.contains("runuser -u signerd -- signctl token init"), "\(made.stderr)")
        // Run again, the token is left alone and nothing is said of it.
        let again = runSignctl(["token", "init", "--label", "warned", "--pin-file", pin, "--so-pin-file", soPIN, "--module", hsm.modulePath], environment: hsm.environment)
        #expect(again.status == 0 && !again.stderr.contains("made as root"), "\(again.stderr)")
    }

    @Test("a configuration file read and refused gets a hint to fix and check it, and code config_invalid; an unreadable one a hint about --config")
    func configErrorHints() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-config-hint")
        let path = directory + "/signerd.json"
        try #"{"token_uri": "pkcs11:token=x?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/nonexistent", "isuer_id": "x"}"#
            .write(toFile: path, atomically: false, encoding: .utf8)
        let typo = runSignctl(["--config", path, "keys", "list", "--json"])
        #expect(typo.status == 78, "\(typo.stderr)")
        #expect(typo.stderr.contains("isuer_id") && typo.stderr.contains("hint: fix \(path) (docs/OPERATIONS.md lists every setting), then check it with: signerd --check-config --config \(path)"), "\(typo.stderr)")
        #expect(!typo.stderr.contains("pass --config"), "\(typo.stderr)")
        let reported = try JSONSerialization.jsonObject(with: Data(typo.stdout.utf8)) as? [String: [String: Any]]
        #expect(reported?["error"]?["code"] as? String == "config_invalid", "\(typo.stdout)")
        let missing = runSignctl(["--config", directory + "/absent.json", "keys", "list"])
        #expect(missing.status == 78 && missing.stderr.contains("hint: no file at \(directory)/absent.json (from --config): pass --config FILE"), "\(missing.stderr)")
        let fromEnvironment = runSignctl(["keys", "list"], environment: ["SIGNERD_CONFIG": directory + "/absent.json"])
        #expect(fromEnvironment.status == 78 && fromEnvironment.stderr.contains("(from SIGNERD_CONFIG)"), "\(fromEnvironment.stderr)")
        // A CLI audit: SIGNERD_CONFIG= was read as the path "" ("cannot read the configuration file : …").
        let empty = runSignctl(["keys", "list"], environment: ["SIGNERD_CONFIG": ""])
        #expect(empty.status != 0 && empty.stderr.contains(SignerConfiguration.defaultPath) && !empty.stderr.contains("file :"), "\(empty.stderr)")
    }

    /// `keys export-public` swallowed every look-up failure and, with two
    /// private keys under the ID, printed the public key object's PEM with
    /// the false note "has only a public key object".
    @Test("export-public of a key ID that two private keys carry is key_invalid (65) naming them, not the public-key-only note")
    func exportPublicTwoPrivateKeys() throws {
        let (token, config) = try tokenConfig("two-private")
        let files = try TestKeyFiles.make()
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "TWOPRIV001", files.sec1]).status == 0)
        var options = TokenOptions()
        options.logger = .disabled
        let hsm = try HSMToken(uri: PKCS11URI(token.uri), options: options)
        let material = try ECPrivateKeyMaterial(contentsOf: files.sec1)
        let created = try hsm.withReadWriteSession { (session) throws(HSMError) -> PKCS11ReturnValue in
            hsm.functions.createObject(session, template: [
                Attribute(P11.classAttribute, ulong: P11.privateKeyClass), Attribute(P11.keyType, ulong: P11.ecKeyType),
                Attribute(P11.token, bool: true), Attribute(P11.private, bool: true), Attribute(P11.sensitive, bool: true),
                Attribute(P11.sign, bool: true), Attribute(P11.id, Array("TWOPRIV001".utf8)),
                Attribute(P11.ecParams, material.curve.parametersDER), Attribute(P11.value, secret: material.scalar),
            ]).0
        }
        hsm.close()
        try #require(created == .ok)
        let exported = runSignctl(["--config", config, "keys", "export-public", "TWOPRIV001"])
        #expect(exported.status == 65, "\(exported.stderr)")
        #expect(exported.stdout.isEmpty, "\(exported.stdout)")
        #expect(exported.stderr.contains("key_invalid: 2 private keys carry key ID TWOPRIV001"), "\(exported.stderr)")
        #expect(!exported.stderr.contains("only a public key object"), "\(exported.stderr)")
    }

    /// The two hints below were chosen by matching text in the message;
    /// they now follow the error's code (`key_id_conflict`) and its
    /// `fileOwner` context, so a reworded message cannot lose them.
    @Test("a key ID carried by an RSA object is key_id_conflict (65) with a listing hint, not --replace; a PIN file of another uid gets a chown hint (78)",
          .enabled(if: geteuid() == 0, "giving the PIN file to another uid (chown) needs root"))
    func hintsFollowCodes() throws {
        let (token, config) = try tokenConfig("conflict")
        var options = TokenOptions()
        options.logger = .disabled
        let hsm = try HSMToken(uri: PKCS11URI(token.uri), options: options)
        let created = try hsm.withReadWriteSession { (session) throws(HSMError) -> PKCS11ReturnValue in
            hsm.functions.createObject(session, template: [
                Attribute(P11.classAttribute, ulong: P11.publicKeyClass), Attribute(P11.keyType, ulong: P11.rsaKeyType),
                Attribute(P11.token, bool: true), Attribute(P11.id, Array("CONFLICT01".utf8)),
                Attribute(P11.modulus, [0xC1] + [UInt8](repeating: 0x5A, count: 255)), Attribute(P11.publicExponent, [1, 0, 1]),
            ]).0
        }
        hsm.close()
        try #require(created == .ok)
        let files = try TestKeyFiles.make()
        for replace in [false, true] {
            let refused = runSignctl(["--config", config, "keys", "import", "--key-id", "CONFLICT01", files.sec1] + (replace ? ["--replace"] : []))
            #expect(refused.status == 65, "\(refused.stderr)")
            #expect(refused.stderr.hasPrefix("error: key_id_conflict: key ID CONFLICT01 is already carried by an RSA public key object"), "\(refused.stderr)")
            #expect(refused.stderr.contains("hint: list the token's objects with: p11tool --list-all"), "\(refused.stderr)")
            #expect(!refused.stderr.contains("pass --replace to replace the key"), "\(refused.stderr)")
        }
        // The PIN file given to nobody: signctl names the owner and says chown, not chmod.
        let directory = TemporaryDirectory.make(prefix: "signerd-pin-owner")
        let pinPath = directory + "/pin"
        try FileManager.default.copyItem(atPath: token.pinPath, toPath: pinPath)
        #expect(chown(pinPath, 65534, 65534) == 0)
        let ownedConfig = directory + "/signerd.json"
        try #"{"token_uri": "pkcs11:token=\#(token.label)?module-path=\#(token.modulePath)&pin-source=file:\#(pinPath)"}"#
            .write(toFile: ownedConfig, atomically: false, encoding: .utf8)
        let owned = runSignctl(["--config", ownedConfig, "keys", "list"])
        #expect(owned.status == 78, "\(owned.stderr)")
        #expect(owned.stderr.contains("belongs to uid 65534"), "\(owned.stderr)")
        #expect(owned.stderr.contains("hint: chown the PIN file to root or to the user signctl runs as"), "\(owned.stderr)")
    }

    /// The Runbook's `signctl --config /etc/signerd/signerd.json keys import`
    /// failed on the service's pin-source (systemd's credential) with no hint.
    @Test("a pin-source under /run/credentials/ is refused (78) with a hint to use an operator configuration",
          .enabled(if: !FileManager.default.fileExists(atPath: "/run/credentials/signerd.service/pin"), "needs a host without signerd's systemd credential"))
    func systemdCredentialPIN() throws {
        let (token, config) = try tokenConfig("credpin")
        let serviceConfig = (config as NSString).deletingLastPathComponent + "/service.json"
        try #"{"token_uri": "\#(token.uri.replacingOccurrences(of: token.pinPath, with: "/run/credentials/signerd.service/pin"))"}"#
            .write(toFile: serviceConfig, atomically: false, encoding: .utf8)
        let files = try TestKeyFiles.make()
        let keyFile = files.directory + "/AuthKey_ABC123DEFG.p8"
        try FileManager.default.copyItem(atPath: files.pkcs8Apple, toPath: keyFile)
        for arguments in [["keys", "list"], ["keys", "import", "--replace", keyFile], ["bench", "--direct", "--requests", "1", "--key-id", "ABC123DEFG"]] {
            let refused = runSignctl(["--config", serviceConfig] + arguments)
            #expect(refused.status == 78, "\(arguments): \(refused.stderr)")
            #expect(refused.stderr.contains("error: pin_source_unreadable: cannot open the PIN file /run/credentials/signerd.service/pin"), "\(refused.stderr)")
            #expect(refused.stderr.contains("hint: /run/credentials/signerd.service/pin is systemd's copy of the PIN (LoadCredential=), which exists only inside the running service"), "\(arguments): \(refused.stderr)")
            #expect(refused.stderr.contains("--config FILE"), "\(refused.stderr)")
        }
        // Any other unreadable PIN file: the hint names the configuration it came from.
        let otherConfig = (config as NSString).deletingLastPathComponent + "/other.json"
        try #"{"token_uri": "\#(token.uri.replacingOccurrences(of: token.pinPath, with: token.pinPath + ".missing"))"}"#
            .write(toFile: otherConfig, atomically: false, encoding: .utf8)
        let other = runSignctl(["--config", otherConfig, "keys", "list"])
        #expect(other.status == 78, "\(other.stderr)")
        #expect(other.stderr.contains("hint: signctl reads the PIN from the pin-source in token_uri of \(otherConfig)"), "\(other.stderr)")
    }

    /// `keys import /tmp/x/nonexist.p8` said it could not tell the key ID
    /// from the file name, and suggested --key-id for a file that is not there.
    @Test("keys import of a missing file (any name) or a directory says so: key_file_unreadable, exit 65")
    func missingKeyFile() throws {
        let (_, config) = try tokenConfig("nofile")
        let directory = TemporaryDirectory.make(prefix: "signerd-nofile")
        for path in [directory + "/nonexist.p8", directory + "/AuthKey_ABC123DEFG.p8"] {
            for extra in [[], ["--key-id", "ABC123DEFG"]] {
                let refused = runSignctl(["--config", config, "keys", "import"] + extra + [path])
                #expect(refused.status == 65, "\(path) \(extra): \(refused.stderr)")
                #expect(refused.stderr == "error: key_file_unreadable: cannot open \(path): No such file or directory\n", "\(refused.stderr)")
            }
        }
        let notFile = runSignctl(["--config", config, "keys", "import", "--key-id", "ABC123DEFG", directory])
        #expect(notFile.status == 65, "\(notFile.stderr)")
        #expect(notFile.stderr.contains("key_file_unreadable: \(directory) is not a regular file"), "\(notFile.stderr)")
        // A file that is there but whose name carries no key ID still asks for --key-id.
        let files = try TestKeyFiles.make()
        let plain = files.directory + "/key.p8"
        try FileManager.default.copyItem(atPath: files.pkcs8Apple, toPath: plain)
        let unnamed = runSignctl(["--config", config, "keys", "import", plain])
        #expect(unnamed.status == 64, "\(unnamed.stderr)")
        #expect(unnamed.stderr.contains("cannot tell the key ID from the file name \(plain): the name is not AuthKey_<KEYID>.p8"), "\(unnamed.stderr)")
    }

    /// `verify … --public-key /nonexistent` said only "cannot read the public key".
    @Test("verify says why --public-key cannot be read: no such file, a directory (65)")
    func publicKeyUnreadable() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-pubkey")
        chmod(directory, 0o755)
        let offer = ["verify", "promotional-offer", "--bundle-id", "com.example.app", "--key-id", "ABC123DEFG", "--product-id", "p", "--offer-id", "o",
                     "--nonce", "5e3f1c2a-9b4d-4e6f-8a7b-1c2d3e4f5a6b", "--timestamp", "1790800914034", "--signature", "MEUCIQ=="]
        func verify(_ path: String, jws: Bool) -> (status: Int32, stdout: String, stderr: String) {
            runSignctl(jws ? ["verify", "jws", "e30.e30.AA", "--public-key", path] : offer + ["--public-key", path])
        }
        for jws in [false, true] {
            let missing = verify(directory + "/absent.pem", jws: jws)
            #expect(missing.status == 65, "\(missing.stderr)")
            #expect(missing.stderr.hasPrefix("error: cannot read the public key \(directory)/absent.pem: No such file or directory\nhint: "), "\(missing.stderr)")
            let folder = verify(directory, jws: jws)
            #expect(folder.status == 65, "\(folder.stderr)")
            #expect(folder.stderr.hasPrefix("error: cannot read the public key \(directory): it is a directory, not a file"), "\(folder.stderr)")
        }
    }

    /// The same for the key file of an import: it said "Permission denied" with no hint,
    /// and exited 65 (bad data) for what is the reader's permission (77).
    @Test("keys import of a key file this user may not read is 77 with a hint naming its owner and mode",
          .enabled(if: getuid() == 0 && SignctlHintTests.unprivilegedCallerAvailable, "needs root with setpriv(1), to read another user's 0600 file as uid 65534"))
    func keyFilePermissionDenied() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-key-denied")
        chmod(directory, 0o755)
        let key = directory + "/AuthKey_DENIED0001.p8"
        try writeSecretFile(key, try String(contentsOfFile: try TestKeyFiles.make().pkcs8Apple, encoding: .utf8))
        let denied = SignctlHintTests.runSignctlUnprivileged(["keys", "import", key])
        #expect(denied.status == 77, "\(denied.stderr)")
        #expect(denied.stderr.hasPrefix("error: key_file_unreadable: cannot open \(key): Permission denied"), "\(denied.stderr)")
        #expect(denied.stderr.contains("hint: this user (uid 65534) may not read \(key) (owner uid 0, mode 600): run signctl as the file's owner or as root"), "\(denied.stderr)")
        // Behind a directory this user may not search: the same exit as verify's --public-key there (77), not 65.
        chmod(key, 0o644)
        chmod(directory, 0o700)
        let closed = SignctlHintTests.runSignctlUnprivileged(["keys", "import", key])
        #expect(closed.status == 77 && closed.stderr.contains("hint: this user (uid 65534) may not search a directory on the path to \(key)"), "\(closed.stderr)")
    }

    @Test("verify says permission denied for a --public-key file this user may not read (77)",
          .enabled(if: getuid() == 0 && SignctlHintTests.unprivilegedCallerAvailable, "needs root with setpriv(1), to read another user's 0600 file as uid 65534"))
    func publicKeyPermissionDenied() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-pubkey-denied")
        chmod(directory, 0o755)
        let secret = directory + "/private.pem"
        try writeSecretFile(secret, try TestKeyFiles.make().publicKeyPEM)
        let denied = SignctlHintTests.runSignctlUnprivileged(["verify", "jws", "e30.e30.AA", "--public-key", secret])
        #expect(denied.status == 77, "\(denied.stderr)")
        #expect(denied.stderr.hasPrefix("error: cannot read the public key \(secret): Permission denied"), "\(denied.stderr)")
    }

    /// Runs signctl as uid/gid 65534 when this process is root (root may
    /// connect to any socket), else as this user.
    static func runSignctlUnprivileged(_ arguments: [String]) -> (status: Int32, stdout: String, stderr: String) {
        guard getuid() == 0 else { return runSignctl(arguments) }
        return runProgram("/usr/bin/setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", "--", Binaries.signctl] + arguments)
    }

    /// Whether a caller other than root can be had: this user, or uid 65534
    /// through setpriv(1) with the signctl binary reachable for it.
    static let unprivilegedCallerAvailable: Bool = getuid() != 0
        || (FileManager.default.isExecutableFile(atPath: "/usr/bin/setpriv") && runSignctlUnprivileged(["--help"]).status == 0)

    /// A delete from a SoftHSM token directory its owner may not write got
    /// CKR_FUNCTION_FAILED with "check the device (or the network path to
    /// the HSM)".
    @Test("a delete the token refuses for a read-only SoftHSM token directory is 69 with a hint naming the directory's permissions",
          .enabled(if: getuid() == 0 && unprivilegedCallerAvailable, "needs root with setpriv(1), to make a token uid 65534 owns"))
    func readOnlyTokenDirectory() throws {
        let hsm = try FreeSoftHSM()
        let pin = try hsm.initializeToken(label: "read-only")
        let config = try hsm.config(label: "read-only", pinPath: pin)
        let files = try TestKeyFiles.make()
        chmod(files.directory, 0o755)
        chmod(files.sec1, 0o644)
        #expect(runSignctl(["--config", config, "keys", "import", "--key-id", "READONLY01", files.sec1], environment: hsm.environment).status == 0)
        // The token and its files belong to uid 65534, which may read but not write its directory.
        var path = hsm.directory
        while path != "/" && path != "" {
            chmod(path, 0o755)
            path = (path as NSString).deletingLastPathComponent
        }
        _ = runProgram("/bin/chown", ["-R", "65534:65534", hsm.directory])
        let tokenDirectory = try #require(try softHSMTokenDirectories(hsm.directory + "/tokens").first)
        chmod(hsm.directory + "/tokens/" + tokenDirectory, 0o500)
        let refused = runProgram("/usr/bin/setpriv", ["--reuid=65534", "--regid=65534", "--clear-groups", "--", "/usr/bin/env", "SOFTHSM2_CONF=\(hsm.directory)/softhsm2.conf",
                                                      Binaries.signctl, "--config", config, "keys", "delete", "READONLY01", "--yes"])
        #expect(refused.status == 69, "\(refused.stdout) \(refused.stderr)")
        #expect(refused.stderr.contains("must be writable by the user signctl runs as"), "\(refused.stderr)")
        #expect(!refused.stdout.contains("deleted"), "\(refused.stdout)")
    }

    /// `signctl health` by a user outside the socket's group exited 69 with
    /// "Permission denied" and no word on what decides who may connect. Then
    /// it exited 69 (unavailable) where 77 means no permission, and for a
    /// socket of group root it advised `usermod -aG root`.
    @Test("a socket this user may not open is 77, naming socket_group/socket_mode and signerd-clients, never advising the root group, naming the mode to a member without group write; a missing socket asks whether signerd runs",
          .enabled(if: unprivilegedCallerAvailable, "needs a non-root user, or root with setpriv(1) and a signctl binary uid 65534 may run"))
    func socketPermissionHint() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-sockperm")
        chmod(directory, 0o755)
        // This process's group (root's is gid 0); as root also one the caller
        // is not in (65533), and the caller's own (65534) with the group's
        // read bit but not its write bit, which connecting needs.
        for socketGroup in [nil] + (getuid() == 0 ? ["65533", "65534"] : []) {
            let socketPath = directory + "/signerd-\(socketGroup ?? "own").sock"
            let mode: UInt32 = socketGroup == "65534" ? 0o640 : 0o000
            let listener = try UnixListener.bind(path: socketPath, mode: mode, group: socketGroup)
            defer { close(listener) }
            let config = directory + "/signerd.json"
            try #"{"token_uri": "pkcs11:token=t?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/nonexistent/pin", "socket_path": "\#(socketPath)"}"#
                .write(toFile: config, atomically: false, encoding: .utf8)
            chmod(config, 0o644)
            let gid = socketGroup.flatMap { gid_t($0) } ?? getgid()
            let group = getgrgid(gid).map { String(cString: $0.pointee.gr_name) } ?? "\(gid)"
            for command in [["health"], ["sign", "promotional-offer", "--bundle-id", "b", "--product-id", "p", "--offer-id", "o"]] {
                let refused = SignctlHintTests.runSignctlUnprivileged(["--config", config] + command)
                #expect(refused.status == 77, "\(command): \(refused.stderr)")
                #expect(refused.stderr.contains("cannot connect to \(socketPath): Permission denied"), "\(refused.stderr)")
                #expect(refused.stderr.contains("hint: this user may not connect"), "\(command): \(refused.stderr)")
                // The socket's own group and mode, not only the shipped ones: a hand-bound socket may have others.
                #expect(refused.stderr.contains("belongs to group \(group) with mode \(String(mode, radix: 8)) "), "\(command): \(refused.stderr)")
                for word in ["socket_group", "socket_mode", "signerd-clients"] {
                    #expect(refused.stderr.contains(word), "\(command): \(word) in \(refused.stderr)")
                }
                if socketGroup == "65534" {
                    #expect(refused.stderr.contains("this user is in \(group), but the mode gives the group no write permission, which connecting needs: set socket_mode to \"0660\""), "\(refused.stderr)")
                    #expect(!refused.stderr.contains("usermod"), "the user is in the group already: \(refused.stderr)")
                } else if gid == 0 {
                    #expect(!refused.stderr.contains("usermod"), "never add a user to the root group: \(refused.stderr)")
                    #expect(refused.stderr.contains("run signctl as root, or set socket_group in signerd's configuration"), "\(refused.stderr)")
                } else {
                    #expect(refused.stderr.contains("usermod -aG \(group) USER"), "\(refused.stderr)")
                }
            }
        }
        let missingConfig = directory + "/missing.json"
        try #"{"token_uri": "pkcs11:token=t?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/nonexistent/pin", "socket_path": "\#(directory)/absent.sock"}"#
            .write(toFile: missingConfig, atomically: false, encoding: .utf8)
        let absent = runSignctl(["--config", missingConfig, "health"])
        #expect(absent.status == 69, "\(absent.stderr)")
        #expect(absent.stderr.contains("hint: is signerd running"), "\(absent.stderr)")
    }
}

/// Failures that fell through to exit 1, which no table documents.
@Suite("signctl: every failure has a documented exit code")
struct SignctlExitCodeTests {
    /// `SOFTHSM2_CONF=/nonexist.conf signctl keys list` printed
    /// `pkcs11_failure: … C_Initialize returned CKR_GENERAL_ERROR`, exit 1,
    /// and nothing on what to check; signerd exits 69 for the same.
    @Test("a module that cannot start (SOFTHSM2_CONF naming no file) is 69 with a hint naming SOFTHSM2_CONF and module-path")
    func moduleCannotStart() throws {
        let hsm = try FreeSoftHSM()
        let config = try hsm.config(label: "absent", pinPath: try hsm.pinFile("pin", "12345678"))
        let missing = hsm.directory + "/nonexist.conf"
        let failed = runSignctl(["--config", config, "keys", "list"], environment: ["SOFTHSM2_CONF": missing])
        #expect(failed.status == 69, "\(failed.stderr)")
        #expect(failed.stderr.hasPrefix("error: pkcs11_failure: ") && failed.stderr.contains("C_Initialize returned CKR_GENERAL_ERROR"), "\(failed.stderr)")
        #expect(failed.stderr.contains("\nhint: the PKCS#11 module could not start: check module-path"), "\(failed.stderr)")
        #expect(failed.stderr.contains("SOFTHSM2_CONF is \(missing)"), "\(failed.stderr)")
    }

    /// A bench whose requests all failed exited 1.
    @Test("bench with failed requests exits 69; --key-id of a key the daemon does not serve is 65")
    func benchFailures() throws {
        let daemon = try DaemonHarness()
        try daemon.start()
        defer { daemon.stop() }
        let refused = daemon.signctlStatus(["bench", "--requests", "3", "--concurrency", "1", "--bundle-id", "com.example.notallowed"])
        #expect(refused.0 == 69, "\(refused.1)")
        #expect(refused.1.contains("errors: bundle_not_allowed 3"), "\(refused.1)")
        let unknownKey = daemon.signctlStatus(["bench", "--requests", "1", "--key-id", "NOTSERVED1"])
        #expect(unknownKey.0 == 65, "\(unknownKey.1)")
        #expect(unknownKey.1.contains("error: no configured key NOTSERVED1 is listed by /v1/keys"), "\(unknownKey.1)")
    }
}
