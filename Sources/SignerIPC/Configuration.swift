import Foundation
import HSMSigner

/// A configuration file that cannot be used; ``message`` names the key.
public struct ConfigurationError: Error, Sendable, CustomStringConvertible {
    /// What is wrong, naming the config key (`keys[1].bundle_ids`).
    public var message: String
    /// Makes an error.
    public init(_ message: String) { self.message = message }
    /// Makes an error about `key`, naming it once: `message` as it is when
    /// it already starts with the key (as ``FieldReader``'s and
    /// ``PKCS11URI``'s messages do), else after `key: `.
    /// - Parameters:
    ///   - key: the config key at fault (`keys[0].bundle_ids`).
    ///   - message: what is wrong with it.
    public init(key: String, _ message: String) {
        self.message = message.hasPrefix(key) ? message : "\(key): \(message)"
    }
    /// The message, naming the config key.
    public var description: String { message }
}

/// One In-App Purchase key the daemon serves.
public struct KeyConfiguration: Sendable, Equatable {
    /// The 10-character key ID; the token's objects carry it as `CKA_ID`.
    public var keyID: String
    /// The bundle IDs this key may sign for (403 `bundle_not_allowed` otherwise).
    public var bundleIDs: [String]
    /// The issuer ID for JWS kinds, overriding the top-level one.
    public var issuerID: String?
    /// When set, only these uids (and root) may use this key.
    public var allowedUIDs: [UInt32]?

    /// Whether `bundleID` is one of ``bundleIDs``, byte for byte. Swift's
    /// `==` holds canonically equivalent strings equal (`K` and U+212A
    /// KELVIN SIGN, `ä` and `a` + U+0308), but the signature covers the
    /// bytes sent, so an allow-list match must be exact.
    /// - Parameter bundleID: the request's bundle ID.
    /// - Returns: true when a listed bundle ID has the same UTF-8 bytes.
    public func allows(bundleID: String) -> Bool {
        bundleIDs.contains { $0.utf8.elementsEqual(bundleID.utf8) }
    }

    /// Makes a key entry.
    public init(keyID: String, bundleIDs: [String], issuerID: String? = nil, allowedUIDs: [UInt32]? = nil) {
        self.keyID = keyID
        self.bundleIDs = bundleIDs
        self.issuerID = issuerID
        self.allowedUIDs = allowedUIDs
    }
}

/// The JSON configuration shared by `signerd` and `signctl`
/// (`/etc/signerd/signerd.json` by default). Unknown keys and invalid values
/// are refused with the key named. Durations carry their unit in the key
/// name (`_seconds`, `_ms`).
public struct SignerConfiguration: Sendable, Equatable {
    /// The default configuration path.
    public static let defaultPath = "/etc/signerd/signerd.json"

