import Synchronization

/// One session checked out of a ``SessionPool``. Only the thread holding the
/// lease uses the session; it gives it back exactly once with
/// ``SessionPool/checkin(_:)`` or ``SessionPool/discard(_:)``.
final class SessionLease: Sendable {
    /// The `CK_SESSION_HANDLE`.
    let handle: UInt
    /// The pool generation the session belongs to; older ones are closed on return.
    let generation: UInt64
    /// The module epoch (bumped by `C_Finalize`/`C_Initialize`); sessions of
    /// an older epoch no longer exist and must not be closed, since their
    /// handle numbers may have been reused.
    let epoch: UInt64
    /// Set when the session was written off while still in use (a hung
    /// call): its slot in the pool was already freed. Set only under the
    /// pool's lock, and only while ``returned`` is false.
    let quarantined = Atomic<Bool>(false)
    /// Set, under the pool's lock, when the holder checked the lease in or
    /// discarded it: a quarantine after that has nothing to write off (the
    /// session is idle, another thread's, or closed).
    let returned = Atomic<Bool>(false)

    init(handle: UInt, generation: UInt64, epoch: UInt64) {
        self.handle = handle
        self.generation = generation
        self.epoch = epoch
    }
}

/// A bounded pool of PKCS#11 sessions on one token.
///
/// PKCS#11 sessions are not for concurrent use, so each is leased to one
/// thread at a time. ``checkout(deadline:priority:afterReset:)`` reuses an idle session, opens a
/// new one while fewer than ``capacity`` exist, and otherwise waits for a
/// return until the deadline instead of failing at once. Waiters are served
/// earliest request deadline first, and first come first served among equal
/// ones: a returned session (or a freed place) is handed to the first waiter
/// and only that thread is woken, so with many more connections than
/// sessions no request is overtaken again and again. Every request has the
/// same time to be answered (`sign_timeout_ms`), so requests are served in
/// the order they arrived, not the order they asked for a session: the
/// later offers of a `/v1/offers` batch go before requests that arrived
/// after the batch, and an overloaded daemon finishes the batches it can
/// instead of taking every one to its deadline together.
final class SessionPool: @unchecked Sendable {
    /// What a waiter is handed.
    private enum Grant {
        case reuse(UInt, UInt64, UInt64)
        case openNew(UInt64, UInt64, UInt)
        /// The pool was reset: the caller may look again.
        case retry
    }

    /// A thread waiting in ``checkout(deadline:priority:afterReset:)``.
    private final class Waiter {
        let condition = ConditionLock.Condition()
        var grant: Grant?
        /// Its place in line: the earlier, the sooner it is served.
        let priority: UInt64
        init(priority: UInt64) { self.priority = priority }
    }

    // All mutable fields are guarded by `lock`.
    private let lock = ConditionLock()
    private var idle: [UInt] = []
    private var counted = 0
    /// Leases out now, of every generation (``reset(moduleReinitialized:)``
    /// does not forget them): one is counted from its grant (also one
    /// handed to a waiter that has not woken yet) until its holder has
    /// given it back and any close of it has returned. A reset closing idle
    /// sessions counts as one until its closes have returned.
    private var outstanding = 0
    /// Leases out that ``quarantine(_:)`` wrote off (their call outlived its
    /// time and may never return), until they stop counting in
    /// `outstanding` (given back, and any close of them returned).
    private var writtenOff = 0
    /// Set by ``freezeIfIdle()`` for a module reinitialization: no lease is
    /// granted until ``unfreeze()``.
    private var frozen = false
    /// In the order they are served: by `priority`, then oldest first.
    private var waiters: [Waiter] = []
    private var generation: UInt64 = 0
    private var epoch: UInt64 = 0
    /// ``MonotonicClock`` nanoseconds when a leased session last came back
    /// (checked in or discarded); 0 before the first.
    private var returnedAt: UInt64 = 0
    /// The most sessions open at once (counting leased ones).
    let capacity: Int
    private var slot: UInt
    private let open: @Sendable (UInt) -> (PKCS11ReturnValue, UInt)
    private let close: @Sendable (UInt) -> Void

    /// - Parameters:
    ///   - capacity: the most sessions open at once (≥ 1).
    ///   - slot: the slot the token is in.
    ///   - open: opens one session on a slot (`C_OpenSession`).
    ///   - close: closes one session (`C_CloseSession`), errors ignored.
    init(capacity: Int, slot: UInt, open: @escaping @Sendable (UInt) -> (PKCS11ReturnValue, UInt), close: @escaping @Sendable (UInt) -> Void) {
        self.capacity = max(1, capacity)
        self.slot = slot
        self.open = open
        self.close = close
    }

