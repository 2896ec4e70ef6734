import Foundation
import Synchronization
import HSMSigner
import SignerIPC

func exitCode(for error: HSMError) -> ExitCode {
    // A token without a user PIN is a set-up problem, not a failure of signctl.
    if error.returnValue == .userPinNotInitialized { return .config }
    return switch error.code {
    // A new PIN refused for its length or form, by signctl's check against
    // C_GetTokenInfo's limits or by C_SetPIN/C_InitPIN: bad input, not a
    // PIN the token refused to log in with.
    case .pinInvalid: .dataError
    case .keyNotFound, .keyExists, .keyIDConflict, .keyDuplicate, .keyInvalid, .verificationFailed: .dataError
    case .invalidURI, .pinSourceInsecure, .pinSourceUnreadable, .moduleNotFound, .moduleInsecure: .config
    case .pinRejected: .noPermission
    // token_not_found, token_unavailable, session_unavailable, sign_timeout
    // and pkcs11_failure (C_Initialize refused, a device error): the token or
    // its module cannot serve, as signerd's exit 69 says for the same faults.
    default: .unavailable
    }
}

func hint(for error: HSMError) -> String? {
    if error.returnValue == .userPinNotInitialized {
        return "the token has no user PIN (an earlier token init stopped half-way): run signctl token init again with the same label and SO PIN file to set it"
    }
    if error.returnValue == .pinLenRange {
        return "write a PIN of a length the token takes into the PIN file"
    }
    if error.code == .pkcs11Failure, error.function == PKCS11Function.signInit.rawValue, let rv = error.returnValue, PKCS11ReturnValue.objectFailures.contains(rv) {
        return "for SoftHSM, free space where directories.tokendir of its softhsm2.conf points (df), or run signctl as the owner of that directory; then import again"
    }
    if let flags = error.userPINFlags, flags & UserPINFlags.finalTry != 0 {
        return "signctl does not spend the last try: check that the PIN file holds the right PIN (the token's counter resets at the next right login), then run the command again with --final-try"
    }
    return switch error.code {
    case .keyIDConflict: namesakeListingHint
    case .pinNotStored: "for SoftHSM, free space where directories.tokendir of its softhsm2.conf points (df, and ulimit -f) before you change the PIN again; do not put the new PIN in the PIN files"
    case .keyNotStored: "free space where the token stores its objects (for SoftHSM: df on directories.tokendir of its softhsm2.conf, and ulimit -f), then import the same file again with --replace; signctl keys list shows what is left, and signctl keys delete --incomplete --yes removes incomplete objects"
    case .keyExists: "pass --replace to replace the key on the token"
    case .keyDuplicate: "check that the file is the key App Store Connect lists under the key ID you import it as; if the same key must really carry both key IDs, pass --allow-duplicate-key"
    case .pinRejected: "check the PIN source; signctl does not retry a refused PIN (tokens lock after a few tries)"
    case .tokenNotFound: "check token= in token_uri (list tokens with: p11-kit list-modules); for SoftHSM, export SOFTHSM2_CONF=<dir>/softhsm2.conf of the token scripts/softhsm-setup.sh made. "
        + "A SoftHSM token that was there before and now counts as uninitialized was being rewritten by another program at that moment (run the command again), "
        + "or, if it stays so, had its token.object cut short (a process ended while writing it, a full disk, a file size limit): then restore the copy of its token directory"
    case .pinSourceInsecure where error.fileOwner != nil: "chown the PIN file to root or to the user signctl runs as (and chmod 0600 it)"
    case .pinSourceInsecure: "chmod 0600 the PIN file"
    case .pinSourceUnreadable: "the PIN file must be a regular file this user can read, with the PIN alone on one line"
    case .pkcs11Failure: pkcs11FailureHint(function: error.function)
    default: nil
    }
}

/// How to find a key object signctl did not make and leaves alone (a
/// namesake of a key ID), so that the tool that made it can remove or
/// relabel it.
let namesakeListingHint = "list the token's objects with: p11tool --list-all (gnutls-bin) or pkcs11-tool --list-objects (opensc)"

/// The note signctl writes on stderr about key objects that carry a key ID
/// and that it leaves alone (``HSMToken/keyNamesakes(keyID:)``,
/// ``HSMToken/labelOnlyKeyObjects()``): `note: <lead>: <descriptions>,
/// which signctl did not make; <they stop keys import …>`, then a hint
/// line saying how to remove them with the tool that made them.
/// - Parameters:
///   - lead: what the note is about (`left alone on token signer`).
///   - objects: the objects' descriptions.
///   - keyIDs: the key IDs whose import they stop.
func namesakeNote(_ lead: String, _ objects: [String], blocking keyIDs: [String]) -> String {
    let (it, stops) = objects.count == 1 ? ("it", "it stops") : ("them", "they stop")
    return "note: \(lead): \(objects.joined(separator: "; ")), which signctl did not make; "
        + "signerd never signs with \(it) (it signs with the EC key whose CKA_ID is the key ID), and \(stops) keys import of \(keyIDs.joined(separator: ", ")) (key_id_conflict)\n"
        + "hint: signctl leaves \(it) alone (keys delete, with or without --incomplete, too): remove or relabel \(it) with the tool that made \(it); \(namesakeListingHint)\n"
}

