/// A command line that does not fit the command: printed as `error: …`
/// plus a hint, exit 64 (`EX_USAGE`).
public struct UsageError: Error, Sendable, Equatable, CustomStringConvertible {
    /// What is wrong.
    public var message: String
    /// What to try instead.
    public var hint: String
    /// Makes a usage error.
    public init(_ message: String, hint: String = "run with --help for usage") {
        self.message = message
        self.hint = hint
    }
    /// The message alone; `signctl` prints ``hint`` on its own line.
    public var description: String { message }
}

/// Exit codes from sysexits(3), as the CLI convention uses them.
public enum ExitCode: Int32, Sendable {
    case success = 0
    case failure = 1
    /// Command line usage error.
    case usage = 64
    /// Bad input data (a key file, a signature).
    case dataError = 65
    /// A service is unavailable (daemon unreachable, not ready, token missing).
    case unavailable = 69
    /// An internal software error.
    case software = 70
    /// An operating system error (sysexits `EX_OSERR`): signerd could not
    /// put `/dev/null` on a closed standard descriptor.
    case osError = 71
    /// A temporary failure; try again.
    case tempFail = 75
    /// Permission denied.
    case noPermission = 77
    /// A configuration error.
    case config = 78
}

/// Parsed command-line arguments: positionals, `--option value` (or
/// `--option=value`), and `--flag`s.
public struct Arguments: Sendable, Equatable {
    /// Non-option words in order.
    public var positionals: [String] = []
    /// Options with values, by name without dashes.
    public var options: [String: String] = [:]
    /// Flags present, by name without dashes.
    public var flags: Set<String> = []

    /// Parses `words` against the options and flags a command accepts.
    /// `-h`/`--help` is always a flag (`help`); `--` ends option parsing.
    /// - Parameters:
    ///   - words: the arguments after the command words.
    ///   - options: names that take a value.
    ///   - flags: names that take none.
    /// - Throws: ``UsageError`` for an unknown option, a missing value, or a repeated option.
    public init(_ words: [String], options: Set<String>, flags: Set<String>) throws(UsageError) {
        var index = 0
        var onlyPositionals = false
        while index < words.count {
            let word = words[index]
            index += 1
            if onlyPositionals || !word.hasPrefix("-") || word == "-" {
                positionals.append(word)
                continue
            }
            if word == "--" {
                onlyPositionals = true
                continue
            }
            if word == "-h" || word == "--help" {
                self.flags.insert("help")
                continue
            }
            guard word.hasPrefix("--") else {
                throw UsageError("unknown option \(word)")
            }
            var name = String(word.dropFirst(2))
            var value: String?
            if let equals = name.firstIndex(of: "=") {
                value = String(name[name.index(after: equals)...])
                name = String(name[..<equals])
            }
            if flags.contains(name) {
                guard value == nil else { throw UsageError("--\(name) takes no value") }
                self.flags.insert(name)
            } else if options.contains(name) {
                if value == nil {
                    guard index < words.count else { throw UsageError("--\(name) needs a value") }
                    // `--concurrency --requests 1` is a value left out, not the value "--requests".
                    let next = words[index]
                    if next == "-h" || next.hasPrefix("--") && (next == "--help" || options.union(flags).contains(String(next.dropFirst(2).prefix { $0 != "=" }))) {
                        throw UsageError("--\(name) needs a value; \(next) after it is an option")
                    }
                    value = next
                    index += 1
                }
                guard self.options[name] == nil else { throw UsageError("--\(name) is given twice") }
                self.options[name] = value
            } else {
                let known = (options.union(flags)).sorted().map { "--\($0)" }.joined(separator: ", ")
                throw UsageError("unknown option --\(name)", hint: known.isEmpty ? "this command takes no options" : "options here: \(known), --help")
            }
        }
    }

    /// Refuses a command line with a word that is not valid UTF-8, which
    /// `CommandLine.arguments` would pass on with U+FFFD in place of the
    /// bad bytes (and signctl would sign).
    /// - Parameter words: the raw bytes of each argument, without the
    ///   program name (`CommandLine.unsafeArgv` from index 1).
    /// - Throws: ``UsageError`` naming the option (`the value of
    ///   --product-id` for `--product-id=…`, `the argument after
    ///   --product-id`), else the argument's position (1-based).
    public static func checkUTF8(_ words: [[UInt8]]) throws(UsageError) {
        for (index, word) in words.enumerated() where String(validating: word, as: UTF8.self) == nil {
            let name: String
            if word.starts(with: Array("--".utf8)), let equals = word.firstIndex(of: UInt8(ascii: "=")),
               let option = String(validating: word[..<equals], as: UTF8.self) {
                name = "the value of \(option)"
            } else if index > 0, words[index - 1].starts(with: Array("--".utf8)), !words[index - 1].contains(UInt8(ascii: "=")),
                      let option = String(validating: words[index - 1], as: UTF8.self) {
                name = "the argument after \(option)"
            } else {
                name = "argument \(index + 1)"
            }
            throw UsageError("\(name) is not valid UTF-8", hint: "pass text as UTF-8 (check the terminal's or the script's encoding)")
        }
    }

    /// Whether `--name` was given.
    public func flag(_ name: String) -> Bool { flags.contains(name) }

    /// The value of a required option.
    /// - Throws: ``UsageError`` when absent.
    public func required(_ name: String) throws(UsageError) -> String {
        guard let value = options[name] else { throw UsageError("--\(name) is required") }
        return value
    }

    /// An integer option within a range.
    /// - Throws: ``UsageError`` when not an integer in `range`.
    public func integer(_ name: String, default fallback: Int, in range: ClosedRange<Int>) throws(UsageError) -> Int {
        guard let text = options[name] else { return fallback }
        guard let value = Int(text), range.contains(value) else {
            throw UsageError("--\(name) must be an integer from \(range.lowerBound) to \(range.upperBound); got \(text)")
        }
        return value
    }

    /// Exactly `count` positionals.
    /// - Throws: ``UsageError`` naming what is expected.
    public func positionals(_ count: Int, _ names: String) throws(UsageError) -> [String] {
        guard positionals.count == count else {
            throw UsageError(positionals.count < count ? "missing \(names)" : "unexpected argument \(positionals[count])")
        }
        return positionals
    }
}