    /// Where the Unix socket is created. Default `/run/signerd/signerd.sock`.
    public var socketPath = "/run/signerd/signerd.sock"
    /// The socket file's mode. Default 0660.
    public var socketMode: UInt32 = 0o660
    /// The socket file's group (name or number); nil keeps the daemon's group.
    public var socketGroup: String?
    /// The RFC 7512 PKCS#11 URI of the token (module, token, PIN source).
    public var tokenURI: String
    /// The issuer ID (a UUID from App Store Connect) for the JWS kinds.
    public var issuerID: String?
    /// The keys served.
    public var keys: [KeyConfiguration] = []
    /// The key used when a request names none and several keys serve its bundle.
    public var defaultKeyID: String?
    /// uids allowed to call, besides root and the daemon's own uid.
    public var allowedUIDs: [UInt32] = []
    /// gids whose members may call.
    public var allowedGIDs: [UInt32] = []
    /// PKCS#11 sessions open at once: the most signatures in progress at
    /// once; further requests wait for a session in the order they arrived.
    /// Default twice the online CPUs, at most 8 (a software token like
    /// SoftHSM signs on the host's CPUs; a network HSM may want more).
    public var sessionPoolSize = min(8, 2 * max(1, sysconf(Int32(_SC_NPROCESSORS_ONLN))))
    /// Verify every signature with the public key before returning it. Default true.
    public var verifyBeforeReturn = true
    /// Write one `signature_issued` line (level `notice`) for every
    /// signature signerd returns, whatever `log_level` says: who asked
    /// (`SO_PEERCRED` uid and pid), the endpoint, the key ID, the bundle
    /// ID and what identifies the signature (product ID, offer identifier,
    /// nonce, timestamp). Never the app account token's value, nor the
    /// signature. Default false; a reload changes it at once.
    public var auditLog = false
    /// The lowest log level written. Default `info`.
    public var logLevel: LogLevel = .info
    /// `http_threads` as read from the file. It no longer has an effect
    /// (each connection has its own thread); it is still accepted so that
    /// older configuration files load, and signerd logs a warning.
    public var httpThreads: Int?
    /// Most connections at once. Default 1024.
    public var maxConnections = 1024
    /// Most connections one peer uid may hold at once. Default:
    /// ``maxConnections`` (api.md: "at most 1024 connections", from one
    /// client too), so one uid may hold them all; set it lower when several
    /// backends share signerd, so that one cannot take every slot.
    public var maxConnectionsPerUID: Int?
    /// Settings that are valid but probably not meant, each as a log event
    /// name and a hint: a socket any local user may connect to
    /// (`socket_mode` with the "other" bits), a `socket_group` whose members
    /// cannot connect (no group write bit), no keys, and a bundle ID that
    /// several keys serve with none of them `default_key_id` (its requests
    /// must name `key_id`; `/v1/offers`, which cannot, answers 7234), a
    /// PIN file readable by a group of the callers (`socket_group` or
    /// `allowed_gids`), and keys with no issuer ID (`issuer_id_missing`:
    /// the JWS kinds are refused for them).
    public var advisories: [(event: String, hint: String)] {
        var found: [(event: String, hint: String)] = []
        if socketMode & 0o006 != 0 {
            found.append(("socket_open_to_all_users", "socket_mode \(String(socketMode, radix: 8)) lets every local user connect (allowed_uids and allowed_gids still decide who may sign); 0660 with socket_group is the usual choice"))
        }
        // Connecting to a Unix socket needs write permission on it.
        if socketGroup != nil && socketMode & 0o020 == 0 {
            found.append(("socket_group_cannot_connect", "socket_mode \(String(socketMode, radix: 8)) gives socket_group \(socketGroup ?? "") no write permission, and connecting to a Unix socket needs it: no member of the group can connect; 0660 is the usual choice"))
        }
        // A PIN file its group may read, whose group is one the callers are
        // in: every backend of that group could read the PIN.
        if let pinFile = (try? PKCS11URI(tokenURI))?.pinSource.flatMap(PKCS11URI.pinFilePath) {
            var info = stat()
            let callerGroups = allowedGIDs + [socketGroup.flatMap { UInt32($0) ?? getgrnam($0)?.pointee.gr_gid }].compactMap { $0 }
            if stat(pinFile, &info) == 0, info.st_mode & 0o040 != 0, callerGroups.contains(info.st_gid) {
                found.append(("pin_file_readable_by_callers", "the PIN file \(pinFile) may be read by its group, gid \(info.st_gid), which is a group of signerd's callers (socket_group or allowed_gids): every backend in it can read the PIN; give the file a group of its own (signerd's) or mode 0600"))
            }
        }
        // api.md: cache the readiness result "so that probes cannot load the HSM".
        if readinessCacheSeconds == 0 {
            found.append(("readiness_cache_off", "readiness_cache_seconds is 0: every GET /readyz makes every key sign a test digest, so probes load the HSM and their signatures show in no histogram; a few seconds (the default is 5) keeps probes off the token"))
        }
        // Only the classic signature needs no issuer: say so at start, not at the first JWS request.
        let withoutIssuer = issuerID == nil ? keys.filter { $0.issuerID == nil }.map(\.keyID) : []
        if !withoutIssuer.isEmpty {
            found.append(("issuer_id_missing", "\(withoutIssuer.count == 1 ? "key" : "keys") \(withoutIssuer.joined(separator: ", ")) \(withoutIssuer.count == 1 ? "has" : "have") no issuer ID (issuer_id, at the top or in the key's entry): the classic promotional offer signature works, but the JWS kinds and the App Store Server API token are answered 400 for \(withoutIssuer.count == 1 ? "it" : "them"); copy the issuer ID from App Store Connect (Users and Access → Integrations → In-App Purchase)"))
        }
        if keys.isEmpty {
            found.append(("no_keys_configured", "keys is empty: every signing request gets 403 bundle_not_allowed until a key is added and signerd reloaded"))
        }
        var servedBy: [String: [String]] = [:]
        for key in keys {
            for bundleID in key.bundleIDs { servedBy[bundleID, default: []].append(key.keyID) }
        }
        for (bundleID, keyIDs) in servedBy.sorted(by: { $0.key < $1.key }) where keyIDs.count > 1 && !keyIDs.contains(defaultKeyID ?? "") {
            found.append(("bundle_key_ambiguous", "bundle_id \(bundleID) is served by keys \(keyIDs.joined(separator: ", ")) and none is default_key_id: its signing requests must name key_id, and /v1/offers (which cannot) answers 7234 for every offer; set default_key_id to one of them"))
        }
        return found
    }