/// What to check when the module itself failed. Before a token is found
/// (`C_Initialize`, `C_GetSlotList`) that is the module and its own
/// configuration, which for SoftHSM is the file `SOFTHSM2_CONF` names.
func pkcs11FailureHint(function: String?) -> String {
    // A write the token refused: for SoftHSM, a token directory this user
    // may not write (CKR_FUNCTION_FAILED from C_DestroyObject).
    let writes = Set([PKCS11Function.createObject, .destroyObject, .setPIN, .initPIN, .initToken].map(\.rawValue))
    if let function, writes.contains(function) {
        return "the token refused the write: for SoftHSM, the token's directory (under directories.tokendir of its softhsm2.conf) must be writable by the user signctl runs as (run signctl as its owner) and have free space; for an HSM, check the device and the module's own logs"
    }
    let starting: Set<String?> = [PKCS11Function.initialize.rawValue, PKCS11Function.getSlotList.rawValue]
    guard starting.contains(function) else {
        return "the token or its module failed: check the device (or the network path to the HSM) and the module's own logs, then try again"
    }
    let conf = ProcessInfo.processInfo.environment["SOFTHSM2_CONF"].map { "SOFTHSM2_CONF is \($0)" } ?? "SOFTHSM2_CONF is not set (SoftHSM then reads /etc/softhsm/softhsm2.conf)"
    return "the PKCS#11 module could not start: check module-path in token_uri and the module's own configuration; "
        + "for SoftHSM, SOFTHSM2_CONF must name a readable softhsm2.conf whose directories.tokendir exists (\(conf))"
}

/// Opens the token of the configuration; signctl logs only warnings and worse.
func openToken(configPath: String) throws -> HSMToken {
    try openToken(loadConfiguration(configPath), configPath: configPath, options: operatorTokenOptions())
}

/// The token options of signctl's commands: two sessions, warnings for a
/// person (``operatorLogger()``), and the last PIN try kept unless
/// `--final-try` was given.
func operatorTokenOptions() -> TokenOptions {
    var options = TokenOptions()
    options.sessionPoolSize = 2
    options.logger = operatorLogger()
    options.loginOnFinalTry = loginOnFinalTry
    return options
}

/// The token's warnings for a person at a terminal, as signctl writes its
/// own on stderr, not as the daemon's JSON log lines:
/// `warning: pin_count_low: final_try=false token.label=signer` (fields by
/// name), then `hint: …` on a line of its own.
func operatorLogger() -> Logger {
    Logger(minimumLevel: .warning) { level, message, metadata in
        let fields = metadata.filter { $0.key != "hint" }.sorted { $0.key < $1.key }.map { "\($0.key)=\($0.value)" }
        var text = "\(level == .warning ? "warning" : "error"): \(message)"
        if !fields.isEmpty { text += ": " + fields.joined(separator: " ") }
        if let hint = metadata.first(where: { $0.key == "hint" })?.value { text += "\nhint: \(hint)" }
        writeStandardError(text + "\n")
    }
}

/// Opens the token of `config` for a command that writes to it
/// (`keys import`, `keys delete`, `token change-pin`), after
/// ``refuseRootOnOthersSoftHSMTokens(module:rerun:)``.
func openTokenForWriting(_ config: SignerConfiguration, configPath: String) throws -> HSMToken {
    let uri = try PKCS11URI(config.tokenURI)
    try refuseRootOnOthersSoftHSMTokens(module: uri.module, rerun: "signctl --config \(configPath) …")
    return try openToken(config, configPath: configPath, options: operatorTokenOptions())
}

/// Refuses to write, as root, to SoftHSM token directories another user
/// owns. SoftHSM keeps each object in a file of its own, created with the
/// writer's uid and mode 0600: objects root creates there are invisible to
/// signerd's user, which then reports the key missing while root's
/// `keys list` shows it (and root's `--replace` removes signerd's copy).
/// Only for SoftHSM (the module's file name says so), whose token
/// directory is `directories.tokendir` of `SOFTHSM2_CONF` (or
/// /etc/softhsm/softhsm2.conf).
/// - Parameters:
///   - module: the PKCS#11 module of the token URI or `--module`.
///   - rerun: the command line the hint shows after `runuser -u USER --`.
/// - Throws: ``CommandFailure`` (exit 77) naming the owner and how to run as it.
func refuseRootOnOthersSoftHSMTokens(module: String?, rerun: String) throws {
    guard geteuid() == 0, let tokenDirectory = SoftHSMFiles.tokenDirectory(module: module) else { return }
    let entries = ((try? FileManager.default.contentsOfDirectory(atPath: tokenDirectory)) ?? []).sorted()
    // Every directory another user owns, the token directory itself first.
    var owned: [(path: String, uid: uid_t)] = []
    for path in [tokenDirectory] + entries.map({ tokenDirectory + "/" + $0 }) {
        var info = stat()
        guard stat(path, &info) == 0, (info.st_mode & S_IFMT) == S_IFDIR, info.st_uid != 0 else { continue }
        owned.append((path, info.st_uid))
    }
    guard let first = owned.first else { return }
    var owners: [uid_t] = []
    for entry in owned where !owners.contains(entry.uid) { owners.append(entry.uid) }
    let described = owners.map { uid in
        let name = SoftHSMFiles.userName(uid, bare: true)
        return name == String(uid) ? "uid \(uid)" : "uid \(uid) (\(name))"
    }.joined(separator: ", ")
    // In a directory several users share, the hint prefers signerd's own user.
    let runAs = owners.first { SoftHSMFiles.userName($0) == "signerd" } ?? first.uid
    throw CommandFailure(.noPermission, "signctl runs as root, but SoftHSM's token directory \(first.path) belongs to \(owners.count == 1 ? described : "another user (the directories in \(tokenDirectory) belong to \(described))"): SoftHSM writes each object as a file of the writer's own, so what root writes there only root can read, and signerd would not see it; nothing was changed",
                         hint: "run signctl as the user signerd runs as: runuser -u \(SoftHSMFiles.userName(runAs, bare: true)) -- \(rerun)",
                         errorCode: "token_directory_owner")
}

