// signctl: the operator's tool for signerd. `signctl <noun> <verb>`.
import Foundation
import HSMSigner
import SignerIPC

let usage = """
usage: signctl [--config FILE] [--json] <command> [options]

Token and keys (talk to the PKCS#11 token named by token_uri in the config):
  token init --label LABEL --pin-file F --so-pin-file F [--module PATH] [--json]
                         initialize a development token (SoftHSM's module unless --module;
                         reads no configuration); PINs come from files
                         no other user may read (0600, or 0640 with signerd's group)
  token change-pin --new-pin-file F [--json]
                         change the user PIN (C_SetPIN) from the one token_uri's pin-source gives;
                         then put the new PIN in every PIN file and restart signerd (reload without LoadCredential=)
  keys import [--key-id ID [--force-key-id]] [--replace] [--allow-duplicate-key] [--json] FILE.p8
                         import an App Store In-App Purchase key (non-extractable, self-tested);
                         a key already on the token under another key ID is refused (65)
  keys list [--json]     key IDs, curve, public key object, CKA_EXTRACTABLE/CKA_SENSITIVE, fingerprint
  keys export-public KEY_ID [--json]
                         the public key as PEM (same bytes as `openssl ec -pubout`)
  keys delete KEY_ID --yes [--json]
                         remove a key's objects from the token
  keys delete --incomplete --yes [--json]
                         remove key objects with no key ID, label or curve (a write stopped half-way)

Daemon (talk to signerd over its Unix socket, socket_path in the config):
  health [--json]        readiness; exit 0 ready, 69 not ready or unreachable, 75 rate limited, 77 not allowed
                         (403, or this user may not connect to the socket)
  sign promotional-offer --bundle-id B --product-id P --offer-id O [--key-id K]
                         [--app-account-token UUID] [--nonce UUID] [--timestamp MS] [--json]
  sign promotional-offer-v2 --bundle-id B --product-id P --offer-id O [--transaction-id T] [--key-id K] [--json]
  sign introductory-offer-eligibility --bundle-id B --product-id P --transaction-id T
                         --allow-introductory-offer true|false [--key-id K] [--json]
  sign advanced-commerce-request --bundle-id B --request JSON_OBJECT [--key-id K] [--json]
  sign server-api-token --bundle-id B [--ttl-seconds 1..3600] [--key-id K] [--json]
  bench [--concurrency N] [--duration S | --requests N] [--endpoint E] [--key-id K] [--bundle-id B] [--verify] [--json]
  bench --direct [--concurrency N] [--duration S | --requests N] [--key-id K] [--verify] [--json]
                         load generator over the socket, or the in-process PKCS#11 baseline

Offline checks (no daemon, no token):
  verify promotional-offer --public-key PEM --bundle-id B --key-id K --product-id P --offer-id O
                         [--app-account-token UUID] --nonce UUID --timestamp MS --signature BASE64 [--json]
  verify jws TOKEN --public-key PEM [--json]
                         decode and verify any signerd JWS; prints header and claims

Options:
  --config FILE          configuration (default: $SIGNERD_CONFIG, else \(SignerConfiguration.defaultPath))
  --json                 JSON output, failures included, for the commands that have it
                         (before or after the command)
  --final-try            log in even when the token says one more wrong user PIN locks it
                         (CKF_USER_PIN_FINAL_TRY); without it signctl stops first (77)
  -h, --help             this help

Exit codes: 0 ok, 64 usage, 65 bad data, 69 unavailable (daemon, token or module), 70 internal error (signerd answered 500),
75 try again, 77 no permission, 78 configuration.
"""

/// A failure as `--json` writes it on stdout: `{"error": {"code", "message",
/// "hint"?, "field"?, "exit_code"}}`, beside the same words on stderr. `code` is
/// always there: the stable code of a token, key-file or daemon error,
/// signctl's own (`daemon_unreachable`, `malformed_jws`, …), or `usage`
/// for a usage error (exit 64).
struct JSONFailure: Encodable {
    let code: String
    let message: String
    /// Left out when signctl has nothing to add to the message.
    let hint: String?
    /// The field signerd named in its error (`{"error": {"field": …}}`), when it named one.
    let field: String?
    let exitCode: Int32
    enum CodingKeys: String, CodingKey {
        case code, message, hint, field
        case exitCode = "exit_code"
    }
}

