import Foundation

/// The fuzz target this process runs, named by its first argument.
enum FuzzTarget: String, CaseIterable, Sendable {
    case handle, preflight, misc

    /// Whether the first argument names a target (libFuzzer's own workers, started with
    /// `-jobs`, get libFuzzer's options only, and learn the target from `environmentName`).
    static let namedFirst = CommandLine.arguments.count > 1 && FuzzTarget(rawValue: CommandLine.arguments[1]) != nil

    /// The environment variable that names the target when the first argument does not.
    static let environmentName = "SIGNERD_FUZZ_TARGET"

    /// The target named by the first argument, else by `SIGNERD_FUZZ_TARGET`; nil when neither names one.
    static let selected: FuzzTarget? = namedFirst ? FuzzTarget(rawValue: CommandLine.arguments[1])
        : ProcessInfo.processInfo.environment[environmentName].flatMap(FuzzTarget.init(rawValue:))

    /// The service `handle` and `preflight` drive, made on first use; `misc` needs none.
    static let environment: FuzzEnvironment = {
        do {
            return try FuzzEnvironment()
        } catch {
            FileHandle.standardError.write(Data("error: signerd-fuzz: cannot make the SoftHSM token: \(error)\n".utf8))
            exit(69)
        }
    }()

    /// Runs one input through the selected target; returns 0 (libFuzzer's
    /// `LLVMFuzzerTestOneInput` contract). A broken invariant traps.
    static func run(_ data: UnsafePointer<UInt8>?, _ size: Int) -> Int32 {
        let input = UnsafeBufferPointer(start: data, count: data == nil ? 0 : size)
        switch selected {
        case .handle: HandleTarget.run(input, in: environment)
        case .preflight: PreflightTarget.run(input, in: environment)
        case .misc: MiscTarget.run(input)
        case nil: break
        }
        return 0
    }

    /// The usage error for a missing or unknown target name (exit 64), or nil when `selected` is set.
    static var usageError: String? {
        guard selected == nil else { return nil }
        let given = CommandLine.arguments.count > 1 ? "unknown fuzz target '\(CommandLine.arguments[1])'" : "no fuzz target given"
        return "error: \(given)\nhint: signerd-fuzz <handle|preflight|misc> …; --help lists them\n"
    }
}