/// `token`, checked to be still in storage when a file size limit
/// (`fileSizeLimit`, bytes) is in force that signctl could not lift: the login that opened it may then have
/// cut SoftHSM's token file short, and no command may report success on a
/// token that is gone.
/// - Throws: ``HSMError`` `token_not_found` saying so (the token is closed).
func stillInStorage(_ token: HSMToken, fileSizeLimit: UInt64?) throws -> HSMToken {
    guard let bytes = fileSizeLimit else { return token }
    do throws(HSMError) {
        try token.confirmTokenInStorage()
    } catch {
        guard error.code == .tokenNotFound else { throw error }
        token.close()
        var gone = error
        let limit = String(bytes)
        gone.message = "token \(token.label) was found and logged in to, and is gone once read again from its storage: SoftHSM's token file was cut short as it was rewritten at that login (the file size limit is \(limit) bytes); restore the copy of its token directory, and run with no file size limit"
        throw gone
    }
    return token
}

/// Opens the token `config.tokenURI` names, with termination signals held
/// while it logs in (SoftHSM rewrites its token file at `C_Login`); a PIN
/// file signctl cannot read fails with a hint that names the configuration
/// it came from.
/// - Throws: ``CommandFailure`` (exit 78) for `pin_source_unreadable`, and
///   (exit 77) for `pin_rejected` naming the PIN file; else the ``HSMError``
///   of ``HSMToken/init(uri:options:)``.
func openToken(_ config: SignerConfiguration, configPath: String, options: TokenOptions) throws -> HSMToken {
    let uri = try PKCS11URI(config.tokenURI)
    try lockSoftHSMTokens(module: uri.module)
    let fileSizeLimit = ProcessControl.raiseFileSizeLimit()
    if let limit = fileSizeLimit, let problem = SoftHSMFiles.loginWouldCut(limit: limit, module: uri.module) {
        throw CommandFailure(.config, "file_size_limit: \(problem)", hint: "ulimit -f unlimited (in the shell signctl runs from), or remove LimitFSIZE= from the unit",
                             errorCode: "file_size_limit")
    }
    do {
        // SoftHSM rewrites its token file at C_Login as well.
        let token = try ProcessControl.holdingTerminationSignals { try HSMToken(uri: uri, options: options) }
        return try ProcessControl.holdingTerminationSignals { try stillInStorage(token, fileSizeLimit: fileSizeLimit) }
    } catch let error as HSMError where error.code == .pinSourceUnreadable {
        throw CommandFailure(error, hint: pinSourceHint(uri.pinSource, configPath: configPath))
    } catch let error as HSMError where error.code == .tokenNotFound || (error.code == .pkcs11Failure && error.function == PKCS11Function.initialize.rawValue) {
        // For SoftHSM, a token this user cannot read (made as root) is listed
        // as uninitialized, and a token directory it cannot read fails C_Initialize.
        let unreadable = SoftHSMFiles.unreadableTokens(module: uri.module)
        throw CommandFailure(error, hint: [unreadable, hint(for: error)].compactMap { $0 }.joined(separator: ". Otherwise: "))
    } catch let error as HSMError where error.code == .pinRejected {
        // Which PIN the token refused, by where it came from: the path, never the PIN.
        let source = uri.pinSource.flatMap(PKCS11URI.pinFilePath).map { "the PIN file \($0)" } ?? "the pin-value"
        // SoftHSM finds tokens through SOFTHSM2_CONF: the quick start's and a
        // service's token may share a label, and the PIN then went to the other.
        let module = uri.module
        let softHSM = SoftHSMFiles.tokenDirectory(module: module).map { directory in
            "; SoftHSM looked in \(directory) (" + (ProcessInfo.processInfo.environment["SOFTHSM2_CONF"].map { "SOFTHSM2_CONF is \($0)" } ?? "SOFTHSM2_CONF is not set")
                + "): if that is not the token this configuration is for, a token there with the same label got the PIN, and export SOFTHSM2_CONF=<its softhsm2.conf> first"
        } ?? ""
        throw CommandFailure(error, message: "\(error.description) (the PIN read from \(source) that token_uri of \(configPath) names)", hint: (hint(for: error) ?? "") + softHSM)
    }
}

