import Foundation
import HSMSigner
import Synchronization

/// A throw-away SoftHSM token store for this test process: its own
/// directory and `SOFTHSM2_CONF`, never the system's tokens. Every test that
/// needs a token makes its own, with its own label and random PINs.
public final class SoftHSMFixture: Sendable {
    public static let shared = SoftHSMFixture()

    /// The SoftHSM module; override with `SIGNERD_TEST_SOFTHSM_MODULE`.
    public let modulePath: String
    public let directory: String
    private let lock = Mutex(0)

    private init() {
        modulePath = ProcessInfo.processInfo.environment["SIGNERD_TEST_SOFTHSM_MODULE"] ?? "/usr/lib/softhsm/libsofthsm2.so"
        directory = TemporaryDirectory.make(prefix: "signerd-softhsm")
        let tokens = directory + "/tokens"
        try! FileManager.default.createDirectory(atPath: tokens, withIntermediateDirectories: true)  // fresh temp dir
        let conf = "directories.tokendir = \(tokens)\nobjectstore.backend = file\nlog.level = ERROR\nslots.removable = false\n"
        try! conf.write(toFile: directory + "/softhsm2.conf", atomically: false, encoding: .utf8)  // fresh temp dir
        // Read by SoftHSM at C_Initialize; set before any module load in this process.
        setenv("SOFTHSM2_CONF", directory + "/softhsm2.conf", 1)
    }

    public struct Token: Sendable {
        public let label: String
        /// The user PIN's 0600 file; the PIN was never set when the token was
        /// made with `userPIN: false`.
        public let pinPath: String
        /// The security officer PIN's 0600 file, for `signctl token init --so-pin-file`.
        public let soPINPath: String
        public let uri: String
        public let modulePath: String
    }

    /// Makes a new initialized token with random PINs in 0600 files.
    /// - Parameters:
    ///   - prefix: the start of the label; a counter makes it unique.
    ///   - userPIN: false to stop after `C_InitToken`, without `C_InitPIN`:
    ///     the token an interrupted `token init` leaves, on which a user
    ///     login returns `CKR_USER_PIN_NOT_INITIALIZED`.
    public func makeToken(_ prefix: String, userPIN: Bool = true) throws -> Token {
        // One at a time: two C_InitToken calls on the one free slot would make one token of two.
        try lock.withLock { counter in
            counter += 1
            let label = "\(prefix)-\(counter)"
            let pinPath = directory + "/\(label).pin"
            let soPINPath = directory + "/\(label).so-pin"
            try writeSecretFile(pinPath, SecureRandom.bytes(12).hexString)
            try writeSecretFile(soPINPath, SecureRandom.bytes(12).hexString)
            let soPIN = try TokenAdministration.readPINFile(soPINPath)
            let outcome = if userPIN {
                try TokenAdministration.initializeToken(modulePath: modulePath, label: label, soPIN: soPIN,
                                                        userPIN: TokenAdministration.readPINFile(pinPath))
            } else {
                try TokenAdministration.initializeTokenWithoutUserPIN(modulePath: modulePath, label: label, soPIN: soPIN)
            }
            guard case .initialized = outcome else {
                throw FixtureError("token \(label) already existed")
            }
            return Token(label: label, pinPath: pinPath, soPINPath: soPINPath,
                         uri: "pkcs11:token=\(label)?module-path=\(modulePath)&pin-source=file:\(pinPath)",
                         modulePath: modulePath)
        }
    }
}

public struct FixtureError: Error, CustomStringConvertible {
    public let description: String
    public init(_ description: String) { self.description = description }
}

public enum TemporaryDirectory {
    /// Every directory made, removed when the test process exits: they hold
    /// throw-away keys, PINs and tokens.
    private static let made = Mutex<[String]>([])
    private static let cleanup: Void = {
        atexit {
            for path in TemporaryDirectory.made.withLock({ $0 }) where !TemporaryDirectory.removeTree(path) {
                // Said, not swallowed: what is left holds a throw-away PIN.
                FileHandle.standardError.write(Data("warning: could not remove the test directory \(path): \(String(cString: strerror(errno)))\n".utf8))
            }
        }
    }()