/// Fails a command with an exit code and a message for stderr.
struct CommandFailure: Error {
    let code: ExitCode
    let message: String
    let hint: String?
    /// The stable code `--json` reports: the daemon's own (`invalid_field`,
    /// …) when the daemon refused, the token's or key file's, or signctl's
    /// (`daemon_unreachable`, `malformed_jws`, …).
    var errorCode: String
    /// The field signerd named in its error, for `--json`.
    var field: String?
    init(_ code: ExitCode, _ message: String, hint: String? = nil, errorCode: String, field: String? = nil) {
        self.code = code
        self.message = message
        self.hint = hint
        self.errorCode = errorCode
        self.field = field
    }
    /// The failure for `error`, keeping its code for `--json`, with more
    /// words than the library's.
    init(_ error: HSMError, message: String? = nil, hint: String?) {
        self.init(exitCode(for: error), message ?? error.description, hint: hint, errorCode: error.code.rawValue)
    }
}

func writeError(_ message: String, hint: String? = nil) {
    writeStandardError("error: \(message)\n" + (hint.map { "hint: \($0)\n" } ?? ""))
}

/// Writes `text` to stderr with its control characters but the line feed
/// shown as escapes (``escapingInvisible(_:controls:)``): a message may quote
/// an argument or a path as given, and its escape bytes are shown, not run
/// by the terminal.
func writeStandardError(_ text: String) {
    FileHandle.standardError.write(Data(escapingInvisible(text, controls: true).utf8))
}

func printJSON(_ value: some Encodable) {
    let encoder = JSONEncoder()
    encoder.outputFormatting = [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]
    let data = (try? encoder.encode(value)) ?? Data("{}".utf8)
    print(String(decoding: data, as: UTF8.self))
}

/// Whether `--final-try` was given: signctl then logs in even when the
/// token reports that one more wrong user PIN locks it.
let loginOnFinalTry = CommandLine.arguments.dropFirst().contains("--final-try")

/// Splits `--config FILE` and `--final-try` (anywhere) from the rest, and
/// moves a `--json` given before the command to the command's options.
/// `--config` given twice is a usage error, as any other option twice: the
/// last one winning could point `keys delete` at another token.
func splitGlobalOptions(_ words: [String]) throws(UsageError) -> (configPath: String, rest: [String]) {
    var given: String?
    var rest: [String] = []
    var jsonBeforeCommand = false
    var index = 0
    func take(_ path: String) throws(UsageError) {
        guard given == nil else {
            throw UsageError("--config is given twice (\(given ?? "") and \(path))", hint: "give one --config FILE")
        }
        given = path
    }
    while index < words.count {
        let word = words[index]
        if word == "--config" {
            guard index + 1 < words.count else { throw UsageError("--config needs a value") }
            try take(words[index + 1])
            index += 2
            continue
        }
        if word.hasPrefix("--config=") {
            try take(String(word.dropFirst("--config=".count)))
            index += 1
            continue
        }
        if word == "--final-try" {
            index += 1  // read at start-up: ``loginOnFinalTry``
            continue
        }
        if word == "--json" && rest.isEmpty {
            // Before the command, as --config and --final-try may be: the
            // command reads it (and refuses it if it has no JSON output).
            jsonBeforeCommand = true
            index += 1
            continue
        }
        rest.append(word)
        index += 1
    }
    if jsonBeforeCommand && !rest.isEmpty {
        // With no command, `signctl --json` is "no command given", not an
        // unknown option. Right after the command's words: at the end, an option left
        // without its value (--offer-id) would take it as its value; and
        // never after a "--", behind which every word is a positional.
        let commandWords = ["health", "bench"].contains(rest.first ?? "") ? 1 : 2
        var at = min(commandWords, rest.count)
        if let separator = rest.firstIndex(of: "--") { at = min(at, separator) }
        rest.insert("--json", at: at)
    }
    return (given ?? configFromEnvironment() ?? SignerConfiguration.defaultPath, rest)
}

/// `SIGNERD_CONFIG`, unless unset or empty (`SIGNERD_CONFIG=` reads as
/// unset, as shells and systemd's `Environment=` leave it; it was "cannot
/// read the configuration file : No such file or directory").
func configFromEnvironment() -> String? {
    ProcessInfo.processInfo.environment["SIGNERD_CONFIG"].flatMap { $0.isEmpty ? nil : $0 }
}

/// "this user (uid U) may not read PATH (owner uid O, mode M)" for a
/// regular file this user may not read, or nil: the start of a hint.
func unreadableFile(_ path: String) -> String? {
    var info = stat()
    guard stat(path, &info) == 0, (info.st_mode & S_IFMT) == S_IFREG, access(path, R_OK) != 0 else { return nil }
    return "this user (uid \(geteuid())) may not read \(path) (owner uid \(info.st_uid), mode \(String(info.st_mode & 0o7777, radix: 8)))"
}

