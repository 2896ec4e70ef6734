import Foundation
import HSMSigner
import SignerIPC
import Synchronization
import Testing
import TestSupport

#if canImport(Glibc)
import Glibc
#endif

/// What signerd does when it cannot get a thread, and what a reload that
/// waits on the token does to the thread taking signals. The review that
/// found these: `OSThread.start` ran its work inline when `pthread_create`
/// failed, so token recovery (a loop until the token is back) could run
/// on the HTTP server's supervisor with its locks held; and a reload on
/// the signal thread waited for a hung `C_Login`, so `SIGTERM` was never
/// taken.
@Suite("Out of threads, and reloads that wait on the token", .serialized)
struct OutOfThreadsTests {
    @Test("no thread for recovery: the request is answered at once, recovery_thread_failed is logged once, and the next request (a signature or a /readyz probe) starts recovery",
          arguments: ["POST /v1/sign/promotional-offer", "GET /readyz"])
    func recoveryWithoutThread(next: String) throws {
        let daemon = try InProcessDaemon()
        defer {
            OSThread.failuresToInject.withLock { $0 = 0 }
            daemon.stop()
        }
        let client = SignerClient(socketPath: daemon.socketPath, timeout: 10)
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)))
        let initializations = daemon.faults.calls(.initialize)

        OSThread.failuresToInject.withLock { $0 = 1 }
        daemon.faults.outage(.deviceRemoved, seconds: 0.3)
        let started = MonotonicClock.now()
        let failed = try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
        let seconds = Double(MonotonicClock.now() - started) / 1e9
        #expect(failed.status == 503)
        #expect(failed.error?.code == "hsm_unavailable")
        #expect(seconds < 0.5, "the request waited \(seconds) s: recovery ran on its thread")
        #expect(daemon.logged("recovery_thread_failed") == 1)
        #expect(OSThread.failuresToInject.withLock { $0 } == 0, "the failure was injected at recovery's start")

        // The outage is over, but no recovery is running: nothing reinitializes the module.
        usleep(800_000)
        #expect(daemon.token.status == .down(reason: "CKR_DEVICE_REMOVED"))
        #expect(daemon.faults.calls(.initialize) == initializations, "recovery ran although its thread was never made")

        // The next request finds the token down, is refused at once, and starts recovery.
        let refused = next.hasPrefix("POST") ? try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
            : try client.send("GET", "/readyz")
        #expect(refused.status == 503)
        #expect(poll(seconds: 10) { daemon.token.status == .up }, "recovery did not bring the token back")
        #expect(daemon.logged("token_up") == 1)
        #expect(daemon.logged("recovery_thread_failed") == 1, "logged once per outage")
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)))
    }

    @Test("a reload waiting for a hung C_Login does not hold up the thread that asked for it, and stop() says it did not finish")
    func reloadBehindHungLogin() throws {
        let daemon = try InProcessDaemon(signTimeoutMs: 1000)
        defer { daemon.stop() }
        let client = SignerClient(socketPath: daemon.socketPath, timeout: 10)
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)))

        // The token forgets the login; the next signature logs in again,
        // and that C_Login hangs for 3 s with the PIN held.
        let logins = daemon.faults.calls(.login)
        daemon.faults.hang(.login, seconds: 3)
        daemon.faults.logOut()
        let hungAt = MonotonicClock.now()
        Thread.detachNewThread {
            _ = try? SignerClient(socketPath: daemon.socketPath, timeout: 10).send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)
        }
        #expect(poll(seconds: 2) { daemon.faults.calls(.login) > logins }, "the re-login began")

        let reloaded = Atomic(0)
        let configuration = daemon.service.configuration
        let runner = CoalescingRunner {
            try? daemon.service.reload(configuration)
            reloaded.add(1, ordering: .relaxed)
        }
        let asked = MonotonicClock.now()
        #expect(runner.request() == .started)
        #expect(runner.request() == .queued)
        let askSeconds = Double(MonotonicClock.now() - asked) / 1e9
        #expect(askSeconds < 0.2, "asking for a reload took \(askSeconds) s")
        // The reload itself is stuck behind the login: that is what the runner keeps off the signal thread.
        #expect(!runner.stop(waitingSeconds: 0.5), "the reload finished while the C_Login still hung")
        #expect(reloaded.load(ordering: .relaxed) == 0)
        #expect(runner.request() == .stopping)

        // Once the C_Login returns, the reload ends; the queued one was dropped by stop().
        #expect(runner.stop(waitingSeconds: 6))
        #expect(Double(MonotonicClock.now() - hungAt) / 1e9 >= 2.5, "the reload ended before the hung C_Login returned")
        #expect(reloaded.load(ordering: .relaxed) == 1)
        #expect(poll(seconds: 10) { daemon.token.status == .up })
        #expect(daemon.verifies(try client.send("POST", "/v1/sign/promotional-offer", body: daemon.offerBody)))
    }

    /// Counts the runs of a ``CoalescingRunner``'s work.
    final class RunCount: Sendable {
        let value = Atomic(0)
        var count: Int { value.load(ordering: .relaxed) }
    }

    /// A runner whose first run is started and held until the semaphore is
    /// signalled; later runs return at once.
    static func runnerHeldInFirstRun() throws -> (CoalescingRunner, DispatchSemaphore, RunCount) {
        let gate = DispatchSemaphore(value: 0)
        let runs = RunCount()
        let runner = CoalescingRunner {
            if runs.value.add(1, ordering: .relaxed).newValue == 1 { gate.wait() }
        }
        #expect(runner.request() == .started)
        try #require(poll(seconds: 2) { runs.count == 1 })
        return (runner, gate, runs)
    }

    @Test("requests made while a reload runs are merged into one more reload after it")
    func queuedReloadsMerge() throws {
        let (runner, gate, runs) = try Self.runnerHeldInFirstRun()
        #expect(runner.request() == .queued)
        // Merged into the queued one (and told apart, so that a storm is not logged per signal).
        #expect(runner.request() == .merged)
        #expect(runner.request() == .merged)
        gate.signal()
        #expect(poll(seconds: 2) { runs.count == 2 })
        #expect(runner.stop(waitingSeconds: 2))
        #expect(runs.count == 2, "three requests during the first reload make one more, not three")
        #expect(runner.request() == .stopping)
    }

    /// A reload queued when SIGTERM came applied its file while signerd
    /// was stopping (an attack round saw `config_reloaded` after
    /// `shutdown_requested`).
    @Test("once shutdown begins, a queued reload is dropped and new ones are refused; the running one ends")
    func queuedReloadDroppedAtShutdown() throws {
        let (runner, gate, runs) = try Self.runnerHeldInFirstRun()
        #expect(runner.request() == .queued)
        runner.refuseNewRuns()
        #expect(runner.request() == .stopping)
        gate.signal()
        #expect(runner.stop(waitingSeconds: 2))
        #expect(runs.count == 1, "the queued reload ran after shutdown began")
    }

    @Test("no thread for a reload: request() says so and runs nothing; the next request runs")
    func reloadWithoutThread() throws {
        defer { OSThread.failuresToInject.withLock { $0 = 0 } }
        let runs = Atomic(0)
        let runner = CoalescingRunner { runs.add(1, ordering: .relaxed) }
        OSThread.failuresToInject.withLock { $0 = 1 }
        #expect(runner.request() == .noThread)
        #expect(runs.load(ordering: .relaxed) == 0)
        #expect(runner.request() == .started)
        #expect(runner.stop(waitingSeconds: 2))
        #expect(runs.load(ordering: .relaxed) == 1)
    }
}
