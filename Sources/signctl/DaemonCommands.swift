import Foundation
import HSMSigner
import SignerIPC

/// A client for the socket the configuration names.
func client(configPath: String) throws -> SignerClient {
    let config = try loadConfiguration(configPath)
    return SignerClient(socketPath: config.socketPath, timeout: 30)
}

/// Sends a request; maps an unreachable daemon to ``unreachable(_:socketPath:)``.
func call(_ client: SignerClient, _ method: String, _ path: String, body: [UInt8]? = nil) throws -> ClientResponse {
    do {
        return try client.send(method, path, body: body)
    } catch {
        throw unreachable(error, socketPath: client.socketPath)
    }
}

/// The failure for a socket signctl could not use: exit 77 when this user
/// may not connect to it (`EACCES`, `EPERM`: no permission, as for a 403),
/// else 69 (signerd not running or not answering), with
/// ``unreachableHint(_:socketPath:)``.
func unreachable(_ error: SocketError, socketPath: String) -> CommandFailure {
    let code: ExitCode = error.errno == EACCES || error.errno == EPERM ? .noPermission : .unavailable
    return CommandFailure(code, "signerd is not reachable at \(socketPath): \(error.message)", hint: unreachableHint(error, socketPath: socketPath),
                          errorCode: "daemon_unreachable")
}

/// What to do about a socket signctl could not use, by the reason. For a
/// refused connection it names the group and mode the socket file has
/// (the shipped signerd.socket and sysusers file give it to signerd-clients).
func unreachableHint(_ error: SocketError, socketPath: String) -> String {
    switch error.errno {
    case EACCES, EPERM:
        var info = stat()
        guard stat(socketPath, &info) == 0 else {
            return "this user may not reach \(socketPath): check the directories above it, and the socket's group and mode (socket_group, socket_mode)"
        }
        let group = getgrgid(info.st_gid).map { String(cString: $0.pointee.gr_name) } ?? String(info.st_gid)
        let owner = "this user may not connect: \(socketPath) belongs to group \(group) with mode \(String(info.st_mode & 0o777, radix: 8)) "
            + "(the shipped signerd.socket makes it signerd-clients, 0660; socket_group and socket_mode in the configuration without socket activation); "
        // Connecting to a Unix socket needs write permission on it.
        if UnixListener.isInGroup(info.st_gid) && info.st_mode & 0o020 == 0 {
            return owner + "this user is in \(group), but the mode gives the group no write permission, which connecting needs: "
                + "set socket_mode to \"0660\" (SocketMode=0660 with signerd.socket) and restart signerd"
        }
        // Membership of gid 0 opens every root-group file on the host: never the advice.
        guard info.st_gid != 0 else {
            return owner + "run signctl as root, or set socket_group in signerd's configuration (SocketGroup= with signerd.socket) to a group "
                + "for its clients, such as signerd-clients, restart signerd, and add the user to that group"
        }
        return owner + "add the user to \(group) (usermod -aG \(group) USER, then log in again) or run as root"
    case ENOENT, ECONNREFUSED:
        return "is signerd running (systemctl status signerd)? signctl connects to socket_path of --config FILE"
    default:
        return "is signerd running, and may this user open the socket (socket_mode, socket_group)?"
    }
}

/// What the signerd listening on a socket says it serves, for
/// `keys delete`'s `key_still_configured` warning: its configuration may
/// differ from signctl's (another file, or edited and not reloaded).
enum DaemonKeys {
    /// signerd answered `GET /v1/keys` with the keys in its `keys[]`.
    case answered([KeysResponse.Key])
    /// signerd could not be asked (`reason`, in words); `notRunning` when
    /// nothing listens there (no socket file, connection refused).
    case unanswered(reason: String, notRunning: Bool)
}

