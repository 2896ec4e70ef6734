import Foundation
import SignerIPC
import Testing

#if canImport(Glibc)
import Glibc
#endif

/// `ProcessControl.holdingTerminationSignals`, which signctl wraps around
/// every write to the token: SoftHSM rewrites its token file in place at
/// `C_Login`, `C_CreateObject`, `C_DestroyObject` and `C_SetPIN`, and a
/// signctl ended half-way (Ctrl-C) left the file empty and the token
/// unusable. Each case runs in a child process (an exit test), since it
/// ends by the signal it raises.
@Suite("Termination signals held around token writes")
struct SignalHoldTests {
    /// The exit test's child process starts with these signals blocked
    /// (inherited from the test runner); signctl's are not.
    static func unblockTerminationSignals() {
        var set = sigset_t()
        sigemptyset(&set)
        for number in [SIGINT, SIGTERM, SIGHUP, SIGQUIT] { sigaddset(&set, number) }
        pthread_sigmask(SIG_UNBLOCK, &set, nil)
    }

    static func stderr(_ result: ExitTest.Result?) -> String {
        String(decoding: result?.standardErrorContent ?? [], as: UTF8.self)
    }

    @Test("SIGINT and SIGTERM during the hold end the process by that signal only after the body finished",
          arguments: [SIGINT, SIGTERM])
    func heldUntilDone(_ number: Int32) async {
        let result = await #expect(processExitsWith: .signal(number), observing: [\.standardErrorContent]) { [number] in
            Self.unblockTerminationSignals()
            ProcessControl.holdingTerminationSignals {
                raise(number)
                FileHandle.standardError.write(Data("body finished\n".utf8))
            }
            FileHandle.standardError.write(Data("after the hold\n".utf8))
        }
        let output = Self.stderr(result)
        #expect(output.contains("writing to the token"), "\(output)")
        #expect(output.contains("body finished"), "the signal ended the process inside the hold: \(output)")
        #expect(!output.contains("after the hold"), "the held signal was not raised again: \(output)")
    }

    @Test("a second signal 3 s or more after the first ends the process at once, saying how to check the token")
    func secondSignalStops() async {
        let result = await #expect(processExitsWith: .signal(SIGINT), observing: [\.standardErrorContent]) {
            Self.unblockTerminationSignals()
            ProcessControl.holdingTerminationSignals {
                raise(SIGINT)
                usleep(3_100_000)
                raise(SIGINT)
                FileHandle.standardError.write(Data("body finished\n".utf8))
            }
        }
        #expect(!Self.stderr(result).contains("body finished"))
        #expect(Self.stderr(result).contains("stopped in the middle of a token write: check the token with signctl keys list"), "\(Self.stderr(result))")
    }

    /// A double Ctrl-C (two signals within milliseconds) ended signctl in
    /// the middle of a write, and emptied SoftHSM's token file in 6 of 30
    /// interrupted PIN changes.
    @Test("a second signal within 3 s of the first is noted and waits: the body finishes, then the process ends by the signal")
    func quickSecondSignalWaits() async {
        let result = await #expect(processExitsWith: .signal(SIGINT), observing: [\.standardErrorContent]) {
            Self.unblockTerminationSignals()
            ProcessControl.holdingTerminationSignals {
                raise(SIGINT)
                raise(SIGINT)
                FileHandle.standardError.write(Data("body finished\n".utf8))
            }
        }
        let output = Self.stderr(result)
        #expect(output.contains("body finished"), "\(output)")
        #expect(output.contains("still writing to the token: a second signal stops signctl at once only 3 s or more after the first"), "\(output)")
    }

    @Test("a signal ignored before the hold stays ignored after it")
    func ignoredStaysIgnored() async {
        await #expect(processExitsWith: .exitCode(3)) {
            Self.unblockTerminationSignals()
            signal(SIGHUP, SIG_IGN)
            _ = ProcessControl.holdingTerminationSignals { raise(SIGHUP) }
            exit(3)
        }
    }

    @Test("an ignored signal neither takes the held slot nor makes the next real one 'the second'")
    func ignoredDoesNotCount() async {
        // SIGHUP ignored (nohup) twice, then a real SIGTERM: held, raised after the body.
        let result = await #expect(processExitsWith: .signal(SIGTERM), observing: [\.standardErrorContent]) {
            Self.unblockTerminationSignals()
            signal(SIGHUP, SIG_IGN)
            ProcessControl.holdingTerminationSignals {
                raise(SIGHUP)
                raise(SIGHUP)
                // Past the 3 s in which a second signal waits: were a SIGHUP
                // counted as the first, this one would end the process at once.
                usleep(3_100_000)
                raise(SIGTERM)
                FileHandle.standardError.write(Data("body finished\n".utf8))
            }
        }
        #expect(Self.stderr(result).contains("body finished"), "\(Self.stderr(result))")
    }

    @Test("a signal whose handler returns (the Swift runtime's SIGQUIT backtracer) still ends the process after the hold")
    func handlerThatReturns() async {
        let result = await #expect(processExitsWith: .signal(SIGQUIT), observing: [\.standardErrorContent]) {
            Self.unblockTerminationSignals()
            signal(SIGQUIT) { _ in
                let note = "handler ran\n"
                _ = note.withCString { write(STDERR_FILENO, $0, strlen($0)) }
            }
            ProcessControl.holdingTerminationSignals {
                raise(SIGQUIT)
                FileHandle.standardError.write(Data("body finished\n".utf8))
            }
            FileHandle.standardError.write(Data("after the hold\n".utf8))
        }
        let output = Self.stderr(result)
        #expect(output.contains("body finished"), "\(output)")
        #expect(!output.contains("after the hold"), "\(output)")
    }

    @Test("nested holds: a signal held in the outer one survives the inner one's release and ends the process after the outer")
    func nested() async {
        let result = await #expect(processExitsWith: .signal(SIGTERM), observing: [\.standardErrorContent]) {
            Self.unblockTerminationSignals()
            ProcessControl.holdingTerminationSignals {
                raise(SIGTERM)
                ProcessControl.holdingTerminationSignals {
                    FileHandle.standardError.write(Data("inner finished\n".utf8))
                }
                FileHandle.standardError.write(Data("outer finished\n".utf8))
            }
            FileHandle.standardError.write(Data("after the hold\n".utf8))
        }
        let output = Self.stderr(result)
        #expect(output.contains("inner finished") && output.contains("outer finished"), "\(output)")
        #expect(!output.contains("after the hold"), "\(output)")
    }

    @Test("without a signal: the body's value is returned, its error thrown, and the dispositions are restored")
    func noSignal() throws {
        func disposition(_ number: Int32) -> UInt {
            var action = sigaction()
            sigaction(number, nil, &action)
            return unsafeBitCast(action.__sigaction_handler.sa_handler, to: UInt.self)
        }
        let before = [SIGINT, SIGTERM, SIGHUP, SIGQUIT].map(disposition)
        #expect(ProcessControl.holdingTerminationSignals { 42 } == 42)
        struct Failure: Error {}
        #expect(throws: Failure.self) { try ProcessControl.holdingTerminationSignals { throw Failure() } }
        #expect([SIGINT, SIGTERM, SIGHUP, SIGQUIT].map(disposition) == before)
    }
}

