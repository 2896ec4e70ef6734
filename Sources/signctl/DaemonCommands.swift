import Foundation
import HSMSigner
import SignerIPC

func health(_ words: [String], configPath: String) throws -> ExitCode {
    throw CommandFailure(.software, "not implemented yet")
}

func sign(kind: String, _ words: [String], configPath: String) throws -> ExitCode {
    throw CommandFailure(.software, "not implemented yet")
}

func verifyPromotionalOffer(_ words: [String]) throws -> ExitCode {
    throw CommandFailure(.software, "not implemented yet")
}

func verifyJWS(_ words: [String]) throws -> ExitCode {
    throw CommandFailure(.software, "not implemented yet")
}

func bench(_ words: [String], configPath: String) throws -> ExitCode {
    throw CommandFailure(.software, "not implemented yet")
}