/// Waits for any other signctl working on the same SoftHSM tokens
/// (``SoftHSMFiles/lockTokens(in:timeout:shouldStop:waiting:)``), saying so on
/// stderr, for up to ``tokenLockSeconds``; the lock is then held until
/// signctl exits. Nothing for a module that is not SoftHSM.
/// - Throws: ``CommandFailure`` (75, try again) when the wait runs out.
func lockSoftHSMTokens(module: String?) throws {
    guard heldTokenLock.withLock({ $0 == nil }), let directory = SoftHSMFiles.tokenDirectory(module: module) else { return }
    let outcome = ProcessControl.beforeTokenWrite {
        SoftHSMFiles.lockTokens(in: directory, timeout: tokenLockSeconds, shouldStop: { ProcessControl.heldTerminationSignal != 0 }) { holder in
            writeStandardError("waiting: another process\(holder.map { " (\($0))" } ?? "") holds the lock on the SoftHSM tokens in \(directory)\n")
        }
    }
    switch outcome {
    case .held(let lock): heldTokenLock.withLock { $0 = lock }
    case .notApplicable(nil): break
    case .notApplicable(let problem?):
        writeStandardError("warning: going on without the SoftHSM token lock: \(problem); once it is removed, signctl makes the lock file again\n")
    case .stopped:
        // The signal is raised again once the command returns; nothing was written.
        stoppedBeforeWriting.withLock { $0 = true }
        throw CommandFailure(.tempFail, "stopped while waiting for the lock on the SoftHSM tokens in \(directory): nothing was changed", errorCode: "interrupted")
    case .timedOut(let holder):
        throw CommandFailure(.tempFail, "another process\(holder.map { " (\($0))" } ?? "") has held the lock on the SoftHSM tokens in \(directory) for \(Int(tokenLockSeconds)) s (signctl takes it so that two commands never rewrite SoftHSM's token files at once)",
                             hint: "let that process finish (signctl bench --direct holds it for its whole run), then run this command again",
                             errorCode: "token_lock_timeout")
    }
}

/// The SoftHSM token lock this signctl holds, kept until it exits.
let heldTokenLock = Mutex<SoftHSMFiles.TokenLock?>(nil)

/// Set when a held signal stopped signctl while it waited for that lock,
/// before the command did anything.
let stoppedBeforeWriting = Mutex(false)

/// How long signctl waits for another signctl using the same SoftHSM tokens, in seconds.
let tokenLockSeconds = 60.0

/// What to do about a `pin-source` signctl cannot read. systemd's
/// credentials (`LoadCredential=`, under /run/credentials/) exist only
/// inside the running service, so the service's own configuration never
/// works for signctl.
func pinSourceHint(_ pinSource: String?, configPath: String) -> String {
    if let path = pinSource.flatMap(PKCS11URI.pinFilePath), PKCS11URI.isSystemdCredential(path) {
        return "\(path) is systemd's copy of the PIN (LoadCredential=), which exists only inside the running service; "
            + "give signctl a configuration of its own, --config FILE, whose token_uri has pin-source=file: naming a PIN file this user can read "
            + "(docs/OPERATIONS.md: /etc/signerd/signctl.json)"
    }
    return "signctl reads the PIN from the pin-source in token_uri of \(configPath): the PIN alone on one line, in a file this user can read; "
        + "or pass --config FILE with a pin-source it can read"
}

func tokenInit(_ words: [String]) throws -> ExitCode {
    let arguments = try Arguments(words, options: ["label", "pin-file", "so-pin-file", "module"], flags: ["json"])
    if arguments.flag("help") {
        print("usage: signctl token init --label LABEL --pin-file F --so-pin-file F [--module PATH] [--json]\n\nInitializes a free token (SoftHSM's module unless --module; no configuration is read) and sets its PINs,\nread from files no other user may read (mode 0600, or 0640 with signerd's group).\nIdempotent: an initialized token with the label is left alone; one without a user PIN gets it.\nBoth PINs are checked against the token's PIN length limits before anything changes.\nThe same PIN as user and SO PIN is allowed, with a warning on stderr.")
        return .success
    }
    _ = try arguments.positionals(0, "")
    let label = try arguments.required("label")
    // The label field of CK_TOKEN_INFO is 32 bytes, blank-padded (PKCS#11 §3.2).
    guard (1...32).contains(label.utf8.count) else {
        throw UsageError("--label is \(label.utf8.count) bytes; a token label is 1 to 32 bytes (UTF-8)", hint: "pick a shorter label, such as signerd")
    }
    let module = arguments.options["module"] ?? "/usr/lib/softhsm/libsofthsm2.so"
    let (soPINFile, userPINFile) = (try arguments.required("so-pin-file"), try arguments.required("pin-file"))
    let soPIN = try TokenAdministration.readPINFile(soPINFile)
    let userPIN = try TokenAdministration.readPINFile(userPINFile)
    try lockSoftHSMTokens(module: module)
    // Only when a write would happen: a token already made is left alone, as root or not.
    if geteuid() == 0, try TokenAdministration.initializationWouldWrite(modulePath: module, label: label) {
        try refuseRootOnOthersSoftHSMTokens(module: module, rerun: "signctl token init …")
    }
    let outcome = try ProcessControl.holdingTerminationSignals {
        try TokenAdministration.initializeToken(modulePath: module, label: label, soPIN: soPIN, userPIN: userPIN)
    }
    if arguments.flag("json") {
        let (serial, name): (String, String) = switch outcome {
        case .initialized(let serial): (serial, "initialized")
        case .alreadyInitialized(let serial): (serial, "already_initialized")
        case .userPINSet(let serial): (serial, "user_pin_set")
        }
        printJSON(TokenInitEntry(token_label: label, serial: serial, outcome: name))
    } else {
        switch outcome {
        case .initialized(let serial): print("initialized token \(label) (serial \(serial))")
        case .alreadyInitialized(let serial): print("token \(label) already initialized (serial \(serial)); left unchanged, and its PINs were not checked against the PIN files")
        case .userPINSet(let serial): print("token \(label) was initialized without a user PIN (serial \(serial)); set the user PIN")
        }
    }
    // SoftHSM writes the token's files mode 0600 for root: the service's
    // user (the shipped unit runs as signerd) could not read them.
    if geteuid() == 0, case .initialized = outcome, let service = getpwnam("signerd"), service.pointee.pw_uid != 0,
       let directory = SoftHSMFiles.tokenDirectory(module: module) {
        writeStandardError(("warning: token \(label) was made as root, in \(directory): SoftHSM wrote its files for root alone, so signerd running as the user signerd cannot use it; "
            + "unless signerd runs as root, delete it (softhsm2-util --delete-token --token \(label)) and run: runuser -u signerd -- signctl token init …\n"))
    }
    // Allowed (a development token), but whoever holds the user PIN can then
    // also act as security officer: set a new user PIN, or wipe the token.
    if soPIN.hasSameBytes(as: userPIN) {
        writeStandardError(("warning: the user PIN (--pin-file \(userPINFile)) and the SO PIN (--so-pin-file \(soPINFile)) are the same: "
            + "whoever can log in as the user can also act as security officer (C_InitPIN, C_InitToken); use a different SO PIN, kept apart from signerd's files\n"))
    }
    return .success
}

