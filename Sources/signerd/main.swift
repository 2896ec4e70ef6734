// signerd: serves signatures made with App Store In-App Purchase keys held in
// a PKCS#11 token, over HTTP/1.1 on a Unix socket. Runs in the foreground and
// logs JSON lines to stderr. SIGTERM/SIGINT: drain and exit 0. SIGHUP: reload.
import Foundation
import HSMSigner
import SignerIPC

#if canImport(Glibc)
import Glibc
#endif

let usage = """
usage: signerd [--config FILE] [--check-config]

  --config FILE    configuration (default \(SignerConfiguration.defaultPath))
  --check-config   check the configuration file, the module file and the PIN
                   file, without opening the token, and exit (0 valid, 78 invalid);
                   warnings (a pin-value, a socket directory not made yet) keep 0
  -h, --help       this help

Signals: SIGTERM/SIGINT stop accepting, finish requests in flight, exit 0;
SIGHUP reloads the configuration (a bad one is refused, the old one stays).
Exit codes: 0 ok, 64 usage, 69 token or socket unavailable, 71 closed standard descriptor,
77 PIN refused, 78 configuration.
"""

func fail(_ code: ExitCode, _ message: String, logger: Logger? = nil, _ metadata: KeyValuePairs<String, LogValue> = [:]) -> Never {
    fail(code, message, logger: logger, fields: metadata.map { ($0.key, $0.value) })
}

/// ``fail(_:_:logger:_:)`` with metadata put together at run time.
func fail(_ code: ExitCode, _ message: String, logger: Logger?, fields: [(key: String, value: LogValue)]) -> Never {
    if let logger {
        logger.log(.critical, message, fields: fields)
    } else {
        FileHandle.standardError.write(Data("error: \(message)\n".utf8))
    }
    exit(code.rawValue)
}

/// Why the directory `socket_path` goes in cannot take the socket now: it
/// does not exist, or is not a directory; nil when it is one.
/// - Parameter socketPath: an absolute path (the configuration checks it).
func socketDirectoryProblem(_ socketPath: String) -> String? {
    let directory = UnixListener.socketDirectory(of: socketPath)
    var info = stat()
    guard stat(directory, &info) == 0 else {
        return "the directory \(directory) of socket_path \(socketPath) cannot be used: \(String(cString: strerror(errno)))"
    }
    guard info.st_mode & S_IFMT == S_IFDIR else {
        return "\(directory), the directory of socket_path \(socketPath), is not a directory"
    }
    return nil
}

/// How to give `socket_path` its directory: systemd makes /run/signerd
/// for the shipped unit; a run by hand needs it made first.
func socketDirectoryHint(_ socketPath: String) -> String {
    let directory = UnixListener.socketDirectory(of: socketPath)
    return "the shipped unit's RuntimeDirectory=signerd makes /run/signerd when the service starts, and with signerd.socket systemd binds the socket; "
        + "to run signerd by hand, make \(directory) first (install -d -o $(id -un) \(directory)) or set socket_path to a directory this user can write"
}

/// "1 key", "2 keys": for systemd's STATUS= line.
func keyCount(_ count: Int) -> String { count == 1 ? "1 key" : "\(count) keys" }

/// Open descriptors signerd wants for `max_connections` connections: every
/// slot libmicrohttpd is given (``HTTPServerOptions/connectionSlots``), two
/// descriptors each, and those kept for the module's files.
func descriptorsWanted(_ maxConnections: Int) -> Int {
    var options = HTTPServerOptions()
    options.connectionLimit = maxConnections
    return ProcessControl.descriptorsNeeded(connections: options.connectionSlots)
}

