import Foundation
import SignerIPC
import Testing

/// The CPU and memory readings `signctl bench` reports, checked against
/// this process, where both sources (proc(5) and getrusage(2)) describe the
/// same threads.
@Suite("bench process statistics")
struct ProcessStatisticsTests {
    @Test("/proc/PID/stat CPU time agrees with getrusage for this process")
    func cpuTime() throws {
        let pid = getpid()
        let procBefore = try #require(ProcessStatistics.cpuMicroseconds(pid))
        let ownBefore = ProcessStatistics.ownCPUMicroseconds()
        // Burn about 300 ms of CPU so both readings move well past one 10 ms clock tick.
        var state: UInt64 = 1
        let until = ownBefore + 300_000
        while ProcessStatistics.ownCPUMicroseconds() < until {
            for _ in 0..<10_000 { state = state &* 6364136223846793005 &+ 1442695040888963407 }
        }
        let procAfter = try #require(ProcessStatistics.cpuMicroseconds(pid))
        let ownAfter = ProcessStatistics.ownCPUMicroseconds()
        let procSpent = Double(procAfter - procBefore)
        let ownSpent = Double(ownAfter - ownBefore)
        #expect(ownSpent >= 300_000)
        // Ticks round down: allow two ticks either way plus 10 % for other threads of the test runner.
        #expect(abs(procSpent - ownSpent) <= 20_000 + ownSpent * 0.1, "proc \(procSpent) µs, getrusage \(ownSpent) µs (state \(state))")
        #expect(ProcessStatistics.residentKiB(pid) ?? 0 > 0)
    }

    @Test("an unknown process has no readings")
    func missingProcess() {
        // PIDs above the kernel's pid_max (at most 2^22) never exist.
        #expect(ProcessStatistics.cpuMicroseconds(Int32(1 << 23)) == nil)
        #expect(ProcessStatistics.residentKiB(Int32(1 << 23)) == nil)
    }
}