    /// The settings that differ between `self` and `old` and take effect
    /// only when signerd starts (the log level, session pool, connection
    /// and size limits, timeouts): a reload keeps their old values, and
    /// signerd names them in `config_reload_needs_restart` so that an
    /// operator is not left believing they changed.
    /// - Parameter old: the configuration signerd started with.
    /// - Returns: the changed keys as the file spells them, in file order.
    public func restartOnlyChanges(from old: SignerConfiguration) -> [String] {
        let compared: [(String, Bool)] = [
            ("session_pool_size", sessionPoolSize != old.sessionPoolSize),
            ("log_level", logLevel != old.logLevel),
            ("max_connections", maxConnections != old.maxConnections),
            ("max_connections_per_uid", effectiveMaxConnectionsPerUID != old.effectiveMaxConnectionsPerUID),
            ("max_body_bytes", maxBodyBytes != old.maxBodyBytes),
            ("max_header_bytes", maxHeaderBytes != old.maxHeaderBytes),
            ("idle_timeout_seconds", idleTimeoutSeconds != old.idleTimeoutSeconds),
            ("request_timeout_seconds", requestTimeoutSeconds != old.requestTimeoutSeconds),
            ("session_checkout_timeout_ms", sessionCheckoutTimeoutMs != old.sessionCheckoutTimeoutMs),
            ("sign_timeout_ms", signTimeoutMs != old.signTimeoutMs),
        ]
        return compared.filter(\.1).map(\.0)
    }

    /// ``maxConnectionsPerUID``, or its default: ``maxConnections``.
    public var effectiveMaxConnectionsPerUID: Int { maxConnectionsPerUID ?? maxConnections }
    /// Largest request body in bytes. Default 65,536.
    public var maxBodyBytes = 64 * 1024
    /// Largest request head (request line and headers) in bytes. Default 8,192.
    public var maxHeaderBytes = 8 * 1024
    /// An idle keep-alive connection is closed after this many seconds. Default 60.
    public var idleTimeoutSeconds = 60
    /// A request not fully received within this many seconds is dropped. Default 10.
    public var requestTimeoutSeconds = 10
    /// How long a readiness result is reused, in seconds. Default 5.
    public var readinessCacheSeconds = 5.0
    /// How often, in seconds, an idle daemon checks its token: when no
    /// PKCS#11 call has come back for this long, the readiness check runs
    /// (every key signs a test digest), so that an outage shows in
    /// `signerd_token_up` and recovery starts without waiting for a
    /// request. 0 turns it off. Default 30; 0–3600.
    public var tokenCheckSeconds = 30
    /// How long a request waits for a free PKCS#11 session, in milliseconds. Default 2000.
    public var sessionCheckoutTimeoutMs = 2000
    /// A signing call in the module longer than this fails the request with
    /// 503 and quarantines its session, in milliseconds. Default 5000.
    public var signTimeoutMs = 5000
    /// How far back the App Store Server API token's `iat` is set, so a host
    /// clock slightly ahead of Apple's does not make future tokens, in seconds. Default 60.
    public var clockSkewSeconds = 60
    /// Requests per second allowed per caller uid; 0 turns the limit off. Default 0.
    public var rateLimitPerSecond = 0.0
    /// Requests a caller may send in a burst above the rate. Default 100.
    public var rateLimitBurst = 100.0

