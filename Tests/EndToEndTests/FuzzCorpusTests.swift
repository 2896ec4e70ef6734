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
    static let fuzzer = Binaries.directory + "/signerd-fuzz"

    @Test("every saved input keeps its target's invariants", arguments: ["handle", "preflight", "misc"])
    func replay(_ target: String) throws {
        let directory = Self.corpus + "/" + target
        let inputs = try FileManager.default.contentsOfDirectory(atPath: directory)
        #expect(inputs.count >= 8, "the \(target) corpus is in the repository")
        // A trap ends the process by a signal: its status is then the signal's number, not 0.
        let (status, _, output) = runProgram(Self.fuzzer, [target, "-dict=\(Self.corpus)/unused.dict", directory], environment: ["FUZZ_STRICT": "1"])
        #expect(status == 0, "\(output)")
        #expect(output.contains("replayed \(inputs.count) inputs through \(target)"), "\(output)")
    }

    @Test("an unknown target and a replay with no inputs are usage errors (64)")
    func usage() {
        for arguments in [["bogus", Self.corpus + "/misc"], ["misc"], []] {
            let (status, _, output) = runProgram(Self.fuzzer, arguments)
            #expect(status == 64, "\(arguments): \(output)")
            #expect(output.hasPrefix("error: "), "\(arguments): \(output)")
        }
    }
}
