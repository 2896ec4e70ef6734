import Foundation
@testable import SignerIPC
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

@Suite("bench CPU per request")
struct PerRequestCPUTests {
    /// A CLI audit: a 20-request run reported the daemon at 0 µs per
    /// request, one /proc tick (10 ms) being all of a short run's CPU or none.
    @Test("a reading under 10 ticks of its resolution is left out; over it, the mean per request")
    func belowResolution() {
        let tick = ProcessStatistics.procTickMicroseconds
        #expect(tick > 0)
        #expect(ProcessStatistics.perRequest(1_000, 1_000, requests: 20, resolution: tick) == nil)
        #expect(ProcessStatistics.perRequest(1_000, 1_000 + 9 * tick, requests: 20, resolution: tick) == nil)
        #expect(ProcessStatistics.perRequest(1_000, 1_000 + 10 * tick, requests: 20, resolution: tick) == Double(10 * tick) / 20)
        // getrusage's microseconds: any reading of 10 µs or more counts.
        #expect(ProcessStatistics.perRequest(0, 2_000, requests: 20) == 100)
        #expect(ProcessStatistics.perRequest(0, 2_000, requests: 0) == nil)
        #expect(ProcessStatistics.perRequest(5, 2, requests: 20) == nil)
    }
}