/// `signctl token change-pin --new-pin-file F`: logs in with the PIN the
/// configuration's pin-source gives and changes it (`C_SetPIN`).
func tokenChangePIN(_ words: [String], configPath: String) throws -> ExitCode {
    let arguments = try Arguments(words, options: ["new-pin-file"], flags: ["json"])
    if arguments.flag("help") {
        print("""
        usage: signctl [--config FILE] token change-pin --new-pin-file F [--json]

        Logs in to the token of token_uri with the PIN its pin-source gives, and changes that
        user PIN to the one in F (C_SetPIN; F is read like a pin-source: one line, no other
        user may read it). Run it as the user signerd runs as (SoftHSM keeps its files per user).
        Then write the new PIN into every PIN file (signerd's pin-source or LoadCredential=
        source, and signctl's), and restart signerd (systemctl restart signerd) when systemd
        passes it the PIN with LoadCredential=, as the shipped unit does: a reload would read
        systemd's old copy; reload it when its pin-source names the file itself. It keeps its
        login until then, but could not log in again with the old PIN.
        A new PIN equal to the current one is refused (exit 65) before the token is touched.
        """)
        return .success
    }
    _ = try arguments.positionals(0, "")
    let newPINFile = try arguments.required("new-pin-file")
    let newPIN = try TokenAdministration.readPINFile(newPINFile)
    // C_SetPIN would take the PIN the token has already: refused here, before
    // any login, as the file's fault (a PIN source signctl cannot read is
    // left to openToken, which says why).
    let config = try loadConfiguration(configPath)
    let uri = try PKCS11URI(config.tokenURI)
    if let current = try? uri.readPIN(), current.hasSameBytes(as: newPIN) {
        let source = uri.pinSource.flatMap(PKCS11URI.pinFilePath).map { "the PIN file \($0)" } ?? "the pin-value"
        throw CommandFailure(.dataError, "the new PIN (--new-pin-file \(newPINFile)) is the same as the current one, from \(source) that token_uri of \(configPath) names; nothing was sent to the token",
                             hint: "write the new PIN, different from the current one, into \(newPINFile)",
                             errorCode: "pin_unchanged")
    }
    let token = try openTokenForWriting(config, configPath: configPath)
    defer { token.close() }
    try ProcessControl.holdingTerminationSignals { try token.changeUserPIN(to: newPIN) }
    // Read back from storage: SoftHSM answers C_SetPIN with CKR_OK when it
    // cannot write its token file, and the token is then gone.
    try token.confirmPINStored()
    if arguments.flag("json") {
        printJSON(PINChangeEntry(token_label: token.label, pin_changed: true))
        return .success
    }
    print("changed the user PIN of token \(token.label)")
    print("next: write the new PIN into every PIN file (signerd's and signctl's), then systemctl restart signerd "
        + "(LoadCredential=, the shipped unit: a reload would read systemd's old copy), or systemctl reload signerd when its pin-source names the file itself")
    return .success
}

/// The one positional of `keys export-public` and `keys delete`, checked
/// before the token is opened, so a mistyped ID is a usage error (exit 64)
/// rather than `key_not_found`.
/// - Throws: ``UsageError`` unless it is 10 characters A-Z0-9.
func keyIDArgument(_ arguments: Arguments) throws -> String {
    let keyID = try arguments.positionals(1, "KEY_ID")[0]
    guard KeyID.isValid(keyID) else {
        throw UsageError("KEY_ID must be 10 characters A-Z0-9, as App Store Connect shows it; got \(keyID)", hint: "list the key IDs on the token with: signctl keys list")
    }
    return keyID
}