/// Asks the signerd on `socketPath` which keys it is configured with
/// (`GET /v1/keys`), waiting at most 5 s for it.
/// - Parameter socketPath: `socket_path` of signctl's configuration.
/// - Returns: the keys, or why they could not be read (unreachable, 403,
///   503, an answer that is not the listing).
func configuredKeysOfDaemon(socketPath: String) -> DaemonKeys {
    let client = SignerClient(socketPath: socketPath, timeout: 5)
    defer { client.close() }
    let response: ClientResponse
    do {
        response = try client.send("GET", Route.keys.rawValue)
    } catch {
        return .unanswered(reason: error.message, notRunning: error.errno == ENOENT || error.errno == ECONNREFUSED)
    }
    guard response.status == 200, let listing = try? response.decode(KeysResponse.self) else {
        return .unanswered(reason: "GET /v1/keys answered \(response.status)\(response.error.map { " \($0.code)" } ?? "")", notRunning: false)
    }
    return .answered(listing.keys)
}

/// Turns an error response into a failure with the contract's code and exit status.
func failure(from response: ClientResponse) -> CommandFailure {
    let error = response.error
    let code: ExitCode = switch response.status {
    case 400, 404, 413, 415: .dataError
    case 403: .noPermission
    case 429: .tempFail
    case 503: .unavailable
    default: .software
    }
    let field = error?.field.map { " (field \($0))" } ?? ""
    // An answer without signerd's error object (another server on the socket, a proxy) is named as such.
    return CommandFailure(code, "\(response.status) \(error?.code ?? "error")\(field): \(error?.message ?? String(decoding: response.body, as: UTF8.self))",
                          errorCode: error?.code ?? "unexpected_response", field: error?.field)
}

func health(_ words: [String], configPath: String) throws -> ExitCode {
    let arguments = try Arguments(words, options: [], flags: ["json"])
    if arguments.flag("help") {
        print("usage: signctl health [--json]\n\nAsks signerd's /readyz: every configured key signs a test digest that must verify.\nExit 0 ready, 69 not ready or unreachable, 75 rate limited (429), 77 not allowed (403, or no permission on the socket).")
        return .success
    }
    _ = try arguments.positionals(0, "")
    let config = try loadConfiguration(configPath)
    let client = SignerClient(socketPath: config.socketPath, timeout: 30)
    let response: ClientResponse
    do {
        response = try client.send("GET", "/readyz")
    } catch {
        // Reported as every other failure: the words on stderr and, with
        // --json, the {"error": …} object on stdout.
        throw unreachable(error, socketPath: config.socketPath)
    }
    guard let readiness = try? response.decode(ReadinessResponse.self) else {
        throw failure(from: response)
    }
    if arguments.flag("json") {
        printJSON(readiness)
    } else {
        print("\(readiness.status)\(readiness.reason.map { ": \($0)" } ?? "")")
        for key in readiness.keys {
            print("  \(key.keyID): \(key.ok ? "ok" : "failing: \(key.error ?? "?")")")
        }
    }
    return response.status == 200 ? .success : .unavailable
}

func sign(kind: String, _ words: [String], configPath: String) throws -> ExitCode {
    switch kind {
    case "promotional-offer":
        let arguments = try Arguments(words, options: ["bundle-id", "product-id", "offer-id", "key-id", "app-account-token", "nonce", "timestamp"], flags: ["json"])
        if arguments.flag("help") {
            print("usage: signctl sign promotional-offer --bundle-id B --product-id P --offer-id O [--key-id K]\n       [--app-account-token UUID] [--nonce UUID] [--timestamp MS] [--json]")
            return .success
        }
        _ = try arguments.positionals(0, "")
        var timestamp: Int64?
        if let text = arguments.options["timestamp"] {
            guard let value = Int64(text) else { throw UsageError("--timestamp must be UNIX time in milliseconds") }
            timestamp = value
        }
        let request = PromotionalOfferRequest(
            bundleID: try arguments.required("bundle-id"), keyID: arguments.options["key-id"],
            productID: try arguments.required("product-id"), offerID: try arguments.required("offer-id"),
            appAccountToken: arguments.options["app-account-token"], nonce: arguments.options["nonce"], timestamp: timestamp)
        let client = try client(configPath: configPath)
        let response = try call(client, "POST", Route.promotionalOffer.rawValue, body: WireBody.encode(request))
        guard response.status == 200, let signed = try? response.decode(PromotionalOfferResponse.self) else {
            throw failure(from: response)
        }
        if arguments.flag("json") {
            printJSON(signed)
        } else {
            print("key_id:            \(signed.keyID)\napp_account_token: \(signed.appAccountToken.isEmpty ? "(none)" : signed.appAccountToken)\nnonce:             \(signed.nonce)\ntimestamp:         \(signed.timestamp)\nsignature:         \(signed.signature)")
        }
        return .success
    case "promotional-offer-v2", "introductory-offer-eligibility", "advanced-commerce-request", "server-api-token":
        return try signJWSCommand(kind: kind, words, configPath: configPath)
    default:
        throw UsageError(kind.isEmpty ? "sign needs a kind" : "unknown signature kind \(kind)",
                         hint: "kinds: promotional-offer, promotional-offer-v2, introductory-offer-eligibility, advanced-commerce-request, server-api-token")
    }
}