    /// Removes `path` and everything below it, one directory at a time
    /// through descriptors (`openat`, `unlinkat`), so that a tree deeper than
    /// PATH_MAX (a test builds one) goes too: FileManager's `removeItem`
    /// works with whole paths and gave up on it without a word. Symbolic
    /// links are removed, never followed. A missing `path` counts as removed.
    /// - Returns: false when something could not be removed (`errno` says why).
    @discardableResult
    public static func removeTree(_ path: String) -> Bool {
        let parent = open((path as NSString).deletingLastPathComponent, O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard parent >= 0 else { return errno == ENOENT }
        defer { close(parent) }
        return removeEntry(parent, (path as NSString).lastPathComponent)
    }

    private static func removeEntry(_ directory: Int32, _ name: String) -> Bool {
        if unlinkat(directory, name, 0) == 0 || errno == ENOENT { return true }
        guard errno == EISDIR || errno == EPERM else { return false }  // Linux answers EISDIR for a directory
        let fd = openat(directory, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0, let listing = fdopendir(fd) else { return false }
        var names: [String] = []
        while let entry = readdir(listing) {
            let entryName = withUnsafeBytes(of: entry.pointee.d_name) { String(decoding: $0.prefix { $0 != 0 }, as: UTF8.self) }
            if entryName != ".", entryName != ".." { names.append(entryName) }
        }
        var removed = true
        for entryName in names where !removeEntry(dirfd(listing), entryName) { removed = false }
        closedir(listing)  // closes fd
        return removed && unlinkat(directory, name, AT_REMOVEDIR) == 0
    }

    /// Paths for the directory checks: `open`, a directory others may write
    /// (0777, no sticky bit) in a fresh temporary one; `inner`, a 0700
    /// directory inside it; `link`, a symbolic link to `inner` beside
    /// `open`, whose path as written passes through no open directory.
    public static func makeBelowOpen(prefix: String) -> (open: String, inner: String, link: String) {
        let base = make(prefix: prefix)
        let open = base + "/open", inner = open + "/inner", link = base + "/via-link"
        precondition(mkdir(open, 0o700) == 0 && chmod(open, 0o777) == 0 && mkdir(inner, 0o700) == 0 && symlink(inner, link) == 0,
                     "cannot make \(open): \(String(cString: strerror(errno)))")
        return (open, inner, link)
    }

    /// A fresh directory under $TMPDIR (or /tmp), mode 0700, removed at exit.
    public static func make(prefix: String) -> String {
        _ = cleanup
        let base = ProcessInfo.processInfo.environment["TMPDIR"] ?? "/tmp"
        var template = Array("\(base)/\(prefix)-XXXXXX".utf8CString)
        let created = template.withUnsafeMutableBufferPointer { mkdtemp($0.baseAddress!) }
        precondition(created != nil, "mkdtemp failed")
        let path = String(decoding: template.prefix { $0 != 0 }.map { UInt8(bitPattern: $0) }, as: UTF8.self)
        made.withLock { $0.append(path) }
        return path
    }
}

/// Writes a file with mode 0600 from the start (no window with wider permissions).
public func writeSecretFile(_ path: String, _ contents: String, mode: mode_t = 0o600) throws {
    let fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode)
    guard fd >= 0 else { throw FixtureError("cannot create \(path)") }
    defer { close(fd) }
    fchmod(fd, mode)
    let bytes = Array(contents.utf8)
    guard write(fd, bytes, bytes.count) == bytes.count else { throw FixtureError("cannot write \(path)") }
}

/// Makes a FIFO (mode 0600) for a test that a reader must not wait on. Should
/// the code under test wait for a writer all the same, one comes after
/// `seconds` and closes at once (end of file), so the test fails rather than hangs.
/// - Returns: whether mkfifo(3) made it.
public func makeFIFO(_ path: String, writerAfter seconds: UInt32 = 10) -> Bool {
    guard mkfifo(path, 0o600) == 0 else { return false }
    Thread.detachNewThread {
        sleep(seconds)
        let fd = open(path, O_WRONLY | O_NONBLOCK)
        if fd >= 0 { close(fd) }
    }
    return true
}

/// Runs a command and returns its standard output; throws on a non-zero exit.
@discardableResult
public func run(_ arguments: [String], input: Data? = nil, environment: [String: String]? = nil) throws -> Data {
    let process = Process()
    process.executableURL = URL(fileURLWithPath: "/usr/bin/env")
    process.arguments = arguments
    if let environment { process.environment = environment }
    let output = Pipe()
    let errors = Pipe()
    process.standardOutput = output
    process.standardError = errors
    let inputPipe = Pipe()
    process.standardInput = input == nil ? FileHandle.nullDevice : inputPipe
    try process.run()
    if let input {
        inputPipe.fileHandleForWriting.write(input)
        try inputPipe.fileHandleForWriting.close()
    }
    let data = output.fileHandleForReading.readDataToEndOfFile()
    let errorData = errors.fileHandleForReading.readDataToEndOfFile()
    process.waitUntilExit()
    guard process.terminationStatus == 0 else {
        throw FixtureError("\(arguments.joined(separator: " ")) exited \(process.terminationStatus): \(String(decoding: errorData, as: UTF8.self))")
    }
    return data
}

extension Array where Element == UInt8 {
    public init?(hex: String) {
        var bytes: [UInt8] = []
        var iterator = hex.utf8.makeIterator()
        while let high = iterator.next() {
            guard let low = iterator.next(), let h = Self.nibble(high), let l = Self.nibble(low) else { return nil }
            bytes.append(h << 4 | l)
        }
        self = bytes
    }

    private static func nibble(_ c: UInt8) -> UInt8? {
        switch c {
        case 0x30...0x39: c - 0x30
        case 0x61...0x66: c - 0x61 + 10
        case 0x41...0x46: c - 0x41 + 10
        default: nil
        }
    }
}
