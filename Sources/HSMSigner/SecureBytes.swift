internal import CLibCrypto

#if canImport(Glibc)
import Glibc
#endif

/// A byte buffer for secrets (PINs, private key scalars) that is wiped with
/// `OPENSSL_cleanse` when released and kept out of swap with `mlock(2)`
/// where the process may lock memory.
///
/// The bytes never pass through `String` or `Array`; read them with
/// ``withUnsafeBytes(_:)`` and do not let the pointer escape the closure.
public final class SecureBytes: @unchecked Sendable {
    // Immutable after init; the class is Sendable because nothing mutates
    // the storage once constructed, and deinit runs once.
    private let storage: UnsafeMutableRawBufferPointer
    private let locked: Bool

    /// Copies `bytes` into a new wiped-on-release buffer.
    /// - Parameter bytes: the secret; the caller wipes its own copy.
    public init(copying bytes: UnsafeRawBufferPointer) {
        storage = UnsafeMutableRawBufferPointer.allocate(byteCount: max(bytes.count, 1), alignment: 16)
        if bytes.count > 0 {
            storage.copyMemory(from: bytes)
        }
        locked = mlock(storage.baseAddress, storage.count) == 0
        length = bytes.count
    }

    /// Allocates `count` bytes and lets `fill` write them in place, so the
    /// secret never exists outside this buffer.
    /// - Parameters:
    ///   - count: the capacity in bytes.
    ///   - fill: writes the secret and returns how many bytes it wrote (≤ `count`).
    /// - Throws: whatever `fill` throws; the buffer is wiped first.
    public init<E: Error>(capacity count: Int, fill: (UnsafeMutableRawBufferPointer) throws(E) -> Int) throws(E) {
        storage = UnsafeMutableRawBufferPointer.allocate(byteCount: max(count, 1), alignment: 16)
        locked = mlock(storage.baseAddress, storage.count) == 0
        do {
            let written = try fill(UnsafeMutableRawBufferPointer(rebasing: storage[0..<count]))
            length = min(max(written, 0), count)
        } catch {
            OPENSSL_cleanse(storage.baseAddress, storage.count)
            if locked { munlock(storage.baseAddress, storage.count) }
            storage.deallocate()
            throw error
        }
    }

    private let length: Int

    /// Gives read access to the secret bytes for the duration of `body`.
    /// - Parameter body: receives exactly ``count`` bytes.
    /// - Returns: what `body` returns.
    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R {
        try body(UnsafeRawBufferPointer(rebasing: storage[0..<length]))
    }

    /// The number of secret bytes (the capacity may be larger).
    public var count: Int { length }

    /// Whether `other` holds the same bytes, compared in constant time for
    /// equal lengths (OpenSSL's `CRYPTO_memcmp`), so the comparison does not
    /// tell how many leading bytes match.
    /// - Parameter other: another secret.
    /// - Returns: true when both lengths and all bytes are equal.
    public func hasSameBytes(as other: SecureBytes) -> Bool {
        guard length == other.length else { return false }
        guard length > 0 else { return true }
        return CRYPTO_memcmp(storage.baseAddress, other.storage.baseAddress, length) == 0
    }

    deinit {
        OPENSSL_cleanse(storage.baseAddress, storage.count)
        if locked {
            munlock(storage.baseAddress, storage.count)
        }
        storage.deallocate()
    }
}