func verifyPromotionalOffer(_ words: [String]) throws -> ExitCode {
    let arguments = try Arguments(words, options: ["public-key", "bundle-id", "key-id", "product-id", "offer-id", "app-account-token", "nonce", "timestamp", "signature"], flags: ["json"])
    if arguments.flag("help") {
        print("""
        usage: signctl verify promotional-offer --public-key PEM --bundle-id B --key-id K --product-id P --offer-id O
               [--app-account-token UUID] --nonce UUID --timestamp MS --signature BASE64 [--json]

        Rebuilds the payload Apple verifies and checks the signature offline, the way the App Store
        does. Exit 0 valid, 65 invalid (the output says which check failed).
        """)
        return .success
    }
    _ = try arguments.positionals(0, "")
    // Every usage error (64) before the key file is read (65 or 77 when it cannot be).
    let publicKeyPath = try arguments.required("public-key")
    guard let timestamp = Int64(try arguments.required("timestamp")) else {
        throw UsageError("--timestamp must be UNIX time in milliseconds")
    }
    let signatureText = try arguments.required("signature")
    let (bundleID, keyID, productID, offerID, nonce) = (try arguments.required("bundle-id"), try arguments.required("key-id"),
                                                       try arguments.required("product-id"), try arguments.required("offer-id"), try arguments.required("nonce"))
    let publicKey = try readPublicKey(publicKeyPath)
    let payload: PromotionalOfferPayload
    do {
        payload = try PromotionalOfferPayload(bundleID: bundleID, keyID: keyID, productID: productID, offerID: offerID,
                                              appAccountToken: arguments.options["app-account-token"] ?? "", nonce: nonce, timestamp: timestamp)
    } catch {
        throw CommandFailure(.dataError, "\(error.field): \(error.message)", errorCode: error.code)
    }
    var problems: [String] = []
    if timestamp < 100_000_000_000 { problems.append("the timestamp looks like seconds; Apple expects milliseconds") }
    // The payload is rebuilt with them lowercase, as Apple's examples and
    // signerd sign them; a signature over the uppercase text does not verify.
    for (name, value) in [("nonce", nonce), ("app account token", arguments.options["app-account-token"] ?? "")] where value != value.lowercased() {
        problems.append("the \(name) was given with uppercase letters; the payload is checked with it lowercase, as it must be signed")
    }
    guard let der = Data(base64Encoded: signatureText).map(Array.init) else {
        let hint = signatureText.contains("-") || signatureText.contains("_") ? " (it looks like base64url; Apple wants standard Base64 with padding)"
            : signatureText.count % 4 != 0 ? " (the padding is missing)" : ""
        throw CommandFailure(.dataError, "the signature is not standard Base64\(hint)", errorCode: "signature_not_base64")
    }
    if der.count == 64, (try? ECDSASignature.raw(fromDER: der, curve: .p256)) == nil {
        problems.append("the signature is 64 bytes: raw r‖s where Apple expects DER")
    }
    let valid = publicKey.verify(derSignature: der, digest: SHA256.hash(payload.payload))
    if arguments.flag("json") {
        printJSON(OfferVerification(valid: valid, payload_sha256: SHA256.hash(payload.payload).hexString, problems: problems))
    } else {
        print(valid ? "valid: the signature verifies for this payload" : "INVALID: the signature does not verify for this payload")
        print("payload SHA-256: \(SHA256.hash(payload.payload).hexString)")
        for problem in problems { print("note: \(problem)") }
        if !valid {
            print("check: the key ID is the key that signed; app_account_token and nonce are lowercase; the token matches the purchase's appAccountToken (empty if none); the timestamp is in milliseconds")
        }
    }
    return valid ? .success : .dataError
}