func loadConfiguration(_ path: String) throws -> SignerConfiguration {
    do {
        return try SignerConfiguration.load(path: path)
    } catch {
        // A file that was read and refused needs fixing, not another --config.
        var info = stat()
        let exists = stat(path, &info) == 0
        let statError = exists ? 0 : errno
        // Where splitGlobalOptions took the path from: --config wins over SIGNERD_CONFIG over the default.
        let environment = configFromEnvironment()
        let source = path == environment ? "SIGNERD_CONFIG" : path == SignerConfiguration.defaultPath ? "the default" : "--config"
        let hint: String
        if !exists && statError == EACCES {
            // The file may well be there: a directory on the way is closed to this user (a 0700 or 0750 /etc/signerd).
            hint = "this user (uid \(geteuid())) may not search a directory on the path to \(path) (from \(source)): run signctl as root (or as a member of the directory's group, when its mode lets the group in), or pass --config FILE with a file this user can reach"
        } else if !exists {
            hint = "no file at \(path) (from \(source)): pass --config FILE (or set SIGNERD_CONFIG); the default is \(SignerConfiguration.defaultPath)"
        } else if let unreadable = unreadableFile(path) {
            hint = "\(unreadable): run signctl as root (or as a member of the file's group, when its mode lets the group read), or pass --config FILE with a file this user can read"
        } else if (info.st_mode & S_IFMT) == S_IFREG {
            hint = "fix \(path) (docs/OPERATIONS.md lists every setting), then check it with: signerd --check-config --config \(path)"
        } else {
            hint = "\(path) (from \(source)) is not a regular file: pass --config FILE"
        }
        throw CommandFailure(.config, error.message, hint: hint, errorCode: "config_invalid")
    }
}

func runCommand(_ words: [String]) throws -> ExitCode {
    let (configPath, rest) = try splitGlobalOptions(words)
    guard let noun = rest.first else {
        throw UsageError("no command given", hint: "run signctl --help for the commands")
    }
    if noun == "-h" || noun == "--help" {
        print(usage)
        return .success
    }
    let verb = rest.count > 1 ? rest[1] : ""
    let tail = Array(rest.dropFirst(2))
    let commands = ["token": "init, change-pin", "keys": "import, list, export-public, delete",
                    "sign": "promotional-offer, promotional-offer-v2, introductory-offer-eligibility, advanced-commerce-request, server-api-token",
                    "verify": "promotional-offer, jws"]
    // `signctl keys`, and `signctl --json keys` or `signctl keys --json list`
    // (an option where the command goes): name the commands, not "unknown command keys --json".
    if let names = commands[noun], verb.isEmpty || (verb.hasPrefix("-") && verb != "-h" && verb != "--help") {
        let before = verb.isEmpty ? "" : " before its options (\(verb))"
        throw UsageError("signctl \(noun) needs a command\(before): \(names)", hint: "run signctl \(noun) --help for usage")
    }
    if commands[noun] != nil, verb == "-h" || verb == "--help" {
        // `signctl keys --help`: the lines of the usage that belong to the noun.
        let lines = usage.split(separator: "\n", omittingEmptySubsequences: false)
        var section: [Substring] = []
        var inside = false
        for line in lines {
            if line.hasPrefix("  \(noun) ") { inside = true } else if !line.hasPrefix("    ") && !line.hasPrefix("                         ") { inside = false }
            if inside { section.append(line) }
        }
        print("usage:\n" + section.joined(separator: "\n") + "\n\nRun signctl \(noun) <command> --help for one command; signctl --help for everything.")
        return .success
    }
    switch (noun, verb) {
    case ("token", "init"): return try tokenInit(tail)
    case ("token", "change-pin"): return try tokenChangePIN(tail, configPath: configPath)
    case ("keys", "import"): return try keysImport(tail, configPath: configPath)
    case ("keys", "list"): return try keysList(tail, configPath: configPath)
    case ("keys", "export-public"): return try keysExportPublic(tail, configPath: configPath)
    case ("keys", "delete"): return try keysDelete(tail, configPath: configPath)
    case ("health", _): return try health(Array(rest.dropFirst()), configPath: configPath)
    case ("sign", _): return try sign(kind: verb, tail, configPath: configPath)
    case ("verify", "promotional-offer"): return try verifyPromotionalOffer(tail)
    case ("verify", "jws"): return try verifyJWS(tail)
    case ("bench", _): return try bench(Array(rest.dropFirst()), configPath: configPath)
    case ("token", _), ("keys", _), ("verify", _):
        throw UsageError("unknown command \(noun) \(verb)", hint: "signctl \(noun) commands: \(commands[noun] ?? ""); run signctl \(noun) --help for usage")
    default:
        // Before the command only --config, --json and --final-try are read.
        guard !noun.hasPrefix("-") else {
            throw UsageError("unknown option \(noun) before the command", hint: "before the command: --config FILE, --json, --final-try; run signctl --help")
        }
        throw UsageError("unknown command \(noun)")
    }
}