    /// Every key the file may hold.
    static let knownKeys: Set<String> = [
        "socket_path", "socket_mode", "socket_group", "token_uri", "issuer_id", "keys", "default_key_id",
        "allowed_uids", "allowed_gids", "session_pool_size", "verify_before_return", "audit_log", "log_level", "http_threads",
        "max_connections", "max_connections_per_uid", "max_body_bytes", "max_header_bytes", "idle_timeout_seconds", "request_timeout_seconds",
        "readiness_cache_seconds", "token_check_seconds", "session_checkout_timeout_ms", "sign_timeout_ms", "clock_skew_seconds",
        "rate_limit_per_second", "rate_limit_burst",
    ]

    /// A configuration with only the token URI set.
    public init(tokenURI: String) {
        self.tokenURI = tokenURI
    }

    /// Reads and checks a configuration file. The file is opened once and
    /// checked and read through that descriptor, so what is checked is what
    /// is read: a file swapped after the check (for a FIFO, or another
    /// user's file) is not. Call it from one thread at a time: the
    /// directory check may enumerate the user database.
    /// - Parameter path: the JSON file (symbolic links followed).
    /// - Throws: ``ConfigurationError`` naming the key at fault, or the file's
    ///   problem (``checkFile(_:path:)``; a directory above it, as written or
    ///   after symbolic links, that another user could change
    ///   (``PathSafety/unsafeDirectory(aboveWrittenOrResolved:)``); larger
    ///   than 4 MiB; unreadable).
    public static func load(path: String) throws(ConfigurationError) -> SignerConfiguration {
        // O_NONBLOCK: a FIFO at the path must not wait for a writer.
        let fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK)
        guard fd >= 0 else {
            throw ConfigurationError("cannot read the configuration file \(path): \(String(cString: strerror(errno)))")
        }
        defer { close(fd) }
        var info = stat()
        guard fstat(fd, &info) == 0 else {
            throw ConfigurationError("cannot read the configuration file \(path): \(String(cString: strerror(errno)))")
        }
        try checkFile(info, path: path)
        if let problem = PathSafety.unsafeDirectory(aboveWrittenOrResolved: path) {
            throw ConfigurationError("the configuration file \(path) lies below \(problem); the file chooses the PKCS#11 module loaded and who may call, so keep it in a directory only root or this user may change, such as /etc/signerd")
        }
        let limit = 4 << 20
        guard info.st_size <= limit else {
            throw ConfigurationError("the configuration file \(path) is \(info.st_size) bytes; a configuration is at most \(limit) bytes")
        }
        var bytes: [UInt8] = []
        var chunk = [UInt8](repeating: 0, count: 65536)
        while bytes.count <= limit {
            let count = read(fd, &chunk, chunk.count)
            if count < 0 && errno == EINTR { continue }
            guard count >= 0 else {
                throw ConfigurationError("cannot read the configuration file \(path): \(String(cString: strerror(errno)))")
            }
            if count == 0 { break }
            bytes.append(contentsOf: chunk[..<count])
        }
        do {
            return try parse(bytes)
        } catch {
            throw ConfigurationError("\(path): \(error.message)")
        }
    }

    /// Refuses a configuration file that is not a regular file, with the
    /// path and what it is (Foundation said "error 256" for a directory),
    /// or one whose owner or mode would let another user choose the PKCS#11
    /// module this process loads.
    /// - Parameters:
    ///   - info: `fstat(2)` of the open file.
    ///   - path: the path, for messages.
    /// - Throws: ``ConfigurationError`` when the file is not regular, belongs
    ///   to another user than root and this process's, or may be written by
    ///   its group or others.
    static func checkFile(_ info: stat, path: String) throws(ConfigurationError) {
        let kind: String
        switch info.st_mode & S_IFMT {
        case S_IFREG:
            // The file names the PKCS#11 module loaded into this process and
            // who may call: only root or this process's user may change it.
            if info.st_uid != 0 && info.st_uid != geteuid() {
                throw ConfigurationError("the configuration file \(path) belongs to uid \(info.st_uid), neither root nor this process's uid \(geteuid()): it chooses the PKCS#11 module loaded and who may call, so that user could run code here; chown it to root")
            }
            if info.st_mode & (S_IWGRP | S_IWOTH) != 0 {
                throw ConfigurationError("the configuration file \(path) may be written by \(info.st_mode & S_IWOTH != 0 ? "other users" : "its group") (mode \(String(info.st_mode & 0o7777, radix: 8))): it chooses the PKCS#11 module loaded and who may call; chmod go-w it")
            }
            return
        case S_IFDIR: throw ConfigurationError("the configuration file \(path) is a directory, not a file; pass the JSON file itself (e.g. \(defaultPath))")
        case S_IFIFO: kind = "a FIFO (named pipe)"
        case S_IFSOCK: kind = "a socket"
        case S_IFCHR, S_IFBLK: kind = "a device"
        default: kind = "not a file"
        }
        throw ConfigurationError("the configuration file \(path) is not a regular file (it is \(kind)); pass a JSON file")
    }

    /// Parses and checks configuration JSON.
    /// - Parameter bytes: the file's contents.
    /// - Throws: ``ConfigurationError`` naming the key at fault.
    public static func parse(_ bytes: [UInt8]) throws(ConfigurationError) -> SignerConfiguration {
        do {
            return try parseFields(bytes)
        } catch let error as APIError {
            switch error.code {
            case .unknownField where error.field?.contains(".") == true:
                // Inside keys[]: its own fields, not the top level's.
                throw ConfigurationError("unknown configuration key \(error.message)")
            case .unknownField:
                throw ConfigurationError("unknown configuration key \(error.field ?? "?"); known keys: \(knownKeys.sorted().joined(separator: ", "))")
            case .invalidJSON:
                throw ConfigurationError(invalidJSONMessage(bytes))
            default:
                throw ConfigurationError(key: error.field ?? "configuration", error.message)
            }
        } catch let error as ConfigurationError {
            throw error
        } catch {
            throw ConfigurationError("\(error)")
        }
    }

    /// Why ``FieldReader`` refused the file as `invalid_json`, in the
    /// file's terms, with its own checks: empty, not UTF-8, not JSON, not
    /// an object, or a member named twice.
    /// - Parameter bytes: the file's contents.
    private static func invalidJSONMessage(_ bytes: [UInt8]) -> String {
        if bytes.allSatisfy({ [0x20, 0x09, 0x0a, 0x0d].contains($0) }) {
            return "the file is empty; it must hold one JSON object, e.g. {\"token_uri\": \"pkcs11:…\"}"
        }
        if let problem = JSONText.notUTF8(bytes) {
            return "the file is not UTF-8 JSON text (\(problem)); save it as UTF-8 without a byte-order mark (RFC 8259 §8.1)"
        }
        // The reader FieldReader refused it with, read again for the file's own words.
        let document: JSONReader.Document
        do throws(JSONReader.Syntax) {
            document = try JSONReader.read(bytes, exactNumbers: false)  // a top-level number is named by its kind only
        } catch {
            return "the file is not valid JSON (RFC 8259): \(error.reason); it must hold one JSON object"
        }
        guard case .object = document.value else {
            return "the file holds \(document.value.kind) where one JSON object is expected"
        }
        if let words = document.repeatedInWords {
            return "the key \(words); give each key once (only the last would count)"
        }
        return "the file is not one JSON object signerd can read"
    }

    private static func parseFields(_ bytes: [UInt8]) throws -> SignerConfiguration {
        var reader = try FieldReader(json: bytes, allowed: knownKeys)
        var config = SignerConfiguration(tokenURI: try reader.string("token_uri", "the RFC 7512 PKCS#11 URI of the token"))
        do {
            _ = try PKCS11URI(config.tokenURI)
        } catch {
            throw ConfigurationError(key: "token_uri", error.message)
        }
        if let path = try reader.optionalString("socket_path") {
            guard path.hasPrefix("/"), path.utf8.count < 108 else {
                throw ConfigurationError("socket_path must be an absolute path shorter than 108 bytes")
            }
            config.socketPath = path
        }
        if let mode = try reader.optionalString("socket_mode") {
            // Octal digits only: UInt32(_:radix:) would also take a sign ("+660").
            guard !mode.isEmpty, mode.utf8.allSatisfy({ (UInt8(ascii: "0")...UInt8(ascii: "7")).contains($0) }),
                  let value = UInt32(mode, radix: 8), value <= 0o777 else {
                throw ConfigurationError("socket_mode must be an octal string such as \"0660\"; got \(mode)")
            }
            // Without them signerd's own uid (its systemd watchdog check among others) cannot connect.
            guard value & 0o600 == 0o600 else {
                throw ConfigurationError("socket_mode must let the socket's owner, signerd's user, read and write (0600 at least; 0660 is usual); got \(mode)")
            }
            config.socketMode = value
        }
        config.socketGroup = try reader.optionalString("socket_group")
        if let group = config.socketGroup, UInt32(group) == nil, getgrnam(group) == nil {
            throw ConfigurationError("socket_group \(group) is not a group on this host")
        }
        if let issuer = try reader.optionalString("issuer_id") {
            config.issuerID = try checkedIssuer(issuer, key: "issuer_id")
        }
        config.allowedUIDs = try ids(reader.optionalArray("allowed_uids"), key: "allowed_uids", users: true)
        config.allowedGIDs = try ids(reader.optionalArray("allowed_gids"), key: "allowed_gids", users: false)
        for (index, entry) in try (reader.optionalArray("keys") ?? []).enumerated() {
            guard case .object(let members) = entry else {
                throw ConfigurationError("keys[\(index)] must be an object with key_id and bundle_ids")
            }
            var keyReader = try FieldReader(members: members, path: "keys[\(index)].", allowed: ["key_id", "bundle_ids", "issuer_id", "allowed_uids"])
            let keyID = try keyReader.string("key_id")
            guard KeyID.isValid(keyID) else {
                throw ConfigurationError("keys[\(index)].key_id must be 10 characters A-Z0-9; got \(keyID)")
            }
            var bundles: [String] = []
            for value in try keyReader.array("bundle_ids") {
                guard case .string(let bundle) = value else {
                    throw ConfigurationError("keys[\(index)].bundle_ids must hold strings")
                }
                do {
                    try AppleFields.checkIdentifier(bundle, field: "keys[\(index)].bundle_ids")
                } catch {
                    throw ConfigurationError(error.message)
                }
                bundles.append(bundle)
            }
            guard !bundles.isEmpty else {
                throw ConfigurationError("keys[\(index)].bundle_ids must name at least one bundle ID")
            }
            var key = KeyConfiguration(keyID: keyID, bundleIDs: bundles)
            if let issuer = try keyReader.optionalString("issuer_id") {
                key.issuerID = try checkedIssuer(issuer, key: "keys[\(index)].issuer_id")
            }
            if let uids = try keyReader.optionalArray("allowed_uids") {
                key.allowedUIDs = try ids(uids, key: "keys[\(index)].allowed_uids", users: true)
            }
            try keyReader.finish()
            guard !config.keys.contains(where: { $0.keyID == keyID }) else {
                throw ConfigurationError("keys[\(index)].key_id \(keyID) appears twice")
            }
            config.keys.append(key)
        }
        if let defaultKey = try reader.optionalString("default_key_id") {
            guard config.keys.contains(where: { $0.keyID == defaultKey }) else {
                throw ConfigurationError("default_key_id \(defaultKey) is not one of keys[].key_id")
            }
            config.defaultKeyID = defaultKey
        }
        config.sessionPoolSize = try integer(&reader, "session_pool_size", config.sessionPoolSize, 1...1024)
        config.verifyBeforeReturn = try reader.optionalBool("verify_before_return") ?? config.verifyBeforeReturn
        config.auditLog = try reader.optionalBool("audit_log") ?? config.auditLog
        if let level = try reader.optionalString("log_level") {
            guard let parsed = LogLevel(rawValue: level) else {
                throw ConfigurationError("log_level must be one of \(LogLevel.allCases.map(\.rawValue).joined(separator: ", ")); got \(level)")
            }
            config.logLevel = parsed
        }
        if reader.has("http_threads") {
            config.httpThreads = try integer(&reader, "http_threads", 4, 1...256)
        }
        config.maxConnections = try integer(&reader, "max_connections", config.maxConnections, 1...65_536)
        if reader.has("max_connections_per_uid") {
            config.maxConnectionsPerUID = try integer(&reader, "max_connections_per_uid", 1, 1...config.maxConnections)
        }
        config.maxBodyBytes = try integer(&reader, "max_body_bytes", config.maxBodyBytes, 1024...(16 * 1024 * 1024))
        config.maxHeaderBytes = try integer(&reader, "max_header_bytes", config.maxHeaderBytes, 1024...(1024 * 1024))
        config.idleTimeoutSeconds = try integer(&reader, "idle_timeout_seconds", config.idleTimeoutSeconds, 1...86_400)
        config.requestTimeoutSeconds = try integer(&reader, "request_timeout_seconds", config.requestTimeoutSeconds, 1...3600)
        config.readinessCacheSeconds = Double(try integer(&reader, "readiness_cache_seconds", Int(config.readinessCacheSeconds), 0...3600))
        config.tokenCheckSeconds = try integer(&reader, "token_check_seconds", config.tokenCheckSeconds, 0...3600)
        config.sessionCheckoutTimeoutMs = try integer(&reader, "session_checkout_timeout_ms", config.sessionCheckoutTimeoutMs, 1...600_000)
        config.signTimeoutMs = try integer(&reader, "sign_timeout_ms", config.signTimeoutMs, 1...600_000)
        config.clockSkewSeconds = try integer(&reader, "clock_skew_seconds", config.clockSkewSeconds, 0...600)
        config.rateLimitPerSecond = Double(try integer(&reader, "rate_limit_per_second", 0, 0...1_000_000))
        config.rateLimitBurst = Double(try integer(&reader, "rate_limit_burst", Int(config.rateLimitBurst), 1...1_000_000))
        try reader.finish()
        return config
    }

    private static func integer(_ reader: inout FieldReader, _ key: String, _ fallback: Int, _ range: ClosedRange<Int>) throws -> Int {
        guard let value = try reader.optionalInteger(key) else { return fallback }
        guard range.contains(Int(value)) else {
            throw ConfigurationError("\(key) must be between \(range.lowerBound) and \(range.upperBound); got \(value)")
        }
        return Int(value)
    }

    private static func checkedIssuer(_ issuer: String, key: String) throws -> String {
        do {
            return try AppleFields.normalizeUUID(issuer, field: key)
        } catch {
            throw ConfigurationError("\(key) must be the issuer ID UUID from App Store Connect (Users and Access → Integrations)")
        }
    }

    private static func ids(_ values: [JSONValue]?, key: String, users: Bool) throws -> [UInt32] {
        try (values ?? []).map { value in
            switch value {
            case .integer(let number) where number >= 0 && number < Int64(UInt32.max):
                return UInt32(number)
            case .string(let name):
                if users, let entry = getpwnam(name) { return entry.pointee.pw_uid }
                if !users, let entry = getgrnam(name) { return entry.pointee.gr_gid }
                throw ConfigurationError("\(key): \(name) is not a \(users ? "user" : "group") on this host")
            default:
                throw ConfigurationError("\(key) must hold numeric ids or names")
            }
        }
    }
}