/// How many connections `max_connections` can have within an open-file
/// limit of `limit` descriptors, with the reserve for root and the daemon's
/// own check kept; and, when fewer than configured, why, for the operator.
/// - Parameters:
///   - configured: `max_connections`.
///   - limit: the open-file limit: the soft one after raising it for the
///     daemon, the hard one (what it could be raised to) for
///     `--check-config`; nil when there is none.
func connectionBudget(_ configured: Int, openFileLimit limit: Int?) -> (maxConnections: Int, problem: String?) {
    let reserve = HTTPServerOptions().connectionSlots - HTTPServerOptions().connectionLimit
    let needed = descriptorsWanted(configured)
    guard let limit, limit < needed else { return (configured, nil) }
    let fitting = ProcessControl.connectionsFitting(openFileLimit: limit) - reserve
    let raise = "raise the hard open-file limit to \(needed) (LimitNOFILE= in the unit, which ships with 8192; ulimit -Hn by hand) or lower max_connections"
    return (max(0, min(configured, fitting)),
            "the open-file limit is \(limit) descriptors, and max_connections \(configured) needs \(needed) (two per connection, with the \(reserve) kept for root "
            + "and signerd's own check, and \(ProcessControl.descriptorsBesidesConnections) for the PKCS#11 module's files and the rest): "
            + (fitting >= 1 ? "max_connections is lowered to \(fitting), so that connections cannot take the descriptors the token needs; \(raise)" : "no connection fits; \(raise)"))
}

/// Gives every key in `keys` a test signature (``HSMToken/selfTest(keyID:)``)
/// and logs `key_unusable`, with a hint, for each one that fails. A failure
/// that is the token's, not the key's (the token down, no session, a
/// timeout, a refused PIN), ends the test with one `self_test_skipped`: every
/// key after it would fail alike, and re-importing keys cannot help.
/// - Parameter stopped: checked before each key; true ends the test there (shutdown).
/// - Returns: the key IDs that failed.
func selfTest(_ keys: [KeyConfiguration], token: HSMToken, logger: Logger, stopped: () -> Bool = { false }) -> [String] {
    var failed: [String] = []
    for key in keys {
        if stopped() { break }
        do {
            try token.selfTest(keyID: key.keyID)
        } catch {
            if token.status != .up || HSMError.Code.tokenProblems.contains(error.code) {
                logger.warning("self_test_skipped", ["key.id": .string(key.keyID), "error": .string(error.code.rawValue),
                                                     "hint": "the token is unavailable, not the keys; /readyz tests them again once it recovers"])
                break
            }
            failed.append(key.keyID)
            let fix = error.code == .keyNotFound ? "import it with signctl keys import"
                : "import its .p8 again with signctl keys import --replace, which replaces every key object with that key ID"
            logger.error("key_unusable", ["key.id": .string(key.keyID), "error": .string(error.code.rawValue), "detail": .string(error.message),
                                          "hint": .string(fix + "; /readyz reports it until then")])
        }
    }
    return failed
}

/// How long signerd waits at start for another process's lock on the
/// SoftHSM tokens, in seconds: under systemd's default `TimeoutStartSec`
/// (90 s), and less than signctl's own wait (60 s).
let startLockSeconds = 30.0

/// How long a running signerd's token recovery (and a reload's login after
/// a refused PIN) waits for another process's lock on the SoftHSM tokens,
/// in seconds (``SoftHSMFiles/RunningTokenLock``): the token is down
/// meanwhile, and a `signctl keys import` or `keys delete` is done well within it.
let recoveryLockSeconds = 2.0