func keysImport(_ words: [String], configPath: String) throws -> ExitCode {
    let arguments = try Arguments(words, options: ["key-id"], flags: ["replace", "json", "force-key-id", "allow-duplicate-key"])
    if arguments.flag("help") {
        print("usage: signctl keys import [--key-id ID [--force-key-id]] [--replace] [--allow-duplicate-key] [--json] FILE.p8\n\nThe key ID comes from an AuthKey_<ID>.p8 or SubscriptionKey_<ID>.p8 file name unless given\n(a browser's second copy, SubscriptionKey_<ID> (1).p8, and .P8 included).\nA --key-id other than the one in such a name is refused unless --force-key-id is given.\nA key already on the token under another key ID is refused (exit 65, naming that key ID)\nunless --allow-duplicate-key is given; --replace of a key ID with its own key is not a duplicate.")
        return .success
    }
    let path = try arguments.positionals(1, "the key file (FILE.p8)")[0]
    // A file that is not there is the problem to name, not the key ID its name lacks.
    do {
        try ECPrivateKeyMaterial.checkFileOpens(path)
    } catch {
        // The file, or a directory on its path this user may not search (as verify's --public-key).
        var info = stat()
        let searchDenied = stat(path, &info) != 0 && errno == EACCES
        guard let unreadable = unreadableFile(path) ?? (searchDenied ? "this user (uid \(geteuid())) may not search a directory on the path to \(path)" : nil) else { throw error }
        // This user may not read it: a permission problem (sysexits 77), not bad data.
        throw CommandFailure(.noPermission, error.description, hint: "\(unreadable): run signctl as the file's owner or as root", errorCode: error.code.rawValue)
    }
    let nameKeyID = ECPrivateKeyMaterial.keyID(fromFileName: path)
    guard let keyID = arguments.options["key-id"] ?? nameKeyID else {
        let reason = ECPrivateKeyMaterial.keyIDProblem(fileName: path).map { ": \($0)" } ?? ""
        throw UsageError("cannot tell the key ID from the file name \(path)\(reason)", hint: "pass --key-id ID (10 characters A-Z0-9, as App Store Connect shows it)")
    }
    guard KeyID.isValid(keyID) else {
        throw UsageError("--key-id must be 10 characters A-Z0-9; got \(keyID)")
    }
    if arguments.flag("force-key-id") && arguments.options["key-id"] == nil {
        throw UsageError("--force-key-id needs --key-id: it lets a --key-id other than the file name's stand", hint: "pass --key-id ID with it, or leave both out to use \(keyID) from the file name")
    }
    if let nameKeyID, nameKeyID != keyID, !arguments.flag("force-key-id") {
        throw UsageError("--key-id \(keyID) differs from the key ID \(nameKeyID) in the file name: Apple names the file it delivers after the key's ID, and a signature made under the wrong key ID is refused by the App Store",
                         hint: "leave out --key-id to use \(nameKeyID), or add --force-key-id if the file was renamed")
    }
    let material = try ECPrivateKeyMaterial(contentsOf: path)
    if material.hasOtherText {
        // OpenSSL skips what surrounds the key: a file put together by hand may not be the one meant.
        writeStandardError("warning: \(path) holds more than the private key (a certificate, a public key, or other text before it); only the private key is read: check that it is the key App Store Connect lists under key ID \(keyID)\n")
    }
    let token = try openTokenForWriting(loadConfiguration(configPath), configPath: configPath)
    defer { token.close() }
    // key_exists would say "pass --replace" about a key that signs nothing.
    if !arguments.flag("replace"), try token.publicKeyOnlyIDs().contains(keyID) {
        throw CommandFailure(.dataError, "key_exists: only a public key object with key ID \(keyID) is on token \(token.label), with no private key (left by an import or a tool that stopped half-way)",
                             hint: "remove it with: signctl keys delete \(keyID) --yes (or pass --replace)",
                             errorCode: "key_exists")
    }
    let result = try ProcessControl.holdingTerminationSignals {
        // Read back from storage, as signerd will read it, before the old
        // key goes: SoftHSM answers an import it could not write with
        // CKR_OK, and its self-test passes in this process.
        try token.importKey(material, keyID: keyID, replace: arguments.flag("replace"), allowDuplicateKey: arguments.flag("allow-duplicate-key"), confirmingStorage: true)
    }
    if !result.duplicateOf.isEmpty {
        writeStandardError("note: the same key is also on token \(token.label) as key ID \(result.duplicateOf.joined(separator: ", ")) (--allow-duplicate-key)\n")
    }
    if arguments.flag("json") {
        printJSON(KeyImportEntry(key_id: result.keyID, fingerprint: result.publicKey.fingerprint, replaced: result.replaced, token_label: token.label))
    } else {
        // A CLI audit: --replace with the key already there said "replaced the old key".
        let replaced = result.replacedSameKey ? " (it already held this key; its objects were written again)" : result.replaced ? " (replaced the old key)" : ""
        print("imported \(result.keyID) into token \(token.label)\(replaced): non-extractable, self-test signature verified")
        print("public key SHA-256 fingerprint: \(result.publicKey.fingerprint)")
        print("the .p8 file is no longer needed on this host; keep the original offline")
    }
    return .success
}

/// What `keys import --json` prints; `replaced` is a JSON boolean.
struct KeyImportEntry: Encodable {
    let key_id: String
    let fingerprint: String
    let replaced: Bool
    let token_label: String
}

/// What `keys export-public --json` prints: `fingerprint` as in ``KeyImportEntry``.
struct PublicKeyEntry: Encodable {
    let key_id: String
    let public_key_pem: String
    let fingerprint: String
}

/// What `keys delete --json` prints; no `key_id` for `--incomplete`.
struct KeyDeletionEntry: Encodable {
    let key_id: String?
    let token_label: String
    let objects_deleted: Int
    /// The codes of the warnings written on stderr (`key_still_configured`),
    /// so that a script reading stdout sees them too.
    var warnings: [String] = []
}

/// What `token init --json` prints: the token, its serial number, and
/// which of the three outcomes it was.
struct TokenInitEntry: Encodable {
    let token_label: String
    let serial: String
    /// `initialized`, `already_initialized` or `user_pin_set`.
    let outcome: String
}

/// What `token change-pin --json` prints once the new PIN is stored.
struct PINChangeEntry: Encodable {
    let token_label: String
    let pin_changed: Bool
}

struct KeyListEntry: Encodable {
    let key_id: String
    let label: String
    let curve: String?
    /// False for a public key object without a private key (it signs nothing).
    let private_key_object: Bool
    let public_key_object: Bool
    let extractable: Bool?
    let sensitive: Bool?
    let fingerprint: String?
}

