import HSMSigner

extension SoftHSMFiles {
    /// signctl's SoftHSM token lock (``lockTokens(in:timeout:shouldStop:waiting:)``)
    /// as a running signerd takes it: around its own `C_Initialize` and
    /// `C_Login` once it serves (each step of a token recovery, a reload's
    /// login after a refused PIN; ``TokenOptions/storageLock``), never for a
    /// request. SoftHSM rewrites its token files at `C_Login`, and a recovery
    /// that did so while `signctl keys import` read its new key back made
    /// the import report the token gone and leave two keys under one key ID
    /// (3 in 1,942 imports beside recoveries, when measured).
    ///
    /// The wait is short (``timeout``): the token is down while recovery
    /// waits, and `signctl bench --direct` holds the lock for its whole run.
    /// When it runs out the step goes ahead without the lock, as before.
    /// A wait, a timeout and an unusable lock file are logged
    /// (`token_lock_wait`, `token_lock_timeout`, `token_lock_unusable`, with
    /// `during` `recovery`), each at most once a minute.
    public final class RunningTokenLock: Sendable {
        /// The SoftHSM token directory whose lock is taken.
        public let directory: String
        /// The longest wait for another holder, in seconds.
        public let timeout: Double
        private let logger: Logger
        /// False until ``arm()``: while signerd still holds its start lock,
        /// taking the lock again (another open file, another flock) would
        /// wait for itself.
        private let armed = Locked(false)
        private let waits = LogThrottle(linesPerWindow: 1, windowSeconds: 60)
        private let timeouts = LogThrottle(linesPerWindow: 1, windowSeconds: 60)
        private let unusable = LogThrottle(linesPerWindow: 1, windowSeconds: 60)

        /// The lock of a SoftHSM token directory.
        /// - Parameters:
        ///   - directory: the token directory (``SoftHSMFiles/tokenDirectory(module:)``).
        ///   - timeout: the longest wait, in seconds.
        ///   - logger: where waits and timeouts are logged.
        public init(directory: String, timeout: Double, logger: Logger) {
            self.directory = directory
            self.timeout = timeout
            self.logger = logger
        }

        /// Lets ``take(shouldStop:)`` take the lock: called once the start
        /// lock is released (signerd's socket is bound).
        public func arm() {
            armed.withLock { $0 = true }
        }

        /// Takes the lock for one step, waiting up to ``timeout`` for
        /// another holder.
        /// - Parameter shouldStop: asked while waiting; true ends the wait.
        /// - Returns: the lock, held until released; nil before ``arm()``, for
        ///   a lock file this user may not open or cannot use, after the
        ///   wait ran out, or when told to stop.
        public func take(shouldStop: () -> Bool) -> TokenLock? {
            guard armed.withLock({ $0 }) else { return nil }
            let (directory, logger, timeout) = (self.directory, self.logger, self.timeout)
            let outcome = SoftHSMFiles.lockTokens(in: directory, timeout: timeout, shouldStop: shouldStop) { holder in
                waits.admit { _ in
                    logger.warning("token_lock_wait", ["token.directory": .string(directory), "holder": .string(holder ?? "unknown"), "during": "recovery",
                                                       "hint": .string("another process is working on the SoftHSM tokens (signctl keys import, signctl bench --direct); the token's recovery waits up to \(Self.seconds(timeout)) s for it, so as not to read the token files while they are rewritten")])
                }
            }
            switch outcome {
            case .held(let lock):
                return lock
            case .timedOut(let holder):
                timeouts.admit { _ in
                    logger.warning("token_lock_timeout", ["token.directory": .string(directory), "holder": .string(holder ?? "unknown"), "during": "recovery",
                                                          "hint": .string("the token's recovery went ahead without the SoftHSM token lock after \(Self.seconds(timeout)) s; a signctl command running meanwhile may report the token gone: run it again once signerd logs token_up")])
                }
                return nil
            case .notApplicable(let problem?):
                unusable.admit { _ in
                    logger.warning("token_lock_unusable", ["token.directory": .string(directory), "during": "recovery",
                                                           "hint": .string("recovering without the SoftHSM token lock: \(problem); once it is removed, signctl makes the lock file again")])
                }
                return nil
            case .notApplicable(nil), .stopped:
                return nil
            }
        }

        private static func seconds(_ value: Double) -> String {
            value == value.rounded() ? String(Int(value)) : String(value)
        }
    }
}