/// Takes signctl's lock on SoftHSM's token directory
/// (``SoftHSMFiles/lockTokens(in:timeout:shouldStop:waiting:)``) for the
/// start: SoftHSM reads its token files at `C_Initialize` and rewrites them
/// at `C_Login`, and a start while another process wrote them (three
/// signerd started at once on one token, a `signctl keys import`) failed
/// with `token_not_found` ("1 uninitialized token") or `C_Login` returning
/// `CKR_USER_PIN_NOT_INITIALIZED`: 2 starts in 27 when measured. A busy lock
/// is logged (`token_lock_wait`, with the holder from /proc/locks) and
/// waited for up to ``startLockSeconds``; after that signerd starts without
/// it (`token_lock_timeout`), since a daemon that does not start signs
/// nothing. A `SIGTERM` or `SIGINT` (blocked, so pending) during the wait
/// ends the start there, before the token is opened: `shutdown_requested`,
/// `signerd_stopped`, exit 0. Once running, signerd takes the lock only
/// for its token recovery (``recoveryLockSeconds``), never for a request:
/// an operator's command must not stop it signing.
/// - Parameters:
///   - directory: SoftHSM's token directory (``SoftHSMFiles/tokenDirectory(module:)``),
///     nil for a module that is not SoftHSM.
///   - logger: where the wait and a lock file signerd cannot use are logged.
/// - Returns: the lock, to release once the socket is bound; nil
///   for a module that is not SoftHSM, a lock file this user may not open
///   (nor write the tokens), or a wait that ran out.
func lockSoftHSMForStart(directory: String?, logger: Logger) -> SoftHSMFiles.TokenLock? {
    guard let directory else { return nil }
    let stopSignals = [SIGTERM, SIGINT]
    let outcome = SoftHSMFiles.lockTokens(in: directory, timeout: startLockSeconds, shouldStop: { ProcessControl.pendingSignal(among: stopSignals) != nil }) { holder in
        logger.warning("token_lock_wait", ["token.directory": .string(directory), "holder": .string(holder ?? "unknown"),
                                           "hint": .string("another process is working on the SoftHSM tokens (signctl keys import, signctl bench --direct, another signerd starting); signerd starts once it is done, or after \(Int(startLockSeconds)) s")])
    }
    switch outcome {
    case .held(let lock):
        return lock
    case .notApplicable(let problem?):
        logger.warning("token_lock_unusable", ["token.directory": .string(directory), "hint": .string("starting without the SoftHSM token lock: \(problem); once it is removed, signctl makes the lock file again")])
    case .timedOut(let holder):
        logger.warning("token_lock_timeout", ["token.directory": .string(directory), "holder": .string(holder ?? "unknown"),
                                              "hint": .string("starting without the SoftHSM token lock after \(Int(startLockSeconds)) s; if the token is not found or its PIN reads as not initialized, start signerd again once that process is done")])
    case .stopped:
        // Nothing was opened yet: no requests to finish, no socket to remove.
        logger.notice("shutdown_requested", ["signal": .int(Int64(ProcessControl.pendingSignal(among: stopSignals) ?? SIGTERM))])
        logger.notice("signerd_stopped", ["drained": .bool(true), "backlog_connections": .int(0)])
        exit(0)
    case .notApplicable(nil):
        break
    }
    return nil
}

/// The file size limit after raising the soft one to the hard one, when
/// finite, and the problem when it is smaller than SoftHSM's largest token
/// file (a login would cut that file short and destroy the token).
func fileSizeLimitCheck(tokenURI: String) -> (bytes: UInt64, fatal: String?)? {
    guard let bytes = ProcessControl.raiseFileSizeLimit() else { return nil }
    let uri = try? PKCS11URI(tokenURI)
    return (bytes, uri.flatMap { SoftHSMFiles.loginWouldCut(limit: bytes, module: $0.module) })
}

