import Foundation
import TestSupport
import Testing

/// docs/API.md says every signature and JWS in it verifies against the
/// example public key it shows under `GET /v1/keys`. The App Store Server
/// API token example had its `exp` edited after it was signed, and no longer
/// verified: a client using it as a fixture failed.
@Suite("Examples in docs/API.md and README.md")
struct DocsExamplesTests {
    static let text: String = (try? String(contentsOfFile: Binaries.root + "/docs/API.md", encoding: .utf8)) ?? ""

    /// The example key's public key, from the `GET /v1/keys` example (a JSON string with `\n` escapes).
    static func publicKeyPEM() throws -> String {
        let start = try #require(text.range(of: #""public_key_pem": "-----BEGIN PUBLIC KEY-----"#))
        let rest = text[text.index(start.lowerBound, offsetBy: #""public_key_pem": ""#.count)...]
        let end = try #require(rest.range(of: #"-----END PUBLIC KEY-----\n""#))
        return String(rest[..<end.lowerBound]).replacingOccurrences(of: #"\n"#, with: "\n") + "-----END PUBLIC KEY-----\n"
    }

    @Test("every compact JWS in API.md verifies with the example public key (signctl verify jws)")
    func everyJWSVerifies() throws {
        let pem = TemporaryDirectory.make(prefix: "signerd-docs") + "/example.pem"
        try Self.publicKeyPEM().write(toFile: pem, atomically: false, encoding: .utf8)
        let pattern = try NSRegularExpression(pattern: #"eyJ[A-Za-z0-9_-]+\.eyJ[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+"#)
        let tokens = Set(pattern.matches(in: Self.text, range: NSRange(Self.text.startIndex..., in: Self.text)).compactMap {
            Range($0.range, in: Self.text).map { String(Self.text[$0]) }
        })
        // Offer V2, introductory offer eligibility, Advanced Commerce, the App Store Server API token.
        #expect(tokens.count >= 4, "\(tokens.count) compact JWS found in docs/API.md")
        for token in tokens.sorted() {
            let verified = runSignctl(["verify", "jws", token, "--public-key", pem])
            #expect(verified.status == 0, "\(token.prefix(60))…: \(verified.stdout) \(verified.stderr)")
        }
    }

    /// The README's client examples, cut out of the README and run as
    /// written (only the socket path changed) against a running signerd:
    /// each must print an answer whose signature verifies. An interop
    /// review found the Node example had no retry for a kept connection
    /// the daemon closes when idle, which the Python one had.
    static func readmeBlock(after marker: String, fence: String) throws -> String {
        let readme = try String(contentsOfFile: Binaries.root + "/README.md", encoding: .utf8)
        let heading = try #require(readme.range(of: marker))
        let open = try #require(readme.range(of: "```\(fence)\n", range: heading.upperBound..<readme.endIndex))
        let close = try #require(readme.range(of: "\n```\n", range: open.upperBound..<readme.endIndex))
        return String(readme[open.upperBound..<close.lowerBound])
    }

    static let hasNode = FileManager.default.isExecutableFile(atPath: "/usr/bin/node")

    /// Starts a signerd with one key, writes the README block after
    /// `marker` to a file with only the socket path changed, and runs it
    /// with `command` followed by the file's path.
    /// - Returns: the running daemon (the caller stops it) and the run.
    static func runReadmeExample(after marker: String, fence: String, keyID: String, command: [String]) throws -> (DaemonHarness, (status: Int32, stdout: String, stderr: String)) {
        let script = try readmeBlock(after: marker, fence: fence)
        let daemon = try DaemonHarness(keyIDs: [keyID])
        do {
            try daemon.start()
            let file = TemporaryDirectory.make(prefix: "signerd-readme-\(fence)") + "/example.\(fence)"
            try script.replacingOccurrences(of: "/run/signerd/signerd.sock", with: daemon.socketPath)
                .write(toFile: file, atomically: false, encoding: .utf8)
            return (daemon, runProgram(command[0], Array(command.dropFirst()) + [file]))
        } catch {
            daemon.stop()
            throw error
        }
    }

    @Test("README's Node.js example, run as written by node against a running signerd, prints a signature that verifies",
          .enabled(if: hasNode, "node is not installed (Debian package nodejs); the Node.js example is not run"))
    func readmeNodeExample() throws {
        let (daemon, run) = try Self.runReadmeExample(after: "Node.js (no dependencies):", fence: "js", keyID: "DOCS000002", command: ["/usr/bin/node"])
        defer { daemon.stop() }
        #expect(run.status == 0, "\(run.stderr)")
        #expect(daemon.verifies(body: Array(run.stdout.utf8), bundleID: "com.example.app", productID: "pro_monthly", offerID: "winback_half_price", token: ""),
                "\(run.stdout) \(run.stderr)")
    }

    @Test("README's Python example, run as written by python3 against a running signerd, prints a 200 whose signature verifies")
    func readmePythonExample() throws {
        let (daemon, run) = try Self.runReadmeExample(after: "Python (standard library):", fence: "python", keyID: "DOCS000003", command: ["/usr/bin/env", "python3"])
        defer { daemon.stop() }
        #expect(run.status == 0, "\(run.stderr)")
        // It prints the tuple (status, answer) as Python shows it: take the answer's values back to JSON.
        #expect(run.stdout.hasPrefix("(200, {"), "\(run.stdout) \(run.stderr)")
        let pattern = try NSRegularExpression(pattern: #"'(\w+)': (?:'([^']*)'|(\d+))"#)
        var answer: [String: Any] = [:]
        for match in pattern.matches(in: run.stdout, range: NSRange(run.stdout.startIndex..., in: run.stdout)) {
            guard let name = Range(match.range(at: 1), in: run.stdout).map({ String(run.stdout[$0]) }) else { continue }
            if let text = Range(match.range(at: 2), in: run.stdout) { answer[name] = String(run.stdout[text]) }
            if let number = Range(match.range(at: 3), in: run.stdout) { answer[name] = Int64(run.stdout[number]) }
        }
        let body = try JSONSerialization.data(withJSONObject: answer)
        #expect(daemon.verifies(body: Array(body), bundleID: "com.example.app", productID: "pro_monthly", offerID: "winback_half_price", token: ""),
                "\(run.stdout)")
    }

    /// README's "check such a signature yourself" named the key ID
    /// ABC123DEFG and left NONCE, TIMESTAMP and SIGNATURE to the reader, so
    /// against the quickstart's daemon (key DEMO000001) it failed as written.
    @Test("README's signature check, run as written by sh against a running signerd, prints Verified OK")
    func readmeSignatureCheck() throws {
        let readme = try String(contentsOfFile: Binaries.root + "/README.md", encoding: .utf8)
        let start = try #require(readme.range(of: "SOCK=/run/signerd/signerd.sock"))
        let end = try #require(readme.range(of: "# Verified OK", range: start.upperBound..<readme.endIndex))
        let daemon = try DaemonHarness(keyIDs: ["DOCS000001"])
        try daemon.start()
        defer { daemon.stop() }
        // Only the socket changes, as the README's comment says it may.
        let snippet = "SOCK=" + daemon.socketPath + readme[start.upperBound..<end.upperBound]
        let directory = TemporaryDirectory.make(prefix: "signerd-readme")
        try snippet.write(toFile: directory + "/check.sh", atomically: false, encoding: .utf8)
        let run = runProgram("/bin/sh", ["-c", "cd '\(directory)' && sh check.sh"])
        #expect(run.status == 0 && run.stdout.contains("Verified OK"), "\(run.stdout) \(run.stderr)")
    }

    /// The helper's review found no way in the docs to check a JWS without
    /// signctl: openssl needs the raw r ‖ s as DER.
    @Test("README's JWS check with openssl, run as written by sh against a running signerd: header, claims, Verified OK; a changed claim fails")
    func readmeJWSCheck() throws {
        let readme = try String(contentsOfFile: Binaries.root + "/README.md", encoding: .utf8)
        let request = try #require(readme.range(of: "http://signerd/v1/sign/promotional-offer-v2 > answer.json"))
        let start = try #require(readme.range(of: "SOCK=/run/signerd/signerd.sock", options: .backwards, range: readme.startIndex..<request.lowerBound))
        let end = try #require(readme.range(of: "# Verified OK", range: request.upperBound..<readme.endIndex))
        let daemon = try DaemonHarness(keyIDs: ["DOCS000002"])
        try daemon.start()
        defer { daemon.stop() }
        let snippet = "SOCK=" + daemon.socketPath + readme[start.upperBound..<end.upperBound]
        let directory = TemporaryDirectory.make(prefix: "signerd-readme-jws")
        try snippet.write(toFile: directory + "/check.sh", atomically: false, encoding: .utf8)
        // Run several times: r or s with a high bit or a leading zero byte must convert too.
        for _ in 0..<8 {
            let run = runProgram("/bin/sh", ["-c", "cd '\(directory)' && sh check.sh"])
            let lines = run.stdout.split(separator: "\n")
            #expect(run.status == 0 && lines.last == "Verified OK", "\(run.stdout) \(run.stderr)")
            #expect(lines.first == #"{"alg":"ES256","kid":"DOCS000002","typ":"JWT"}"#, "\(run.stdout)")
            #expect(lines.dropFirst().first?.contains(#""aud":"promotional-offer""#) == true, "\(run.stdout)")
        }
        // The same check refuses a signing input changed after signing.
        let tampered = runProgram("/bin/sh", ["-c", "cd '\(directory)' && printf x >> signing-input.txt && openssl dgst -sha256 -verify public_key.pem -signature signature.der signing-input.txt"])
        #expect(tampered.status != 0 && tampered.stdout.contains("Verification failure"), "\(tampered.stdout) \(tampered.stderr)")
    }
}

/// `open_file_limit_low` was logged for a day before the table of log
/// messages in docs/OPERATIONS.md named it: an operator reading the journal
/// found a message the docs did not explain.
@Suite("Log messages in docs/OPERATIONS.md")
struct LogMessagesDocumentedTests {
    @Test("every log message signerd writes at warning or above, and every one from signerd's and SignerIPC's own code, has a row in OPERATIONS.md's table")
    func everyMessageHasARow() throws {
        let operations = try String(contentsOfFile: Binaries.root + "/docs/OPERATIONS.md", encoding: .utf8)
        let rows = operations.split(separator: "\n").filter { $0.hasPrefix("| `") }.map { $0.split(separator: "|").first.map(String.init) ?? "" }
        // logger.notice("msg", …), logger.log(.warning, "msg", …), fail(.config, "msg", …): the msg is a constant.
        let pattern = try NSRegularExpression(pattern: #"(?:logger\??\.(trace|debug|info|notice|warning|error|critical)\(|\.log\(\.(trace|debug|info|notice|warning|error|critical),\s*|\bfail\(\.[a-zA-Z]+,\s*)"([a-z][a-z0-9_]*)""#)
        var checked = 0
        var missing: [String] = []
        for directory in ["signerd", "SignerIPC", "HSMSigner"] {
            let root = Binaries.root + "/Sources/" + directory
            for file in try FileManager.default.contentsOfDirectory(atPath: root) where file.hasSuffix(".swift") {
                let text = try String(contentsOfFile: root + "/" + file, encoding: .utf8)
                for match in pattern.matches(in: text, range: NSRange(text.startIndex..., in: text)) {
                    let level = [1, 2].compactMap { Range(match.range(at: $0), in: text).map { String(text[$0]) } }.first ?? "critical"
                    guard let name = Range(match.range(at: 3), in: text).map({ String(text[$0]) }) else { continue }
                    // HSMSigner's lower levels reach only signctl, whose logger writes warnings and above.
                    guard directory != "HSMSigner" || ["warning", "error", "critical"].contains(level) else { continue }
                    checked += 1
                    if !rows.contains(where: { $0.contains("`\(name)`") }) { missing.append("\(directory)/\(file): \(name) (\(level))") }
                }
            }
        }
        #expect(checked > 30, "found \(checked) log calls; the pattern no longer matches how the code logs")
        #expect(missing.isEmpty, "not in docs/OPERATIONS.md's table of log messages: \(Set(missing).sorted())")
    }
}
