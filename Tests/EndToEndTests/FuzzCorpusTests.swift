import Foundation
import Testing

/// The fuzzing rounds' seeds and the inputs that found faults
/// (Tests/FuzzCorpus), replayed through `signerd-fuzz` as built for the
/// tests (no libFuzzer: each input runs once). Every answer must keep the
/// target's invariants, and with `FUZZ_STRICT` no input may get a 500; the
/// `handle` inputs that are valid signing requests must be answered 200, so
/// that a replay that signs nothing fails. A replay is killed, and its test
/// fails, after `replayLimit` seconds.
/// docs/FUZZING.md says how to fuzz further with libFuzzer.
@Suite("fuzz corpus replay")
struct FuzzCorpusTests {
    static let corpus = Binaries.root + "/Tests/FuzzCorpus"
    static let fuzzer = Binaries.directory + "/signerd-fuzz"
    /// How long a replay may run before it is killed and its test fails. A
    /// replay takes about a second (`handle`, the slowest, makes a SoftHSM
    /// token and signs about twenty times); the bound is there for a hang.
    static let replayLimit = 120.0

    /// The `handle` inputs whose requests must be signed: each is a valid body
    /// for a single-signature endpoint (promotional offer, V2, introductory
    /// offer eligibility, Advanced Commerce, App Store Server API token) from
    /// an allowed peer for `ABC123DEFG`, which the fuzz token holds. (`/v1/offers`
    /// answers 200 even when every signature in it failed, and the key
    /// listing, health and metrics sign nothing, so none of them is here.)
    static let signingInputs = ["seed001", "seed003", "seed006", "seed007", "seed008", "seed009", "seed010",
                                "seed011", "seed012", "seed018", "seed020", "seed021", "seed022", "seed023"]

    @Test("every saved input keeps its target's invariants", arguments: ["handle", "preflight", "misc"])
    func replay(_ target: String) throws {
        let directory = Self.corpus + "/" + target
        let inputs = try FileManager.default.contentsOfDirectory(atPath: directory)
        #expect(inputs.count >= 8, "the \(target) corpus is in the repository")
        // A trap ends the process by a signal: its status is then the signal's number, not 0.
        let run = runProgram(Self.fuzzer, [target, "-dict=\(Self.corpus)/unused.dict", directory],
                             environment: ["FUZZ_STRICT": "1"], killAfter: Self.replayLimit)
        try #require(!run.timedOut, "the \(target) replay still ran after \(Int(Self.replayLimit)) s and was killed: \(run.stderr)")
        #expect(run.status == 0, "\(run.stderr)")
        #expect(run.stderr.contains("replayed \(inputs.count) inputs through \(target)"), "\(run.stderr)")
        if target == "handle" {
            let statuses = try #require(Self.statuses(in: run.stderr, target: target), "no statuses line: \(run.stderr)")
            #expect(statuses.values.reduce(0, +) == inputs.count, "one answer per input: \(statuses)")
            #expect(statuses[200, default: 0] >= Self.signingInputs.count, "the inputs that sign got 200: \(statuses)")
        }
    }

    @Test("the handle inputs that should sign are signed: the replay counts a 200 for each")
    func handleSigns() throws {
        let files = Self.signingInputs.map { Self.corpus + "/handle/" + $0 }
        let run = runProgram(Self.fuzzer, ["handle"] + files, environment: ["FUZZ_STRICT": "1"], killAfter: Self.replayLimit)
        try #require(!run.timedOut, "the replay still ran after \(Int(Self.replayLimit)) s and was killed: \(run.stderr)")
        #expect(run.status == 0, "\(run.stderr)")
        let statuses = try #require(Self.statuses(in: run.stderr, target: "handle"), "no statuses line: \(run.stderr)")
        #expect(statuses == [200: files.count], "every one of \(Self.signingInputs) answered 200 (rerun with FUZZ_DEBUG=1 to see each answer): \(statuses)")
    }

    @Test("a program still running at its bound is killed, and the runner says so")
    func replayBound() {
        let started = Date()
        let run = runProgram("/bin/sleep", ["60"], killAfter: 1)
        #expect(run.timedOut, "sleep 60 was not reported killed: status \(run.status)")
        #expect(run.status == SIGKILL, "sleep 60 ended by SIGKILL: status \(run.status)")
        #expect(Date().timeIntervalSince(started) < 30, "the runner returned soon after the 1 s bound")
    }

    /// The counts in the replayer's `statuses through TARGET: 200=N 400=N …`
    /// line, by HTTP status; nil when `output` has no such line.
    static func statuses(in output: String, target: String) -> [Int: Int]? {
        let prefix = "statuses through \(target): "
        guard let line = output.split(separator: "\n").first(where: { $0.hasPrefix(prefix) }) else { return nil }
        var counts: [Int: Int] = [:]
        for pair in line.dropFirst(prefix.count).split(separator: " ") {
            let parts = pair.split(separator: "=")
            guard parts.count == 2, let status = Int(parts[0]), let count = Int(parts[1]) else { return nil }
            counts[status] = count
        }
        return counts
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