func keysList(_ words: [String], configPath: String) throws -> ExitCode {
    let arguments = try Arguments(words, options: [], flags: ["json"])
    if arguments.flag("help") {
        print("usage: signctl keys list [--json]\n\nPrivate keys with their public key objects, then public key objects whose private key is missing\n(\"public key only\"; private_key_object false in --json), which block an import of their key ID.\nIncomplete key objects (no key ID, label or curve: left by a write that stopped half-way)\nare counted in a note on stderr.")
        return .success
    }
    _ = try arguments.positionals(0, "")
    let token = try openToken(configPath: configPath)
    defer { token.close() }
    let keys = try token.listKeys()
    let publicOnly = try token.publicKeyOnlyIDs()
    // What signerd would find wrong with a key (two private keys or two
    // public keys under its key ID after a replacement that stopped
    // half-way), in signerd's words, with its advice.
    for keyID in Set(keys.map(\.keyID)).sorted() where !keyID.isEmpty {
        do throws(HSMError) {
            _ = try token.publicKey(keyID: keyID)
        } catch {
            guard error.code == .keyInvalid else { continue }
            writeStandardError("warning: key_invalid: \(error.message)\n")
        }
    }
    let labelOnly = try token.labelOnlyKeyObjects()
    if !labelOnly.isEmpty {
        // On stderr, as the incomplete objects below: --json stays a list of keys.
        writeStandardError(namesakeNote("token \(token.label) holds key objects with no CKA_ID labelled with a key ID", labelOnly.map(\.description),
                                                         blocking: Array(Set(labelOnly.map(\.label))).sorted()))
    }
    let incomplete = try token.incompleteKeyObjectCount()
    if incomplete > 0 {
        // On stderr, so that --json stays a list of keys.
        writeStandardError("note: token \(token.label) holds \(incomplete) incomplete key \(incomplete == 1 ? "object" : "objects") (no key ID, label or curve), left by a write that stopped half-way; \(incomplete == 1 ? "it signs" : "they sign") nothing\nhint: remove \(incomplete == 1 ? "it" : "them") with: signctl keys delete --incomplete --yes\n")
    }
    if arguments.flag("json") {
        printJSON(keys.map {
            KeyListEntry(key_id: $0.keyID, label: $0.label, curve: $0.curve?.rawValue, private_key_object: true, public_key_object: $0.hasPublicKey,
                         extractable: $0.extractable, sensitive: $0.sensitive, fingerprint: $0.fingerprint)
        } + publicOnly.map {
            KeyListEntry(key_id: $0, label: "", curve: nil, private_key_object: false, public_key_object: true,
                         extractable: nil, sensitive: nil, fingerprint: nil)
        })
        return .success
    }
    if keys.isEmpty && publicOnly.isEmpty {
        print("no keys on token \(token.label)")
        return .success
    }
    func flag(_ value: Bool?) -> String { value.map { $0 ? "true" : "false" } ?? "?" }
    // Labels are shown when one differs from its key ID (signctl gives both
    // the same value): a key another tool made, whose label may be taken for its ID.
    let showLabels = keys.contains { $0.label != $0.keyID }
    print("KEY ID      CURVE  PUBLIC  EXTRACTABLE  SENSITIVE  SHA-256 FINGERPRINT" + (showLabels ? String(repeating: " ", count: 47) + "LABEL" : ""))
    for key in keys {
        let columns = [
            key.keyID.padding(toLength: 10, withPad: " ", startingAt: 0),
            (key.curve?.rawValue ?? "?").padding(toLength: 5, withPad: " ", startingAt: 0),
            (key.hasPublicKey ? "yes" : "no").padding(toLength: 6, withPad: " ", startingAt: 0),
            flag(key.extractable).padding(toLength: 11, withPad: " ", startingAt: 0),
            flag(key.sensitive).padding(toLength: 9, withPad: " ", startingAt: 0),
            showLabels ? (key.fingerprint ?? "-").padding(toLength: 64, withPad: " ", startingAt: 0) + "  " + key.label : key.fingerprint ?? "-",
        ]
        print(columns.joined(separator: "  "))
    }
    for keyID in publicOnly {
        print("\(keyID.padding(toLength: 10, withPad: " ", startingAt: 0))  public key only, no private key: signs nothing; remove it with signctl keys delete \(keyID) --yes")
    }
    return .success
}

func keysExportPublic(_ words: [String], configPath: String) throws -> ExitCode {
    let arguments = try Arguments(words, options: [], flags: ["json"])
    if arguments.flag("help") {
        print("usage: signctl keys export-public KEY_ID [--json]\n\nWrites the PEM SubjectPublicKeyInfo to stdout, byte-identical to `openssl ec -in FILE.p8 -pubout`.\nWith --json: {\"key_id\", \"public_key_pem\", \"fingerprint\"} (SHA-256 of the DER SubjectPublicKeyInfo, hex), as keys import --json gives it.")
        return .success
    }
    let keyID = try keyIDArgument(arguments)
    let token = try openToken(configPath: configPath)
    defer { token.close() }
    let publicKey = try exportablePublicKey(token, keyID: keyID)
    if arguments.flag("json") {
        printJSON(PublicKeyEntry(key_id: keyID, public_key_pem: publicKey.pem, fingerprint: publicKey.fingerprint))
    } else {
        FileHandle.standardOutput.write(Data(publicKey.pem.utf8))
    }
    return .success
}

