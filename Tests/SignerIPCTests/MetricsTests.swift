import Foundation
@testable import HSMSigner
@testable import SignerIPC
import Testing

@Suite("metrics counters")
struct MetricsTests {
    /// The value of one sample line in Prometheus text format.
    func sample(_ text: String, _ name: String) -> Double? {
        text.split(separator: "\n").first { $0.hasPrefix(name + " ") }.flatMap { Double($0.split(separator: " ").last!) }
    }

    @Test("request counters and histograms lose nothing when 8 threads count at once")
    func concurrentCounting() {
        let metrics = Metrics()
        let threads = 8, perThread = 10_000
        DispatchQueue.concurrentPerform(iterations: threads) { thread in
            for index in 0..<perThread {
                metrics.countRequest(route: .promotionalOffer, status: index % 10 == 0 ? 503 : 200)
                metrics.countRequest(route: nil, status: 404)
                // 50 µs, 300 µs, 20 s (beyond the last bound: only +Inf).
                let nanoseconds: UInt64 = [50_000, 300_000, 20_000_000_000][(index + thread) % 3]
                metrics.observe(TokenSignature(raw: [], queueNanoseconds: nanoseconds, hsmNanoseconds: nanoseconds))
            }
        }
        // A status outside the lock-free table still counts.
        metrics.countRequest(route: .promotionalOffer, status: 418)
        let text = metrics.render(token: nil, keys: 0)
        let total = Double(threads * perThread)
        #expect(sample(text, #"signerd_requests_total{endpoint="/v1/sign/promotional-offer",status="200"}"#) == total * 0.9)
        #expect(sample(text, #"signerd_requests_total{endpoint="/v1/sign/promotional-offer",status="503"}"#) == total * 0.1)
        #expect(sample(text, #"signerd_requests_total{endpoint="/v1/sign/promotional-offer",status="418"}"#) == 1)
        #expect(sample(text, #"signerd_requests_total{endpoint="other",status="404"}"#) == total)
        #expect(sample(text, "signerd_sign_hsm_seconds_count") == total)
        #expect(sample(text, #"signerd_sign_hsm_seconds_bucket{le="+Inf"}"#) == total)
        // Cumulative buckets: a third at ≤ 0.0001 s, two thirds at ≤ 0.0005 s and at ≤ 10 s.
        let third = (total / 3).rounded(.down)
        let atFifty = sample(text, #"signerd_sign_hsm_seconds_bucket{le="0.0001"}"#) ?? -1
        #expect(abs(atFifty - third) <= 1)
        #expect(sample(text, #"signerd_sign_hsm_seconds_bucket{le="0.0005"}"#) == sample(text, #"signerd_sign_hsm_seconds_bucket{le="10.0"}"#))
        let sum = sample(text, "signerd_sign_hsm_seconds_sum") ?? 0
        let expectedSum = (0..<threads).reduce(0.0) { partial, thread in
            partial + (0..<perThread).reduce(0.0) { $0 + [50e-6, 300e-6, 20][($1 + thread) % 3] }
        }
        #expect(abs(sum - expectedSum) < 1e-3, "sum \(sum), expected \(expectedSum)")
    }
}

@Suite("Log throttle")
struct LogThrottleTests {
    @Test("lets the first lines of a window through, counts the rest, and reports them with the next line logged")
    func throttles() {
        let throttle = LogThrottle(linesPerWindow: 10, windowSeconds: 0.2)
        var logged: [Int] = []
        for _ in 0..<25 { throttle.admit { logged.append($0) } }
        #expect(logged == Array(repeating: 0, count: 10))
        usleep(250_000)  // the next window
        throttle.admit { logged.append($0) }
        #expect(logged.last == 15, "the 15 lines left out are reported once")
        throttle.admit { logged.append($0) }
        #expect(logged.last == 0)
    }

    /// One throttle for every uid let a caller refused in a loop use up the
    /// lines, so that another uid's refused attempt was never logged.
    @Test("per caller: one uid's flood leaves another uid's lines; the table of callers stays bounded")
    func perCaller() {
        let throttle = PerCallerLogThrottle(linesPerWindow: 10, windowSeconds: 60, maximumCallers: 4)
        var logged: [UInt32] = []
        for _ in 0..<50 { throttle.admit(uid: 4004) { _ in logged.append(4004) } }
        throttle.admit(uid: 4002) { _ in logged.append(4002) }
        #expect(logged.filter { $0 == 4004 }.count == 10)
        #expect(logged.last == 4002, "the other uid's first line is logged")
        // More callers than the table holds (4): uids beyond it share one
        // window of 10 lines, so 300 uids cannot log 300 lines (an attack
        // round's first version cleared the table and logged them all).
        logged.removeAll()
        for uid in UInt32(1)...300 { throttle.admit(uid: uid) { _ in logged.append(uid) } }
        #expect(logged.count == 2 + 10, "2 free places in the table, then the shared window: \(logged.count)")
        #expect(logged.prefix(2) == [1, 2])
        // The callers already in the table keep their own lines.
        throttle.admit(uid: 1) { _ in logged.append(1) }
        #expect(logged.last == 1 && logged.count == 13)
    }
}