/// Reads the PEM file `--public-key` names, saying why when it cannot:
/// no such file, permission denied, a directory or another file that is
/// not a regular one (which could block, as a FIFO does), not UTF-8.
/// - Parameter path: the file.
/// - Throws: ``CommandFailure`` with the path and the reason: 77 when this
///   user may not read the file, else 65; ``CryptoError`` when the text is
///   not a P-256 public key.
func readPublicKey(_ path: String) throws -> ECPublicKey {
    func unreadable(_ reason: String, exit: ExitCode = .dataError) -> CommandFailure {
        CommandFailure(exit, "cannot read the public key \(path): \(reason)", hint: "pass --public-key with the PEM file signctl keys export-public KEY_ID writes",
                       errorCode: "public_key_unreadable")
    }
    var info = stat()
    guard stat(path, &info) == 0 else {
        let failed = errno
        throw unreadable(String(cString: strerror(failed)), exit: failed == EACCES ? .noPermission : .dataError)
    }
    switch info.st_mode & S_IFMT {
    case S_IFREG: break
    case S_IFDIR: throw unreadable("it is a directory, not a file")
    default: throw unreadable("it is not a regular file")
    }
    guard let pem = try? String(contentsOfFile: path, encoding: .utf8) else {
        // Permission is the reader's problem, not the file's (sysexits: 77).
        if access(path, R_OK) != 0 {
            let failed = errno
            throw unreadable(String(cString: strerror(failed)), exit: failed == EACCES ? .noPermission : .dataError)
        }
        throw unreadable("it is not UTF-8 text, as a PEM file is")
    }
    return try ECPublicKey(pem: pem)
}

/// What `verify promotional-offer --json` prints: `valid` is a JSON boolean
/// (the string "false" is truthy to jq -e, JavaScript and Python), and
/// `problems` an array of sentences.
struct OfferVerification: Encodable {
    let valid: Bool
    let payload_sha256: String
    let problems: [String]
}

/// JSON bodies for requests, as the API expects them.
enum WireBody {
    static func encode(_ value: some Encodable) -> [UInt8] {
        let encoder = JSONEncoder()
        encoder.outputFormatting = [.withoutEscapingSlashes, .sortedKeys]
        return Array((try? encoder.encode(value)) ?? Data())
    }
}

func verifyJWS(_ words: [String]) throws -> ExitCode {
    let arguments = try Arguments(words, options: ["public-key"], flags: ["json"])
    if arguments.flag("help") {
        print("usage: signctl verify jws TOKEN --public-key PEM [--json]\n\nDecodes any signerd JWS (the four kinds), checks ES256 with the public key and prints header and claims.\nExit 0 valid, 65 invalid or malformed (a DER signature is named as such).")
        return .success
    }
    let token = try arguments.positionals(1, "the compact JWS").first!  // exactly one
    let publicKey = try readPublicKey(try arguments.required("public-key"))
    let decoded: CompactJWS.Decoded
    do {
        decoded = try CompactJWS.decode(token.trimmingCharacters(in: .whitespacesAndNewlines))
    } catch {
        throw CommandFailure(.dataError, "malformed JWS: \(error.message)", errorCode: error.code)
    }
    let valid = publicKey.verify(rawSignature: decoded.signature, digest: SHA256.hash(Array(decoded.signingInput.utf8)))
    func pretty(_ json: String) -> String {
        guard let object = try? JSONSerialization.jsonObject(with: Data(json.utf8)),
              let data = try? JSONSerialization.data(withJSONObject: object, options: [.prettyPrinted, .sortedKeys, .withoutEscapingSlashes]) else { return escapingInvisible(json) }
        return escapingInvisible(String(decoding: data, as: UTF8.self))
    }
    if arguments.flag("json") {
        print("{\"valid\": \(valid), \"header\": \(decoded.header), \"claims\": \(decoded.claims)}")
    } else {
        print(valid ? "valid: ES256 signature verifies with the public key" : "INVALID: the signature does not verify with this public key")
        print("header: \(pretty(decoded.header))")
        print("claims: \(pretty(decoded.claims))")
    }
    return valid ? .success : .dataError
}

