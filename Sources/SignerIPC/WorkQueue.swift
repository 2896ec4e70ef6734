import HSMSigner
import Synchronization

#if canImport(Glibc)
import Glibc
#endif

/// One request handed from an HTTP thread to a worker. It completes exactly
/// once: with the handler's response, or with a 503 from the watchdog when it
/// waited or ran longer than the signing timeout.
final class Job: Sendable {
    enum Phase: Int {
        case queued = 0, running = 1, completed = 2
    }

    let request: HTTPRequest
    /// When the request was complete (``MonotonicClock`` nanoseconds).
    let received: UInt64
    private let phase = Atomic<Int>(Phase.queued.rawValue)
    private let started = Atomic<UInt64>(0)
    private let deliver: @Sendable (HTTPResponse) -> Void

    init(request: HTTPRequest, received: UInt64, deliver: @escaping @Sendable (HTTPResponse) -> Void) {
        self.request = request
        self.received = received
        self.deliver = deliver
    }

    /// Claims the job for a worker; false when the watchdog already answered it.
    func start() -> Bool {
        started.store(MonotonicClock.now(), ordering: .relaxed)
        return phase.compareExchange(expected: Phase.queued.rawValue, desired: Phase.running.rawValue, ordering: .acquiringAndReleasing).exchanged
    }

    /// Delivers `response` unless the job was already completed; returns whether it was delivered.
    @discardableResult
    func complete(_ response: HTTPResponse) -> Bool {
        complete { response }
    }

    /// Completes the job with the response `make` builds — called only if
    /// this call completes the job, so its side effects (metrics, marking
    /// the token down) happen once.
    @discardableResult
    func complete(_ make: () -> HTTPResponse) -> Bool {
        while true {
            let current = phase.load(ordering: .acquiring)
            guard current != Phase.completed.rawValue else { return false }
            if phase.compareExchange(expected: current, desired: Phase.completed.rawValue, ordering: .acquiringAndReleasing).exchanged {
                deliver(make())
                return true
            }
        }
    }

    var isRunning: Bool { phase.load(ordering: .acquiring) == Phase.running.rawValue }
    /// Set when the watchdog answered the job while a worker was still running it.
    let abandonedWhileRunning = Atomic<Bool>(false)
    var isCompleted: Bool { phase.load(ordering: .acquiring) == Phase.completed.rawValue }
}

/// Runs requests that may block in the PKCS#11 module on dedicated worker
/// threads, never on the HTTP threads, and bounds how long any of them may
/// take: a request still queued or running after `timeout` seconds is
/// answered with the timeout response, and the token is told to write off
/// the call (its session is quarantined). A worker stuck in a hung call is
/// replaced so that capacity stays, up to `maximumWorkers`.
final class WorkQueue: @unchecked Sendable {
    // Every mutable field is guarded by `lock`.
    private let lock = ConditionLock()
    private var pending: [Job] = []
    private var pendingHead = 0
    private var workers = 0
    /// Workers whose job the watchdog answered while they were still in it.
    private var stuckWorkers = 0
    private var stopping = false
    private var running: [ObjectIdentifier: Job] = [:]
    private let watchdogRunning = Atomic<Bool>(true)

    let targetWorkers: Int
    let maximumWorkers: Int
    let maximumQueued: Int
    let timeout: Double
    private let handle: @Sendable (Job) -> HTTPResponse
    private let timedOut: @Sendable (Job, Bool) -> HTTPResponse
    private let onTick: @Sendable () -> Void

    /// - Parameters:
    ///   - workers: threads normally running (one per PKCS#11 session).
    ///   - maximumWorkers: the most threads, stuck ones included.
    ///   - maximumQueued: requests waiting beyond this are refused at once.
    ///   - timeout: seconds from a request's arrival to its answer.
    ///   - handle: runs a job (on a worker).
    ///   - timedOut: the response for a job over the timeout (second argument: whether a worker was running it).
    ///   - onTick: called on every watchdog tick (the application writes off hung calls there).
    init(workers: Int, maximumWorkers: Int, maximumQueued: Int, timeout: Double,
         handle: @escaping @Sendable (Job) -> HTTPResponse,
         timedOut: @escaping @Sendable (Job, Bool) -> HTTPResponse,
         onTick: @escaping @Sendable () -> Void) {
        self.targetWorkers = max(1, workers)
        self.maximumWorkers = max(self.targetWorkers, maximumWorkers)
        self.maximumQueued = maximumQueued
        self.timeout = timeout
        self.handle = handle
        self.timedOut = timedOut
        self.onTick = onTick
        for _ in 0..<targetWorkers { spawnWorker() }
        OSThread.start { [self] in watchdog() }
    }

    /// Queues a job. Returns false when the queue is full (the caller answers 503 itself).
    func submit(_ job: Job) -> Bool {
        lock.withLock {
            guard !stopping, pending.count - pendingHead < maximumQueued else { return false }
            pending.append(job)
            lock.signal()
            return true
        }
    }

    /// Stops the workers once the queue is empty, and the watchdog.
    func stop() {
        lock.withLock {
            stopping = true
            lock.broadcast()
        }
        watchdogRunning.store(false, ordering: .releasing)
    }

    private func spawnWorker() {
        lock.withLock { workers += 1 }
        OSThread.start { [self] in work() }
    }

    private func work() {
        while true {
            let job: Job? = lock.withLock {
                while pendingHead == pending.count {
                    if stopping || workers - stuckWorkers > targetWorkers {
                        workers -= 1
                        return nil
                    }
                    lock.wait()
                }
                let next = pending[pendingHead]
                pendingHead += 1
                if pendingHead > 1024 && pendingHead * 2 > pending.count {
                    pending.removeFirst(pendingHead)
                    pendingHead = 0
                }
                return next
            }
            guard let job else { return }
            guard job.start() else { continue }  // the watchdog answered it while queued
            let key = ObjectIdentifier(job)
            lock.withLock { running[key] = job }
            let response = handle(job)
            job.complete(response)
            // Back from a call the watchdog wrote off: a replacement took this
            // worker's place, so one of them leaves.
            let leave = lock.withLock { () -> Bool in
                running[key] = nil
                if job.abandonedWhileRunning.load(ordering: .relaxed) { stuckWorkers -= 1 }
                guard workers - stuckWorkers > targetWorkers else { return false }
                workers -= 1
                return true
            }
            if leave { return }
        }
    }

    private func watchdog() {
        let limit = UInt64(timeout * 1e9)
        let tick = useconds_t(min(100_000, max(10_000, timeout * 1e6 / 10)))
        while watchdogRunning.load(ordering: .acquiring) {
            usleep(tick)
            let now = MonotonicClock.now()
            // Queued too long: answer now; a worker that picks it up later skips it.
            let stale: [Job] = lock.withLock {
                pending[pendingHead...].filter { now > $0.received + limit && !$0.isCompleted }
            }
            for job in stale { job.complete { timedOut(job, false) } }
            // Running too long: answer, write the call off, keep capacity.
            // Marked under the lock, so the worker's return and this count agree.
            let answered: Int = lock.withLock {
                var count = 0
                for job in running.values where now > job.received + limit && job.complete({ timedOut(job, true) }) {
                    job.abandonedWhileRunning.store(true, ordering: .relaxed)
                    stuckWorkers += 1
                    count += 1
                }
                return count
            }
            onTick()
            if answered > 0 {
                let spawn = lock.withLock { max(0, min(maximumWorkers - workers, targetWorkers - (workers - stuckWorkers))) }
                for _ in 0..<spawn { spawnWorker() }
            }
        }
    }
}