// A closed standard descriptor would be taken by the next file opened (a
// token file SoftHSM writes), and messages for stderr would land in it.
ProcessControl.openClosedStandardDescriptors()
// `keys import` holds the private key and every token command the PIN:
// neither may land in a core file or be read by ptrace, as in signerd.
ProcessControl.disableCoreDumps()

/// Runs the command and reports a failure on stderr (and, with `--json`,
/// as one JSON object on stdout).
/// - Returns: the exit status.
func runReporting(_ words: [String]) -> Int32 {
    var caught: (message: String, hint: String?, code: ExitCode, errorCode: String)?
    var field: String?
    do {
        try Arguments.checkUTF8((1..<Int(CommandLine.argc)).map { index in
            CommandLine.unsafeArgv[index].map { Array(UnsafeBufferPointer(start: UnsafeRawPointer($0).assumingMemoryBound(to: UInt8.self), count: strlen($0))) } ?? []
        })
        return try runCommand(words).rawValue
    } catch let error as UsageError {
        caught = (error.message, error.hint, .usage, "usage")
    } catch let error as CommandFailure {
        caught = (error.message, error.hint, error.code, error.errorCode)
        field = error.field
    } catch let error as HSMError {
        caught = (error.description, hint(for: error), exitCode(for: error), error.code.rawValue)
    } catch let error as CryptoError {
        caught = (error.description, nil, .dataError, error.code.rawValue)
    } catch let error as BenchmarkError {
        if let response = error.response {
            // The daemon refused bench's first request (403, 429, 503): its own code and words.
            let refusal = failure(from: response)
            caught = ("\(error.description): \(refusal.message)", refusal.hint, refusal.code, refusal.errorCode)
            field = refusal.field
        } else {
            // bench's --key-id names no configured key, or the key has no public key for --verify.
            caught = (error.description, nil, .dataError, "bench_not_started")
        }
    } catch {
        // Every error signctl expects is caught above; anything else is its own fault.
        caught = ("\(error)", nil, .software, "internal")
    }
    let reported = caught ?? ("unknown failure", nil, .software, "internal")
    writeError(reported.message, hint: reported.hint)
    // A script that asked for --json reads one JSON object on stdout either way.
    if words.prefix(while: { $0 != "--" }).contains("--json") {
        printJSON(["error": JSONFailure(code: reported.errorCode, message: reported.message, hint: reported.hint, field: field, exitCode: reported.code.rawValue)])
    }
    return reported.code.rawValue
}

/// Whether `words` name a command that logs in to the token and may write
/// to it (`token init`, `token change-pin`, `keys import`, `keys list`,
/// `keys export-public`, `keys delete`). SoftHSM rewrites its token file in
/// place at `C_Login` as well as at every write, and a process ended in the
/// middle leaves the token unusable; so these commands run whole, answer or
/// error included, under one hold of the termination signals. A Ctrl-C
/// then ends signctl once it has said what it did; a second one 3 s or
/// more after the first, at once.
func holdsSignalsThroughout(_ words: [String]) -> Bool {
    guard let (_, rest) = try? splitGlobalOptions(words), rest.count >= 2 else { return false }
    let command = rest[0] + " " + rest[1]
    return ["token init", "token change-pin", "keys import", "keys list", "keys export-public", "keys delete"].contains(command)
}

let words = Array(CommandLine.arguments.dropFirst())
// Lifted for every command (bench --direct logs in too); said where the token is opened.
let fileSizeLimit = ProcessControl.raiseFileSizeLimit()
let opensToken = holdsSignalsThroughout(words) || words.contains("--direct")
if let bytes = fileSizeLimit, opensToken {
    writeStandardError("warning: file_size_limit: \(ProcessControl.fileSizeLimitWarning(bytes))\n")
}
let status = holdsSignalsThroughout(words)
    ? ProcessControl.holdingTerminationSignals {
        let status = runReporting(words)
        // Out before the held signal ends the process: stdout to a pipe is
        // buffered, and a signal's default action does not flush it.
        fflush(nil)
        // The signal still ends signctl (a shell loop around it stops too),
        // so the exit status says "interrupted" even where the command was
        // done: say which one counts.
        let held = ProcessControl.heldTerminationSignal
        if held != 0 && !stoppedBeforeWriting.withLock({ $0 }) {
            let name = [SIGINT: "SIGINT", SIGTERM: "SIGTERM", SIGHUP: "SIGHUP", SIGQUIT: "SIGQUIT"][held] ?? "signal \(held)"
            writeStandardError("stopping for \(name) now that the command has run to its end: what it printed above is what it did (the exit status is the signal's, \(128 + held) in a shell)\n")
        }
        return status
    }
    : runReporting(words)
exit(status)
