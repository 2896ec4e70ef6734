import Foundation
import Testing

/// The fuzzing rounds' seeds and the inputs that found faults
/// (Tests/FuzzCorpus), replayed through `signerd-fuzz` as built for the
/// tests (no libFuzzer: each input runs once). Every answer must keep the
/// target's invariants, and with `FUZZ_STRICT` no input may get a 500.
/// docs/FUZZING.md says how to fuzz further with libFuzzer.
@Suite("fuzz corpus replay")
struct FuzzCorpusTests {
    static let corpus = Binaries.root + "/Tests/FuzzCorpus"

    @Test("every saved input keeps its target's invariants", arguments: ["handle", "preflight", "misc"])
    func replay(_ target: String) throws {
        let directory = Self.corpus + "/" + target
        let inputs = try FileManager.default.contentsOfDirectory(atPath: directory)
        #expect(inputs.count >= 8, "the \(target) corpus is in the repository")
        let (process, output) = try Self.fuzz([target, "-dict=\(Self.corpus)/unused.dict", directory], strict: true)
        #expect(process.terminationReason == .exit && process.terminationStatus == 0, "\(output)")
        #expect(output.contains("replayed \(inputs.count) inputs through \(target)"), "\(output)")
    }

    @Test("an unknown target and a replay with no inputs are usage errors (64)")
    func usage() throws {
        for arguments in [["bogus", Self.corpus + "/misc"], ["misc"], []] {
            let (process, output) = try Self.fuzz(arguments, strict: false)
            #expect(process.terminationStatus == 64, "\(arguments): \(output)")
            #expect(output.hasPrefix("error: "), "\(arguments): \(output)")
        }
    }

    /// Runs the built `signerd-fuzz` with `arguments` (with `FUZZ_STRICT=1` when
    /// `strict`) and returns the finished process and its standard error.
    static func fuzz(_ arguments: [String], strict: Bool) throws -> (Process, String) {
        let process = Process()
        process.executableURL = URL(fileURLWithPath: Binaries.directory + "/signerd-fuzz")
        process.arguments = arguments
        process.environment = ProcessInfo.processInfo.environment.merging(strict ? ["FUZZ_STRICT": "1"] : [:]) { $1 }
        let errors = Pipe()
        process.standardError = errors
        process.standardOutput = FileHandle.nullDevice
        try process.run()
        let output = String(decoding: errors.fileHandleForReading.readDataToEndOfFile(), as: UTF8.self)
        process.waitUntilExit()
        return (process, output)
    }
}
