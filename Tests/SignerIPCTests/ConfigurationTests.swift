import Foundation
import HSMSigner
import SignerIPC
import TestSupport
import Testing

@Suite("Configuration file")
struct ConfigurationTests {
    static let uri = "pkcs11:token=signer?module-path=/usr/lib/softhsm/libsofthsm2.so&pin-source=file:/etc/signerd/pin"

    func parse(_ json: String) throws(ConfigurationError) -> SignerConfiguration {
        try SignerConfiguration.parse(Array(json.utf8))
    }

    /// Two keys for one bundle without `default_key_id` passed the check
    /// and the reload silently; then every `/v1/offers` for it got 7234.
    @Test("a bundle several keys serve with none of them default_key_id is an advisory naming the bundle and the keys")
    func ambiguousBundle() throws {
        let keys = """
        "keys": [{"key_id": "ABC123DEFG", "bundle_ids": ["com.example.app", "com.example.solo"]},
                 {"key_id": "XYZ987WVUT", "bundle_ids": ["com.example.app"]}]
        """
        let ambiguous = try parse(#"{"token_uri": "\#(Self.uri)", \#(keys)}"#).advisories.filter { $0.event == "bundle_key_ambiguous" }
        #expect(ambiguous.count == 1)
        #expect(ambiguous.first?.hint.contains("bundle_id com.example.app is served by keys ABC123DEFG, XYZ987WVUT") == true, "\(ambiguous)")
        #expect(ambiguous.first?.hint.contains("7234") == true)
        let settled = try parse(#"{"token_uri": "\#(Self.uri)", \#(keys), "default_key_id": "XYZ987WVUT"}"#)
        #expect(!settled.advisories.contains { $0.event == "bundle_key_ambiguous" })
    }

    /// api.md: "at most 1024 connections". A default share of half that
    /// refused one client's 513th connection with 429.
    @Test("by default one uid may hold max_connections connections; max_connections_per_uid lowers it")
    func connectionShareDefault() throws {
        #expect(try parse(#"{"token_uri": "\#(Self.uri)"}"#).effectiveMaxConnectionsPerUID == 1024)
        #expect(try parse(#"{"token_uri": "\#(Self.uri)", "max_connections": 64}"#).effectiveMaxConnectionsPerUID == 64)
        #expect(try parse(#"{"token_uri": "\#(Self.uri)", "max_connections_per_uid": 512}"#).effectiveMaxConnectionsPerUID == 512)
        #expect(HTTPServerOptions().connectionsPerUIDLimit == HTTPServerOptions().connectionLimit)
    }

    @Test("a fraction where a whole number belongs is named with its value")
    func fractionNamed() throws {
        let error = #expect(throws: ConfigurationError.self) { try parse(#"{"token_uri": "\#(Self.uri)", "rate_limit_per_second": 1.5}"#) }
        #expect(error?.message.contains("rate_limit_per_second") == true, "\(error?.message ?? "")")
        #expect(error?.message.contains("got a number written with a fraction or an exponent (1.5)") == true, "\(error?.message ?? "")")
    }

    /// An unknown member of a keys[] entry was named, then followed by the
    /// top level's keys (a documentation audit).
    @Test("an unknown key, at the top or in a keys[] entry, is named with the keys allowed there")
    func unknownKeyNamed() throws {
        let top = #expect(throws: ConfigurationError.self) { try parse(#"{"token_uri": "\#(Self.uri)", "socket_pth": "/x"}"#) }
        #expect(top?.message.hasPrefix("unknown configuration key socket_pth; known keys: ") == true && top?.message.contains("socket_path") == true, "\(top?.message ?? "")")
        let entry = #expect(throws: ConfigurationError.self) {
            try parse(#"{"token_uri": "\#(Self.uri)", "keys": [{"key_id": "ABC123DEFG", "bundle_ids": ["a"], "bundle_id": "a"}]}"#)
        }
        #expect(entry?.message.contains("keys[0].bundle_id is not a field of keys[0] (fields are: allowed_uids, bundle_ids, issuer_id, key_id)") == true, "\(entry?.message ?? "")")
        #expect(entry?.message.contains("socket_path") == false, "\(entry?.message ?? "")")
    }

    @Test("a full configuration parses with its values")
    func full() throws {
        let config = try parse("""
        {"socket_path": "/tmp/s.sock", "socket_mode": "0600", "token_uri": "\(Self.uri)",
         "issuer_id": "57246542-96FE-1A63-E053-0824D011072A",
         "keys": [{"key_id": "ABC123DEFG", "bundle_ids": ["com.example.app"], "allowed_uids": [1000]},
                  {"key_id": "XYZ987WVUT", "bundle_ids": ["com.example.app", "com.example.other"], "issuer_id": "00000000-0000-4000-8000-000000000000"}],
         "default_key_id": "ABC123DEFG", "allowed_uids": [33, "root"], "allowed_gids": [0],
         "session_pool_size": 4, "verify_before_return": false, "audit_log": true, "log_level": "debug", "sign_timeout_ms": 250,
         "token_check_seconds": 0}
        """)
        #expect(config.socketPath == "/tmp/s.sock")
        #expect(config.socketMode == 0o600)
        #expect(config.issuerID == "57246542-96fe-1a63-e053-0824d011072a")
        #expect(config.keys.count == 2)
        #expect(config.keys[0].allowedUIDs == [1000])
        #expect(config.keys[1].bundleIDs == ["com.example.app", "com.example.other"])
        #expect(config.defaultKeyID == "ABC123DEFG")
        #expect(config.allowedUIDs == [33, 0])
        #expect(config.sessionPoolSize == 4)
        #expect(config.verifyBeforeReturn == false)
        #expect(config.auditLog == true)
        #expect(config.logLevel == .debug)
        #expect(config.signTimeoutMs == 250)
        #expect(config.maxBodyBytes == 65536)
        #expect(config.requestTimeoutSeconds == 10)
        #expect(config.idleTimeoutSeconds == 60)
        #expect(config.maxConnections == 1024)
        #expect(config.tokenCheckSeconds == 0, "0 turns the idle token check off")
        #expect(!config.advisories.contains { $0.event == "readiness_cache_off" })
        let uncached = try parse("{\"token_uri\": \"\(Self.uri)\", \"readiness_cache_seconds\": 0}")
        #expect(uncached.advisories.contains { $0.event == "readiness_cache_off" && $0.hint.contains("probes load the HSM") })
        #expect(try parse("{\"token_uri\": \"\(Self.uri)\"}").tokenCheckSeconds == 30, "the default")
    }

    /// A key with no issuer ID signs the classic signature only; the JWS
    /// kinds found out at their first request, with a 400.
    @Test("keys with no issuer ID, top level or their own, are an advisory naming them")
    func missingIssuer() throws {
        let keys = """
        "keys": [{"key_id": "ABC123DEFG", "bundle_ids": ["com.example.app"]},
                 {"key_id": "XYZ987WVUT", "bundle_ids": ["com.example.other"], "issuer_id": "57246542-96fe-1a63-e053-0824d011072a"},
                 {"key_id": "QRS456LMNO", "bundle_ids": ["com.example.third"]}]
        """
        let missing = try parse(#"{"token_uri": "\#(Self.uri)", \#(keys)}"#).advisories.filter { $0.event == "issuer_id_missing" }
        #expect(missing.count == 1)
        #expect(missing.first?.hint.hasPrefix("keys ABC123DEFG, QRS456LMNO have no issuer ID") == true, "\(missing)")
        #expect(missing.first?.hint.contains("JWS kinds and the App Store Server API token are answered 400") == true, "\(missing)")
        let topLevel = try parse(#"{"token_uri": "\#(Self.uri)", "issuer_id": "57246542-96fe-1a63-e053-0824d011072a", \#(keys)}"#)
        #expect(!topLevel.advisories.contains { $0.event == "issuer_id_missing" })
        let one = try parse(#"{"token_uri": "\#(Self.uri)", "keys": [{"key_id": "ABC123DEFG", "bundle_ids": ["com.example.app"]}]}"#)
        #expect(one.advisories.filter { $0.event == "issuer_id_missing" }.map(\.hint).first?.hasPrefix("key ABC123DEFG has no issuer ID") == true)
    }

    @Test("bad configurations are refused with the key named", arguments: [
        ("{}", "token_uri"),
        ("{\"token_uri\": \"\(uri)\", \"socket_pth\": \"/x\"}", "socket_pth"),
        ("{\"token_uri\": \"pkcs11:token=a\"}", "token_uri"),
        ("{\"token_uri\": \"\(uri)\", \"socket_mode\": \"rw\"}", "socket_mode"),
        // UInt32(_:radix:) takes a sign; a mode is octal digits only (a fuzzing round).
        ("{\"token_uri\": \"\(uri)\", \"socket_mode\": \"+660\"}", "socket_mode must be an octal string"),
        ("{\"token_uri\": \"\(uri)\", \"socket_mode\": \"-0\"}", "socket_mode must be an octal string"),
        ("{\"token_uri\": \"\(uri)\", \"socket_mode\": \"\"}", "socket_mode must be an octal string"),
        ("{\"token_uri\": \"\(uri)\", \"socket_mode\": \"0000\"}", "socket_mode must let the socket's owner, signerd's user, read and write"),
        ("{\"token_uri\": \"\(uri)\", \"socket_mode\": \"0460\"}", "socket_mode must let the socket's owner"),
        ("{\"token_uri\": \"\(uri)\", \"socket_path\": \"relative.sock\"}", "socket_path"),
        ("{\"token_uri\": \"\(uri)\", \"session_pool_size\": 0}", "session_pool_size"),
        ("{\"token_uri\": \"\(uri)\", \"session_pool_size\": \"8\"}", "session_pool_size"),
        ("{\"token_uri\": \"\(uri)\", \"keys\": [{\"key_id\": \"short\", \"bundle_ids\": [\"a\"]}]}", "keys[0].key_id"),
        ("{\"token_uri\": \"\(uri)\", \"keys\": [{\"key_id\": \"ABC123DEFG\", \"bundle_ids\": []}]}", "keys[0].bundle_ids"),
        ("{\"token_uri\": \"\(uri)\", \"keys\": [{\"key_id\": \"ABC123DEFG\", \"bundle_ids\": [\"a\"], \"bundle\": 1}]}", "keys[0].bundle"),
        ("{\"token_uri\": \"\(uri)\", \"default_key_id\": \"ABC123DEFG\"}", "default_key_id"),
        ("{\"token_uri\": \"\(uri)\", \"issuer_id\": \"not-a-uuid\"}", "issuer_id"),
        ("{\"token_uri\": \"\(uri)\", \"log_level\": \"loud\"}", "log_level"),
        ("{\"token_uri\": \"\(uri)\", \"allowed_uids\": [\"no-such-user-xyz\"]}", "allowed_uids"),
        ("{\"token_uri\": \"\(uri)\", \"verify_before_return\": 1}", "verify_before_return"),
        ("{\"token_uri\": \"\(uri)\", \"audit_log\": \"yes\"}", "audit_log"),
        ("{\"token_uri\": \"\(uri)\", \"token_check_seconds\": 3601}", "token_check_seconds"),
        ("{\"token_uri\": \"\(uri)\", \"token_check_seconds\": -1}", "token_check_seconds"),
        ("[1, 2]", "JSON object"),
    ])
    func refused(_ json: String, _ key: String) throws {
        let error = #expect(throws: ConfigurationError.self) { try parse(json) }
        #expect(error?.message.contains(key) == true, "\(error?.message ?? "no error")")
    }

    @Test("an empty file, broken JSON, a non-object and a key given twice each get their own message", arguments: [
        ("", "the file is empty"),
        (" \n", "the file is empty"),
        ("{ not json", "the file is not valid JSON"),
        ("{\"token_uri\": \"\(uri)\",}x", "the file is not valid JSON"),
        ("{\"token_uri\": \"\(uri)\", \"keys\": [],}", "the file is not valid JSON (RFC 8259): a comma directly before } or ] (a trailing comma)"),
        ("[1, 2]", "the file holds an array where one JSON object is expected"),
        ("\"token_uri\"", "the file holds a string where one JSON object is expected"),
        // Once "a value": a `where` clause meant for both number types bound only one.
        ("1.5", "the file holds a number written with a fraction or an exponent (1.5) where one JSON object is expected"),
        ("12", "the file holds a number where one JSON object is expected"),
        ("{\"token_uri\": \"\(uri)\", \"keys\": [], \"keys\": []}", "the key \"keys\" appears more than once in one object"),
        ("{\"token_uri\": \"\(uri)\", \"keys\": [{\"key_id\": \"ABC123DEFG\", \"key_id\": \"XYZ987WVUT\", \"bundle_ids\": [\"a\"]}]}",
         "the key \"key_id\" appears more than once in one object"),
        ("\u{FEFF}{\"token_uri\": \"\(uri)\"}", "the file is not UTF-8 JSON text"),
    ])
    func jsonProblemsNamed(_ json: String, _ expected: String) throws {
        let error = #expect(throws: ConfigurationError.self) { try parse(json) }
        #expect(error?.message.hasPrefix(expected) == true, "\(error?.message ?? "no error")")
    }

    @Test("a message names the key once, also through load (what a refused reload logs)", arguments: [
        ("{\"token_uri\": \"\(uri)\", \"keys\": [{\"key_id\": \"ABC123DEFG\", \"bundle_ids\": \"com.example.app\"}]}", "keys[0].bundle_ids"),
        ("{\"token_uri\": \"\(uri)\", \"keys\": [{\"bundle_ids\": [\"a\"]}]}", "keys[0].key_id"),
        ("{\"token_uri\": \"\(uri)\", \"session_pool_size\": \"8\"}", "session_pool_size"),
        ("{}", "token_uri"),
        ("{\"token_uri\": \"pkcs11:token=a\"}", "token_uri"),
        ("{\"token_uri\": \"\(uri)&pin-value=1234\"}", "token_uri"),
    ])
    func keyNamedOnce(_ json: String, _ key: String) throws {
        let path = NSTemporaryDirectory() + "signerd-config-\(UUID().uuidString).json"
        try json.write(toFile: path, atomically: false, encoding: .utf8)
        defer { try? FileManager.default.removeItem(atPath: path) }
        let error = #expect(throws: ConfigurationError.self) { try SignerConfiguration.load(path: path) }
        let message = error?.message ?? ""
        #expect(message.hasPrefix("\(path): \(key)"), "\(message)")
        #expect(message.components(separatedBy: key).count == 2, "\(message)")
        #expect(!message.contains("1234"))
    }

    @Test("a bundle allow-list matches bytes, not canonically equivalent strings")
    func bundleAllowListIsExact() {
        let key = KeyConfiguration(keyID: "ABC123DEFG", bundleIDs: ["com.Kelvin.app", "com.ex\u{E4}mple.app"])
        #expect(key.allows(bundleID: "com.Kelvin.app"))
        #expect(key.allows(bundleID: "com.ex\u{E4}mple.app"))
        // Equal as Swift strings, other bytes on the wire (and in the signed payload).
        #expect("com.\u{212A}elvin.app" == "com.Kelvin.app")
        #expect(!key.allows(bundleID: "com.\u{212A}elvin.app"))
        #expect(!key.allows(bundleID: "com.exa\u{308}mple.app"))
    }
}

@Suite("Settings a reload cannot change")
struct RestartOnlyChangesTests {
    @Test("named by the value in effect: max_connections_per_uid written as its default is no change; http_threads (ignored) is never named")
    func effectiveValues() {
        let start = SignerConfiguration(tokenURI: "pkcs11:token=x?module-path=/x.so&pin-source=file:/p")
        var file = start
        file.maxConnectionsPerUID = start.maxConnections
        file.httpThreads = 4
        #expect(file.restartOnlyChanges(from: start).isEmpty)
        file.maxConnectionsPerUID = 10
        file.logLevel = .debug
        file.rateLimitPerSecond = 5  // applies at once
        #expect(file.restartOnlyChanges(from: start) == ["log_level", "max_connections_per_uid"])
    }
}

@Suite("Command-line arguments")
struct ArgumentsTests {
    @Test("options, flags, = form, -- and positionals")
    func parse() throws {
        let arguments = try Arguments(["--key-id", "ABC", "file.p8", "--replace", "--json", "--x=1", "--", "--literal"],
                                      options: ["key-id", "x"], flags: ["replace", "json"])
        #expect(arguments.options == ["key-id": "ABC", "x": "1"])
        #expect(arguments.flags == ["replace", "json"])
        #expect(arguments.positionals == ["file.p8", "--literal"])
        // A value that merely starts with -- (no option of that name) is still a value.
        #expect(try Arguments(["--key-id", "--odd"], options: ["key-id"], flags: []).options == ["key-id": "--odd"])
    }

    @Test("usage errors name the option", arguments: [
        (["--nope"], "--nope"), (["--key-id"], "--key-id"), (["--json=1"], "--json"), (["--key-id", "a", "--key-id", "b"], "twice"), (["-x"], "-x"),
        // A value left out before another option: that option is not taken as the value.
        (["--key-id", "--json"], "--key-id needs a value; --json after it is an option"), (["--key-id", "--help"], "--key-id needs a value"),
        (["--key-id", "-h"], "--key-id needs a value; -h after it is an option"),
    ])
    func errors(_ words: [String], _ expected: String) throws {
        let error = #expect(throws: UsageError.self) { try Arguments(words, options: ["key-id"], flags: ["json"]) }
        #expect(error?.message.contains(expected) == true)
    }

    @Test("integers are range-checked")
    func integers() throws {
        let arguments = try Arguments(["--concurrency", "0"], options: ["concurrency"], flags: [])
        #expect(throws: UsageError.self) { try arguments.integer("concurrency", default: 8, in: 1...1024) }
        #expect(try Arguments([], options: ["concurrency"], flags: []).integer("concurrency", default: 8, in: 1...1024) == 8)
    }
}

@Suite("Request field reader")
struct FieldReaderTests {
    @Test("types are checked by name, unknown fields refused, null means absent")
    func reader() throws {
        var reader = try FieldReader(json: Array(#"{"a": "x", "n": 12, "b": true, "z": null, "o": {"k": 1}}"#.utf8), allowed: ["a", "n", "b", "z", "o"])
        #expect(try reader.string("a") == "x")
        #expect(try reader.optionalInteger("n") == 12)
        #expect(try reader.bool("b") == true)
        #expect(try reader.optionalString("z") == nil)
        #expect(try reader.object("o") == ["k": .integer(1)])
        try reader.finish()

        let unknown = #expect(throws: APIError.self) { try FieldReader(json: Array(#"{"productId": "x"}"#.utf8), allowed: ["product_id"]) }
        #expect(unknown?.code == .unknownField)
        #expect(unknown?.field == "productId")
        #expect(unknown?.status == 400)

        var missing = try FieldReader(json: Array("{}".utf8), allowed: ["product_id"])
        let absent = #expect(throws: APIError.self) { try missing.string("product_id") }
        #expect(absent?.code == .missingField)
        #expect(absent?.field == "product_id")

        var wrong = try FieldReader(json: Array(#"{"timestamp": "1790800914034", "flag": 1, "n": 1.5}"#.utf8), allowed: ["timestamp", "flag", "n"])
        #expect((#expect(throws: APIError.self) { try wrong.optionalInteger("timestamp") })?.field == "timestamp")
        #expect((#expect(throws: APIError.self) { try wrong.bool("flag") })?.code == .invalidField)
        #expect((#expect(throws: APIError.self) { try wrong.optionalInteger("n") })?.code == .invalidField)
    }

    /// Found by an attack run: doubles were signed in their shortest form
    /// (9007199254740993e0 as 9007199254740992.0, 1e-400 as 0.0).
    @Test("an Advanced Commerce request with a fraction or exponent anywhere is refused, naming where", arguments: [
        (#"{"p":9007199254740993e0}"#, "request.p"),
        (#"{"a":[{"b":1e-400}]}"#, "request.a[0].b"),
        (#"{"p":12345678901234567e10}"#, "request.p"),
        (#"{"p":9007199254740993.0}"#, "request.p"),
        (#"{"p":0.30000000000000004}"#, "request.p"),
        (#"{"p":4.99}"#, "request.p"),
        // Found by an attack run: `request.a.b` also named the integer in "a".
        (#"{"a":{"b":1},"a.b":2.0}"#, #"request["a.b"]"#),
        (#"{"":1.0}"#, #"request[""]"#),
        (#"{"é ü":[1e2]}"#, #"request["é ü"][0]"#),
    ])
    func advancedCommerceNumbers(request: String, field: String) {
        let body = Array(#"{"bundle_id":"com.example.app","request":\#(request)}"#.utf8)
        let error = #expect(throws: APIError.self) { try AdvancedCommerceSigningRequest(body: body) }
        #expect(error?.code == .invalidField)
        #expect(error?.field == field, "\(error?.message ?? "")")
    }

    @Test("integers in an Advanced Commerce request are kept exactly, the ends of Int64 included")
    func advancedCommerceIntegers() throws {
        let body = Array(#"{"bundle_id":"com.example.app","request":{"max":9223372036854775807,"min":-9223372036854775808,"zero":-0,"price":4990}}"#.utf8)
        let parsed = try AdvancedCommerceSigningRequest(body: body)
        #expect(JSONValue.object(parsed.request).compactJSON == #"{"max":9223372036854775807,"min":-9223372036854775808,"price":4990,"zero":0}"#)
    }

    @Test("an unknown field is named before a number problem elsewhere in the body")
    func unknownFieldFirst() {
        let body = Array(#"{"bundle_id":"com.example.app","request":{},"x":9223372036854775808}"#.utf8)
        let error = #expect(throws: APIError.self) { try AdvancedCommerceSigningRequest(body: body) }
        #expect(error?.code == .unknownField)
        #expect(error?.field == "x")
    }

    @Test("broken JSON says what the parser found and where", arguments: [
        (#"{"request":"# + String(repeating: "[", count: 600) + String(repeating: "]", count: 600) + "}", "nested"),
        (#"{"a":"x"#, "the text ends inside the string that starts at byte 5"),
        // Foundation said "Unexpected end of file during string parse" for these.
        (#"{"a":"ok \\ud800 \ud83d\ude00 x\uD800"}"#, #"the escape \uD800 at byte 31 is half of a UTF-16 surrogate pair"#),
        (#"{"a":"\udc00"}"#, #"the escape \udc00 at byte 6 is half"#),
    ])
    func parserReason(text: String, reason: String) {
        let error = #expect(throws: APIError.self) { try FieldReader(json: Array(text.utf8), allowed: ["request", "timestamp", "a"]) }
        #expect(error?.code == .invalidJSON)
        #expect(error?.message.contains(reason) == true, "\(error?.message ?? "")")
    }

    @Test("non-objects and broken JSON are invalid_json", arguments: ["", "{", "[1]", "\"s\"", "{\"a\":}", "nul"])
    func invalidJSON(_ text: String) throws {
        let error = #expect(throws: APIError.self) { try FieldReader(json: Array(text.utf8), allowed: []) }
        #expect(error?.code == .invalidJSON)
    }

    @Test("error bodies have the contract's shape")
    func errorBody() throws {
        let body = APIError(.invalidField, "timestamp must be \"ms\"", field: "timestamp").jsonBody
        let object = try #require(try JSONSerialization.jsonObject(with: Data(body.utf8)) as? [String: [String: String]])
        #expect(object["error"] == ["code": "invalid_field", "message": "timestamp must be \"ms\"", "field": "timestamp"])
    }
}

@Suite("Process hardening")
struct ProcessHardeningTests {
    @Test("disableCoreDumps makes the process undumpable (PR_SET_DUMPABLE 0) with RLIMIT_CORE 0")
    func coreDumps() throws {
        #expect(ProcessControl.disableCoreDumps())
        #expect(!ProcessControl.isDumpable)
        let limits = try String(contentsOfFile: "/proc/self/limits", encoding: .utf8)
        let core = try #require(limits.split(separator: "\n").first { $0.hasPrefix("Max core file size") })
        #expect(core.split(separator: " ", omittingEmptySubsequences: true).dropFirst(4).prefix(2) == ["0", "0"])
    }
}

/// A configuration path that is not a regular file: a directory gave
/// "NSCocoaErrorDomain error 256", a FIFO "You don't have permission" even
/// to root (and reading one may wait for a writer).
@Suite("Configuration file that is not a regular file")
struct ConfigurationFileKindTests {
    @Test("a directory is named as one, with its path")
    func directory() throws {
        let directory = TemporaryDirectory.make(prefix: "signerd-confdir")
        let error = #expect(throws: ConfigurationError.self) { try SignerConfiguration.load(path: directory) }
        #expect(error?.message == "the configuration file \(directory) is a directory, not a file; pass the JSON file itself (e.g. /etc/signerd/signerd.json)", "\(error?.message ?? "no error")")
    }

    @Test("a FIFO is not a regular file, refused at once without waiting for a writer")
    func fifo() throws {
        let fifo = TemporaryDirectory.make(prefix: "signerd-conffifo") + "/signerd.json"
        #expect(makeFIFO(fifo))
        let started = Date()
        let error = #expect(throws: ConfigurationError.self) { try SignerConfiguration.load(path: fifo) }
        #expect(Date().timeIntervalSince(started) < 5, "waited for a writer")
        #expect(error?.message == "the configuration file \(fifo) is not a regular file (it is a FIFO (named pipe)); pass a JSON file", "\(error?.message ?? "no error")")
    }
}

/// The configuration file's own owner and mode were checked, not the
/// directories above it: another user who may write one could put a file
/// naming their own PKCS#11 module in its place.
@Suite("Configuration file below a directory another user may change")
struct ConfigurationDirectoryTests {
    @Test("a configuration below a directory others may write without the sticky bit is refused, as written and after symbolic links; below a sticky one it loads")
    func belowWritableDirectory() throws {
        let (open, inner, link) = TemporaryDirectory.makeBelowOpen(prefix: "signerd-confdir-open")
        let file = inner + "/signerd.json"
        #expect(FileManager.default.createFile(atPath: file, contents: Data("{\"token_uri\": \"\(ConfigurationTests.uri)\"}".utf8), attributes: [.posixPermissions: 0o644]))
        for path in [file, link + "/signerd.json"] {
            let error = #expect(throws: ConfigurationError.self) { try SignerConfiguration.load(path: path) }
            #expect(error?.message.hasPrefix("the configuration file \(path) lies below the directory \(open) (owner uid \(geteuid())") == true, "\(error?.message ?? "no error")")
            #expect(error?.message.contains("may be written by other users without the sticky bit") == true, "\(error?.message ?? "no error")")
        }
        #expect(chmod(open, 0o1777) == 0)
        #expect(try SignerConfiguration.load(path: link + "/signerd.json").tokenURI == ConfigurationTests.uri)
    }
}

/// A review found that checking the directories above a path as written
/// and above where it finally leads missed a symbolic link in the middle
/// of a chain, kept in another user's directory: that user could point it
/// at another root-owned configuration or PIN file whenever they liked.
@Suite("Configuration and PIN files reached through a link another user may change")
struct LinkChainTests {
    @Test("a configuration or PIN file reached through a symbolic link that lies in another user's directory is refused, naming that directory",
          .enabled(if: geteuid() == 0, "giving a directory to another uid (chown) needs root"))
    func linkInAnotherUsersDirectory() throws {
        let base = TemporaryDirectory.make(prefix: "signerd-linkchain")
        #expect(chmod(base, 0o755) == 0)
        let safe = base + "/safe", theirs = base + "/theirs"
        #expect(mkdir(safe, 0o755) == 0 && mkdir(theirs, 0o755) == 0 && chown(theirs, 65534, 65534) == 0)
        #expect(FileManager.default.createFile(atPath: safe + "/signerd.json", contents: Data("{\"token_uri\": \"\(ConfigurationTests.uri)\"}".utf8), attributes: [.posixPermissions: 0o644]))
        try writeSecretFile(safe + "/pin", "s3cret\n")
        // base/entry → base/theirs/current → base/safe: every directory written or
        // reached is root's; the middle link lies in uid 65534's directory.
        #expect(symlink(safe, theirs + "/current") == 0 && symlink(theirs + "/current", base + "/entry") == 0)
        let config = #expect(throws: ConfigurationError.self) { try SignerConfiguration.load(path: base + "/entry/signerd.json") }
        #expect(config?.message.contains("lies below the directory \(theirs) (owner uid 65534") == true, "\(config?.message ?? "no error")")
        let pin = #expect(throws: HSMError.self) { try PKCS11URI("pkcs11:token=x?module-path=/x.so&pin-source=file:\(base)/entry/pin").readPIN() }
        #expect(pin?.code == .pinSourceInsecure && pin?.message.contains("the directory \(theirs) (owner uid 65534") == true, "\(pin?.message ?? "no error")")
        // The same files named directly are read.
        #expect(try SignerConfiguration.load(path: safe + "/signerd.json").tokenURI == ConfigurationTests.uri)
        #expect(try PKCS11URI("pkcs11:token=x?module-path=/x.so&pin-source=file:\(safe)/pin").readPIN().count == 6)
    }
}