/// The daemon: everything after the process starts, in a function rather
/// than top-level code (whose globals made the optimizer run away in release).
func runDaemon() -> Never {
    // First, before anything opens a file that could take number 2 and receive log lines.
    let closedAtStart = ProcessControl.openClosedStandardDescriptors()
    // Without /dev/null on all three any file could take number 2 (nothing can be logged to say so): EX_OSERR.
    guard ProcessControl.standardDescriptorsOpen else { exit(ExitCode.osError.rawValue) }
    // An audit trail to nowhere is none: audit_log then refuses every signature (503 audit_log_unwritable).
    if closedAtStart.contains(2) || ProcessControl.standardErrorIsNullDevice { Logger.markStandardErrorDiscarded() }
    let handledSignals = [SIGTERM, SIGINT, SIGHUP]
    ProcessControl.blockSignals(handledSignals)
    ProcessControl.disableCoreDumps()
    ProcessControl.returnLargeAllocationsToTheSystem()

    let arguments: Arguments
    do {
        arguments = try Arguments(Array(CommandLine.arguments.dropFirst()), options: ["config"], flags: ["check-config"])
        _ = try arguments.positionals(0, "")
    } catch {
        FileHandle.standardError.write(Data("error: \(error.message)\nhint: \(error.hint)\n".utf8))
        exit(ExitCode.usage.rawValue)
    }
    if arguments.flag("help") {
        print(usage)
        exit(0)
    }
    let configPath = arguments.options["config"] ?? SignerConfiguration.defaultPath

    // --check-config is read by a person (or ExecStartPre's journal lines): plain text, not the JSON log.
    let checkOnly = arguments.flag("check-config")
    var configuration: SignerConfiguration
    do {
        configuration = try SignerConfiguration.load(path: configPath)
    } catch {
        fail(.config, checkOnly ? "config_invalid: \(error.message)" : "config_invalid", logger: checkOnly ? nil : Logger(),
             ["config.path": .string(configPath), "error": .string(error.message)])
    }
    if checkOnly {
        // The files opening the token needs, short of loading the module or logging in.
        let unchecked: [String]
        let uri: PKCS11URI
        do throws(HSMError) {
            uri = try PKCS11URI(configuration.tokenURI)
            unchecked = try uri.checkFilesBeforeOpening()
        } catch {
            fail(.config, "config_invalid: \(configPath): \(error.description)")
        }
        print("configuration \(configPath) is valid")
        for note in unchecked { print("note: \(note)") }
        for advisory in configuration.advisories { print("warning: \(advisory.event): \(advisory.hint)") }
        if uri.hasPINValue { print("warning: pin_value_in_uri: \(PKCS11URI.pinValueHint)") }
        if let problem = socketDirectoryProblem(configuration.socketPath) {
            // A warning, not an error: RuntimeDirectory= makes /run/signerd only when the service starts.
            print("warning: socket_directory_missing: \(problem): binding the socket will fail with exit 69 unless it is made first "
                + "(\(socketDirectoryHint(configuration.socketPath)))")
        }
        if socketDirectoryProblem(configuration.socketPath) == nil, let problem = UnixListener.unsafeDirectory(of: configuration.socketPath) {
            print("warning: socket_directory_unsafe: \(problem): binding the socket itself (without signerd.socket) will fail with exit 69")
        }
        // The hard limit: what signerd started from this shell (or by ExecStartPre, under the unit's LimitNOFILE=) could raise its own to.
        let budget = connectionBudget(configuration.maxConnections, openFileLimit: ProcessControl.hardOpenFileLimit)
        if let problem = budget.problem {
            if budget.maxConnections < 1 { fail(.config, "open_file_limit_too_low: \(problem)") }
            print("warning: open_file_limit_low: \(problem)")
        }
        // As the start would: ExecStartPre= runs under the unit's LimitFSIZE= too.
        if let (bytes, fatal) = fileSizeLimitCheck(tokenURI: configuration.tokenURI) {
            if let problem = fatal { fail(.config, "file_size_limit: \(problem)") }
            print("warning: file_size_limit: \(ProcessControl.fileSizeLimitWarning(bytes))")
        }
        if let group = configuration.socketGroup, !UnixListener.mayGiveSocket(toGroup: group) {
            print("warning: socket_group_not_joined: this user (uid \(geteuid())) is not a member of socket_group \(group): binding the socket itself "
                + "(without signerd.socket) will fail with exit 69; add the user to \(group), or start signerd through signerd.socket")
        }
        exit(0)
    }
    let logger = Logger(minimumLevel: configuration.logLevel)
    for advisory in configuration.advisories { logger.warning(advisory.event, ["hint": .string(advisory.hint)]) }
    let budget = connectionBudget(configuration.maxConnections, openFileLimit: ProcessControl.raiseOpenFileLimit(to: descriptorsWanted(configuration.maxConnections)))
    if let problem = budget.problem {
        // Connections past the budget would take the descriptors SoftHSM
        // opens its token files with: the token would go down for everyone.
        if budget.maxConnections < 1 { fail(.config, "open_file_limit_too_low", logger: logger, ["error": .string(problem)]) }
        logger.warning("open_file_limit_low", ["max_connections": .int(Int64(budget.maxConnections)), "hint": .string(problem)])
    }
    if let (bytes, fatal) = fileSizeLimitCheck(tokenURI: configuration.tokenURI) {
        if let problem = fatal {
            fail(.config, "file_size_limit", logger: logger, ["bytes": .int(Int64(clamping: bytes)), "error": .string(problem)])
        }
        logger.warning("file_size_limit", ["bytes": .int(Int64(clamping: bytes)), "hint": .string(ProcessControl.fileSizeLimitWarning(bytes))])
    }

    // A second signerd, or a socket path the bind would fail on, is refused
    // before its C_Login, which SoftHSM records by rewriting its token file:
    // a restart loop on a socket problem costs no login. The bind checks
    // again, since the path may change while the token opens.
    func socketFailed(_ error: SocketError) -> Never {
        var fields: [(key: String, value: LogValue)] = [("socket.path", .string(configuration.socketPath)), ("error", .string(error.message))]
        if socketDirectoryProblem(configuration.socketPath) != nil { fields.append(("hint", .string(socketDirectoryHint(configuration.socketPath)))) }
        fail(.unavailable, "socket_bind_failed", logger: logger, fields: fields)
    }
    let passedListener: Int32?
    do {
        passedListener = try Systemd.takeListeningSocket()
        if passedListener == nil {
            try UnixListener.refuseIfListening(path: configuration.socketPath)
            try UnixListener.refuseIfUnbindable(path: configuration.socketPath, group: configuration.socketGroup)
        }
    } catch {
        socketFailed(error)
    }

    // Held from before C_Initialize until the socket is bound: another
    // signerd on the same socket_path, which waited for it, then finds this
    // one listening and is refused before its C_Login.
    // Read once from SoftHSM's configuration, for the start's lock and recovery's.
    let softHSMTokens = SoftHSMFiles.tokenDirectory(module: (try? PKCS11URI(configuration.tokenURI))?.module)
    var startLock = lockSoftHSMForStart(directory: softHSMTokens, logger: logger)
    if startLock != nil, passedListener == nil {
        do {
            try UnixListener.refuseIfListening(path: configuration.socketPath)
        } catch {
            socketFailed(error)
        }
    }
    var tokenOptions = TokenOptions()
    tokenOptions.sessionPoolSize = configuration.sessionPoolSize
    tokenOptions.sessionCheckoutTimeout = Double(configuration.sessionCheckoutTimeoutMs) / 1000
    tokenOptions.logger = logger
    // Recovery's C_Initialize and C_Login wait for signctl's lock, once the start lock is let go.
    let runningLock = softHSMTokens.map { SoftHSMFiles.RunningTokenLock(directory: $0, timeout: recoveryLockSeconds, logger: logger) }
    if let runningLock {
        tokenOptions.storageLock = { shouldStop in runningLock.take(shouldStop: shouldStop) }
    }
    let token: HSMToken
    do {
        token = try HSMToken(uri: PKCS11URI(configuration.tokenURI), options: tokenOptions)
    } catch {
        let code: ExitCode = switch error.code {
        case .pinRejected: .noPermission
        case .invalidURI, .pinSourceInsecure, .pinSourceUnreadable, .moduleNotFound, .moduleInsecure: .config
        default: .unavailable
        }
        let uri = try? PKCS11URI(configuration.tokenURI)
        let pinFile = uri?.pinSource.flatMap(PKCS11URI.pinFilePath)
        var hint: String?
        switch error.code {
        case .pinRejected where error.returnValue == .pinLocked:
            hint = "unlock the user PIN with the SO PIN (the token's own tools), then start signerd again; no C_Login was made"
        case .pinRejected:
            hint = "fix the PIN source (\(pinFile.map { "the PIN file \($0)" } ?? "pin-value in token_uri")), then start signerd again; signerd made one C_Login and no more, since tokens lock after a few wrong PINs"
        case .pinSourceUnreadable where pinFile.map(PKCS11URI.isSystemdCredential) == true:
            hint = "\(pinFile ?? "") is systemd's copy of the PIN (LoadCredential=), which exists only inside the running service: start signerd with systemctl start signerd; "
                + "to run it by hand, give it a configuration whose pin-source names a PIN file this user can read (docs/OPERATIONS.md)"
        case let code where code == .tokenNotFound || (code == .pkcs11Failure && error.function == PKCS11Function.initialize.rawValue):
            // For SoftHSM, a token this user cannot read (made as root) looks
            // uninitialized, and a token directory it cannot read fails C_Initialize.
            let module = uri?.module
            hint = SoftHSMFiles.unreadableTokens(module: module) ?? SoftHSMFiles.tokenMissingHint(module: module)
        default:
            hint = nil
        }
        // p11.rv only when a PKCS#11 call failed (not for a PIN file signerd refused itself).
        var fields: [(key: String, value: LogValue)] = [("error", .string(error.description))]
        if let rv = error.returnValue { fields.append(("p11.rv", .string(rv.name))) }
        if let hint { fields.append(("hint", .string(hint))) }
        fail(code, "token_open_failed", logger: logger, fields: fields)
    }

    // Prove every configured key signs before telling systemd we are ready.
    let keyProblems = selfTest(configuration.keys, token: token, logger: logger)

    let metrics = Metrics()
    let service = SignerService(configuration: configuration, token: token, logger: logger, metrics: metrics)
    let listener: Int32
    let socketActivated: Bool
    if let passedListener {
        listener = passedListener
        socketActivated = true
    } else {
        do {
            // Checked again: the path may have changed while the token opened.
            listener = try UnixListener.bind(path: configuration.socketPath, mode: configuration.socketMode, group: configuration.socketGroup)
        } catch {
            socketFailed(error)
        }
        socketActivated = false
    }
    let listeningPath = UnixListener.boundPath(listener) ?? configuration.socketPath
    withExtendedLifetime(startLock) { startLock = nil }
    runningLock?.arm()
    // Recognized at shutdown: a file someone put at the path later is not removed.
    let boundFile = socketActivated ? nil : UnixListener.fileIdentity(configuration.socketPath)
    func removeSocketFile() {
        guard let boundFile else { return }  // a socket systemd created stays; it belongs to signerd.socket
        if !UnixListener.removeSocketFile(configuration.socketPath, boundAs: boundFile) {
            logger.warning("socket_file_not_removed", ["socket.path": .string(configuration.socketPath),
                                                       "reason": "the file at the path is no longer the socket signerd bound (deleted or replaced)"])
        }
    }
    var serverOptions = HTTPServerOptions()
    serverOptions.connectionLimit = budget.maxConnections
    serverOptions.connectionsPerUIDLimit = min(configuration.effectiveMaxConnectionsPerUID, budget.maxConnections)
    serverOptions.idleTimeoutSeconds = configuration.idleTimeoutSeconds
    serverOptions.requestTimeoutSeconds = Double(configuration.requestTimeoutSeconds)
    serverOptions.maxBodyBytes = configuration.maxBodyBytes
    serverOptions.maxHeaderBytes = configuration.maxHeaderBytes
    serverOptions.signTimeoutSeconds = Double(configuration.signTimeoutMs) / 1000
    if configuration.httpThreads != nil {
        logger.warning("config_option_ignored", ["option": "http_threads", "hint": "each connection has its own thread; remove http_threads from the file"])
    }
    // The trail says where it begins, before the first signature can come.
    if configuration.auditLog { service.noteAuditTrail(on: true, reason: "start") }
    let server = HTTPServer(listenDescriptor: listener, options: serverOptions, handler: service, logger: logger, metrics: metrics)
    do {
        try server.start()
    } catch {
        removeSocketFile()
        fail(.unavailable, "http_start_failed", logger: logger, ["error": .string(error.message)])
    }
    let status = keyProblems.isEmpty ? "serving \(keyCount(configuration.keys.count)) on \(listeningPath)"
        : "serving on \(listeningPath); keys failing their self-test: \(keyProblems.joined(separator: ", "))"
    Systemd.notify("READY=1\nSTATUS=\(status)\nMAINPID=\(getpid())")
    if let interval = Systemd.watchdogPingInterval {
        // Ping only while the HTTP server answers its own /healthz: a wedged
        // server stops the pings and systemd restarts the service.
        let pinging = OSThread.start {
            while true {
                usleep(useconds_t(interval * 1_000_000))
                // Nor while token recovery is stuck inside the module: only
                // a new process gets a module that answers again.
                if !service.recoveryStuck,
                   let answer = try? SignerClient(socketPath: listeningPath, timeout: max(1, interval / 2)).send("GET", "/healthz"), answer.status == 200 {
                    Systemd.notify("WATCHDOG=1")
                }
            }
        }
        if !pinging {
            // Without pings systemd would kill signerd at WatchdogSec anyway: say why now.
            removeSocketFile()
            fail(.unavailable, "http_start_failed", logger: logger, ["error": "no thread could be started for the systemd watchdog's pings (the process is out of threads)"])
        }
    }
    logger.notice("signerd_ready", [
        "socket.path": .string(listeningPath), "socket.activated": .bool(socketActivated), "token.label": .string(token.label),
        "keys": .int(Int64(configuration.keys.count)),
        "sessions": .int(Int64(token.sessionCapacity)), "pid": .int(Int64(getpid())), "audit_log": .bool(configuration.auditLog),
    ])

    // Whether STOPPING=1 was sent; systemd must not see RELOADING=1 or
    // READY=1 from a reload after it. Checked and sent under one lock.
    let stopNotified = Locked(false)
    // The self-test after each reload, on a thread of its own (a slow token
    // must not hold up the next reload), one at a time: a reload storm tests
    // the latest keys once more, not once per reload. Shutdown stops it
    // between keys and waits for it before closing the token.
    let selfTestKeys = Locked<[KeyConfiguration]>([])
    let selfTests = CoalescingRunner {
        _ = selfTest(selfTestKeys.withLock { $0 }, token: token, logger: logger, stopped: { stopNotified.withLock { $0 } })
    }
    // An idle daemon checks its token every token_check_seconds, so that an
    // outage shows in signerd_token_up and recovery starts before the next
    // request. The checks run on a runner, one at a time, so that shutdown
    // can wait for one inside a PKCS#11 call before it closes the token.
    let tokenChecks = CoalescingRunner { _ = service.checkTokenIfIdle() }
    let watching = OSThread.start {
        while true {
            usleep(1_000_000)
            guard service.tokenCheckDue else { continue }
            if tokenChecks.request() == .stopping { return }
        }
    }
    if !watching {
        logger.warning("token_check_skipped", ["error": "no thread could be started for the idle token check (the process is out of threads)",
                                               "hint": "requests and GET /readyz still find an outage; signerd_token_up may lag until one comes"])
    }
    let startConfiguration = configuration
    // Reloads run on a thread of their own: one can wait on the token (a
    // C_Login, or recovery's login holding the PIN), and this thread must
    // stay free to take SIGTERM.
    let reloads = CoalescingRunner {
        logger.info("reload_requested", ["config.path": .string(configPath)])
        stopNotified.withLock { stopping in
            if !stopping { Systemd.notify("RELOADING=1\nMONOTONIC_USEC=\(Systemd.monotonicMicroseconds)") }
        }
        defer {
            stopNotified.withLock { stopping in
                if !stopping { Systemd.notify("READY=1\nSTATUS=serving \(keyCount(service.configuration.keys.count)) on \(listeningPath)") }
            }
        }
        do {
            let fresh = try SignerConfiguration.load(path: configPath)
            try service.reload(fresh)
            logger.notice("config_reloaded", ["keys": .int(Int64(fresh.keys.count)), "audit_log": .bool(fresh.auditLog)])
            // Against the start's values, which are the ones in effect.
            let unchanged = fresh.restartOnlyChanges(from: startConfiguration)
            if !unchanged.isEmpty {
                logger.warning("config_reload_needs_restart", [
                    "options": .string(unchanged.joined(separator: ", ")),
                    "hint": "these keep their values from the start until signerd restarts (systemctl restart signerd; run by hand, stop it and start it again); the rest of the file is in effect",
                ])
            }
            for advisory in fresh.advisories { logger.warning(advisory.event, ["hint": .string(advisory.hint)]) }
            // As at start, a key that cannot sign is named now rather than by the first request;
            // on a thread of its own, so a slow token cannot hold up the next reload.
            selfTestKeys.withLock { $0 = fresh.keys }
            if selfTests.request() == .noThread {
                logger.warning("self_test_skipped", ["error": "no thread could be started for the self-test (the process is out of threads)",
                                                     "hint": "GET /readyz tests the keys when asked"])
            }
        } catch {
            logger.error("config_reload_refused", ["error": .string("\(error)"), "hint": "the previous configuration stays in effect"])
        }
    }
    while true {
        let received = ProcessControl.waitForSignal(handledSignals)
        if received == SIGHUP {
            switch reloads.request() {
            case .queued:
                logger.info("reload_queued", ["hint": "a reload is still running (waiting for the token); the file is read again when it ends"])
            case .noThread:
                logger.error("config_reload_refused", ["error": "no thread could be started for the reload (the process is out of threads)", "hint": "the previous configuration stays in effect; send SIGHUP again"])
            case .started, .merged, .stopping:
                break
            }
            continue
        }
        logger.notice("shutdown_requested", ["signal": .int(Int64(received))])
        stopNotified.withLock { stopping in
            stopping = true
            Systemd.notify("STOPPING=1")
        }
        // A queued reload must not apply its file while signerd stops, nor
        // an idle token check start new PKCS#11 work.
        reloads.refuseNewRuns()
        tokenChecks.refuseNewRuns()
        // Nor recovery: a call hung now (a request's, or an idle check's)
        // marks the token down at sign_timeout_ms, and recovery's login and
        // test signature would go into the module that hangs.
        token.stopRecovering()
        let listening = server.stopAccepting()
        removeSocketFile()
        // Connections whose connect() returned but that libmicrohttpd had
        // not accepted yet would be reset by the close: serve them too.
        let adopted = server.adoptPendingConnections(from: listening)
        if listening >= 0 { close(listening) }
        // One window, sign_timeout_ms + 5 s from here, for everything that
        // may still be inside the token: requests in progress (answered
        // within sign_timeout_ms by the watchdog), a reload waiting on it (a
        // hung C_Login), its self-test, an idle token check. They run at
        // once, so waiting for each in its own window only added them up.
        let settled = MonotonicClock.deadline(after: Double(configuration.signTimeoutMs) / 1000 + 5)
        func secondsLeft() -> Double { max(0, Double(Int64(bitPattern: settled &- MonotonicClock.now())) / 1e9) }
        let drained = server.waitForRequestsInProgress(seconds: secondsLeft())
        let reloadFinished = reloads.stop(waitingSeconds: secondsLeft())
        if !reloadFinished {
            logger.warning("reload_unfinished", ["reason": "a reload is still waiting on the token (a login in progress, or a PKCS#11 call that does not return); signerd stops regardless"])
        }
        let selfTestFinished = selfTests.stop(waitingSeconds: secondsLeft())
        if !selfTestFinished {
            logger.warning("self_test_unfinished", ["reason": "a reload's key self-test is still inside a PKCS#11 call; the token is closed regardless"])
        }
        let tokenCheckFinished = tokenChecks.stop(waitingSeconds: secondsLeft())
        if !tokenCheckFinished {
            logger.warning("token_check_unfinished", ["reason": "an idle token check is still inside a PKCS#11 call; the token is closed regardless"])
        }
        // The token first: from here a request still arriving on an open
        // connection gets 503 at once, so no PKCS#11 call can start (and
        // hang) between stop()'s check for hung calls and its join of the
        // connection threads; close() waits for calls already inside.
        token.close()
        // Stopped before its next call, a recovery still running is inside one that has not returned.
        let recoveryLeft = token.isRecovering
        if recoveryLeft {
            logger.warning("recovery_unfinished", ["reason": "token recovery is still inside a PKCS#11 call; signerd stops regardless"])
        }
        let joined = server.stop()
        logger.notice("signerd_stopped", ["drained": .bool(drained), "backlog_connections": .int(Int64(adopted))])
        // With a connection thread, a reload, a self-test or a token check left inside a hung call, exit(3)'s
        // atexit handlers and C++ static destructors (the PKCS#11 module's)
        // would run under it, and crashed the process once in a stress run:
        // leave without them. Log lines are already written (write(2)).
        if !joined || !reloadFinished || !selfTestFinished || !tokenCheckFinished || recoveryLeft { _exit(0) }
        exit(0)
    }
}

runDaemon()