    /// Leases out now, of this generation and older ones, opening or
    /// closing ones included: a module may be finalized only at 0, since a
    /// holder's next call would use a session (and key) handle number that
    /// a reinitialized module may have given to something else.
    var leasesOut: Int { lock.withLock { outstanding } }

    /// Whether leases are out and every one of them was written off
    /// (``quarantine(_:)``): each is held by a call that outlived its time,
    /// so waiting for the pool to become idle may never end.
    var onlyWrittenOffLeasesOut: Bool {
        lock.withLock { outstanding > 0 && outstanding <= writtenOff }
    }

    /// Stops granting leases, when none is out, for a module
    /// reinitialization (`C_Finalize` + `C_Initialize`): checking that no
    /// lease is out and stopping new ones is one step, so no thread can
    /// take a session between the check and the `C_Finalize` and then use
    /// its number on the reinitialized module. Checkouts meanwhile fail
    /// with ``HSMError/Code/sessionUnavailable``.
    /// - Returns: false, changing nothing, when a lease is out.
    func freezeIfIdle() -> Bool {
        lock.withLock {
            guard outstanding == 0 else { return false }
            frozen = true
            return true
        }
    }

    /// Grants leases again after ``freezeIfIdle()``; harmless when not frozen.
    func unfreeze() {
        lock.withLock { frozen = false }
    }

    /// Sessions in use and idle, for metrics.
    var usage: (inUse: Int, idle: Int, waiting: Int) {
        lock.withLock { (counted - idle.count, idle.count, waiters.count) }
    }

    /// Leases a session, waiting until `deadline` (``MonotonicClock``
    /// nanoseconds) when all are in use.
    /// - Parameters:
    ///   - deadline: when to stop waiting.
    ///   - priority: the caller's place in line, in ``MonotonicClock``
    ///     nanoseconds: the deadline of the request it serves
    ///     (``RequestDeadline/current``); nil takes `deadline`. Earlier is served first.
    ///   - afterReset: called, without the pool's lock, when the
    ///     pool was reset while this caller waited, before it looks again: it
    ///     throws to give up (the token went down, and a fresh session would
    ///     be opened into the module that failed).
    /// - Throws: ``HSMError/Code/sessionUnavailable`` on timeout; the
    ///   `C_OpenSession` failure when opening one fails; what `afterReset` throws.
    func checkout(deadline: UInt64, priority: UInt64? = nil, afterReset: () throws(HSMError) -> Void = {}) throws(HSMError) -> SessionLease {
        let priority = priority ?? deadline
        // A grant is counted in `outstanding` by whoever makes it.
        var next: Grant? = lock.withLock { waitForGrant(deadline: deadline, priority: priority) }
        while case .retry? = next {
            try afterReset()
            next = lock.withLock { waitForGrant(deadline: deadline, priority: priority) }
        }
        switch next {
        case .retry?:
            preconditionFailure("a retry grant is handled by the loop above")
        case .reuse(let handle, let generation, let epoch):
            return SessionLease(handle: handle, generation: generation, epoch: epoch)
        case .openNew(let generation, let epoch, let slot):
            let (rv, handle) = open(slot)
            guard rv == .ok else {
                lock.withLock {
                    outstanding -= 1
                    if generation == self.generation {
                        counted -= 1
                        handOverFreedPlace()
                    }
                }
                throw HSMError(pkcs11: .openSession, rv, message: "cannot open a session")
            }
            return SessionLease(handle: handle, generation: generation, epoch: epoch)
        case nil:
            var error = HSMError(.sessionUnavailable, "all \(capacity) PKCS#11 sessions stayed busy until the checkout timeout")
            error.retryAfter = 1
            throw error
        }
    }

    /// The grant ``checkout(deadline:priority:afterReset:)`` gets (lock
    /// held): an idle session, a free place, or what a returning session or
    /// freed place hands it while it waits in line at `priority`; nil at the deadline.
    private func waitForGrant(deadline: UInt64, priority: UInt64) -> Grant? {
        while true {
            // The module is being finalized and initialized again: no session
            // of it may be used (the token is down meanwhile, so this is short).
            if frozen { return nil }
            if let handle = idle.popLast() {
                outstanding += 1
                return .reuse(handle, generation, epoch)
            }
            if counted < capacity {
                counted += 1
                outstanding += 1
                return .openNew(generation, epoch, slot)
            }
            let waiter = Waiter(priority: priority)
            // Behind every waiter of the same or an earlier priority (looked
            // for from the back: a request that just arrived goes last).
            waiters.insert(waiter, at: (waiters.lastIndex { $0.priority <= priority } ?? -1) + 1)
            while waiter.grant == nil {
                if !lock.wait(on: waiter.condition, untilMonotonic: deadline) && MonotonicClock.now() >= deadline {
                    break
                }
            }
            switch waiter.grant {
            case .retry?:
                return .retry  // the caller decides outside the lock whether to look again
            case let grant?:
                return grant
            case nil:
                waiters.removeAll { $0 === waiter }
                return nil
            }
        }
    }