/// The public key `keys export-public` writes: the key's, or, when no
/// private key carries the ID, that of a public key object left without
/// one (with a note on stderr). Any other failure (two private keys under
/// the ID, a token error) is thrown as it is.
func exportablePublicKey(_ token: HSMToken, keyID: String) throws -> ECPublicKey {
    do {
        return try token.publicKey(keyID: keyID)
    } catch {
        guard error.code == .keyNotFound, let orphan = try? token.publicKeyObject(keyID: keyID) else { throw error }
        writeStandardError("note: \(keyID) has only a public key object on the token (no private key: it signs nothing)\n")
        return orphan
    }
}

func keysDelete(_ words: [String], configPath: String) throws -> ExitCode {
    let arguments = try Arguments(words, options: [], flags: ["yes", "incomplete", "json"])
    if arguments.flag("help") {
        print("usage: signctl keys delete KEY_ID --yes [--json]\n       signctl keys delete --incomplete --yes [--json]\n\nRemoves the key's private and public key objects. There is no undo: App Store Connect lets you download a key once.\nWarns key_still_configured when the running signerd (GET /v1/keys on socket_path) still has KEY_ID in keys[],\nor, when no signerd answers there, when keys[] of the configuration file has it (and says which it read).\nWith --incomplete: removes the EC key objects that carry no key ID, label or curve, left by a write\nthat stopped half-way (keys list counts them); no other object is touched.")
        return .success
    }
    if arguments.flag("incomplete") {
        _ = try arguments.positionals(0, "")
        guard arguments.flag("yes") else {
            throw UsageError("deleting incomplete key objects cannot be undone", hint: "add --yes to confirm")
        }
        let token = try openTokenForWriting(loadConfiguration(configPath), configPath: configPath)
        defer { token.close() }
        let removed = try ProcessControl.holdingTerminationSignals { try token.deleteIncompleteKeyObjects() }
        if arguments.flag("json") {
            printJSON(KeyDeletionEntry(key_id: nil, token_label: token.label, objects_deleted: removed))
        } else {
            print(removed == 0 ? "no incomplete key objects on token \(token.label)"
                               : "deleted \(removed) incomplete key \(removed == 1 ? "object" : "objects") from token \(token.label)")
        }
        // Objects with no CKA_ID but a key ID for a label are not incomplete:
        // say that they stay, since they stop an import of that key ID.
        let labelOnly = try token.labelOnlyKeyObjects()
        if !labelOnly.isEmpty {
            writeStandardError(namesakeNote("left alone on token \(token.label), not incomplete (a label, no CKA_ID)", labelOnly.map(\.description),
                                                             blocking: Array(Set(labelOnly.map(\.label))).sorted()))
        }
        return .success
    }
    let keyID = try keyIDArgument(arguments)
    guard arguments.flag("yes") else {
        throw UsageError("deleting \(keyID) cannot be undone", hint: "add --yes to confirm")
    }
    let configuration = try loadConfiguration(configPath)
    // The running daemon's keys[] decides, not signctl's own file; asked
    // before the token is locked and changed.
    let served = configuredKeysOfDaemon(socketPath: configuration.socketPath)
    let token = try openTokenForWriting(configuration, configPath: configPath)
    defer { token.close() }
    let removed = try ProcessControl.holdingTerminationSignals { try token.deleteKey(keyID: keyID) }
    // What carries the key ID and was not deleted stops its next import.
    let namesakes = try token.keyNamesakes(keyID: keyID)
    if !namesakes.isEmpty {
        writeStandardError(namesakeNote("left alone on token \(token.label)", namesakes, blocking: [keyID]))
    }
    // A signerd that still has it configured takes its disappearance for
    // the token's storage going away: every key answers 503 for about a
    // second while the module is reinitialized (OPERATIONS.md, "Retiring a key").
    var warnings: [String] = []
    let outage = "marks the token down for about a second (every key answers 503) before it takes \(keyID) as deleted; "
        + "remove it from keys[] of signerd's configuration and reload signerd before deleting a key"
    switch served {
    case .answered(let keys):
        // A key signerd serves from another token is not the one deleted here.
        if keys.contains(where: { $0.keyID == keyID && $0.tokenLabel == token.label }) {
            writeStandardError("warning: key_still_configured: \(keyID) is in keys[] of the running signerd (GET /v1/keys on \(configuration.socketPath)); it \(outage)\n")
            warnings.append("key_still_configured")
        }
    case .unanswered(let reason, let notRunning):
        if configuration.keys.contains(where: { $0.keyID == keyID }) {
            writeStandardError(("warning: key_still_configured: \(keyID) is in keys[] of \(configPath), signctl's configuration, read because signerd did not answer "
                + "GET /v1/keys on \(configuration.socketPath) (\(reason)); a signerd running with it \(outage)\n"))
            warnings.append("key_still_configured")
        } else if !notRunning {
            // Something listens there that could not say: the file is all signctl has, and it may be out of date.
            writeStandardError(("note: could not ask signerd on \(configuration.socketPath) which keys it serves (\(reason)); keys[] of \(configPath) does not list \(keyID), "
                + "but the running signerd's configuration may, and then it \(outage)\n"))
        }
    }
    if arguments.flag("json") {
        printJSON(KeyDeletionEntry(key_id: keyID, token_label: token.label, objects_deleted: removed, warnings: warnings))
    } else {
        print("deleted \(keyID) from token \(token.label) (\(removed) \(removed == 1 ? "object" : "objects"))")
    }
    return .success
}