/// `text` with the characters a terminal would act on or hide written as
/// JSON escapes (`\u202E`): C1 controls (U+0080–U+009F, U+009B opens an
/// escape sequence on some terminals) and the bidirectional controls
/// (U+061C, U+200E, U+200F, U+202A–U+202E, U+2066–U+2069), which reorder
/// what is shown. A claim read from a token someone handed over is shown
/// as it is, not as it would look.
/// - Parameters:
///   - text: what to show.
///   - controls: also escape the C0 controls but the line feed, and DEL
///     (ESC starts a terminal escape sequence, CR overwrites the line):
///     for error messages, which may quote the operator's own arguments.
func escapingInvisible(_ text: String, controls: Bool = false) -> String {
    var out = ""
    out.unicodeScalars.reserveCapacity(text.unicodeScalars.count)
    for scalar in text.unicodeScalars {
        let control = (scalar.value < 0x20 && scalar.value != 0x0A) || scalar.value == 0x7F
        switch scalar.value {
        case _ where control && controls,
             0x80...0x9F, 0x61C, 0x200E, 0x200F, 0x202A...0x202E, 0x2066...0x2069:
            out += "\\u" + String(repeating: "0", count: 4 - String(scalar.value, radix: 16).count) + String(scalar.value, radix: 16, uppercase: true)
        default:
            out.unicodeScalars.append(scalar)
        }
    }
    return out
}

