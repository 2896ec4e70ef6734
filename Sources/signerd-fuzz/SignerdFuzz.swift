// signerd-fuzz: the libFuzzer targets for signerd's parsers and request path.
//
// Built by `scripts/fuzz.sh` (`swift build --sanitize=fuzzer` with
// SIGNERD_LIBFUZZER defined), it is a libFuzzer binary: libFuzzer's main runs
// the target named first. In an ordinary build (`swift build`, the tests) it
// replays saved inputs through the same targets instead, once each, and traps
// on the first that breaks a target's invariant: Tests/FuzzCorpus is replayed
// that way by the test suite. See docs/FUZZING.md.
import Foundation

#if SIGNERD_LIBFUZZER
/// libFuzzer's set-up hook: takes the target's name out of the command line,
/// which libFuzzer parses next, and leaves it in `SIGNERD_FUZZ_TARGET` for the
/// workers `-jobs` starts (compiler-rt's FuzzerInterface.h).
@_cdecl("LLVMFuzzerInitialize")
public func fuzzerInitialize(_ argc: UnsafeMutablePointer<Int32>, _ argv: UnsafeMutablePointer<UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>>) -> Int32 {
    if let error = FuzzTarget.usageError {
        FileHandle.standardError.write(Data(error.utf8))
        exit(64)
    }
    guard FuzzTarget.namedFirst, let target = FuzzTarget.selected else { return 0 }
    setenv(FuzzTarget.environmentName, target.rawValue, 1)
    // argv[1] is the target: shift the rest down over it (argv[argc] stays NULL).
    let words = argv.pointee
    for index in 1..<Int(argc.pointee) {
        words[index] = words[index + 1]
    }
    argc.pointee -= 1
    return 0
}

/// libFuzzer's entry: one input through the selected target.
@_cdecl("LLVMFuzzerTestOneInput")
public func fuzzerTestOneInput(_ data: UnsafePointer<UInt8>?, _ size: Int) -> Int32 {
    FuzzTarget.run(data, size)
}
#else

/// The replayer (an ordinary build): runs each saved input once through the target named first.
@main
enum SignerdFuzz {
    static let usage = """
        usage: signerd-fuzz <handle|preflight|misc> [libFuzzer options] [corpus directories or files]

        handle     SignerService.handle: every endpoint's body and field rules, signing on SoftHSM
        preflight  SignerService.preflight: method, path, media type, codings, length, peer
        misc       configuration, DER/raw signatures, RFC 7512 URIs, JWS, base64url,
                   Apple field rules, key files, command-line arguments, request bodies

        This build has no libFuzzer: every input in the files and directories is
        run once, and options (words that start with '-') are ignored. It ends
        with "replayed N inputs through TARGET" on stderr and, for handle and
        preflight, "statuses through TARGET: 200=N 400=N ..." (how many answers
        had each HTTP status). Built by scripts/fuzz.sh, libFuzzer runs the
        target and takes the options. See docs/FUZZING.md.

        """

    static func main() {
        let arguments = CommandLine.arguments
        if arguments.count > 1, ["-h", "--help"].contains(arguments[1]) {
            print(usage, terminator: "")
            exit(0)
        }
        if let error = FuzzTarget.usageError {
            FileHandle.standardError.write(Data(error.utf8))
            exit(64)
        }

        // Replay: every regular file named, and every regular file in each directory named, once.
        let paths = arguments.dropFirst(FuzzTarget.namedFirst ? 2 : 1).filter { !$0.hasPrefix("-") }
        guard !paths.isEmpty else {
            FileHandle.standardError.write(Data("error: no inputs to replay\nhint: this build has no libFuzzer; name corpus files or directories, or build with scripts/fuzz.sh\n".utf8))
            exit(64)
        }
        var files: [String] = []
        for path in paths {
            var isDirectory: ObjCBool = false
            guard FileManager.default.fileExists(atPath: path, isDirectory: &isDirectory) else {
                FileHandle.standardError.write(Data("error: \(path): no such file or directory\n".utf8))
                exit(66)
            }
            if isDirectory.boolValue {
                let names = (try? FileManager.default.contentsOfDirectory(atPath: path)) ?? []
                files += names.sorted().map { path + "/" + $0 }.filter {
                    var inner: ObjCBool = false
                    return FileManager.default.fileExists(atPath: $0, isDirectory: &inner) && !inner.boolValue
                }
            } else {
                files.append(path)
            }
        }
        for file in files {
            guard let data = FileManager.default.contents(atPath: file) else {
                FileHandle.standardError.write(Data("error: \(file): cannot be read\n".utf8))
                exit(66)
            }
            _ = data.withUnsafeBytes { raw in
                FuzzTarget.run(raw.bindMemory(to: UInt8.self).baseAddress, raw.count)
            }
        }
        let target = FuzzTarget.selected?.rawValue ?? ""
        FileHandle.standardError.write(Data("replayed \(files.count) inputs through \(target)\n".utf8))
        if let summary = FuzzEnvironment.summary(target: target) {
            FileHandle.standardError.write(Data((summary + "\n").utf8))
        }
    }
}
#endif