    /// When a leased session last came back from the module, in
    /// ``MonotonicClock`` nanoseconds (0: none yet): recent means the token
    /// answers, and a request still waiting for a session meets load.
    var lastReturn: UInt64 { lock.withLock { returnedAt } }

    /// Returns a healthy session for reuse.
    func checkin(_ lease: SessionLease) {
        // Decided under the lock that quarantine(_:) takes: a lease is
        // either written off before it comes back (closed here, its place
        // already freed) or comes back first (the quarantine is then a no-op).
        let closeIt: Bool = lock.withLock {
            returnedAt = MonotonicClock.now()
            lease.returned.store(true, ordering: .relaxed)
            let quarantined = lease.quarantined.load(ordering: .relaxed)
            let stale = quarantined || lease.generation != generation
            if stale && lease.epoch == epoch { return true }
            if stale {
                // Nothing to close: the lease ends here, in the same lock round trip.
                endLease(writtenOff: quarantined)
            } else if waiters.isEmpty {
                endLease(writtenOff: false)
                idle.append(lease.handle)
            } else {
                // The lease changes hands and stays counted.
                let waiter = waiters.removeFirst()
                waiter.grant = .reuse(lease.handle, generation, epoch)
                lock.signal(waiter.condition)
            }
            return false
        }
        guard closeIt else { return }
        close(lease.handle)
        lock.withLock { endLease(writtenOff: lease.quarantined.load(ordering: .relaxed)) }
    }

    /// A lease stops counting (lock held): given back, and any close of it returned.
    private func endLease(writtenOff wasWrittenOff: Bool) {
        outstanding -= 1
        if wasWrittenOff { writtenOff -= 1 }
    }

    /// Closes a broken session and frees its place for a new one.
    func discard(_ lease: SessionLease) {
        let sameEpoch: Bool = lock.withLock {
            returnedAt = MonotonicClock.now()
            lease.returned.store(true, ordering: .relaxed)
            if !lease.quarantined.load(ordering: .relaxed) && lease.generation == generation {
                counted -= 1
                handOverFreedPlace()
            }
            return lease.epoch == epoch
        }
        if sameEpoch { close(lease.handle) }
        lock.withLock { endLease(writtenOff: lease.quarantined.load(ordering: .relaxed)) }
    }

    /// Writes off a session whose call is still running (a hung `C_Sign`):
    /// its place is freed now, and it is closed, never reused, when the
    /// call returns and its holder checks it in or discards it.
    /// - Returns: false when there was nothing to write off: the lease was
    ///   already quarantined, or its holder gave it back first (the call
    ///   returned just as it was found overdue).
    @discardableResult
    func quarantine(_ lease: SessionLease) -> Bool {
        lock.withLock {
            guard !lease.returned.load(ordering: .relaxed), !lease.quarantined.load(ordering: .relaxed) else { return false }
            lease.quarantined.store(true, ordering: .relaxed)
            writtenOff += 1
            if lease.generation == generation {
                counted -= 1
                handOverFreedPlace()
            }
            return true
        }
    }

    /// A place in the pool was freed (lock held): the longest waiter may open a session.
    private func handOverFreedPlace() {
        guard counted < capacity, !waiters.isEmpty else { return }
        let waiter = waiters.removeFirst()
        counted += 1
        outstanding += 1
        waiter.grant = .openNew(generation, epoch, slot)
        lock.signal(waiter.condition)
    }

    /// Drops every session (see below) and moves the pool to `slot`, where
    /// the token was found again.
    func reset(moduleReinitialized: Bool, slot: UInt) {
        lock.withLock { self.slot = slot }
        reset(moduleReinitialized: moduleReinitialized)
    }

    /// Drops every session. With `moduleReinitialized` the handles are
    /// already gone (after `C_Finalize`) and are not closed; otherwise idle
    /// ones are closed now and leased ones when they come back.
    func reset(moduleReinitialized: Bool) {
        let toClose: [UInt] = lock.withLock {
            generation += 1
            if moduleReinitialized { epoch += 1 }
            let old = idle
            idle.removeAll()
            counted = 0
            for waiter in waiters {
                waiter.grant = .retry
                lock.signal(waiter.condition)
            }
            waiters.removeAll()
            // While frozen the module is about to be finalized, which ends
            // these sessions anyway; a close by number could land after its
            // C_Initialize, on a new session given the same number.
            let closing = moduleReinitialized || frozen ? [] : old
            if !closing.isEmpty { outstanding += 1 }
            return closing
        }
        for handle in toClose { close(handle) }
        if !toClose.isEmpty { lock.withLock { outstanding -= 1 } }
    }
}