func signJWSCommand(kind: String, _ words: [String], configPath: String) throws -> ExitCode {
    let path: Route
    let body: [UInt8]
    let arguments: Arguments
    switch kind {
    case "promotional-offer-v2":
        arguments = try Arguments(words, options: ["bundle-id", "key-id", "product-id", "offer-id", "transaction-id"], flags: ["json"])
        if arguments.flag("help") {
            print("usage: signctl sign promotional-offer-v2 --bundle-id B --product-id P --offer-id O [--transaction-id T] [--key-id K] [--json]")
            return .success
        }
        path = .promotionalOfferV2
        body = WireBody.encode(PromotionalOfferV2Request(bundleID: try arguments.required("bundle-id"), keyID: arguments.options["key-id"],
                                                         productID: try arguments.required("product-id"), offerID: try arguments.required("offer-id"),
                                                         transactionID: arguments.options["transaction-id"]))
    case "introductory-offer-eligibility":
        arguments = try Arguments(words, options: ["bundle-id", "key-id", "product-id", "transaction-id", "allow-introductory-offer"], flags: ["json"])
        if arguments.flag("help") {
            print("usage: signctl sign introductory-offer-eligibility --bundle-id B --product-id P --transaction-id T --allow-introductory-offer true|false [--key-id K] [--json]")
            return .success
        }
        let allow = try arguments.required("allow-introductory-offer")
        guard allow == "true" || allow == "false" else { throw UsageError("--allow-introductory-offer must be true or false") }
        path = .introductoryOfferEligibility
        body = WireBody.encode(IntroductoryOfferEligibilityRequest(bundleID: try arguments.required("bundle-id"), keyID: arguments.options["key-id"],
                                                                   productID: try arguments.required("product-id"), allowIntroductoryOffer: allow == "true",
                                                                   transactionID: try arguments.required("transaction-id")))
    case "advanced-commerce-request":
        arguments = try Arguments(words, options: ["bundle-id", "key-id", "request"], flags: ["json"])
        if arguments.flag("help") {
            print("usage: signctl sign advanced-commerce-request --bundle-id B --request JSON_OBJECT [--key-id K] [--json]")
            return .success
        }
        // Sent to signerd as written: decoding and encoding it here would merge
        // a repeated name or round a number before signerd's checks saw it.
        let text = Array(try arguments.required("request").utf8)
        guard (try? JSONSerialization.jsonObject(with: Data(text))) is [String: Any] else {
            throw UsageError("--request must be one JSON object")
        }
        path = .advancedCommerceRequest
        struct Outer: Encodable {
            var bundleID: String
            var keyID: String?
            enum CodingKeys: String, CodingKey { case bundleID = "bundle_id", keyID = "key_id" }
        }
        var outer = WireBody.encode(Outer(bundleID: try arguments.required("bundle-id"), keyID: arguments.options["key-id"]))
        outer.removeLast()  // the closing brace of {"bundle_id":…}
        body = outer + Array(#","request":"#.utf8) + text + [UInt8(ascii: "}")]
    default:  // server-api-token
        arguments = try Arguments(words, options: ["bundle-id", "key-id", "ttl-seconds"], flags: ["json"])
        if arguments.flag("help") {
            print("usage: signctl sign server-api-token --bundle-id B [--ttl-seconds 1..3600] [--key-id K] [--json]")
            return .success
        }
        let ttl = arguments.options["ttl-seconds"] == nil ? nil : try arguments.integer("ttl-seconds", default: 300, in: 1...3600)
        path = .serverAPIToken
        body = WireBody.encode(ServerAPITokenRequest(bundleID: try arguments.required("bundle-id"), keyID: arguments.options["key-id"], ttlSeconds: ttl))
    }
    _ = try arguments.positionals(0, "")
    let client = try client(configPath: configPath)
    let response = try call(client, "POST", path.rawValue, body: body)
    guard response.status == 200 else { throw failure(from: response) }
    if arguments.flag("json") {
        if let token = try? response.decode(ServerAPITokenResponse.self) {
            printJSON(token)
        } else if let jws = try? response.decode(JWSResponse.self) {
            printJSON(jws)
        }
    } else if let token = try? response.decode(ServerAPITokenResponse.self) {
        print(token.token)
    } else if let jws = try? response.decode(JWSResponse.self) {
        print(jws.jws)
    }
    return .success
}

/// Makes sure this process may open the descriptors a bench run needs
/// (getrlimit(2) `RLIMIT_NOFILE`): one per connection, or in direct mode
/// up to three per thread (its session's token files while SoftHSM signs),
/// and 64 more for signctl itself. A soft limit below that is raised
/// toward the hard limit (setrlimit(2)); without that, connections would
/// fail with `EMFILE` and be counted as the daemon's socket errors.
/// - Throws: ``UsageError`` (exit 64) naming both limits when even the
///   hard limit is too low.
func reserveDescriptors(forConcurrency concurrency: Int, direct: Bool) throws {
    let needed = rlim_t(concurrency * (direct ? 3 : 1) + 64)
    var limit = rlimit()
    guard getrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &limit) == 0, limit.rlim_cur < needed else { return }
    if limit.rlim_max >= needed {
        var raised = limit
        raised.rlim_cur = needed
        if setrlimit(__rlimit_resource_t(RLIMIT_NOFILE.rawValue), &raised) == 0 { return }
    }
    throw UsageError("--concurrency \(concurrency) needs about \(needed) open descriptors in signctl, and this process may open \(limit.rlim_cur) "
                     + "(hard limit \(limit.rlim_max == rlim_t.max ? "unlimited" : String(limit.rlim_max)))",
                     hint: "raise the limit (ulimit -n \(needed), or LimitNOFILE= for a service), or lower --concurrency")
}

func bench(_ words: [String], configPath: String) throws -> ExitCode {
    let arguments = try Arguments(words, options: ["concurrency", "duration", "requests", "endpoint", "key-id", "bundle-id"], flags: ["direct", "verify", "json"])
    if arguments.flag("help") {
        print("""
        usage: signctl bench [--concurrency N] [--duration S | --requests N] [--endpoint E] [--key-id K] [--bundle-id B] [--verify] [--json]
               signctl bench --direct [--concurrency N] [--duration S | --requests N] [--key-id K] [--verify] [--json]

        Closed-loop load over signerd's socket: N keep-alive connections, each sending the next request when
        the previous answer arrived. Every response counts as an error unless it is a 200 with a well-formed
        signature; --verify also checks each signature with the public key (off by default, so the client
        does not become the bottleneck). Reports successful requests/s, latency p50/p90/p99/p99.9/max, errors
        by code, the daemon's RSS and open descriptors before and after (from /proc), and the CPU time per
        request of signctl and of signerd (getrusage, /proc/PID/stat). The daemon is the socket's peer, or
        under socket activation the listener's one signerd child (daemon_pid in --json). Without --key-id
        the first listed key that serves --bundle-id (default: that key's first bundle ID) and is on the token;
        a --bundle-id that no key serves is sent with the first key, so that the daemon's refusal is loaded.
        signctl raises its own descriptor limit (RLIMIT_NOFILE) to what N connections need, or refuses (64).

        --direct is the baseline: the same SHA-256 + C_SignInit/C_Sign loop through the PKCS#11 module in
        this process (token_uri from the config), N threads with one session each, no socket.

        Endpoints: \(LoadGenerator.Endpoint.allCases.map(\.rawValue).joined(separator: ", ")). Defaults: --concurrency 8 --duration 10 (seconds, at most 86400).
        Exit 0 when every request succeeded, 69 when any failed (the report counts them by code: the daemon's
        error code, http_STATUS, malformed_signature, short_signature (a valid DER signature under the documented
        70 bytes, which signerd returns only when signing again failed, as in an outage), invalid_signature with
        --verify, or socket_ERRNO such as socket_ECONNREFUSED, socket_timeout (30 s without an answer),
        socket_closed and socket_protocol when the socket itself failed). A request in flight is waited for up to those 30 s, so a daemon that hangs can
        make a run last that much longer than --duration.
        """)
        return .success
    }
    _ = try arguments.positionals(0, "")
    let concurrency = try arguments.integer("concurrency", default: 8, in: 1...1024)
    let length: BenchmarkLength
    if arguments.options["requests"] != nil {
        guard arguments.options["duration"] == nil else { throw UsageError("give --duration or --requests, not both") }
        length = .requests(try arguments.integer("requests", default: 1000, in: 1...100_000_000))
    } else {
        let text = arguments.options["duration"] ?? "10"
        // Decimal seconds only: Swift's Double(_:) also reads "0x10" (16) and "1e-9".
        guard !text.isEmpty, text.allSatisfy({ $0.isASCII && ($0.isNumber || $0 == ".") }),
              let seconds = Double(text), seconds > 0, seconds <= 86_400 else {
            throw UsageError("--duration must be seconds, more than 0 and at most 86400 (one day); got \(text)")
        }
        length = .seconds(seconds)
    }
    if arguments.flag("direct") {
        for option in ["endpoint", "bundle-id"] where arguments.options[option] != nil {
            throw UsageError("--\(option) does not apply to --direct, which signs digests through the PKCS#11 module without signerd",
                             hint: "leave out --\(option), or --direct to load signerd")
        }
    }
    if let endpoint = arguments.options["endpoint"], [LoadGenerator.Endpoint.offers, .healthz].map(\.rawValue).contains(endpoint), arguments.options["key-id"] != nil {
        // The RevenueCat batch format names no key (the daemon chooses the bundle's), and /healthz signs nothing.
        throw UsageError("--key-id does not apply to --endpoint \(endpoint), whose requests name no key",
                         hint: endpoint == LoadGenerator.Endpoint.offers.rawValue ? "signerd chooses the bundle's key for /v1/offers: leave out --key-id, or give the bundle's default_key_id in the configuration" : "leave out --key-id")
    }
    if arguments.options["endpoint"] == LoadGenerator.Endpoint.healthz.rawValue, arguments.flag("verify") {
        throw UsageError("--verify does not apply to --endpoint healthz, whose answers carry no signature", hint: "leave out --verify")
    }
    try reserveDescriptors(forConcurrency: concurrency, direct: arguments.flag("direct"))
    if let keyID = arguments.options["key-id"], !KeyID.isValid(keyID) {
        throw UsageError("--key-id must be 10 characters A-Z0-9, as App Store Connect shows it; got \(keyID)")
    }
    let config = try loadConfiguration(configPath)
    let report: BenchmarkReport
    if arguments.flag("direct") {
        var options = TokenOptions()
        options.sessionPoolSize = concurrency
        options.logger = operatorLogger()
        options.loginOnFinalTry = loginOnFinalTry
        let token = try openToken(config, configPath: configPath, options: options)
        defer { token.close() }
        guard let keyID = arguments.options["key-id"] ?? config.keys.first?.keyID else {
            throw UsageError("--key-id is required when the configuration lists no keys")
        }
        report = try DirectBenchmark(token: token, keyID: keyID, concurrency: concurrency, length: length, verify: arguments.flag("verify")).run()
    } else {
        guard let endpoint = LoadGenerator.Endpoint(rawValue: arguments.options["endpoint"] ?? "promotional-offer") else {
            throw UsageError("unknown --endpoint", hint: "endpoints: \(LoadGenerator.Endpoint.allCases.map(\.rawValue).joined(separator: ", "))")
        }
        do {
            report = try LoadGenerator(socketPath: config.socketPath, endpoint: endpoint, concurrency: concurrency, length: length,
                                       verify: arguments.flag("verify"), bundleID: arguments.options["bundle-id"], keyID: arguments.options["key-id"]).run()
        } catch let error as SocketError {
            throw unreachable(error, socketPath: config.socketPath)
        }
    }
    if arguments.flag("json") {
        printJSON(report)
    } else {
        func ms(_ key: String, _ latency: [String: Double] = report.latencyMs) -> String { String(format: "%.3f", latency[key] ?? 0) }
        print("\(report.mode) \(report.endpoint): \(report.concurrency) \(report.mode == "direct" ? "threads" : "connections"), \(report.requests) requests in \(String(format: "%.2f", report.durationSeconds)) s")
        print(String(format: "throughput: %.0f successful requests/s", report.throughput))
        if report.latencyMs.isEmpty {
            print("latency ms: none (no request succeeded)")
        } else {
            print("latency ms: p50 \(ms("p50"))  p90 \(ms("p90"))  p99 \(ms("p99"))  p99.9 \(ms("p99.9"))  max \(ms("max"))  mean \(ms("mean"))")
        }
        print("errors: \(report.errorCount == 0 ? "none" : report.errors.sorted { $0.key < $1.key }.map { "\($0.key) \($0.value)" }.joined(separator: ", "))")
        if !report.errorLatencyMs.isEmpty {
            let failed = report.errorLatencyMs
            print("failed requests' latency ms: p50 \(ms("p50", failed))  p99 \(ms("p99", failed))  max \(ms("max", failed))  mean \(ms("mean", failed))")
        }
        func shown(_ value: Int?) -> String { value.map(String.init) ?? "unreadable" }
        if let rss = report.rssKiB { print("daemon RSS KiB: before \(shown(rss["before"])), after \(shown(rss["after"]))") }
        if let fds = report.openFDs {
            let note = fds["before"] == nil ? " (/proc/PID/fd of signerd, which is not dumpable, can be listed only by root)" : ""
            print("daemon open descriptors: before \(shown(fds["before"])), after \(shown(fds["after"]))\(note)")
        }
        if let pid = report.daemonPID { print("daemon: pid \(pid) (\(ProcessStatistics.commandName(pid) ?? "exited"))") }
        if let why = report.daemonNotMeasured { print("daemon RSS, descriptors and CPU not read: \(why)") }
        if let cpu = report.cpuMicrosecondsPerRequest, !cpu.isEmpty {
            // The JSON key stays `signerd`; the text names it by role, since the
            // socket's peer may be another server (the C floor, a proxy).
            print("CPU µs per request: " + cpu.sorted { $0.key < $1.key }.map { "\($0.key == "signerd" ? "daemon" : $0.key) " + String(format: "%.1f", $0.value) }.joined(separator: ", "))
        }
        if report.daemonPID != nil, report.cpuMicrosecondsPerRequest?["signerd"] == nil {
            print("daemon CPU not shown: it used less than 10 clock ticks of /proc/PID/stat in this run; run for a second or more")
        }
    }
    guard report.requests > 0 else {
        // A run that completed nothing measured nothing: not a success.
        writeError("no request completed in \(String(format: "%.2f", report.durationSeconds)) s", hint: "give a longer --duration, or --requests N")
        return .unavailable
    }
    return report.errorCount == 0 ? .success : .unavailable
}
